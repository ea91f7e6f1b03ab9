"""A tiny GPT (local spec, GQA, RMSNorm, SwiGLU, RoPE) trained 10 steps with Megatron's DDP:
the plugin's losses equal stock Megatron's, with overlap_grad_reduce on and off."""

import pytest

from . import rank_fns

# Losses are means over the global batch in fp32. Per-op differences are <= ~1e-7 relative
# (see test_parity); through 10 SGD steps they stay far below 1e-5.
LOSS_REL_TOL = 1e-5
STEPS = 10


@pytest.mark.parametrize(
    "tp,flags",
    [
        (2, ["--overlap-tp", "p2p"]),
        (4, ["--overlap-tp", "p2p", "--overlap-tp-rs", "a2a", "--overlap-tp-chunks", "8"]),
        (4, ["--overlap-tp", "auto", "--overlap-tp-bidirectional"]),
    ],
    ids=["tp2xdp2-ring", "tp4-a2a-8chunks", "tp4-auto-bidirectional"],
)
@pytest.mark.parametrize("overlap_grad_reduce", [False, True], ids=["ogr-off", "ogr-on"])
def test_losses_match_stock(pool4, tp, flags, overlap_grad_reduce):
    stock = pool4.run(rank_fns.gpt_losses, tp, STEPS, [], overlap_grad_reduce)
    ours = pool4.run(rank_fns.gpt_losses, tp, STEPS, flags, overlap_grad_reduce)
    for rank in range(4):
        assert len(ours[rank]) == STEPS
        for step, (a, b) in enumerate(zip(ours[rank], stock[rank])):
            assert abs(a - b) <= LOSS_REL_TOL * abs(b), (rank, step, a, b)
    # the model learns: the run is not a constant
    assert stock[0][-1] < stock[0][0]


@pytest.mark.parametrize("overlap_grad_reduce", [False, True], ids=["ogr-off", "ogr-on"])
def test_held_back_wgrads_train_like_stock(pool4, overlap_grad_reduce):
    """With gradient-accumulation fusion the plugin keeps wgrad GEMMs back to fill the waits on
    its transfers (tp/wgrad_store.py) and holds DDP's grad-ready registration until they ran:
    the losses are stock's bit for bit (TP=2: the same GEMMs on the same tensors, only later),
    and the store was used."""
    stock = pool4.run(rank_fns.gpt_losses_fused_wgrad, 2, STEPS, [], overlap_grad_reduce)
    ours = pool4.run(rank_fns.gpt_losses_fused_wgrad, 2, STEPS, ["--overlap-tp", "p2p"], overlap_grad_reduce)
    for rank in range(4):
        assert ours[rank]["losses"] == stock[rank]["losses"], rank
        # 2 layers x (qkv, proj, fc1, fc2) + the output layer: 9 wgrads held back per step
        assert ours[rank]["ran"] == 9 * STEPS and ours[rank]["left"] == 0, ours[rank]
    assert stock[0]["losses"][-1] < stock[0]["losses"][0]


def test_sequence_parallel_with_the_torch_norm_without_apex(pool4):
    """Without apex, Megatron's local spec cannot build a sequence-parallel model (its torch
    norm asserts); with the plugin installed it does, marks the norm parameters so Megatron
    sums their gradients over TP, and trains bit for bit as stock Megatron with an SP norm
    (the lab's shim: apex's math, its parameters marked the same way)."""
    steps = 3
    stock = pool4.run(rank_fns.stock_spec_losses, 2, [], steps)
    assert all("sequence parallel not supported by torch LayerNorm" in r["error"] for r in stock), stock
    ours = pool4.run(rank_fns.stock_spec_losses, 2, ["--overlap-tp", "p2p"], steps)
    assert all(r["marked"] and r["norms"] == 2 * 2 + 1 for r in ours), ours  # 2 per layer + the final norm
    reference = pool4.run(rank_fns.stock_spec_losses, 2, [], steps, True)  # stock linears, the lab's SP norm
    for r, ref in zip(ours, reference):
        assert r["losses"] == ref["losses"], (r["losses"], ref["losses"])
