"""The cost model's pieces: units, monotonicity, limits, calibration, and the scheduler against
the closed forms. Pure Python, no ranks."""

import math
import random

import pytest

from megatron_overlap.tune import comm, gemm
from megatron_overlap.tune.engine import Graph, contended_gemm_ms, schedule
from megatron_overlap.tune.hardware import HARDWARE, Link, cpu_emulated_spec, with_link
from megatron_overlap.tune.layer_ops import mlp_ops
from megatron_overlap.tune.models import ModelSpec, RunSpec
from megatron_overlap.tune.strategy_sim import make_ctx, simulate, simulate_ops
from megatron_overlap.tune.strategies import Strategy, default_chunks_per_rank, piece_rows

SMALL = ModelSpec("small", hidden=1024, ffn=4096, heads=8, kv_heads=8, layers=2, vocab=1024, seq=2048)


# ---------------------------------------------------------------- units


def test_transfer_units():
    link = Link(bandwidth_GBps=100.0, latency_us=0.0)
    assert comm.transfer_ms(1e9, link) == pytest.approx(10.0)  # 1 GB at 100 GB/s
    slow = Link(bandwidth_GBps=100.0, latency_us=20.0, launch_us=5.0)
    assert comm.transfer_ms(1e9, slow, messages=3) == pytest.approx(10.0 + 0.065)


def test_collective_volumes_and_hops():
    link = Link(bandwidth_GBps=100.0, latency_us=10.0)
    # ring AG of a 4 GB result over 4 ranks: each rank sends 3 shards of 1 GB, 3 hops
    assert comm.all_gather_ms(4e9, 4, link) == pytest.approx(30.0 + 0.03)
    assert comm.reduce_scatter_ms(4e9, 4, link) == comm.all_gather_ms(4e9, 4, link)
    assert comm.all_reduce_ms(4e9, 4, link) == pytest.approx(60.0 + 0.06)  # RS + AG
    assert comm.all_to_all_ms(4e9, 4, link) == pytest.approx(30.0 + 0.03)
    assert comm.p2p_ms(1e9, link) == pytest.approx(10.01)
    assert comm.all_gather_ms(4e9, 1, link) == 0.0  # one rank: nothing moves


def test_small_message_protocol_is_taken_only_when_cheaper():
    link = Link(bandwidth_GBps=100.0, latency_us=5.0, small_latency_us=1.0, small_bandwidth_fraction=0.5)
    small, big = comm.transfer_cost(1e3, link, 7), comm.transfer_cost(1e9, link, 7)
    assert small.latency_ms == pytest.approx(7e-3)  # LL hops for a tiny message
    assert big.busy_ms == pytest.approx(10.0)  # full bandwidth for a large one
    for n in (1e3, 1e6, 1e9):
        full = Link(bandwidth_GBps=100.0, latency_us=5.0)
        assert comm.transfer_ms(n, link, 7) <= comm.transfer_ms(n, full, 7)


def test_gemm_roofline_units():
    hw = cpu_emulated_spec(gemm_gflops=100.0, mem_GBps=10.0, link_bandwidth_GBps=1.0, link_latency_us=0.0)
    # 2 * 1000^3 flops = 2 GFLOP at 100 GFLOP/s: 20 ms; bytes 3 * 4 MB / 10 GB/s = 1.2 ms
    assert gemm.gemm_ms(1000, 1000, 1000, hw) == pytest.approx(20.0)
    # a GEMV is memory-bound: 4 B * (1000 + 1e6 + 1000) / 10 GB/s
    assert gemm.gemm_ms(1, 1000, 1000, hw) == pytest.approx(4 * (1000 + 1e6 + 1000) / 10e9 * 1e3)


def test_hardware_specs_are_per_direction_and_cited():
    h100, pcie = HARDWARE["h100-sxm"], HARDWARE["a100-pcie"]
    assert h100.intra.bandwidth_GBps == pytest.approx(900 / 2 * 0.8)  # NVLink 900 GB/s both ways
    assert pcie.intra.bandwidth_GBps == pytest.approx(64 / 2 * 0.8)  # PCIe Gen4 x16 64 GB/s both ways
    assert {"a100-pcie", "a100-sxm", "h800-sxm", "h100-sxm", "h200-sxm"} <= set(HARDWARE)
    for hw in HARDWARE.values():
        assert hw.peak_tflops > 0 and hw.hbm_GBps > 0 and hw.sm_count > 0
        assert hw.inter.bandwidth_GBps < hw.intra.bandwidth_GBps
        assert 0 < hw.nccl_sm_fraction < 1


# ---------------------------------------------------------------- monotonicity


def test_more_chunks_never_less_gemm_time():
    hw = HARDWARE["h100-sxm"]
    for m, n, k in ((8192, 8192, 8192), (4096, 1024, 8192), (512, 28672, 8192)):
        times = [gemm.chunked_gemm_ms(m, n, k, c, hw) for c in (1, 2, 4, 8, 16)]
        assert times == sorted(times), times
    # at a fixed efficiency (flat curve, no overhead) chunking costs nothing extra when compute-bound
    flat = gemm.GemmEfficiency(max_fraction=0.7, half_dim=0.0)
    t1 = gemm.gemm_ms(8192, 8192, 8192, hw, flat)
    assert gemm.chunked_gemm_ms(8192, 8192, 8192, 8, hw, flat) == pytest.approx(t1)
    # with a per-call overhead, strictly more
    over = gemm.GemmEfficiency(max_fraction=0.7, half_dim=0.0, overhead_us=5.0)
    assert gemm.chunked_gemm_ms(8192, 8192, 8192, 8, hw, over) > gemm.gemm_ms(8192, 8192, 8192, hw, over)


@pytest.mark.parametrize("name", ["a100-pcie", "h100-sxm"])
def test_more_bandwidth_is_never_slower(name):
    run = RunSpec(tp=4, seq=2048, micro_batch=1, phase="train")
    for strategy in (Strategy("megatron"), Strategy("p2p"), Strategy("p2p", chunks=2, rs="a2a"),
                     Strategy("symm-mem"), Strategy("fused")):
        steps = [simulate(SMALL, run, with_link(HARDWARE[name], bw), strategy).step_ms
                 for bw in (5.0, 20.0, 80.0, 320.0, 1280.0)]
        for slower, faster in zip(steps, steps[1:]):
            assert faster <= slower * (1 + 1e-9), (strategy, steps)


def test_engine_is_monotone_in_durations(seed):
    rng = random.Random(seed)  # a fresh graph each run (conftest: printed on failure)
    g = Graph()
    for i in range(40):
        deps = [j for j in range(i) if rng.random() < 0.1]
        if rng.random() < 0.4:
            g.add(f"t{i}", "link", rng.uniform(0, 5), deps, latency_ms=rng.uniform(0, 1))
        else:
            g.compute(f"c{i}", rng.uniform(0, 5), deps)
    base = schedule(g).makespan_ms
    for t in g.tasks:
        t.busy_ms *= 0.5
    assert schedule(g).makespan_ms <= base + 1e-9


# ---------------------------------------------------------------- limits and closed forms


def test_zero_communication_changes_nothing():
    assert contended_gemm_ms(12.0, 0.0, 0.2) == 12.0
    # a link that costs nothing and GEMMs at one efficiency: the plugin's schedule is stock's
    hw = cpu_emulated_spec(80.0, 1e9, link_bandwidth_GBps=1e12, link_latency_us=0.0)
    run = RunSpec(tp=2, seq=2048, phase="train")
    ops = mlp_ops(1024, 4096, 3.0, 50.0)
    stock = simulate_ops(ops, make_ctx(run, hw, Strategy("megatron")), True)
    ours = simulate_ops(ops, make_ctx(run, hw, Strategy("p2p")), True)
    assert ours.fwd_ms + ours.bwd_ms == pytest.approx(stock.fwd_ms + stock.bwd_ms, rel=1e-6)
    assert stock.exposed_ms() == pytest.approx(0.0, abs=1e-6)


def test_tp1_has_nothing_to_overlap():
    run = RunSpec(tp=1, seq=2048, phase="train")
    hw = HARDWARE["h100-sxm"]
    stock = simulate(SMALL, run, hw, Strategy("megatron"))
    assert stock.comm_ms == 0.0 and stock.exposed_comm_ms == 0.0
    for name in ("p2p", "symm-mem", "fused"):
        assert not simulate(SMALL, run, hw, Strategy(name)).applicable


def _pipelined_ms(gemm_ms: float, comm_ms: float, chunks: int) -> float:
    """The closed form of a c-stage pipeline of a transfer and a GEMM (each cut in c equal
    chunks): the longer of the two plus one chunk of the shorter (fill or drain)."""
    return max(gemm_ms, comm_ms) + min(gemm_ms, comm_ms) / chunks


@pytest.mark.parametrize("gemm_ms,comm_ms", [(10.0, 4.0), (4.0, 10.0), (7.0, 7.0)])
@pytest.mark.parametrize("chunks", [1, 2, 5])
def test_scheduler_matches_the_pipeline_closed_form(gemm_ms, comm_ms, chunks):
    g = Graph()
    sends = [g.add("send", "link", comm_ms / chunks) for _ in range(chunks)]
    for s in sends:
        g.compute("gemm", gemm_ms / chunks, [s])
    assert schedule(g).makespan_ms == pytest.approx(_pipelined_ms(gemm_ms, comm_ms, chunks))
    assert schedule(g).exposed_ms() == pytest.approx(_pipelined_ms(gemm_ms, comm_ms, chunks) - gemm_ms)


def test_sm_contention_slows_only_overlapped_gemms():
    g = Graph()
    g.add("nccl", "link", 10.0, sm_comm=True)
    g.compute("gemm", 20.0, contended=True)
    sched = schedule(g, sm_fraction=0.25)
    assert sched.makespan_ms == pytest.approx(contended_gemm_ms(20.0, 10.0, 0.25))  # 22.5
    assert schedule(g, sm_fraction=0.0).makespan_ms == 20.0
    copy_engine = Graph()
    copy_engine.add("copy", "link", 10.0, sm_comm=False)
    copy_engine.compute("gemm", 20.0, contended=True)
    assert schedule(copy_engine, sm_fraction=0.25).makespan_ms == 20.0


def test_contention_closed_form_bounds():
    for g_ms, c_ms, s in ((10, 5, 0.1), (10, 50, 0.1), (10, 0, 0.5)):
        t = contended_gemm_ms(g_ms, c_ms, s)
        assert g_ms <= t <= g_ms / (1 - s) + 1e-12


# ---------------------------------------------------------------- calibration and the plugin's rules


def test_fit_recovers_a_known_curve():
    hw = cpu_emulated_spec(1000.0, 100.0, 1.0, 0.0)
    truth = gemm.GemmEfficiency(max_fraction=0.7, half_dim=2.0 ** 5, overhead_us=10.0, hbm_fraction=1.0)
    shapes = [(m, n, k) for m in (64, 128, 256, 512, 1024, 2048) for n, k in ((1024, 2048), (2048, 1024))]
    table = {s: gemm.gemm_ms(*s, hw, truth) for s in shapes}
    fitted = gemm.fit_efficiency(table, hw.peak_tflops)
    assert fitted.half_dim == pytest.approx(truth.half_dim)
    assert fitted.overhead_us == pytest.approx(truth.overhead_us)
    assert fitted.max_fraction == pytest.approx(truth.max_fraction, rel=1e-9)


def test_calibrating_a_gpu_spec_changes_only_its_gemm_curve():
    from megatron_overlap.tune.hardware import calibrate_gemm

    hw = HARDWARE["h100-sxm"]
    truth = gemm.GemmEfficiency(max_fraction=0.6, half_dim=2.0 ** 7, overhead_us=3.0, hbm_fraction=hw.gemm.hbm_fraction)
    rows = [{"M": 16384 // c, "N": 8192, "K": 8192, "ms": gemm.gemm_ms(16384 // c, 8192, 8192, hw, truth)}
            for c in (1, 2, 4, 8, 16)] + [{"M": 16384, "N": 1024, "K": 8192,
                                            "ms": gemm.gemm_ms(16384, 1024, 8192, hw, truth)}]
    calibrated = calibrate_gemm(hw, rows)
    assert calibrated.intra == hw.intra and calibrated.peak_tflops == hw.peak_tflops
    for r in rows:
        assert gemm.gemm_ms(r["M"], r["N"], r["K"], calibrated) == pytest.approx(r["ms"], rel=1e-6)


def test_fit_on_the_measured_cpu_table_predicts_it():
    import json
    from pathlib import Path

    rates = json.loads((Path(__file__).parent / "data" / "cpu_gemm_rates.json").read_text())
    table = gemm.table_from_rows(rates["gemm_table"])
    peak = max(2 * m * n * k / ms / 1e6 for (m, n, k), ms in table.items()) / 1e3
    fitted = gemm.fit_efficiency(table, peak)
    hw = cpu_emulated_spec(peak * 1e3, 10.0, 1.0, 0.0, gemm=fitted)
    errors = [abs(gemm.gemm_ms(m, n, k, hw) / ms - 1) for (m, n, k), ms in table.items()]
    # single-thread BLAS times of one VM vary ~10% between shapes that the curve treats alike
    assert max(errors) < 0.25 and sum(errors) / len(errors) < 0.1, errors


@pytest.mark.parametrize("rows,chunks", [(r, c) for r in (1, 7, 64, 1000, 1024) for c in (1, 2, 3, 5, 8) if c <= r])
@pytest.mark.parametrize("taper", [False, True])
def test_pieces_match_the_plugin(rows, chunks, taper):
    from megatron_overlap.comm.rings import split_pieces

    assert piece_rows(rows, chunks, taper) == [p.rows for p in split_pieces(rows, chunks, taper=taper)]


@pytest.mark.parametrize("rows,batch", [(16, 1), (255, 1), (256, 1), (1024, 1), (512, 4), (4096, 2)])
def test_default_chunk_rule_matches_the_plugin(rows, batch):
    from megatron_overlap.config import TPConfig
    from megatron_overlap.tp.linear_plan import chunks_per_rank

    assert default_chunks_per_rank(rows, batch) == chunks_per_rank(TPConfig(mode="p2p"), 2, rows, batch)


def test_run_spec_validation():
    with pytest.raises(ValueError):
        RunSpec(tp=0)
    with pytest.raises(ValueError):
        RunSpec(phase="serve")
    with pytest.raises(ValueError):
        RunSpec(cp=2, seq=1026)  # 2 x CP chunks
    assert RunSpec(tp=8, cp=2, seq=4096, micro_batch=2).tokens == 4096
    assert RunSpec(tp=8, seq=4096, micro_batch=3, phase="decode").tokens == 3
    assert math.isclose(SMALL.params_per_layer, 1024 * 3072 + 1024 * 1024 + 1024 * 8192 + 4096 * 1024)


def test_fused_is_priced_at_its_measured_speed():
    """The model's fused GEMM runs at the efficiency the H200 check recorded; the figure it uses
    is the one in the newest GPU record (a new record must replace it)."""
    import glob
    import json
    import os

    from megatron_overlap.tune.measured import FUSED_AG_GEMM_VS_CUBLAS, fused_slowdown

    root = os.path.join(os.path.dirname(__file__), "..", "docs", "gpu")
    newest = sorted(glob.glob(os.path.join(root, "*gpu_check*.json")))[-1]
    recorded = [run["ag_gemm_vs_matmul_throughput"] for run in json.load(open(newest)).values()
                if isinstance(run, dict) and "ag_gemm_vs_matmul_throughput" in run]
    assert recorded and FUSED_AG_GEMM_VS_CUBLAS.value == recorded[-1]
    assert os.path.basename(newest) in FUSED_AG_GEMM_VS_CUBLAS.source
    assert Strategy("fused").slowdown == pytest.approx(fused_slowdown()) == pytest.approx(1 / recorded[-1] - 1)
    assert Strategy("flux").slowdown == 0.0 and Strategy("fused", fused_slowdown=0.0).slowdown == 0.0
    run, hw, model = RunSpec(tp=8, seq=8192), HARDWARE["h100-sxm"], ModelSpec("m", 8192, 28672, 64, 8, 4, 128256, 8192)
    measured, ideal = simulate(model, run, hw, Strategy("fused")), simulate(model, run, hw, Strategy("fused", fused_slowdown=0.0))
    stock = simulate(model, run, hw, Strategy("megatron"))
    assert measured.step_ms > stock.step_ms > ideal.step_ms * 0.5  # at 0.26x cuBLAS, slower than stock


def test_sub_batches_move_the_same_bytes_and_hide_more_of_a_layer():
    """tune/sub_batches.py: a layer cut in 2 (the `bench layer` shapes on an emulated CPU link)
    moves the same bytes as per-op overlap (zero-latency link: the same link time) and leaves
    less of them exposed, the attention's compute hiding the projection's reduce-scatters; the
    planner lists the cut with its flag, and `auto` never chooses it (it is the user's)."""
    from megatron_overlap.tune.hardware import cpu_emulated_spec
    from megatron_overlap.tune.layer_ops import transformer_layer_ops
    from megatron_overlap.tune.models import ModelSpec, RunSpec
    from megatron_overlap.tune.strategy_ranking import candidates
    from megatron_overlap.tune.strategy_sim import make_ctx, simulate_ops
    from megatron_overlap.tune.strategies import Strategy

    hw = cpu_emulated_spec(60.0, 10.0, 0.04, 0.0)
    model = ModelSpec("layer", hidden=1024, ffn=4096, heads=8, kv_heads=8, layers=1, vocab=1024, seq=2048, gated=False)
    run = RunSpec(tp=2, seq=2048, micro_batch=1, phase="train")
    ops = transformer_layer_ops(model, run, hw)
    whole = simulate_ops(ops, make_ctx(run, hw, Strategy("p2p")), True)
    cut = simulate_ops(ops, make_ctx(run, hw, Strategy("p2p", sub_batches=2)), True)
    assert cut.comm_ms("tp") == pytest.approx(whole.comm_ms("tp"), rel=1e-9)
    assert cut.exposed_ms("tp") < whole.exposed_ms("tp")
    flags = {s.flags(2) for s in candidates(run) if s.sub_batches > 1}
    assert "--overlap-tp p2p --overlap-tp-sub-batches 2 --overlap-tp-chunks 0 --overlap-tp-rs ring" in flags
    with pytest.raises(ValueError, match="p2p and symm-mem only"):
        Strategy("fused", sub_batches=2)
    import argparse

    from megatron_overlap.tune.auto import predicted_choice

    from megatron_overlap.tune.hardware import get_hardware
    from megatron_overlap.tune.models import get_model
    from megatron_overlap.tune.strategy_ranking import make_plan

    # Llama-3-8B, H100, TP=4, seq 8192, micro-batch 8: the plan ranks symm-mem cut in 2 first (0.1% ahead of
    # whole: with every backend's early whole re-gather priced, the only such case among Llama-3-8B/70B, TP 4/8,
    # seq 4096/8192, micro-batch 1-8)
    plan = make_plan(get_model("llama3-8b"), RunSpec(tp=4, seq=8192, micro_batch=8, phase="train"),
                     get_hardware("h100-sxm"))
    assert plan.best.strategy.sub_batches == 2, plan.best.name
    args = argparse.Namespace(hidden_size=4096, ffn_hidden_size=14336, num_attention_heads=32, num_layers=32,
                              seq_length=8192, tensor_model_parallel_size=4, micro_batch_size=8,
                              num_query_groups=8, group_query_attention=True, swiglu=True, padded_vocab_size=128256)
    best, _stock = predicted_choice(args, "NVIDIA H100 80GB HBM3", True)
    assert best.strategy.sub_batches == 1 and best.strategy.name == "symm-mem", best.name
    # `--overlap-tp-sub-batches auto` asks for the cut: the plan's own first choice
    best, _stock = predicted_choice(args, "NVIDIA H100 80GB HBM3", True, sub_batches="auto")
    assert (best.strategy.name, best.strategy.sub_batches) == ("symm-mem", 2), best.name
    # with the backend fixed (`--overlap-tp p2p`), only the cut is chosen (count and blocks): the fastest p2p cut
    best, stock = predicted_choice(args, "NVIDIA H100 80GB HBM3", True, sub_batches="auto", backend="p2p")
    cuts = [Strategy("p2p")] + [Strategy("p2p", sub_batches=n, cut=c) for n in (2, 3) for c in ("all", "attention", "mlp")]
    p2p = {(r.strategy.sub_batches, r.strategy.cut): r.step_ms
           for r in make_plan(get_model("llama3-8b"), RunSpec(tp=4, seq=8192, micro_batch=8, phase="train"),
                              get_hardware("h100-sxm"), cuts).ranked}
    assert best.strategy.name == "p2p" and best.step_ms == min(p2p.values()) == p2p[
        best.strategy.sub_batches, best.strategy.cut]
    assert stock.strategy.name == "megatron"
    # the user's blocks (`--overlap-tp-sub-batch-blocks mlp`): only that cut is a candidate
    best, _stock = predicted_choice(args, "NVIDIA H100 80GB HBM3", True, sub_batches="auto", backend="p2p",
                                    blocks="mlp")
    assert best.strategy.sub_batches == 1 or best.strategy.cut == "mlp", best.name


def test_sub_batches_of_one_block_kind_are_modelled_as_the_code_cuts_them():
    """``--overlap-tp-sub-batch-blocks``: the model cuts only the attention (or only the MLP)
    blocks, the others whole as per-op runs them (their Row starting the Column's early
    re-gather); the bytes stay per-op's, and the flags name the blocks."""
    from megatron_overlap.tune.hardware import cpu_emulated_spec
    from megatron_overlap.tune.layer_ops import transformer_layer_ops
    from megatron_overlap.tune.models import ModelSpec, RunSpec
    from megatron_overlap.tune.strategy_sim import make_ctx, simulate_ops
    from megatron_overlap.tune.strategies import Strategy
    from megatron_overlap.tune.sub_batches import blocks

    hw = cpu_emulated_spec(60.0, 10.0, 0.04, 0.0)
    model = ModelSpec("layer", hidden=1024, ffn=4096, heads=8, kv_heads=8, layers=1, vocab=1024, seq=2048, gated=False)
    run = RunSpec(tp=2, seq=2048, micro_batch=1, phase="train")
    ops = transformer_layer_ops(model, run, hw)
    kinds = {cut: [kind for kind, _ in blocks(ops, 1, cut)] for cut in ("all", "attention", "mlp")}
    assert "attention" in kinds["all"] and "mlp" in kinds["all"]
    assert "attention" in kinds["attention"] and "mlp" not in kinds["attention"]
    assert "mlp" in kinds["mlp"] and "attention" not in kinds["mlp"]
    whole = simulate_ops(ops, make_ctx(run, hw, Strategy("p2p")), True)
    for cut in ("attention", "mlp"):
        one = simulate_ops(ops, make_ctx(run, hw, Strategy("p2p", sub_batches=2, cut=cut)), True)
        assert one.comm_ms("tp") == pytest.approx(whole.comm_ms("tp"), rel=1e-9)
        if cut == "attention":  # the whole MLP's fc2 starts fc1's input re-gather early, as per-op
            assert "fc1 bwd AG(x) early" in [t.name for t in one.bwd_tasks]
    flags = Strategy("p2p", sub_batches=2, cut="attention").flags(2)
    assert "--overlap-tp-sub-batches 2 --overlap-tp-sub-batch-blocks attention" in flags
    with pytest.raises(ValueError, match="more than 1 sub-batch"):
        Strategy("p2p", cut="attention")
    with pytest.raises(ValueError, match="one of"):
        Strategy("p2p", sub_batches=2, cut="qkv")


def test_per_op_backward_prices_the_whole_input_regather_early():
    """Per-op overlap (no sub-batches): a Row's backward starts the whole input re-gather of the
    Column before it once its own grad-output pieces are in (tp.linear.GatherSlot.start), so the
    model prices that early gather at a full all-gather and nothing is left for the Column's own;
    the bytes stay stock's."""
    from megatron_overlap.tune.hardware import cpu_emulated_spec
    from megatron_overlap.tune.layer_ops import transformer_layer_ops
    from megatron_overlap.tune.models import ModelSpec, RunSpec
    from megatron_overlap.tune.strategies import Strategy

    hw = cpu_emulated_spec(60.0, 10.0, 0.04, 0.0)
    model = ModelSpec("layer", hidden=1024, ffn=4096, heads=8, kv_heads=8, layers=1, vocab=1024, seq=2048, gated=False)
    run = RunSpec(tp=2, seq=2048, micro_batch=1, phase="train")
    ops = transformer_layer_ops(model, run, hw)
    ours = simulate_ops(ops, make_ctx(run, hw, Strategy("p2p")), True)
    stock = simulate_ops(ops, make_ctx(run, hw, Strategy("megatron")), True)
    early = {t.name: t.busy_ms for t in ours.bwd_tasks if t.name.endswith("bwd AG(x) early")}
    late = {t.name: t.busy_ms for t in ours.bwd_tasks if t.name.endswith("bwd AG(x)")}
    full = {t.name: t.busy_ms for t in stock.bwd_tasks if t.name.endswith("bwd AG(x)")}
    assert early and set(late) == set(full), (early, late, full)
    for name, ms in early.items():  # each Column with a Row after it: the whole gather early
        assert ms == pytest.approx(full[name[:-len(" early")]], rel=1e-9) and late[name[:-len(" early")]] == 0.0
    assert ours.comm_ms("tp") == pytest.approx(stock.comm_ms("tp"), rel=1e-9)
