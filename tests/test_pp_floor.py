"""The pipeline floor (``pp/optimal.py``): the shortest step any schedule reaches in the
simulator's model, proved by CP-SAT. It is a floor for our schedules and Megatron's (never above
their simulated steps), it is reached by them where they are optimal (the bench's measured case),
and more memory never raises it. Bad input is refused with what to change."""

import random
import sys

import pytest

from megatron_overlap.pp import build
from megatron_overlap.pp.optimal import floor
from megatron_overlap.pp.schedule_sim import LinkCost, StageTimes, simulate

# bench pp's measured run (BENCHMARKS.md, 2026-12-01): F/B/W per stage and the link
BENCH = [StageTimes(118.6, 120.4, 102.9), StageTimes(120.1, 119.8, 107.5)]
BENCH_LINK = LinkCost(transfer_ms=67.8, latency_ms=0.02)


def test_the_floor_is_below_every_schedule_and_above_the_busiest_stage():
    rng = random.Random(3)
    for p, m in ((2, 4), (3, 4), (2, 6)):
        times = [StageTimes(*(rng.uniform(5, 15) for _ in range(3))) for _ in range(p)]
        link = LinkCost(transfer_ms=rng.uniform(0, 6), latency_ms=0.1)
        split = floor(times, m, link.transfer_ms, link.latency_ms)
        whole = floor(times, m, link.transfer_ms, link.latency_ms, split=False)
        assert split.optimal and whole.optimal
        busiest = max(m * (t.f + t.b + t.w) for t in times)
        assert busiest <= split.bound_ms <= whole.bound_ms + 1e-6
        # our schedules, and Megatron's, are schedules of the model: none beats the floor
        assert split.bound_ms <= simulate(build("zb", p, m), times, link).step_ms
        for kind in ("megatron", "1f1b"):
            assert whole.bound_ms <= simulate(build(kind, p, m), times, link).step_ms, (kind, p, m)


def test_our_schedules_reach_the_floor_on_the_bench_run():
    """ZB-H1 and async 1F1B are optimal on bench pp's measured times and link: no schedule within
    1F1B's memory is shorter (the reason ZB-H1's bubble cannot go below ~0.55x stock's there)."""
    zb = floor(BENCH, 8, BENCH_LINK.transfer_ms, BENCH_LINK.latency_ms, memory=2.1)
    # equal up to the solver's 0.01 ms ticks (durations rounded down: the floor never overshoots)
    assert zb.optimal and zb.step_ms == pytest.approx(simulate(build("zb", 2, 8), BENCH, BENCH_LINK).step_ms, abs=0.3)
    whole = floor(BENCH, 8, BENCH_LINK.transfer_ms, BENCH_LINK.latency_ms, memory=2.0, split=False)
    assert whole.step_ms == pytest.approx(simulate(build("1f1b", 2, 8), BENCH, BENCH_LINK).step_ms, abs=0.3)
    stock = simulate(build("megatron", 2, 8), BENCH, BENCH_LINK)
    assert zb.bubble_floor / stock.bubble > 0.45
    # a third micro-batch's room on every stage (1.5x) or a W piece held apart lowers it
    assert floor(BENCH, 8, 67.8, 0.02, memory=3.0).bound_ms < zb.bound_ms - 100
    assert floor(BENCH, 8, 67.8, 0.02, memory=2.1, piece=(15, 0.07)).bound_ms < zb.bound_ms


def test_the_floor_refuses_what_no_schedule_can_run():
    with pytest.raises(ValueError, match="below one micro-batch's, no schedule runs"):
        floor(BENCH, 4, 1.0, memory=0.5)
    with pytest.raises(ValueError, match="must be shorter than the stage's W"):
        floor(BENCH, 4, 1.0, piece=(500, 0.1))
    with pytest.raises(ValueError, match="2 values for 3 stages|3 stages"):
        floor(BENCH + BENCH[:1], 4, 1.0, memory=[2, 2])
    with pytest.raises(ValueError, match=">= 2 stages"):
        floor(BENCH[:1], 4, 1.0)


def test_the_floor_says_how_to_get_the_solver(monkeypatch):
    monkeypatch.setitem(sys.modules, "ortools", None)
    monkeypatch.setitem(sys.modules, "ortools.sat.python", None)
    with pytest.raises(ImportError, match="pip install ortools"):
        floor(BENCH, 4, 1.0)


def _cli(capsys, *args):
    from megatron_overlap.cli.main import main

    rc = main(["floor", *args])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_floor_command(capsys):
    rc, out, err = _cli(capsys, "--times", "10/10/10", "--stages", "2", "--micro-batches", "4", "--transfer-ms", "2",
                        "--json")
    assert rc == 0, err
    assert "floor, B/W split" in out and "stock Megatron 1F1B" in out and "simulated" in out
    with pytest.raises(SystemExit):
        _cli(capsys, "--times", "10/10", "--stages", "2")
    assert "a stage's times are F/B/W in ms" in capsys.readouterr().err
    rc, _out, err = _cli(capsys, "--times", "10/10/10", "--stages", "2", "--memory", "0.5")
    assert rc == 2 and "below 1F1B's own peak" in err
    rc, _out, err = _cli(capsys, "--times", "10/10/10")
    assert rc == 2 and ">= 2 stages" in err
