"""megatron-core's own hybrid-CP scheduler as an HDP ``Plan``: the peer our scheduler is measured
against (``megatron-overlap bench hdp``). The conversion is pure (``hdp.baselines``); only the
import of ``BalancedCPScheduler`` (``megatron/core/pipeline_parallel/hybrid_cp_schedule.py``,
0.16+) lives here."""

from __future__ import annotations

import warnings
from typing import Sequence

from ..hdp.baselines import MegatronSchedulerError, schedule_balanced_cp

__all__ = ["MegatronSchedulerError", "schedule_megatron_balanced"]


def schedule_megatron_balanced(seq_lens: Sequence[int], ranks: int, capacity_tokens: int, cost=None):
    """megatron-core's ``BalancedCPScheduler``, run unmodified, converted to a ``Plan``."""
    with warnings.catch_warnings():  # megatron-core warns on import about Transformer Engine / Apex
        warnings.simplefilter("ignore")
        from megatron.core.pipeline_parallel.hybrid_cp_schedule import BalancedCPScheduler

    return schedule_balanced_cp(BalancedCPScheduler, seq_lens, ranks, capacity_tokens, cost)
