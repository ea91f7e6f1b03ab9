"""The names the plugin marks a trace with (``torch.profiler`` record_function labels): written
by :mod:`.tracer`, the waits of ``comm`` and the lab's emulated link, read back by :mod:`.report`."""

from __future__ import annotations

from torch.profiler import record_function

STEP = "megatron_overlap::step"
WAIT = "megatron_overlap::wait"


def wait(work) -> None:
    """``work.wait()``, marked for the trace (costs ~1 us when no profiler runs)."""
    with record_function(WAIT):
        work.wait()
