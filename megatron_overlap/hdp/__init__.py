"""Hybrid data parallelism (HDP, after ByteScale): each sequence of a full batch on at least as many
of the DP x CP ranks as hold it, short ones whole on one rank, long ones zigzag-sharded over a
ring of ceil(L / C) ranks or more where that balances the step, every rank's work per step
balanced, sequences kept where they were loaded where the step allows.

    shard.py       which rows of a sequence a rank holds (zigzag over an ordered ring)
    cost.py        what a rank spends on them (compute + exposed ring communication)
    step_plan.py   a step's plan as data (per rank, ordered micro-batches) and its invariants
    simulate.py    the step's timeline from a plan
    batch_input.py the planners' input checked (lengths, R, C, mode): ``check_batch``
    scheduler.py   the HDP scheduler (``schedule_hdp``)
    ring_sizes.py  its step 1: each ring's size and ranks, every size scored at once
    pp_timeline.py a plan's step in a 1F1B pipeline (what mode ``pp`` plans against)
    slot_balance.py      mode ``pp``'s slot-balanced plans: every slot's cells about equal
    collector_pause.py   the planner with Python's cyclic garbage collector paused
    guard.py       never slower than megatron-core's plan: ours or its, by the cost model
    bound_tradeoff.py    our plan or one planned with cheaper linears, close to both models' bounds
    planahead.py   step k+1 planned while step k trains
    locality.py    which plan rank is which, so sequences stay where they were loaded
    baselines.py   ``static`` CP, and megatron-core's ``BalancedCPScheduler`` output as a plan
    balanced_cp.py megatron-core's ``BalancedCPScheduler`` re-implemented: the same groups, faster, no torch
    checks.py      model settings the runtime cannot honour (at install)
    packing.py     sequences into micro-batches of at most C rows
    samples.py     a rank's share of the full batch (``Sample``, ``as_samples``)
    layout.py      which token rows a rank holds in a micro-batch (pure, from the plan)
    exchange.py    the lengths all-gather and the one row all-to-all, over an explicit group
    runtime.py     ``--overlap-hdp`` on real ranks: plan, exchange, micro-batches with their rings and
                   true positions, exact loss normalisation, Megatron's per-token-loss contract

``megatron-overlap bench hdp`` and ``demo --overlap-hdp`` live in ``cli/`` (and ``lab/``).

Only ``runtime`` and ``exchange`` communicate, over an explicit group, and neither is imported
here. Nothing in this package imports Megatron: the runtime's model adapter and megatron-core's
``BalancedCPScheduler`` (the benchmarks' peer) come from ``integration.hdp`` and
``integration.baselines``.
"""

from .cost import HdpCostModel
from .step_plan import Plan
from .scheduler import MODES, check_batch, schedule_hdp
from .shard import Shard, ranks_needed, zigzag_ranges
from .simulate import StepTime, simulate

__all__ = [
    "HdpCostModel",
    "MODES",
    "Plan",
    "SCHEDULERS",
    "Shard",
    "StepTime",
    "check_batch",
    "ranks_needed",
    "schedule",
    "schedule_hdp",
    "simulate",
    "zigzag_ranges",
]


def _static(*args, **kwargs):
    from .baselines import schedule_static

    return schedule_static(*args, **kwargs)


SCHEDULERS = {"static": _static, "hdp": schedule_hdp}  # megatron-core's: integration.baselines


def schedule(name: str, seq_lens, ranks: int, capacity_tokens: int, cost=None, **kwargs) -> Plan:
    """Plan of scheduler ``name`` (one of ``SCHEDULERS``) for one full batch."""
    if name not in SCHEDULERS:
        raise ValueError(f"unknown scheduler {name!r}: choose one of {', '.join(SCHEDULERS)}")
    return SCHEDULERS[name](seq_lens, ranks, capacity_tokens, cost, **kwargs)
