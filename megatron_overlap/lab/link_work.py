"""The emulated link's work handles: a wait returns once the real op is done and the emulated
deadline has passed (``lab/emulated_link.py``)."""

from __future__ import annotations

import time

from torch.profiler import record_function

from ..trace.markers import WAIT


class _EmuWork:
    """A work handle whose wait() also honours the emulated deadline: it sleeps until then, or,
    with ``EmulatedLink.stream_waits`` and a clock, returns once the real op is done and only the
    clock's device waits for the deadline (``ComputeClock.resume_at``), as a GPU's stream wait
    holds the device, not the host."""

    def __init__(self, link: "EmulatedLink", real, deadline: float, op: str = ""):
        self._link = link
        self._real = real
        self._deadline = deadline
        self._done = False
        self._op = op

    def wait(self, timeout=None):
        if self._done:
            return True
        t0 = time.perf_counter()
        with record_function(WAIT):  # marks stock Megatron's waits for --overlap-trace too
            if self._real is not None:
                self._real.wait() if timeout is None else self._real.wait(timeout)
            self._arrived()
            left = self._deadline - time.perf_counter()
            if left > 0 and not (self._link.stream_waits and self._link.clock is not None):
                time.sleep(left)
        self._done = True
        self._link._blocked(t0, time.perf_counter(), self._op)
        if self._link.clock is not None:
            self._link.clock.resume_at(self._deadline)
        return True

    def _arrived(self):
        """Called once the real operation is done (a receive learns its deadline here)."""

    def is_completed(self):
        if self._done:
            return True
        if self._real is not None and not self._real.is_completed():
            return False
        self._arrived()
        return time.perf_counter() >= self._deadline

    def is_success(self):
        return True

    def result(self):
        return self._real.result() if self._real is not None else []


class _RecvWork(_EmuWork):
    """A receive whose deadline is read off the board once the data is there."""

    def __init__(self, link, real, key):
        super().__init__(link, real, float("inf"), "irecv")
        self._key = key

    def _arrived(self):
        if self._key is not None:
            self._deadline = self._link._board.take(*self._key)
            self._key = None
