"""Pipeline schedules (``--overlap-pp``): schedules as data (``schedule``), named and built
(``build``), checked before they run (``validate``). Pure Python; the executor that runs them
with Megatron's ``forward_step`` / ``backward_step`` is ``integration/schedules.py``."""

from .build import KINDS, build, check_inflight

MODES = ("off", "1f1b", "zb", "zbv", "auto")  # --overlap-pp (zbv: virtual pipelines of 2 chunks)
BUCKETS = ("megatron", "every-chunk")  # --overlap-pp-buckets (integration/ddp.py)
from .schedule import Action, Comm, Schedule
from .validate import ScheduleError, validate

__all__ = ["BUCKETS", "KINDS", "MODES", "Action", "Comm", "Schedule", "ScheduleError", "build", "check_inflight", "validate"]
