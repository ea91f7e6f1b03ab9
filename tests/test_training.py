"""A tiny GPT (local spec, GQA, RMSNorm, SwiGLU, RoPE) trained 10 steps with Megatron's DDP:
the plugin's losses equal stock Megatron's, with overlap_grad_reduce on and off."""

import pytest
import torch

from . import gpt_rank_fns, rank_helpers, tp_rank_fns

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
    stock = pool4.run(gpt_rank_fns.gpt_losses, tp, STEPS, [], overlap_grad_reduce)
    ours = pool4.run(gpt_rank_fns.gpt_losses, tp, STEPS, flags, overlap_grad_reduce)
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
    the store was used (the output layer's task taking its input re-gather, posted behind its
    reduce-scatter, when it runs), and the embedding's grad all-gather (the backward's last
    transfer) travelled while the held wgrads ran (integration/embedding_grad.py)."""
    stock = pool4.run(gpt_rank_fns.gpt_losses_fused_wgrad, 2, STEPS, [], overlap_grad_reduce)
    ours = pool4.run(gpt_rank_fns.gpt_losses_fused_wgrad, 2, STEPS, ["--overlap-tp", "p2p"], overlap_grad_reduce)
    for rank in range(4):
        assert ours[rank]["losses"] == stock[rank]["losses"], rank
        # 2 layers x (qkv, proj, fc1, fc2) + the output layer: 9 wgrads held back per step
        assert ours[rank]["ran"] == 9 * STEPS and ours[rank]["left"] == 0, ours[rank]
        # the output layer's input re-gather went behind its reduce-scatter, taken by its held task
        assert ours[rank]["late"] == STEPS, ours[rank]
        # the embedding's grad all-gather travelled while the held ones ran, once per step
        assert ours[rank]["embedding_overlaps"] == STEPS, ours[rank]
    assert stock[0]["losses"][-1] < stock[0]["losses"][0]


def test_sequence_parallel_with_the_torch_norm_without_apex(pool4):
    """Without apex, Megatron's local spec cannot build a sequence-parallel model (its torch
    norm asserts); with the plugin installed it does, marks the norm parameters so Megatron
    sums their gradients over TP, and trains bit for bit as stock Megatron with an SP norm
    (the lab's shim: apex's math, its parameters marked the same way)."""
    steps = 3
    stock = pool4.run(gpt_rank_fns.stock_spec_losses, 2, [], steps)
    assert all("sequence parallel not supported by torch LayerNorm" in r["error"] for r in stock), stock
    ours = pool4.run(gpt_rank_fns.stock_spec_losses, 2, ["--overlap-tp", "p2p"], steps)
    assert all(r["marked"] and r["norms"] == 2 * 2 + 1 for r in ours), ours  # 2 per layer + the final norm
    reference = pool4.run(gpt_rank_fns.stock_spec_losses, 2, [], steps, True)  # stock linears, the lab's SP norm
    for r, ref in zip(ours, reference):
        assert r["losses"] == ref["losses"], (r["losses"], ref["losses"])


SUB_STEPS = 3


@pytest.mark.parametrize("overlap_grad_reduce", [False, True], ids=["ogr-off", "ogr-on"])
@pytest.mark.parametrize("tp,n", [(2, 2), (2, 3), (4, 2), (4, 3)], ids=["tp2-sub2", "tp2-sub3", "tp4-sub2", "tp4-sub3"])
def test_sub_batches_match_stock(pool4, tp, n, overlap_grad_reduce):
    """Each attention and MLP block cut into n sub-batches (uneven for
    n = 3: 32 rows per rank -> 11, 11, 10 at TP=2, 16 -> 6, 5, 5 at TP=4): every loss and every
    gradient of the first step are stock's bits at TP=2, where per-op overlap gives stock's bits
    (at TP=4 the embedding's gradient is 1.3e-7 from stock's: within 1e-6).
    The forward computes every row with the same GEMMs and softmax as stock; each weight
    gradient is one GEMM over every part's rows, and the keys' and values' gradients are
    stock's two GEMMs over all query rows."""
    flags = ["--overlap-tp", "p2p", "--overlap-tp-sub-batches", str(n)]
    stock = pool4.run(gpt_rank_fns.gpt_losses_and_grads, tp, SUB_STEPS, [], overlap_grad_reduce)
    ours = pool4.run(gpt_rank_fns.gpt_losses_and_grads, tp, SUB_STEPS, flags, overlap_grad_reduce)
    for rank in range(4):
        s, o = stock[rank], ours[rank]
        # 2 layers, every step: both blocks of every layer ran cut
        assert o["calls"]["tp.sub_batches"] == o["calls"]["tp.sub_batches.attention"] == 2 * SUB_STEPS, o["calls"]
        if tp == 2:
            assert o["losses"] == s["losses"], (rank, o["losses"], s["losses"])
        for a, b in zip(o["losses"], s["losses"]):
            assert abs(a - b) <= 1e-6 * abs(b), (rank, o["losses"], s["losses"])
        for name, grad in s["grads"].items():
            diff = rank_helpers.rel(o["grads"][name], grad)
            assert diff == 0 if tp == 2 else diff <= 1e-6, (rank, name, diff)
    assert stock[0]["losses"][-1] < stock[0]["losses"][0]


@pytest.mark.parametrize("blocks", ["attention", "mlp"])
def test_sub_batches_of_one_block_kind_match_stock(pool4, blocks):
    """``--overlap-tp-sub-batch-blocks``: only the attention (or only the MLP) blocks are cut, the
    others run whole with per-op overlap; every loss and gradient is still stock's bits (TP=2)."""
    flags = ["--overlap-tp", "p2p", "--overlap-tp-sub-batches", "2", "--overlap-tp-sub-batch-blocks", blocks]
    stock = pool4.run(gpt_rank_fns.gpt_losses_and_grads, 2, SUB_STEPS, [], True)
    ours = pool4.run(gpt_rank_fns.gpt_losses_and_grads, 2, SUB_STEPS, flags, True)
    for rank in range(4):
        s, o = stock[rank], ours[rank]
        cut = {"tp.sub_batches.attention" if blocks == "attention" else "tp.sub_batches": 2 * SUB_STEPS}
        whole = "tp.sub_batches" if blocks == "attention" else "tp.sub_batches.attention"
        assert all(o["calls"].get(k) == v for k, v in cut.items()) and not o["calls"].get(whole), o["calls"]
        assert o["losses"] == s["losses"], (rank, o["losses"], s["losses"])
        for name, grad in s["grads"].items():
            assert rank_helpers.rel(o["grads"][name], grad) == 0, (rank, name)


def test_sub_batches_sum_key_value_gradients_per_part_on_another_layout(pool4):
    """Where Megatron-core's core attention is not laid out as the cut rebuilds it, each part sums
    its own key and value gradients (said once): losses and gradients within 1e-6 of stock, the
    key/value path's gradients (QKV) no longer stock's bits, everything else still is."""
    stock = pool4.run(gpt_rank_fns.gpt_losses_and_grads, 2, SUB_STEPS, [], False)
    ours = pool4.run(gpt_rank_fns.gpt_grads_key_value_summed_per_part, 2, SUB_STEPS,
                     ["--overlap-tp", "p2p", "--overlap-tp-sub-batches", "2"])
    assert ours[0]["checks"] == 2 * SUB_STEPS and "attention-parts-sum" in ours[0]["noticed"], ours[0]["noticed"]
    for s, o in zip(stock, ours):
        for a, b in zip(o["losses"], s["losses"]):
            assert abs(a - b) <= 1e-6 * abs(b), (o["losses"], s["losses"])
        diffs = {name: rank_helpers.rel(o["grads"][name], grad) for name, grad in s["grads"].items()}
        assert all(d <= 1e-6 for d in diffs.values()), diffs
        assert any(d > 0 for name, d in diffs.items() if "linear_qkv" in name), diffs


@pytest.mark.parametrize("overlap_grad_reduce", [False, True], ids=["ogr-off", "ogr-on"])
def test_sub_batches_with_context_parallelism(pool4, overlap_grad_reduce):
    """TP=2 x CP=2 (ring): the attention runs whole (CP has its own), the MLP is cut; losses
    and gradients within 1e-6 of the same CP run without sub-batches."""
    base = ["--overlap-tp", "p2p", "--overlap-cp", "ring"]
    whole = pool4.run(gpt_rank_fns.gpt_losses_and_grads, 2, SUB_STEPS, base, overlap_grad_reduce, cp=2)
    cut = pool4.run(gpt_rank_fns.gpt_losses_and_grads, 2, SUB_STEPS, base + ["--overlap-tp-sub-batches", "2"],
                    overlap_grad_reduce, cp=2)
    for rank in range(4):
        w, c = whole[rank], cut[rank]
        assert c["calls"]["tp.sub_batches"] == 2 * SUB_STEPS and "tp.sub_batches.attention" not in c["calls"], c["calls"]
        for a, b in zip(c["losses"], w["losses"]):
            assert abs(a - b) <= 1e-6 * abs(b), (rank, c["losses"], w["losses"])
        for name, grad in w["grads"].items():
            assert rank_helpers.rel(c["grads"][name], grad) <= 1e-6, (rank, name)


def test_sub_batches_leave_blocks_whole_where_they_cannot_cut(pool4):
    """The settings a cut cannot honour leave the block whole (with a notice naming the reason,
    issued by the patched forward): sliding windows and the fused softmax (both assume the whole
    square of queries), a frozen projection, inference, Megatron-FSDP weights."""
    r = pool4.run(tp_rank_fns.sub_batch_whole_reasons, 2)[0]
    assert r["plain"] == (None, None), r
    assert "sliding-window" in r["window"] and "fused softmax" in r["fused"], r
    assert "frozen" in r["frozen"] and "inference" in r["inference"] and "FSDP" in r["fsdp"], r


def test_sub_batches_refuse_rows_they_cannot_cut(pool4):
    """Too few rows per rank for the sub-batches (or for the chunks of each sub-batch) is an
    error naming the flag when training; without gradients (inference, decode) the block runs
    whole, with a notice, and gives stock's output."""
    r = pool4.run(tp_rank_fns.sub_batch_row_errors, 2)[0]
    assert r["too_many"].startswith("OverlapConfigError: --overlap-tp-sub-batches") and \
        "fewer than the 40 sub-batches" in r["too_many"], r
    assert "fewer than the 8 chunks per rank of --overlap-tp-chunks 16" in r["chunks"], r
    assert r["no_grad_equal"] and r["no_grad_calls"] == 0, r
