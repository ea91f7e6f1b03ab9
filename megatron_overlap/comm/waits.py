"""The one wait of the plugin's own communication: bounded, and saying where it failed.

Every wait of ours (TP rings, CP and HDP rings, the CP all-to-all, the HDP exchange, pipeline
transfers, the fused backend's slot transfers) goes through :func:`wait`. When it fails or
times out, the error names

- the op (``"ring all-gather: step 1 piece 0 receive"``), given by the caller;
- where in the model: the labels the integration layer entered around the call (``"layer 3
  linear_fc1 forward"``, ``"HDP micro-batch 4"``, ``"pipeline stage 1, forward of micro-batch
  2"``), with :func:`at`;
- the peer: its rank in the group and in the world (for a collective, the ranks it waits on).

The bound: ``comm.timeout_s`` (``--overlap-timeout-s``), entered with :func:`at` by the patched
entry points; without it the process group's own timeout bounds every wait. On gloo a work's
``wait(timeout)`` does it; elsewhere (NCCL, whose ``wait`` only orders streams) the host polls
``is_completed()`` until the deadline, then waits: a diagnostic mode that gives up the host's
run-ahead of the GPU, which is why it is opt-in.

The labels live in a context variable (per thread, like ``cp.ring_context``'s ring), never in module
state; autograd runs a backward in another thread on a GPU, so the autograd functions keep
:func:`current` from their forward and re-enter it with :func:`restored`.
"""

from __future__ import annotations

import contextlib
import contextvars
import datetime
import time
from dataclasses import dataclass
from typing import Optional, Sequence

import torch.distributed as dist
from torch.profiler import record_function

from ..trace.markers import WAIT

@dataclass(frozen=True)
class Where:
    """What is running (labels, outermost first) and how long one wait may take (None: the
    process group's timeout)."""

    labels: tuple = ()
    timeout_s: Optional[float] = None

    def describe(self) -> str:
        return ", ".join(self.labels)


_current: contextvars.ContextVar = contextvars.ContextVar("megatron_overlap_waits", default=Where())


def current() -> Where:
    return _current.get()


@contextlib.contextmanager
def at(*labels: str, timeout_s: Optional[float] = None):
    """Add ``labels`` (and, when not None, the bound) for the enclosed waits."""
    now = _current.get()
    token = _current.set(Where(now.labels + tuple(str(label) for label in labels if label),
                               now.timeout_s if timeout_s is None else timeout_s))
    try:
        yield
    finally:
        _current.reset(token)


@contextlib.contextmanager
def restored(where: Where, *labels: str):
    """Re-enter ``where`` (kept by a forward) for its backward, plus ``labels``."""
    token = _current.set(Where(where.labels + labels, where.timeout_s))
    try:
        yield
    finally:
        _current.reset(token)


class WaitError(RuntimeError):
    """A wait of the plugin's communication failed or ran past ``comm.timeout_s``. ``op``,
    ``where`` (labels), ``peers`` (group ranks) and ``timed_out`` say which."""

    def __init__(self, message: str, op: str, where: Where, peers: tuple, timed_out: bool):
        super().__init__(message)
        self.op, self.where, self.peers, self.timed_out = op, where, peers, timed_out


def describe_peers(group, peers: Sequence[int]) -> str:
    """``group rank 1 (world rank 5)``, or a list of them."""
    def one(p):
        try:
            return f"group rank {p} (world rank {dist.get_global_rank(group, p)})" if group is not None else f"rank {p}"
        except (RuntimeError, ValueError):
            return f"group rank {p}"

    if not peers:
        return "its peers"
    return one(peers[0]) if len(peers) == 1 else "one of " + ", ".join(one(p) for p in peers)


def wait(work, op: str, group=None, peer: Optional[int] = None, peers: Optional[Sequence[int]] = None) -> None:
    """``work.wait()`` within the bound in force; on failure a :class:`WaitError` naming ``op``,
    the labels in force and the peer (``peer`` for a P2P transfer; ``peers`` for a collective,
    default: every other rank of ``group``). Marked for ``--overlap-trace``."""
    if work is None:
        return
    where = _current.get()
    with record_function(WAIT):
        try:
            if where.timeout_s is None:
                work.wait()
                return
            if _bounded_wait(work, group, where.timeout_s):
                return
            error, timed_out = None, True
        except RuntimeError as exc:
            error, timed_out = exc, _timed_out(exc)
    who = _peers(group, peer, peers)
    site = f" [{where.describe()}]" if where.labels else ""
    from ..errors import render

    if error is None or (timed_out and where.timeout_s is not None):
        message = (f"megatron-overlap: {op}{site}: {describe_peers(group, who)} never answered within "
                   f"{where.timeout_s:g} s (`comm.timeout_s`); it is silent, stuck or dead"
                   + (f" ({error})" if error is not None else ""))
    else:
        message = (f"megatron-overlap: {op}{site}: waiting for {describe_peers(group, who)} failed: {error}"
                   + (" (the process group's timeout; `comm.timeout_s` S ends such a wait in S seconds)"
                      if timed_out else ""))
    raise WaitError(render(message), op, where, tuple(who), timed_out) from error


def _bounded_wait(work, group, timeout_s: float) -> bool:
    """True once ``work`` completed within ``timeout_s``; False past it."""
    if _backend(group) == "gloo":
        work.wait(timeout=datetime.timedelta(seconds=timeout_s))
        return True
    deadline = time.monotonic() + timeout_s
    pause = 2e-5
    while not work.is_completed():
        if time.monotonic() > deadline:
            return False
        time.sleep(pause)
        pause = min(2 * pause, 1e-3)
    work.wait()  # completed: orders the streams (NCCL), raises the work's own error if any
    return True


def _backend(group) -> str:
    try:
        return str(dist.get_backend(group))
    except (RuntimeError, ValueError, AttributeError):
        return ""


def _peers(group, peer, peers) -> list:
    if peer is not None:
        return [int(peer)]
    if peers is not None:
        return [int(p) for p in peers]
    try:
        me, size = dist.get_rank(group), dist.get_world_size(group)
    except (RuntimeError, ValueError):
        return []
    return [r for r in range(size) if r != me]


def _timed_out(exc: BaseException) -> bool:
    """gloo says "Timed out", NCCL's watchdog "Timeout"."""
    text = str(exc).lower()
    return "timed out" in text or "timeout" in text
