"""Tensor parallelism without sequence parallelism: the all-reduces of Megatron's
Column/Row linears overlapped (``tp/linear_ar.py``), sub-batches without SP, the all-reduce
fusion (``tp/allreduce_fusion.py``) and the numerics it states, what the path refuses, and the
emulated link counting and delaying stock's all-reduces as well as ours.

Tolerances. At TP=2 an all-reduce is a + b on both sides: every result here equals stock's bit
for bit (``==``), sub-batches included (each weight gradient and the keys' and values' are one
GEMM over every part's rows, as stock's). At TP=4 the all-reduce of a row piece sums each
element in the order gloo's ring gives that piece, which differs from the order of the whole
tensor's all-reduce in the last bits, and the fusion's ring reduce-scatter sums partials in ring
order: relative 1e-6 bounds both (measured ~5e-8 per op, ~4e-7 on the tiny GPT's gradients)."""

import pytest

from . import ar_rank_fns, tp_rank_fns

ROUNDING = 1e-6  # fp32 sums in another order (see the module docstring)


def test_gemm_all_reduce_matches_one_gemm_and_the_stock_collective(pool4, seed):
    for rows in pool4.run(ar_rank_fns.ops_vs_reference, seed):
        for row in rows:
            assert row["rel"] <= ROUNDING, (seed, row)
            if row["size"] == 2 and row["chunks"] < 27:  # pieces of >= 5 rows, a + b: stock's bits
                assert row["equal"], (seed, row)


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("backend", ["p2p", "symm-mem"])
def test_linears_without_sp_match_stock(pool4, tp, backend, seed):
    """QKV (GQA), fc1 (SwiGLU's doubled width) and fc2 on 27 rows (28 for symm-mem, whose
    all-reduce is its reduce-scatter and an all-gather), every chunk setting; symm-mem runs its
    composition with stock collectives in place of PyTorch's CUDA-only fused ops."""
    rows = [r for rank in pool4.run(ar_rank_fns.layer_parity, tp, backend, seed) for r in rank]
    assert len(rows) == 4 * 3 * 4 * (3 if backend == "p2p" else 1)
    for row in rows:
        assert ("tp.column_ar" if "column" in row["layer"] else "tp.row_ar") in row["calls"], row
        # p2p at TP=4: pieces summed in their own order; symm-mem's reduce-scatter + all-gather is
        # gloo's all-reduce exactly, at both sizes
        if tp == 2 or backend == "symm-mem":
            assert row["equal"], (seed, row)
        assert row["rel"] <= ROUNDING, (seed, row)


def test_gradient_accumulation_fusion_without_sp(pool4, seed):
    """``main_grad`` accumulation (Megatron's default where apex exists) on the all-reduce path."""
    rows = [r for rank in pool4.run(ar_rank_fns.layer_parity, 2, "p2p", seed, True) for r in rank]
    assert {r["tensor"] for r in rows} >= {"weight.main_grad", "weight.grad_added_to_main_grad"}
    assert all(r["equal"] for r in rows), [r for r in rows if not r["equal"]][:3]


def test_tiny_gpt_without_sp_trains_like_stock(pool4):
    """The tiny GPT (SwiGLU, GQA 8/2, odd sizes) without SP: per-op overlap and sub-batches keep
    stock's losses and gradients bit for bit at TP=2; every attention and MLP block of every
    step ran cut."""
    variants = [["--overlap-tp", "p2p"], ["--overlap-tp", "p2p", "--overlap-tp-sub-batches", "2"]]
    for tp in (2, 4):
        for plain, cut in pool4.run(ar_rank_fns.gpt_no_sp_vs_stock, tp, 3, variants):  # each rank's
            # per step: QKV, fc1 of 2 layers and the output layer; proj and fc2 of 2 layers
            assert plain["calls"]["tp.column_ar"] == 3 * 5 and plain["calls"]["tp.row_ar"] == 3 * 4, plain["calls"]
            assert cut["calls"]["tp.sub_batches"] == cut["calls"]["tp.sub_batches.attention"] == 3 * 2, cut["calls"]
            if tp == 2:
                assert plain["equal"] and cut["equal"], (plain, cut)
            assert plain["loss_rel"] <= ROUNDING and plain["grad_rel"] <= ROUNDING, plain
            assert cut["loss_rel"] <= ROUNDING and cut["grad_rel"] <= ROUNDING, cut


@pytest.mark.parametrize("tp", [2, 4])
def test_emulated_link_delays_stock_all_reduces_as_ours(pool4, tp):
    """Stock Megatron's all-reduces (``mappings._reduce`` and the Column backward, both calling
    ``torch.distributed.all_reduce`` at call time) are counted and delayed by the emulated link:
    the same bytes as ours per step, all of them all-reduce, and stock's step on a slow link
    lasts at least its transfer time."""
    for r in pool4.run(ar_rank_fns.mlp_link_no_sp, tp):
        assert r["stock"]["bytes"] == r["ours"]["bytes"] == r["sub"]["bytes"] == r["expected"], r
        assert set(r["stock"]["by_op"]) == set(r["ours"]["by_op"]) == {"all_reduce"}, r
        assert r["stock"]["calls"]["all_reduce"] == 2 and r["ours"]["calls"]["all_reduce"] > 2, r
        assert r["stock"]["step_s"] >= 0.95 * r["stock"]["transfer_s"], r


def test_fused_and_bidirectional_refused_without_sp_at_first_run(pool4):
    """A programmatic install learns the model when a layer first runs: the same messages."""
    for message in pool4.run(tp_rank_fns.sp_off_error, 2, ["--overlap-tp", "fused"]):
        assert message.startswith("OverlapConfigError: --overlap-tp: fused: without --sequence-parallel"), message
    for message in pool4.run(tp_rank_fns.sp_off_error, 2, ["--overlap-tp", "p2p", "--overlap-tp-rs", "a2a"]):
        assert message.startswith("OverlapConfigError: --overlap-tp-rs: picks the reduce-scatter"), message


def test_symm_mem_refuses_rows_that_do_not_split(pool4):
    for message in pool4.run(ar_rank_fns.symm_mem_odd_rows_error, 2):
        assert message.startswith("OverlapConfigError: --overlap-tp: symm-mem: its all-reduce is a reduce-scatter "
                                  "and an all-gather, and the 27 sequence rows do not split over the 2"), message


def test_tp1_without_sp_says_it_does_nothing(caplog):
    """TP = 1 without SP: nothing to overlap; install says so and runs stock Megatron."""
    import logging

    import megatron_overlap

    from .flag_args import megatron_args

    with caplog.at_level(logging.WARNING, logger="megatron_overlap"):
        inst = megatron_overlap.install(megatron_args("--overlap-tp", "p2p", tp=1, sp=False))
    assert not inst.tp_overlap and not megatron_overlap.is_installed()
    said = [r.getMessage() for r in caplog.records]
    assert any("--overlap-tp p2p has nothing to overlap with tensor-parallel size 1; running stock Megatron" in m
               for m in said), said


def test_fusion_op_keeps_stocks_numerics(pool4, seed):
    """The fused op against stock's own ops (one GEMM, the all-reduce, ``+ bias``, ``F.dropout``,
    ``residual +``; autograd through them) from the same generator state, which is what the
    fusion states it keeps: the generator left where stock leaves it (the mask drawn whole, in
    one draw) and every rank applying stock's mask to its rows; stock's backward (every gradient
    stock's bits at TP 2 and 4: it sums nothing); the output stock's bits at TP=2, and within
    rounding at TP=4 (the ring reduce-scatter's summation order)."""
    for rows in pool4.run(ar_rank_fns.fusion_op_vs_reference, seed):
        for r in rows:
            assert r["rng_same"], (seed, r)
            assert all(r[f"{name}_equal"] for name in ("x", "w", "bias", "residual")), (seed, r)
            assert r["out_equal"] if r["size"] == 2 else r["out_rel"] <= ROUNDING, (seed, r)


def test_fusion_trains_like_stock(pool4):
    """The tiny GPT without SP, hidden and attention dropout 0.1, biases on: with the fusion
    (p2p, and symm-mem's composition on stock collectives) losses and gradients are stock's bits
    at TP=2 (RMSNorm, whose composite backward sums three contributions: the norm runs as stock's
    graph); at TP=4 (LayerNorm) within rounding. Every attention block of every step was fused
    and its fc1 GEMM computed while the gather landed."""
    fused = [["--overlap-tp", "p2p", "--overlap-tp-allreduce-fusion"],
             ["--overlap-tp", "symm-mem", "--overlap-tp-allreduce-fusion"]]
    for tp, norm, variants in ((2, "RMSNorm", fused), (4, "LayerNorm", fused[:1])):
        for rank in pool4.run(ar_rank_fns.gpt_no_sp_vs_stock, tp, 3, variants, hidden_dropout=0.1,
                              attention_dropout=0.1, add_bias_linear=True, normalization=norm):
            for r in rank:
                assert r["calls"]["tp.fusion"] == r["calls"]["tp.fusion.served"] == 3 * 2, r["calls"]
                if tp == 2:
                    assert r["equal"], r
                assert r["loss_rel"] <= ROUNDING and r["grad_rel"] <= ROUNDING, r


def test_fusion_runs_unfused_where_it_cannot(pool4):
    for r in pool4.run(ar_rank_fns.fusion_reasons, 2):
        assert r["plain"] is None, r
        assert "compiled bias-dropout-add draws its dropout masks" in r["compiled_bda"], r
        assert r["compiled_bda_eval"] is None, r  # no dropout outside training: nothing to draw
        assert r["recompute_norm"] == "recompute or offloading of its norms", r
        assert r["sub_batches"] == "its attention runs cut into sub-batches (`tp.sub_batches`)", r
        assert r["sequence_parallel"] == "sequence parallelism reduce-scatters already", r


def test_traces_mark_the_all_reduce_waits(pool4):
    for r in pool4.run(ar_rank_fns.traced_waits_no_sp, 2):
        assert r["pieces"] == 2 * 4 and r["waits"] == r["pieces"], r  # fc2's forward and fc1's dgrad, 4 pieces each


# --------------------------------------------------------------------------- cost model, planner
def _plan(tp, hardware="a100-pcie", **run):
    from megatron_overlap.tune.hardware import get_hardware
    from megatron_overlap.tune.models import RunSpec, get_model
    from megatron_overlap.tune.strategy_ranking import make_plan

    return make_plan(get_model("llama3-8b"), RunSpec(tp=tp, sequence_parallel=False, **run), get_hardware(hardware))


def test_plan_prices_stock_all_reduces_and_ours():
    """Without SP the planner prices stock's all-reduces (the Row forward's blocking, the Column
    backward's beside its wgrad: exposed > 0) against the all-reduce path, its sub-batches and the
    fusion, recommends the fastest, and prints flags that run without SP."""
    from megatron_overlap import OverlapConfig, overlap_parser
    from megatron_overlap.config import ModelContext
    from megatron_overlap.tp.checks import check_tp_model

    plan = _plan(4)  # PCIe A100s: the link is slow, so overlap pays
    assert plan.stock.exposed_comm_ms > 0.1 * plan.stock.step_ms, plan.stock
    names = {r.name for r in plan.ranked}
    assert {"megatron", "p2p auto/rank", "p2p auto/rank x2 sub-batches", "p2p auto/rank ring + AR fusion",
            "symm-mem", "symm-mem + AR fusion"} <= names, names
    assert [r.reason for r in plan.not_applicable] == ["without SP its GEMM-reduce-scatter hides nothing (refused)"]
    assert plan.best.strategy.name != "megatron" and plan.best.exposed_comm_ms < plan.stock.exposed_comm_ms
    assert plan.best.step_ms == min(r.step_ms for r in plan.ranked)
    for r in plan.ranked:
        flags = r.flags.split()
        # no reduce-scatter to pick but the fusion's (symm-mem's is its own)
        assert ("--overlap-tp-rs" in flags) == (r.strategy.allreduce_fusion and r.strategy.name == "p2p"), r.flags
        if r.strategy.name != "megatron":
            config = OverlapConfig.from_args(overlap_parser().parse_args(flags))
            check_tp_model(config.tp, ModelContext(tp_size=4, sequence_parallel=False, seq_length=8192))
    fusion = next(r for r in plan.ranked if r.name == "p2p auto/rank ring + AR fusion")
    per_op = next(r for r in plan.ranked if r.name == "p2p auto/rank")
    assert fusion.layer_fwd_ms < per_op.layer_fwd_ms and fusion.layer_bwd_ms == per_op.layer_bwd_ms  # forward only


def test_plan_recommends_stock_where_overlap_cannot_pay():
    """A decode step's all-reduces carry one token: stock wins; the strategies that need a
    reduce-scatter say why they cannot run."""
    plan = _plan(4, phase="decode")
    assert plan.best.strategy.name == "megatron"
    reasons = " ".join(r.reason for r in plan.not_applicable)
    assert "do not split over TP=4 (its reduce-scatter needs it)" in reasons, reasons


def test_plan_cli_without_sequence_parallel(capsys):
    import json

    from megatron_overlap.cli.plan_command import main

    assert main(["--model", "llama3-8b", "--tp", "4", "--hardware", "a100-pcie", "--no-sequence-parallel",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["config"]["sequence_parallel"] is False and out["best"] != "megatron", out["best"]
    assert main(["--model", "llama3-8b", "--tp", "4", "--hardware", "a100-pcie", "--no-sequence-parallel"]) == 0
    table = capsys.readouterr().out
    assert "TP=4 without SP" in table and "--overlap-tp-allreduce-fusion" in table, table


def test_autotune_measures_the_all_reduce_path(pool4, tmp_path):
    for r in pool4.run(ar_rank_fns.autotuned_no_sp, 2, str(tmp_path)):
        assert r["kinds"] == ["column_ar", "row_ar"] and r["entries"] == ["column_ar", "row_ar"], r
        assert r["worst"] == 0.0, r  # TP=2: whatever the pieces, stock's bits


def test_bench_layer_without_sp_smoke():
    """``bench layer --no-sequence-parallel`` with sub-batches and the fusion in the same rounds:
    stock's bytes in every mode (all of them all-reduces, the fusion's RS + AG included), the
    gradients stock's (the fusion's bit for bit), the bound without SP reported."""
    import json

    from .cli_runner import cli

    out = cli("bench", "layer", "--hidden", "64", "--ffn", "128", "--heads", "4", "--seq", "64", "--steps", "1",
              "--warmup", "1", "--overlap-tp-sub-batches", "2", "--no-sequence-parallel", "--overlap-tp-allreduce-fusion",
              "--no-progress",
              "--json", timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert len({result[m]["bytes_per_step"] for m in ("stock", "overlap", "sub", "fusion")}) == 1
    assert result["max_rel_diff_vs_stock"] <= ROUNDING and result["sub_max_rel_diff_vs_stock"] <= ROUNDING
    assert result["fusion_max_rel_diff_vs_stock"] == 0.0
    ph = result["phases"]
    assert ph["forward_link_bound_ms"] > ph["transfer_forward_ms"] and ph["step_bound_ms"] >= result["phase_limit_ms"]
    assert "TP=2 without SP (all-reduces)" in out.stdout and "all-reduce fusion:" in out.stdout


def test_bench_refuses_what_sp_off_cannot_run():
    from .cli_runner import cli

    out = cli("bench", "mlp", "--overlap-tp-allreduce-fusion", "--no-progress")
    assert out.returncode != 0 and "--overlap-tp-allreduce-fusion splits the all-reduces of TP without sequence parallelism; " \
        "add --no-sequence-parallel" in out.stderr, out.stderr
    out = cli("bench", "mlp", "--no-sequence-parallel", "--overlap-tp-bidirectional", "--no-progress")
    assert out.returncode != 0 and "--overlap-tp-bidirectional splits ring transfers" in out.stderr, out.stderr
