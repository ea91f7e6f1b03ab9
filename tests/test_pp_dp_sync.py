"""The data-parallel sync in the pipeline's bubbles: the weight-gradient
drain (``tp/wgrad_store.py``), the simulator's DP model (``pp/schedule_sim.py``), Megatron DDP's
bucket layout (``pp/buckets.py``) and the floor with the DP sync (``pp/optimal.py``). Pure: no
ranks; the numerics through Megatron's DDP and distributed optimizer are in
tests/test_pp_training.py."""

import random

import pytest
import torch

from megatron_overlap.pp import ScheduleError, build
from megatron_overlap.pp.buckets import buckets, default_bucket_size, stage_bucket_size
from megatron_overlap.pp.optimal import floor
from megatron_overlap.pp.schedule_sim import DPSync, LinkCost, StageTimes, grad_segment, simulate
from megatron_overlap.tp.wgrad_store import WgradStore


def _store_with(mbs, params):
    """A store holding, for each micro-batch, one task per parameter (pushed in backward order)
    that appends (param index, mb) to ``log`` and adds a value into ``sums``."""
    store, log = WgradStore(), []
    sums = {p: torch.zeros((), dtype=torch.float32) for p in range(len(params))}
    for mb in mbs:
        with store.hold_for(mb):
            for p in reversed(range(len(params))):
                def task(p=p, mb=mb):
                    log.append((p, mb))
                    sums[p].add_(torch.tensor(1.0 / (3 + mb) ** 7))  # sums depend on the order
                store.push(params[p], task)
    return store, log, sums


def test_drain_runs_layer_by_layer_each_parameter_in_microbatch_order():
    params = [torch.nn.Parameter(torch.zeros(1)) for _ in range(4)]
    store, log, sums = _store_with([2, 3, 4], params)
    released = []
    for i, p in enumerate(params):
        store.after(p, lambda i=i: released.append((i, len(log))))
    assert store.run_layer_major([2, 3, 4]) == 12 and not store.held_microbatches()
    # the last layer's parameter first (the backward's push order), its micro-batches in order
    assert log == [(p, mb) for p in (3, 2, 1, 0) for mb in (2, 3, 4)]
    # each parameter is released for DDP's bucket as soon as its last task ran
    assert released == [(3, 3), (2, 6), (1, 9), (0, 12)]
    # the same additions in the same order per parameter as micro-batch after micro-batch
    ref_store, _ref_log, ref_sums = _store_with([2, 3, 4], params)
    for mb in (2, 3, 4):
        ref_store.run_microbatch(mb)
    assert all(torch.equal(sums[p], ref_sums[p]) for p in sums)


def test_flush_runs_each_parameters_held_tasks_before_its_own():
    params = [torch.nn.Parameter(torch.zeros(1)) for _ in range(3)]
    store, log, _sums = _store_with([0, 1], params)
    with store.flush_for(2):  # the last B: each push runs that parameter's held tasks, then itself
        for p in reversed(range(3)):
            store.push(params[p], lambda p=p: log.append((p, 2)))
    assert log == [(p, mb) for p in (2, 1, 0) for mb in (0, 1, 2)]
    assert not store.held_microbatches() and store.held_bytes() == 0
    assert store.run_microbatch(0) == 0  # the W actions after it find nothing left


def test_megatron_bucket_layout():
    # reversed registration order; a bucket closes at the parameter that reaches the size
    assert buckets([10, 30, 25, 5], 40) == [60, 10]  # 5 + 25 + 30 reaches 40; 10 is left
    assert buckets([10, 30, 25, 5], None) == [70]
    assert buckets([50], 40) == [50]
    assert default_bucket_size(2) == 40_000_000 and default_bucket_size(64) == 64_000_000
    assert stage_bucket_size(2, 0) == 40_000_000
    assert stage_bucket_size(2, 1) is None and stage_bucket_size(2, 0, overlap_grad_reduce=False) is None


def test_drains_are_where_the_validator_allows():
    zb = build("zb", 4, 8)
    assert zb.drain == ("bw", "w", "w", "w")
    assert build("zb", 4, 8, drain=False).drain == ()
    assert build("1f1b", 4, 8).drain == ()
    import dataclasses

    with pytest.raises(ScheduleError, match="sends a gradient: only stage 0"):
        from megatron_overlap.pp.validate import validate

        validate(dataclasses.replace(zb, drain=("bw", "bw", "w", "w")))
    with pytest.raises(ScheduleError, match="one of"):
        validate(dataclasses.replace(zb, drain=("bw", "x", "w", "w")))


T = [StageTimes(10.0, 11.0, 6.0), StageTimes(10.0, 11.0, 6.0), StageTimes(10.0, 11.0, 6.0)]
LINK = LinkCost(transfer_ms=1.0)


def test_gradient_buckets_fill_over_the_last_gradient_segment():
    stock, zb = build("megatron", 3, 6), build("zb", 3, 6)
    one = DPSync(reduce_ms=(30.0,))
    many = DPSync(reduce_ms=(10.0, 10.0, 10.0))
    free = simulate(stock, T, LINK)
    # one bucket: starts when the stage's last backward ends
    r = simulate(stock, T, LINK, [one] * 3)
    for s in range(3):
        first, last = grad_segment(stock, s)
        assert r.dp_spans[s][0][1] == pytest.approx(free.timeline[s][-1][2])
    # several: the first is ready a third into the last B, the reduction ends after it
    r = simulate(stock, T, LINK, [many] * 3)
    t0 = free.timeline[0][-1]
    assert r.dp_spans[0][0][1] == pytest.approx(t0[1] + (t0[2] - t0[1]) / 3)
    assert r.step_ms >= free.step_ms
    # a drained zb stage 0 fills its buckets over its last B and the weight gradients after it
    first, last = grad_segment(zb, 0)
    assert zb.actions[0][first].op == "B" and zb.actions[0][last].op == "W"


def test_parameter_gather_at_the_start_hides_in_the_warm_up():
    """Stock gathers at the first forward's hook: a later stage starts its pipeline that late,
    one stage after the other; gathered from the step's start it travels while the stage
    waits for its first activation."""
    syncs = [DPSync(gather_ms=(8.0,), reduce_ms=(1.0,)) for _ in range(3)]
    stock = simulate(build("megatron", 3, 6), T, LINK, syncs)
    ours = simulate(build("1f1b", 3, 6), T, LINK, [d.replace(gather_at_start=True) for d in syncs])
    assert stock.dp_gather_wait_ms[1] == pytest.approx(8.0) and stock.dp_gather_wait_ms[2] == pytest.approx(8.0)
    assert ours.dp_gather_wait_ms[1] == 0.0 and ours.dp_gather_wait_ms[2] == 0.0
    assert ours.dp_gather_wait_ms[0] == pytest.approx(8.0)  # nothing to hide behind on the first stage
    assert stock.step_ms - ours.step_ms > 15.0  # two stages' gathers off the critical path


def test_the_floor_with_the_dp_sync_is_below_every_schedule():
    """Random F/B/W, buckets and gathers at p = 2-3: the floor with the DP sync is below every
    schedule simulated with the same sync (ours gathering from the start, stock at the first
    forward), and above the floor without it."""
    rng = random.Random(3)
    for _ in range(3):
        p, m = rng.choice([(2, 4), (3, 5)])
        times = [StageTimes(rng.uniform(5, 12), rng.uniform(5, 12), rng.uniform(2, 8)) for _ in range(p)]
        link = LinkCost(transfer_ms=rng.uniform(0.2, 3.0))
        syncs = [DPSync(reduce_ms=tuple(rng.uniform(2, 10) for _ in range(3 if s == 0 else 1)),
                        gather_ms=tuple(rng.uniform(1, 5) for _ in range(3 if s == 0 else 1)), latency_ms=0.01)
                 for s in range(p)]
        ours = [d.replace(gather_at_start=True) for d in syncs]
        with_dp = floor(times, m, link.transfer_ms, memory=p * 1.05, dp=ours, time_limit_s=20)
        without = floor(times, m, link.transfer_ms, memory=p * 1.05, time_limit_s=20)
        assert with_dp.bound_ms >= without.bound_ms - 0.05
        for kind in ("megatron", "1f1b", "zb"):
            sched = build(kind, p, m, times=(times[0].f, times[0].b, times[0].w))
            step = simulate(sched, times, link, syncs if kind == "megatron" else ours).step_ms
            assert with_dp.bound_ms <= step + 1e-6, (kind, p, m, with_dp.bound_ms, step)


def _megatron_args(**kw):
    import argparse

    values = dict(hidden_size=8192, ffn_hidden_size=28672, num_attention_heads=64, num_query_groups=8,
                  group_query_attention=True, num_layers=80, seq_length=8192, swiglu=True, padded_vocab_size=128256,
                  tensor_model_parallel_size=8, pipeline_model_parallel_size=4, context_parallel_size=1,
                  micro_batch_size=1, global_batch_size=32, use_distributed_optimizer=True, overlap_grad_reduce=True,
                  overlap_param_gather=True)
    values.update(kw)
    return argparse.Namespace(**values)


def test_pp_auto_prices_the_dp_sync_as_the_bench_measures_it():
    """``--overlap-pp auto`` on an H100 with Llama-3-70B's shape, TP=8 x PP=4 x DP=2, 16
    micro-batches: the cost model's schedules with the DP sync (distributed optimizer,
    overlap flags as given) pick zb and say the predicted speedup; without a GPU it knows, or
    without the step's micro-batches, the rule (zb where W can be deferred)."""
    from megatron_overlap.config import PPConfig, TPConfig
    from megatron_overlap.pp.checks import resolve_auto
    from megatron_overlap.tune.auto import predicted_pp_choice
    from megatron_overlap.tune.models import RunSpec, get_model
    from megatron_overlap.tune.hardware import get_hardware
    from megatron_overlap.tune.pipeline import DPOptions, simulate_schedules

    class Ctx:
        transformer_impl, tp_size = "local", 8

    got = predicted_pp_choice(_megatron_args(), "NVIDIA H100 80GB HBM3", world_size=64)
    assert got["dp"] == 2 and got["microbatches"] == 16 and got["hardware"] == "h100-sxm"
    assert len(got["placement"]) == 3  # zb then places its weight gradients for these (the install sets them)
    rows = {r.label: r.step_ms for r in simulate_schedules(
        get_model("llama3-70b"), RunSpec(tp=8, pp=4, dp=2, seq=8192, micro_batches=16), get_hardware("h100-sxm"))}
    assert got["steps_ms"]["zb"] == pytest.approx(rows["zb (ZB-H1)"], rel=0.02)  # the planner's own figure
    notes = []
    picked = resolve_auto(PPConfig(mode="auto"), TPConfig(mode="p2p"), Ctx, notes.append, got)
    assert picked.mode == "zb" and "predicted 1.1" in notes[0] and "distributed optimizer, overlap_grad_reduce" in notes[0]
    plain = predicted_pp_choice(_megatron_args(use_distributed_optimizer=False, overlap_param_gather=False),
                                "NVIDIA H100 80GB HBM3", world_size=64)
    assert plain["options"] == "all-reduce, overlap_grad_reduce"
    assert DPOptions(distributed_optimizer=False).describe().startswith("all-reduce")
    assert predicted_pp_choice(_megatron_args(), None, world_size=64) is None  # no GPU the cost model knows
    assert predicted_pp_choice(_megatron_args(global_batch_size=None), "H100", world_size=64) is None
    notes.clear()
    assert resolve_auto(PPConfig(mode="auto"), TPConfig(mode="p2p"), Ctx, notes.append).mode == "zb"
    assert "ZB-H1" in notes[0]


def test_zb_places_its_weight_gradients_for_the_best_simulated_times():
    """``placement_times``: of the stages' own F/B/W ratio and the fixed candidates, the one
    whose zb schedule simulates fastest with the DP sync; never slower than any candidate."""
    from megatron_overlap.pp.build import PLACEMENTS, placement_times

    rng = random.Random(5)
    for _ in range(6):
        p, m = rng.choice([(3, 6), (4, 8), (4, 12)])
        times = [StageTimes(10.0, 10.5, rng.uniform(3, 10)) for _ in range(p)]
        link = LinkCost(transfer_ms=rng.uniform(0.1, 2))
        dp = [DPSync(reduce_ms=(rng.uniform(5, 30),), gather_ms=(3.0,), gather_at_start=True) for _ in range(p)]
        best = placement_times(times, m, link, dp)
        step = simulate(build("zb", p, m, times=best), times, link, dp).step_ms
        own = tuple(sum(getattr(t, k) for t in times) / p for k in "fbw")
        for cand in (own,) + PLACEMENTS:
            assert step <= simulate(build("zb", p, m, times=cand), times, link, dp).step_ms + 1e-6
