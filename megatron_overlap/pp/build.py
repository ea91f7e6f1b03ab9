"""The named schedules (``--overlap-pp``), built and validated.

    megatron  Megatron's non-interleaved 1F1B as it runs today: every transfer waited where it
              is posted (the reference the others are tested against)
    1f1b      the same order of forwards and backwards, every transfer posted as early as the
              link allows and waited just before use (``inflight`` > stages: Centauri's model
              level, more forwards in flight before the first backward)
    zb        the backward split into B (input gradient) and W (weight gradient); W fills what
              would be bubbles (ZB-H1 at ``inflight`` = stages: 1F1B's peak memory); the W
              actions after each stage's last B drained layer by layer (``drain``: stage 0
              inside its last B, the others after it), so the data-parallel gradient buckets
              start their reduction as their last gradient is in
    zbv       ZB-V: two model chunks per stage in a V (``pp/chunks.py``), B/W split

With ``chunks`` > 1 (virtual pipelines, Megatron's interleaved placement): ``megatron`` is
Megatron's interleaved 1F1B (its order exactly; its transfers, overlapped by
``overlap_p2p_comm`` there, posted early and waited late as ours are), ``1f1b`` the same order
with ``inflight - stages`` more warm-up forwards per stage, ``zb`` interleaved zero bubble.
"""

from __future__ import annotations

from typing import Sequence

from ..errors import OverlapConfigError
from .schedule import Schedule, asynchronous_actions, megatron_actions, one_f_one_b_order, split_order, warmup
from .validate import validate

KINDS = ("megatron", "1f1b", "zb", "zbv")


def check_inflight(stages: int, microbatches: int, inflight: int) -> None:
    if not stages <= inflight <= max(stages, microbatches):
        raise OverlapConfigError(
            "pp.max_inflight", f"is {inflight}; with {stages} stages and {microbatches} micro-batches it must be in "
            f"[{stages}, {max(stages, microbatches)}] (the stages at least, as 1F1B; at most every micro-batch, as GPipe)")


def build(kind: str, stages: int, microbatches: int, inflight: int = 0, w_share: float = 0.5,
          times: Sequence[float] = (1.0, 1.0, 1.0), forward_only: bool = False, drain: bool = True,
          chunks: int = 1, group: int = 0) -> Schedule:
    """Schedule ``kind`` for ``stages`` x ``microbatches`` (``inflight`` 0: as many as stages),
    validated before it is returned; ``chunks`` model chunks per stage (``zbv``: 2), ``group``
    Megatron's ``microbatch_group_size_per_vp_stage`` (0: the stages). ``drain``: split schedules drain their trailing weight
    gradients layer by layer (``Schedule.drain``); False runs them one micro-batch at a time."""
    p, m = stages, microbatches
    if kind not in KINDS:
        raise ValueError(f"unknown schedule {kind!r}; choose one of {', '.join(KINDS)}")
    if p < 2 or m < 1:
        raise ValueError(f"a pipeline schedule needs >= 2 stages and >= 1 micro-batch, got {p} and {m}")
    if kind == "zbv" or chunks > 1:
        from .chunk_build import build_chunked

        return build_chunked(kind, p, m, chunks, inflight, w_share, times, forward_only, group)
    k = inflight or p
    if kind != "megatron":
        check_inflight(p, m, k)
    split = kind == "zb" and not forward_only
    if kind == "megatron":
        k = p
        actions = [megatron_actions(p, m, s, forward_only) for s in range(p)]
    else:
        if forward_only:
            orders = [[("F", i) for i in range(m)] for _ in range(p)]
        elif split:
            orders = split_order(p, m, k, times)
        else:
            orders = [one_f_one_b_order(p, m, s, k) for s in range(p)]
        actions = [asynchronous_actions(orders, s, forward_only) for s in range(p)]
    if forward_only:
        bound = tuple(float(m) for _ in range(p))  # nothing is kept for a backward
    elif split:
        bound = tuple(warmup(p, m, s, k) + s * w_share for s in range(p))
    else:
        bound = tuple(float(warmup(p, m, s, k)) for s in range(p))
    name = kind if k == p or kind == "megatron" else f"{kind} (inflight {k})"
    drains = (("bw",) + ("w",) * (p - 1)) if split and drain else ()
    schedule = Schedule(name=name, stages=p, microbatches=m, split=split, inflight=k,
                        actions=tuple(tuple(a) for a in actions), memory_bound=bound, w_share=w_share,
                        forward_only=forward_only, drain=drains)
    validate(schedule)
    return schedule


# W placements tried for a split schedule (``times`` for ``split_order``'s list scheduling):
# the stages' own ratio, W as long as F, W half of F (a transformer layer's weight-gradient
# GEMMs are about half of its backward's work). The greedy placement is not monotone in how
# close the assumed times are to the real ones, so each is simulated and the best kept.
PLACEMENTS = ((1.0, 1.0, 1.0), (1.0, 1.0, 0.5))


def placement_times(stage_times, microbatches: int, link=None, dp=(), inflight: int = 0) -> tuple:
    """The (F, B, W) to build ``zb``'s W placement with, for stages that take ``stage_times``
    on ``link`` with data-parallel sync ``dp`` (``pp/schedule_sim.py``): of the stages' own ratio
    (their means) and ``PLACEMENTS``, the one whose schedule simulates fastest (ties: the
    earliest listed, the stages' own first)."""
    from .schedule_sim import LinkCost, simulate

    p = len(stage_times)
    own = (sum(t.f for t in stage_times) / p, sum(t.b for t in stage_times) / p, sum(t.w for t in stage_times) / p)
    best = None
    for times in (own,) + PLACEMENTS:
        step = simulate(build("zb", p, microbatches, inflight, times=times), stage_times, link or LinkCost(),
                        dp).step_ms
        if best is None or step < best[0] - 1e-9:
            best = (step, tuple(round(x, 3) for x in times))
    return best[1]
