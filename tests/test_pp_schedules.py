"""Pipeline schedules as data: every generated schedule validated over the
required ranges, broken ones rejected with a message that says what is wrong, and the simulated
bubble of each against 1F1B's. Pure Python, no torch.distributed."""

import dataclasses

import itertools

import pytest

from megatron_overlap.errors import OverlapConfigError
from megatron_overlap.pp import ScheduleError, build, validate
from megatron_overlap.pp.schedule import (ACT, B, F, GRAD, POST, RECV, SEND, WAIT, W, Action, Comm, compute, post,
                                          wait)
from megatron_overlap.pp.schedule_sim import LinkCost, StageTimes, simulate
from megatron_overlap.pp.validate import _simulate


def _cases():
    for p in range(2, 9):
        ms = range(p, 4 * p + 1) if p <= 3 else sorted({p, p + 1, 2 * p, 3 * p + 1, 4 * p})
        for m in ms:
            yield p, m


@pytest.mark.parametrize("kind", ["megatron", "1f1b", "zb"])
def test_every_schedule_in_range_is_valid(kind):
    """p in 2..8, m in p..4p, K in [p, m]: built (which validates), with the memory each holds
    within its bound and, for 1F1B order, exactly 1F1B's: stage s holds p - s micro-batches."""
    n = 0
    for p, m in _cases():
        for k in ([p] if kind == "megatron" else sorted({p, (p + m) // 2, m})):
            s = build(kind, p, m, k)
            peak = validate(s)["peak_memory"]
            assert all(x <= b + 1e-9 for x, b in zip(peak, s.memory_bound))
            if kind != "zb" and k == p:
                assert peak == [min(m, p - st) for st in range(p)], (kind, p, m)
            if kind == "zb":
                assert max(peak) <= min(m, k) + 1e-9  # no stage above stage 0's 1F1B peak (ZB-H1)
            if kind != "megatron":
                validate(build(kind, p, m, k, forward_only=True))
            n += 1
    assert n >= 42


def test_megatron_reference_is_megatrons_order():
    """The reference is Megatron's 1F1B: stage s runs p - s - 1 warm-up forwards, then
    F/B in turn, then the cool-down backwards; every transfer waited where it is posted."""
    s = build("megatron", 4, 6)
    assert [f"{op}{mb}" for op, mb in s.compute_order(1)] == \
        ["F0", "F1", "F2", "B0", "F3", "B1", "F4", "B2", "F5", "B3", "B4", "B5"]
    assert [f"{op}{mb}" for op, mb in s.compute_order(3)] == [x for i in range(6) for x in (f"F{i}", f"B{i}")]
    acts = s.actions[1]
    for i, a in enumerate(acts):
        if a.op == POST:  # each batch is followed at once by the waits of all it posted
            assert [x.comms[0] for x in acts[i + 1:i + 1 + len(a.comms)]] == list(a.comms)
            assert all(x.op == WAIT for x in acts[i + 1:i + 1 + len(a.comms)])


def test_asynchronous_posts_early_and_waits_late():
    s = build("1f1b", 4, 8)
    for st in range(3):  # (the last stage uses each activation right after its previous B)
        acts = s.actions[st]
        posted = {c: i for i, a in enumerate(acts) if a.op == POST for c in a.comms}
        waited = {a.comms[0]: i for i, a in enumerate(acts) if a.op == WAIT}
        # some receive is posted before the compute that precedes its use: it travels meanwhile
        early = [c for c in posted if c.op == RECV and any(acts[j].op in (F, B) for j in range(posted[c], waited[c]))]
        assert early, st


def test_zb_h1_shape_and_bubble():
    """ZB-H1: W's of stage s trail its B's by at most s; with F = B = W the bubble is about a
    third of 1F1B's (Qi et al.: (p-1)(F+B-W) against (p-1)(F+B+W)) and the peak memory is
    1F1B's."""
    s = build("zb", 4, 16)
    for st in range(4):
        order = s.compute_order(st)
        pending = 0
        for op, _mb in order:
            pending += {B: 1, W: -1}.get(op, 0)
            assert pending <= st + 1
    t = [StageTimes(1.0, 1.0, 1.0)]
    ref = simulate(build("megatron", 4, 16), t)
    zb = simulate(s, t)
    assert zb.bubble < 0.45 * ref.bubble
    assert ref.bubble == pytest.approx(3 / (16 + 3), rel=1e-6)  # (p-1)/(m+p-1)


@pytest.mark.parametrize("p", [2, 3, 4, 8])
def test_asynchronous_transfers_hide_behind_compute_in_simulation(p):
    """On a link where a transfer takes 0.3 of a forward, exposed = step - the same schedule's
    step on a free link: stock pays for every transfer; asynchronous 1F1B at 1F1B's memory
    (K = p) still has the activation's and the gradient's trip on its critical path each
    cycle; K = 2p - 1, each stage two micro-batches ahead of the next, hides all but the fill and
    the drain (the first activation down and the last gradient up the p - 1 hops), which
    nothing can hide; ZB-H1 sits between, at 1F1B's memory."""
    t, link = [StageTimes(1.0, 1.0, 1.0)], LinkCost(transfer_ms=0.3, latency_ms=0.01)

    def exposed(kind, k=0):
        schedule = build(kind, p, 4 * p, k)
        return simulate(schedule, t, link).step_ms - simulate(schedule, t).step_ms

    stock = exposed("megatron")
    fill_drain = 2 * (p - 1) * (link.transfer_ms + link.latency_ms)
    assert stock >= 4 * p * (link.transfer_ms + link.latency_ms)  # about one transfer per micro-batch
    assert exposed("1f1b", p) < stock
    assert exposed("1f1b", 2 * p - 1) == pytest.approx(fill_drain)
    assert exposed("1f1b", 4 * p) == pytest.approx(fill_drain)
    assert exposed("zb", p) < 0.5 * stock


def test_two_ahead_per_stage_hides_more_than_one_ahead_and_holds_less():
    """The in-flight rule (``max(p - s, K - 2s)`` forwards before stage s's first backward)
    against the plain ``K - s``: never a longer step, over stages, micro-batches, F/B ratios,
    transfer sizes and K, and at most the same activations on every stage."""
    from megatron_overlap.pp.schedule import Schedule, asynchronous_actions, warmup

    for p, m, (f, b), size in itertools.product((2, 4), (None, 3), ((1, 2), (1, 1.5)), (0.1, 0.6)):
        m = 4 * p if m is None else m * p
        times, link = [StageTimes(f, b, 0.0)], LinkCost(transfer_ms=size)
        for k in sorted({p + 1, 2 * p - 1, m}):
            ours = simulate(build("1f1b", p, m, k), times, link).step_ms
            plain = []
            for s in range(p):
                warm = max(1, min(m, k - s))
                order = [("F", i) for i in range(warm - 1)]
                for j in range(m - warm + 1):
                    order += [("F", warm - 1 + j), ("B", j)]
                plain.append(order + [("B", j) for j in range(m - warm + 1, m)])
            actions = tuple(tuple(asynchronous_actions(plain, s, False)) for s in range(p))
            reference = Schedule(name="plain", stages=p, microbatches=m, inflight=k, split=False,
                                 actions=actions, memory_bound=tuple(float(max(1, min(m, k - s))) for s in range(p)))
            assert ours <= simulate(reference, times, link).step_ms + 1e-9, (p, m, f, b, size, k)
            assert all(warmup(p, m, s, k) <= max(1, min(m, k - s)) for s in range(p))


# -- broken schedules -------------------------------------------------------------------------------
def _edit(s, stage, fn):
    actions = [list(a) for a in s.actions]
    actions[stage] = fn(actions[stage])
    return dataclasses.replace(s, actions=tuple(tuple(a) for a in actions))


def _swap_compute(acts, a, b):
    i = acts.index(compute(*a))
    j = acts.index(compute(*b))
    acts[i], acts[j] = acts[j], acts[i]
    return acts


@pytest.mark.parametrize("broken, message", [
    (lambda s: _edit(s, 0, lambda a: [x for x in a if x != compute(F, 2)]), "3 F actions for 4 micro-batches|runs before F2"),
    (lambda s: _edit(s, 0, lambda a: _swap_compute(a, (F, 0), (F, 1))), "out of micro-batch order"),
    (lambda s: _edit(s, 0, lambda a: _swap_compute(a, (B, 0), (W, 0))), "W0 runs before B0"),
    (lambda s: _edit(s, 1, lambda a: [x for x in a if not (x.op == WAIT and x.comms[0] == Comm(RECV, ACT, 0, 0))]),
     "runs before its activation's receive was waited for"),
    (lambda s: _edit(s, 0, lambda a: [x if x.op != POST else post(*[c for c in x.comms if c != Comm(SEND, ACT, 3, 1)])
                                      for x in a if not (x.op == WAIT and x.comms[0] == Comm(SEND, ACT, 3, 1))]),
     "missing \\['SEND act 3 ->1'\\]"),
])
def test_broken_schedules_are_rejected_with_the_reason(broken, message):
    with pytest.raises(ScheduleError, match=message):
        validate(broken(build("zb", 2, 4)))


def test_mismatched_transfer_order_is_rejected():
    """Stage 1 posts its receives of activations 0 and 1 (one batch) in the other order."""
    s = build("1f1b", 3, 5)
    first = s.actions[1][0]
    assert first.op == POST and [c.mb for c in first.comms] == [0, 1]

    def swap(acts):
        return [post(*reversed(first.comms))] + list(acts[1:])

    with pytest.raises(ScheduleError, match="transfer 0 from stage 0 to stage 1 is act 0 where it is sent but act 1 "
                                            "where it is received"):
        validate(_edit(s, 1, swap))


def test_deadlock_is_rejected_under_either_backend_model():
    """Stage 0 waits for a gradient before sending the activation it depends on: F0 of stage 1
    never gets its input. Both ends post the same transfers in the same order, so only the
    message-passing simulation can see it."""
    g, a0 = Comm(RECV, GRAD, 0, 1), Comm(SEND, ACT, 0, 1)
    stage0 = [compute(F, 0), post(g), wait(g), post(a0), wait(a0), compute(B, 0)]
    r, s1 = Comm(RECV, ACT, 0, 0), Comm(SEND, GRAD, 0, 0)
    stage1 = [post(r), wait(r), compute(F, 0), compute(B, 0), post(s1), wait(s1)]
    sched = dataclasses.replace(build("megatron", 2, 1), actions=(tuple(stage0), tuple(stage1)))
    with pytest.raises(ScheduleError, match="deadlocks"):
        validate(sched)
    for model in ("link", "batch"):
        with pytest.raises(ScheduleError, match="stage 0 at action 2"):
            _simulate(sched, model)


def test_memory_bound_is_enforced():
    s = build("1f1b", 4, 8, inflight=6)
    with pytest.raises(ScheduleError, match="holds 5 micro-batches' activations, above its bound 4"):
        validate(dataclasses.replace(s, memory_bound=(4.0,) * 4))


def test_inflight_outside_p_m_is_refused_naming_the_flag():
    with pytest.raises(OverlapConfigError, match="--overlap-pp-max-inflight.*must be in \\[4, 8\\]"):
        build("1f1b", 4, 8, inflight=9)
    with pytest.raises(OverlapConfigError, match="--overlap-pp-max-inflight.*must be in \\[4, 8\\]"):
        build("zb", 4, 8, inflight=3)


def test_unknown_kind_and_degenerate_sizes():
    with pytest.raises(ValueError, match="unknown schedule"):
        build("gpipe", 2, 4)
    with pytest.raises(ValueError, match=">= 2 stages"):
        build("1f1b", 1, 4)


def test_action_strings_read_like_the_docs():
    assert str(compute(F, 3)) == "F3"
    assert str(post(Comm(SEND, ACT, 3, 1), Comm(RECV, GRAD, 1, 1))) == "POST[SEND act 3 ->1, RECV grad 1 <-1]"
    assert str(wait(Comm(RECV, ACT, 2, 0))) == "WAIT RECV act 2 <-0"
    assert isinstance(Action(F, 0), Action)
