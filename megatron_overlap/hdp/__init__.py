"""Hybrid data parallelism (HDP, after ByteScale): each sequence of a global batch on as few of the
DP x CP ranks as hold it, short ones whole on one rank, long ones zigzag-sharded over a ring of
ceil(L / C) ranks, every rank's work per step balanced.

    shard.py       which rows of a sequence a rank holds (zigzag over an ordered ring)
    cost.py        what a rank spends on them (compute + exposed ring communication)
    plan.py        a step's plan as data (per rank, ordered micro-batches) and its invariants
    simulate.py    the step's timeline from a plan
    scheduler.py   the HDP scheduler (``schedule_hdp``)
    baselines.py   ``static`` CP and megatron-core's ``BalancedCPScheduler``, as plans
    bench.py       ``megatron-overlap bench hdp``: the three on the same batches and cost model
    runtime.py     ``--hdp`` on real ranks: lengths all-gathered, the plan, the sample exchange,
                   micro-batches with their rings and true positions, exact loss normalisation
    demo.py        ``run_hdp_demo``: static CP vs HDP on 4 CPU gloo ranks, per-rank busy time

Only ``runtime`` (and ``demo``, through it) communicates, and neither is imported here (they
need torch and megatron-core); megatron-core's scheduler is imported only when
``schedule_megatron_balanced`` runs.
"""

from .cost import HdpCostModel
from .plan import Plan
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


def _megatron(*args, **kwargs):
    from .baselines import schedule_megatron_balanced

    return schedule_megatron_balanced(*args, **kwargs)


SCHEDULERS = {"static": _static, "megatron_balanced": _megatron, "hdp": schedule_hdp}


def schedule(name: str, seq_lens, ranks: int, capacity_tokens: int, cost=None, **kwargs) -> Plan:
    """Plan of scheduler ``name`` (one of ``SCHEDULERS``) for one global batch."""
    if name not in SCHEDULERS:
        raise ValueError(f"unknown scheduler {name!r}: choose one of {', '.join(SCHEDULERS)}")
    return SCHEDULERS[name](seq_lens, ranks, capacity_tokens, cost, **kwargs)
