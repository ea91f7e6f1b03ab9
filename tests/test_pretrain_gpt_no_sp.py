"""Tensor parallelism without sequence parallelism through Megatron-LM's own
``pretrain_gpt.py``: TP=2 with no ``--sequence-parallel``, stock against the plugin's all-reduce
path, its all-reduce fusion and its sub-batches, and TP=2 x DP=2 with the distributed optimizer
(overlapped grad reduce and param gather). The launcher and its cache are
``pretrain_gpt_runs.train``'s; the same tiny GPT (2 layers, hidden 128, 5 iterations, hidden and
attention dropout 0.1, ``--no-bias-dropout-fusion``), with ``--clip-grad 1`` so that Megatron
computes each iteration's grad norm.

Tolerances: at TP=2 every all-reduce (and the fusion's reduce-scatter) is a + b, and the fusion
draws stock's dropout masks, so losses and grad norms are stock's bit for bit (``==``), sub-batches
included where the linears have no bias (each weight gradient is one GEMM over every part's rows;
fc1's bias gradient is summed per part)."""

import pytest

from .pretrain_gpt_runs import needs_megatron_lm, train

pytestmark = needs_megatron_lm

TP2_NO_SP = ("--tensor-model-parallel-size", "2", "--clip-grad", "1.0")
DIST_OPT = ("--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather",
            "--global-batch-size", "8")  # DP=2 on 4 ranks: 2 micro-batches of 2 per rank and step


@pytest.mark.parametrize("flags, calls", [
    (("--overlap-tp", "p2p"), {"tp.column_ar", "tp.row_ar"}),
    (("--overlap-tp", "p2p", "--overlap-tp-allreduce-fusion"), {"tp.column_ar", "tp.row_ar", "tp.fusion",
                                                                "tp.fusion.served"}),
], ids=["p2p", "p2p-fusion"])
def test_tp_without_sp_trains_like_stock(flags, calls):
    stock = train("stock", 2, TP2_NO_SP)
    ours = train("plugin", 2, TP2_NO_SP + flags)
    assert stock["calls"] == {} and calls <= set(ours["calls"]), ours["calls"]
    if "tp.fusion" in calls:  # every attention block of every iteration: 2 ranks x 5 x 2 micro-batches x 2 layers
        assert ours["calls"]["tp.fusion"] == ours["calls"]["tp.fusion.served"] == 40, ours["calls"]
    assert len(stock["grad_norms"]) == 5 and all(g is not None and g > 0 for g in stock["grad_norms"]), stock
    assert ours["losses"] == stock["losses"]
    assert ours["grad_norms"] == stock["grad_norms"]


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
def test_tp_without_sp_sub_batches_train_like_stock(bias):
    """Attention dropout is on, so only the MLP blocks are cut (the attention runs whole, said
    once). Without linear biases the losses and grad norms are stock's bits; with them, fc1's
    bias is added inside Megatron's activation, once per part, so its gradient is summed per
    part: within 1e-6 relative."""
    flags = TP2_NO_SP if bias else TP2_NO_SP + ("--disable-bias-linear",)
    stock = train("stock", 2, flags)
    ours = train("plugin", 2, flags + ("--overlap-tp", "p2p", "--overlap-tp-sub-batches", "2"))
    assert ours["calls"].get("tp.sub_batches") == 40 and "tp.sub_batches.attention" not in ours["calls"], ours
    if not bias:
        assert ours["losses"] == stock["losses"] and ours["grad_norms"] == stock["grad_norms"], (ours, stock)
    for a, b in zip(ours["losses"] + ours["grad_norms"], stock["losses"] + stock["grad_norms"]):
        assert abs(a - b) <= 1e-6 * abs(b), (ours, stock)


def test_tp_without_sp_with_the_distributed_optimizer_and_dp2():
    """TP=2 x DP=2 on 4 ranks, Megatron's distributed optimizer with overlapped grad reduce and
    param gather (its forward pre-hooks wait for each module's parameters: the fusion's
    look-ahead runs fc1's before it reads fc1's weight)."""
    stock = train("stock", 4, TP2_NO_SP + DIST_OPT)
    ours = train("plugin", 4, TP2_NO_SP + DIST_OPT + ("--overlap-tp", "p2p", "--overlap-tp-allreduce-fusion"))
    assert ours["calls"].get("tp.fusion", 0) > 0 and ours["calls"].get("tp.fusion.served") == ours["calls"]["tp.fusion"]
    assert ours["losses"] == stock["losses"]
    assert ours["grad_norms"] == stock["grad_norms"]
