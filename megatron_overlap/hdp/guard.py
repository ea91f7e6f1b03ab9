"""Never slower than megatron-core's plan: the guard between our plan and its peer's.

Our scheduler is a heuristic planned with one cost model; megatron-core's ``BalancedCPScheduler``
(power-of-two CP sizes, groups separated by barriers) is another. On some batches (a few
documents of half a million tokens or more among many short ones) its plan has measured shorter
than ours. The guard makes "never more than ``tolerance`` slower than megatron-core's, batch by
batch, under our cost model and under its own L^2 / cp model" hold by construction:

    candidates   our plan, and the peer's plan run as ONE phase (``one_phase``: its barriers
                 dropped, each of its groups padded with empty slots so ring peers still sit at
                 one index)
    reference    the peer's plan as it runs, with its barriers, scored by both models
    kept         ours (or, in order, any ``extra`` plan of ours) when it is within (1 + tolerance)
                 x the reference under BOTH models, else the peer's one-phase plan

The peer's one-phase plan always qualifies: the simulator is a max-plus system (each
micro-batch starts at the max of its rank's previous end and, for a ring, its peers'), and a
barrier only adds terms to those maxima, so dropping barriers never delays anything: its step is
at most the reference under any cost model (tested). The guard therefore never returns a plan slower
than megatron-core's by more than ``tolerance``, under either model, whatever our heuristic does.
The runtime can run the result (one phase, the usual invariants: ``Plan.validate``).

The peer comes in as a plan (``integration.baselines.schedule_megatron_balanced``, which imports
megatron-core): nothing here imports Megatron.
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional, Sequence, Tuple

from .cost import SquareWorkload
from .collector_pause import gc_paused
from .step_plan import Plan
from .simulate import simulate

TOLERANCE = 0.01


def one_phase(plan: Plan) -> Plan:
    """``plan`` without its barriers: phase by phase, every rank's micro-batches of that phase,
    padded with empty slots to the longest rank's count, so a ring's peers (at one index within
    the phase) stay at one index (module docstring)."""
    phase_ids = sorted({p for ph in plan.phases for p in ph})
    if len(phase_ids) <= 1:
        return plan
    out: List[List[tuple]] = [[] for _ in range(plan.ranks)]
    for phase in phase_ids:
        per_rank = [[mb for mb, p in zip(mbs, plan.phases[r]) if p == phase]
                    for r, mbs in enumerate(plan.microbatches)]
        depth = max(len(x) for x in per_rank)
        for r, mbs in enumerate(per_rank):
            out[r].extend(mbs + [()] * (depth - len(mbs)))
    return dataclasses.replace(plan, microbatches=tuple(tuple(m) for m in out),
                               phases=tuple(tuple(0 for _ in m) for m in out),
                               notes=plan.notes + ("run as one phase: its barriers dropped",))


def models_for(cost) -> Tuple[object, SquareWorkload]:
    """The two models the guard judges by: ``cost`` and megatron-core's L^2 / cp."""
    return cost, SquareWorkload(gpus_per_node=cost.gpus_per_node)


@gc_paused
def guarded(ours: Plan, peer: Optional[Plan], cost, tolerance: float = TOLERANCE,
            extra: Sequence[Plan] = ()) -> Plan:
    """The kept plan (module docstring): ``ours`` (and any ``extra`` candidates of ours) or the
    peer's one-phase plan. ``peer`` None (megatron-core's scheduler absent or failed): ours."""
    if peer is None:
        return ours
    models = models_for(cost)
    reference = [simulate(peer, m).step_ms for m in models]
    candidates = [ours, *extra]
    for plan in candidates:  # ours first: kept when it is not slower
        steps = [simulate(plan, m).step_ms for m in models]
        if all(x <= (1 + tolerance) * ref for x, ref in zip(steps, reference)):
            return plan
    flat = one_phase(peer)
    mine = [simulate(ours, m).step_ms for m in models]
    note = (f"guard: megatron-core's plan kept (ours {mine[0]:.0f} / {mine[1]:.0f} ms against its "
            f"{reference[0]:.0f} / {reference[1]:.0f} ms under our / its model)")
    return dataclasses.replace(flat, scheduler=ours.scheduler, notes=flat.notes + (note,))
