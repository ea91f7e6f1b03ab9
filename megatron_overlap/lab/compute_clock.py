"""Emulated compute: a wait of a given duration that holds no core, with a device's queue.

A rank of the emulated cluster (``lab/emulated_model.py``) computes nothing: each forward,
input-gradient or weight-gradient op sleeps for the time the modelled GPU would take. The
clock keeps what a device queue keeps:

- ops run back to back: an op issued before, or within ``slack_s`` after, the previous op's
  end starts at that end (the host's own overhead between two ops hidden, as a GPU hides it
  while the host runs ahead of its queue); issued later, it starts when issued (the device
  idled);
- the host runs ahead of the device by up to ``ahead_s``: an op returns once the device is
  less than that behind, not at its end (fewer, longer sleeps); :meth:`sync` waits for the
  device, as a ``torch.cuda.synchronize`` would;
- a communication wait that returns tells the clock when the transfer arrived
  (:meth:`resume_at`): the next op starts from there, not from when this process woke up,
  as a kernel queued behind a stream wait starts when the event fires;
- a send posted right after an op leaves when that op ended (:meth:`ready`), the time its
  data existed on the device.

Sleeping costs no CPU, so many ranks fit on a few cores; what a rank does besides sleeping
(Python, gloo, Megatron's bookkeeping) is real CPU time, measured beside the step
(``lab/cluster.py`` prints both). Times, not numerics: the ops' results are computed by cheap
element-wise math on small tensors.
"""

from __future__ import annotations

import time
from typing import List, Optional, Tuple

SLACK_S = 0.005  # host lateness between two ops a device queue hides (an assumption: a queue a few ops deep)
AHEAD_S = 0.005  # how far the host may run ahead of the device (an assumption: a shallow queue)


class ComputeClock:
    def __init__(self, slack_s: float = SLACK_S, ahead_s: float = AHEAD_S, record: bool = False):
        if slack_s < 0 or ahead_s < 0:
            raise ValueError(f"slack_s and ahead_s must be >= 0, got {slack_s}, {ahead_s}")
        self.slack_s = slack_s
        self.ahead_s = ahead_s
        self.end = float("-inf")  # when the last op ends (perf_counter seconds)
        self.busy_s = 0.0
        self.late_s = 0.0  # device idle because the host issued an op late (not waiting for a transfer)
        self.record = record
        self.spans: List[Tuple[str, float, float]] = []

    def _start(self, now: float) -> float:
        return self.end if now - self.end <= self.slack_s else now

    def run(self, seconds: float, label: str = "") -> None:
        """One op of ``seconds`` (returns up to ``ahead_s`` before its end)."""
        now = time.perf_counter()
        start = self._start(now)
        if start == now and self.end > float("-inf"):
            self.late_s += now - self.end
        end = start + max(0.0, seconds)
        self.end = end
        self.busy_s += end - start
        if self.record and label:
            self.spans.append((label, start, end))
        left = end - self.ahead_s - time.perf_counter()
        if left > 0:
            time.sleep(left)

    def sync(self) -> None:
        """Wait until the device has run every op issued."""
        left = self.end - time.perf_counter()
        if left > 0:
            time.sleep(left)

    def ready(self, now: Optional[float] = None) -> float:
        """When data produced by the ops so far exists (a transfer posted now may leave then)."""
        now = time.perf_counter() if now is None else now
        return self._start(now)

    def resume_at(self, when: float) -> None:
        """A wait returned; the transfer it waited for arrived at ``when`` (a later op starts
        no earlier than that)."""
        if when > self.end:
            self.end = when

    def reset(self) -> None:
        self.end = float("-inf")
        self.busy_s = 0.0
        self.late_s = 0.0
        self.spans = []
