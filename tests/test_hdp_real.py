"""HDP on the batches users train with: ``bench hdp --batch-tokens`` cutting a lengths
file, the refusal of a file that is one batch by accident, the guard that keeps a plan never more
than 1% slower than megatron-core's under either cost model, and the planner's speed."""

import collections
import io
import json
import random
from contextlib import redirect_stderr, redirect_stdout

import pytest

from megatron_overlap.cli.corpus import corpus_batches, cut_batches
from megatron_overlap.hdp import HdpCostModel, schedule_hdp, simulate
from megatron_overlap.integration.baselines import schedule_megatron_balanced

COST = HdpCostModel()


def _cli(*argv):
    from megatron_overlap.cli.main import main

    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        rc = main(["bench", "hdp", *argv])
    return rc, out.getvalue(), err.getvalue()


def test_cut_batches_in_order_with_the_remainder_dropped():
    batches, left = cut_batches([5, 3, 9, 1, 1, 7, 2, 2], 8)
    assert batches == [[5, 3], [9], [1, 1, 7]] and left == 4
    assert cut_batches([4], 8) == ([], 4)
    with pytest.raises(ValueError, match="batch tokens must be >= 1"):
        cut_batches([4], 0)
    docs = [("a", 700), ("b", 300), ("c", 50)]
    one = corpus_batches(docs, 500, 400)
    many = corpus_batches(docs, 500, 400, min_batches=7)  # read again, reshuffled, like epochs
    assert len(one) == 1 and len(many) >= 7 and many[:len(one)] == one
    assert all(sum(b) >= 500 for b in many)


def test_bench_batch_tokens_cuts_a_lengths_file(tmp_path):
    f = tmp_path / "docs.txt"
    lens = [9000, 3000, 100, 200, 5000, 700] * 4  # 72000 tokens, no blank line
    f.write_text("\n".join(map(str, lens)) + "\n")
    rc, out, err = _cli("--lengths-file", str(f), "--batch-tokens", "16000", "--ranks", "4",
                        "--overlap-hdp-max-tokens-per-rank", "4096", "--json", "--no-progress")
    assert rc == 0, err
    cfg = json.loads(out.strip().splitlines()[-1])["config"]
    expected, left = cut_batches(lens, 16000)
    assert cfg["steps"] == len(expected) == 4 and cfg["sequences"] == sum(map(len, expected))
    assert cfg["tokens"] == sum(lens) - left and f"cut into 4 batches of >= 16000 tokens, the last {left}" in out
    # blank lines are batches without --batch-tokens, and re-cut with it
    f.write_text("100\n200\n\n300\n")
    rc, out, _ = _cli("--lengths-file", str(f), "--ranks", "2", "--overlap-hdp-max-tokens-per-rank", "4096", "--json",
                      "--no-progress")
    assert rc == 0 and json.loads(out.strip().splitlines()[-1])["config"]["steps"] == 2
    rc, _, err = _cli("--lengths-file", str(f), "--batch-tokens", "10000", "--ranks", "2", "--no-progress")
    assert rc == 2 and "holds 600 tokens, fewer than one batch of --batch-tokens 10000" in err


def test_a_lengths_file_without_blank_lines_is_refused_with_the_reason(tmp_path):
    f = tmp_path / "docs.txt"
    f.write_text("\n".join(["2100000"] + ["7000"] * 1845) + "\n")
    rc, out, err = _cli("--lengths-file", str(f), "--ranks", "64", "--no-progress")
    assert rc == 2 and not out
    assert (f"{f} has no blank line between batches, so it would be one full batch of 1846 sequences "
            f"(15015000 tokens, the longest 2100000), planned as one step: pass --batch-tokens T") in err
    assert "8 x R x C = 16777216 here" in err and "or put a blank line after each batch" in err


def _random_batch(seed):
    rng = random.Random(seed)
    R, C = rng.choice([2, 4, 8, 16]), rng.choice([64, 256, 1024, 4096])
    lens = [min(R * C, max(1, int(rng.lognormvariate(rng.uniform(3, 7), rng.uniform(0.5, 2.0)))))
            for _ in range(rng.randint(1, 40))]
    return lens, R, C


def test_guard_never_slower_than_megatron_cores_plan_on_random_batches():
    """The guard's plan (ours, or megatron-core's run as one phase) against megatron-core's plan
    as it runs (with its barriers): never more than 1% slower under our cost model or under its
    own L^2 / cp model, on random batches (power-of-two R: its scheduler fails on others). Its
    one-phase plan is never slower than the phased one (max-plus: a barrier only adds waits);
    our plan is kept unless it is slower; both outcomes occur."""
    from megatron_overlap.hdp.guard import guarded, models_for, one_phase

    kept = collections.Counter()
    for seed in range(150):
        lens, R, C = _random_batch(seed)
        peer = schedule_megatron_balanced(lens, R, C)
        ours = schedule_hdp(lens, R, C, COST)
        plan = guarded(ours, peer, COST)
        plan.validate()
        assert set(plan.phases[0]) <= {0} and plan.scheduler == "hdp"
        steps = {}
        for m in models_for(COST):
            ref = simulate(peer, m).step_ms
            assert simulate(one_phase(peer), m).step_ms <= ref * (1 + 1e-12), seed
            assert simulate(plan, m).step_ms <= 1.01 * ref, (seed, lens, R, C)
            steps[m] = (simulate(ours, m).step_ms, ref)
        if plan is ours:
            kept["ours"] += 1
        else:
            kept["megatron"] += 1
            assert any(s > 1.01 * ref for s, ref in steps.values()), seed  # switched only when ours was slower
            assert plan.notes[-1].startswith("guard: megatron-core's plan kept")
    assert kept["ours"] > 0 and kept["megatron"] > 0, kept
    assert guarded(ours, None, COST) is ours  # no peer (megatron-core absent or failed): ours


def test_the_fast_planner_scores_every_ring_size_as_the_plain_loop_does():
    """The scheduler's numpy scan over ring sizes (``ring_sizes.RingSizes.estimates``) and the
    lower bound's (``simulate.sequence_options``) give the plain loop's numbers exactly, under
    both cost models, so the fast planner makes the same plans."""
    from megatron_overlap.hdp.cost import SquareWorkload
    from megatron_overlap.hdp.simulate import sequence_options
    from megatron_overlap.hdp.ring_sizes import RingSizes

    class Plain:  # the same model without the vectorised method: sequence_options' loop
        def __init__(self, cost):
            self.cost, self.gpus_per_node = cost, cost.gpus_per_node

        def sequence_ms(self, *a):
            return self.cost.sequence_ms(*a)

    rng = random.Random(5)
    for cost in (COST, SquareWorkload()):
        for _ in range(20):
            R, L = rng.choice([24, 64, 256]), rng.randint(1000, 2_000_000)
            clock = [rng.choice([0.0, rng.uniform(0, 500)]) for _ in range(R)]
            sizes = RingSizes(L, clock, cost)
            placed, rest = sum(clock), rng.uniform(0, 1e5)
            fast = sizes.estimates(9, R, placed, rest)
            for n in range(9, R + 1):
                _, start, end, waits = sizes.best(n)
                assert fast[n] == max(end, (placed + n * (end - start) + waits + rest) / R), (n, L)
            low = rng.choice([1, 2, 5])
            assert sequence_options(L, low, R, cost) == sequence_options(L, low, R, Plain(cost))


def test_the_planners_numpy_paths_give_the_plain_loops_numbers():
    """The planner-time pass: every vectorised or memoised step gives what the
    plain code gives, bit for bit, so the plans stay the same: the small ring sizes scored for
    all nodes at once (``RingSizes.small_estimates``) against ``best`` size by size, the sorted
    clocks and prefix sums against ``sorted`` and a running sum, the lower bound's scan of all
    lengths (``options_many``) against ``sequence_options`` one length at a time, ``simulate``'s
    micro-batch times against ``Plan.item_ms``, the node weights of ``locality.relabel`` against
    the loop; and ``gc_paused`` leaves the collector as it found it."""
    import gc

    from megatron_overlap.hdp.cost import SquareWorkload
    from megatron_overlap.hdp.collector_pause import gc_paused
    from megatron_overlap.hdp.locality import _node_weight
    from megatron_overlap.hdp.shard import ranks_needed
    from megatron_overlap.hdp.simulate import _items, options_many, sequence_options
    from megatron_overlap.hdp.ring_sizes import RingSizes

    rng = random.Random(7)
    for cost in (COST, HdpCostModel(gpus_per_node=4), SquareWorkload()):
        gpn = cost.gpus_per_node
        for _ in range(30):
            R, L = rng.choice([16, 64, 256]), rng.randint(1000, 2_000_000)
            clock = [rng.choice([0.0, 10.0, rng.uniform(0, 500)]) for _ in range(R)]  # ties included
            sizes = RingSizes(L, clock, cost)
            assert sizes.order == sorted(range(R), key=lambda r: (clock[r], r))
            running = [0.0]
            for r in sizes.order:
                running.append(running[-1] + clock[r])
            assert sizes.prefix == running
            placed, rest = sum(clock), rng.uniform(0, 1e5)
            fast = sizes.small_estimates(2, gpn, placed, rest)
            assert len(fast) >= gpn - 2, (len(fast), gpn)  # sizes with tied starts may be left to best
            for n, estimate in fast.items():
                _, start, end, waits = sizes.best(n)
                assert estimate == max(end, (placed + n * (end - start) + waits + rest) / R), (n, L)
        C = rng.choice([4096, 32768])
        lens = [rng.choice([rng.randint(1, C), rng.randint(C, 40 * C)]) for _ in range(300)]
        many = options_many(lens, 64, C, cost)
        for L in lens:
            low = 1 if L <= C else ranks_needed(L, C)
            assert many[L] == sequence_options(L, low, 64, cost), L
    plan = schedule_megatron_balanced([rng.randint(100, 200_000) for _ in range(200)], 16, 32768)
    for cost in (COST, HdpCostModel(microbatch_overhead_ms=1.0), SquareWorkload()):
        rings, dur, keys = _items(plan, cost)
        assert dur == [[plan.item_ms(mb, cost) for mb in mbs] for mbs in plan.microbatches]
        assert keys == [[plan.ring_key(mb) if plan.ring_of(mb) else None for mb in mbs] for mbs in plan.microbatches]
        assert simulate(plan, cost) is simulate(plan, cost)  # simulated once per model
    at_home = [[float(rng.choice([0, 0, rng.randint(1, 10**6)])) for _ in range(32)] for _ in range(32)]
    nodes = [list(range(s, s + 8)) for s in range(0, 32, 8)]
    assert _node_weight(at_home, nodes, [0, 1, 2, 3]) == [
        [sum(at_home[r][h] for r in nodes[a] for h in nodes[b]) for b in range(4)] for a in range(4)]
    seen = gc_paused(lambda: gc.isenabled())
    assert gc.isenabled() and seen() is False and gc.isenabled()
    gc.disable()
    try:
        assert seen() is False and not gc.isenabled()  # a caller's choice is kept
    finally:
        gc.enable()


class _Runtime:
    """The runtime's three step parts without ranks: ``gather`` deals sample i to rank i mod R
    (one process plays every rank), ``load`` keeps the plan; the planner is the runtime's own."""

    def __init__(self, planner):
        self.planner, self.loaded = planner, []

    def gather(self, samples):
        from megatron_overlap.hdp.runtime import Gathered

        R = self.planner.ranks
        return Gathered(tuple(len(s) for s in samples), tuple(float(len(s)) for s in samples),
                        tuple((i % R, i // R) for i in range(len(samples))))

    def load(self, samples, gathered, plan):
        import types

        self.loaded.append(plan)
        mb = types.SimpleNamespace(batch=lambda: {"tokens": None})
        return types.SimpleNamespace(plan=plan, microbatches=[mb] * max(1, len(plan.microbatches[0])),
                                     global_tokens=sum(gathered.weights))

    def step(self, item):
        from megatron_overlap.hdp.samples import as_samples

        samples = as_samples(item)
        g = self.gather(samples)
        return self.load(samples, g, self.planner(g.seq_lens, g.home))


def _steps(count, seed=3):
    import torch

    rng = random.Random(seed)
    for _ in range(count):
        lens = [rng.choice([rng.randint(1, 800), rng.randint(800, 12000)]) for _ in range(rng.randint(3, 30))]
        yield [(torch.zeros(L, dtype=torch.long), torch.zeros(L, dtype=torch.long)) for L in lens]


def _run(iterator):
    out = []
    while True:
        try:
            count = iterator.start_step()
        except StopIteration:
            return out
        for _ in range(count):
            next(iterator)
        out.append(iterator.current.plan)


def test_planning_ahead_gives_the_inline_plans_and_survives_the_data_ending():
    """``HdpDataIterator(plan_ahead=True)``: step k+1 planned in a helper process while step k
    trains. The plans (guarded by megatron-core's scheduler, pickled into the helper) are the
    inline ones, step for step; when the data iterator ends while the next step is read, the
    current step still runs and the next ``start_step()`` raises ``StopIteration``, as inline;
    an iterator that is empty from the start raises at once."""
    from megatron_overlap.hdp.planahead import HdpDataIterator, Planner

    planner = Planner("hdp", 8, 4096, peer=schedule_megatron_balanced)
    inline = _run(HdpDataIterator(_steps(5), _Runtime(planner)))
    runtime = _Runtime(planner)
    ahead = HdpDataIterator(_steps(5), runtime, plan_ahead=True)
    planned = _run(ahead)
    assert len(inline) == len(planned) == 5 and len(runtime.loaded) == 5
    assert [repr(p.microbatches) for p in planned] == [repr(p.microbatches) for p in inline]
    assert ahead._helper._proc is None  # stopped when the data ended
    with pytest.raises(StopIteration):
        ahead.start_step()
    empty = HdpDataIterator(iter([]), _Runtime(planner), plan_ahead=True)
    with pytest.raises(StopIteration):
        empty.start_step()
    empty.close()


def test_bench_sweep_over_ranks_and_tokens_per_step():
    """``bench hdp --sweep``: one row per (R, T = m x R x C) and scheduler, time-weighted against
    the bound (>= 1) and megatron-core's (1 for itself), the worst batch against it (ours never
    more than 1% slower: the guard), under both models, with the planner's time per step."""
    rc, out, err = _cli("--sweep", "--sweep-ranks", "8,16", "--sweep-multiples", "1,4", "--overlap-hdp-max-tokens-per-rank",
                        "2048", "--steps", "2", "--json", "--no-progress")
    assert rc == 0, err
    rows = json.loads(out.strip().splitlines()[-1])["sweep"]
    assert [(r["ranks"], r["multiple"]) for r in rows] == [(8, 1), (8, 4), (16, 1), (16, 4)]
    for r in rows:
        meg, ours = r["summary"]["megatron_balanced"], r["summary"]["hdp"]
        assert meg["ours_x_megatron"] == meg["l2_x_megatron"] == meg["ours_worst"] == 1.0
        for model in ("ours", "l2"):
            assert ours[f"{model}_tw_bound"] >= 1 - 1e-9 and ours[f"{model}_worst"] <= 1.01
            assert ours[f"{model}_x_megatron"] <= meg[f"{model}_tw_bound"] + 1e-9  # no plan beats the bound
        assert ours["plan_s_max"] >= ours["plan_s_mean"] > 0 and 0 <= ours["guard_kept_megatron"] <= r["batches"]
    assert "tw/bound" in out and "heavy-tailed" in out.splitlines()[0]


def test_a_bad_batch_fails_at_its_own_step_whether_planned_ahead_or_inline():
    """A batch the planner refuses (a sequence longer than R x C) raises at the start_step of
    that step in both modes, with the planner's own error (handed back from the helper)."""
    import torch

    from megatron_overlap.errors import OverlapConfigError
    from megatron_overlap.hdp.planahead import HdpDataIterator, Planner

    def data():
        good = [(torch.zeros(L, dtype=torch.long),) * 2 for L in (100, 900, 30)]
        yield good
        yield good + [(torch.zeros(5000, dtype=torch.long),) * 2]  # R x C = 4096
        yield good

    for ahead in (False, True):
        it = HdpDataIterator(data(), _Runtime(Planner("hdp", 4, 1024)), plan_ahead=ahead)
        it.start_step()
        it._queue.clear()
        with pytest.raises(OverlapConfigError, match="sequence 3 has 5000 tokens, more than the 4 ranks hold"):
            it.start_step()
        it.close()


def test_a_planning_helper_that_does_not_answer_ends_in_an_error_within_the_bound():
    """Every wait is bounded: a helper stuck in its planner (here: a sleep) is stopped after
    the timeout, and the error says which helper and what to do."""
    import time

    from megatron_overlap.hdp.planahead import Helper

    helper = Helper()
    try:
        pending = helper.submit(time.sleep, 30.0)
        t0 = time.perf_counter()
        with pytest.raises(RuntimeError, match=r"HDP planning helper \(pid \d+\) gave no plan within 0.5 s"):
            pending.result(timeout_s=0.5)
        assert time.perf_counter() - t0 < 5.0
        assert helper._proc.wait(timeout=5) is not None  # it was stopped
    finally:
        helper.close()
