"""An emulated interconnect, so overlap can be measured on a CPU with gloo.

Every transfer completes no earlier than ``latency + bytes / bandwidth`` after the rank's
egress port is free to start it, and waiting for it costs no CPU (the waiting thread sleeps):

- one egress port per rank (a switch, as NVSwitch or a NIC): transfers a rank issues queue
  behind each other; ``bandwidth_GBps`` is that port's rate;
- a collective over R ranks sends what a ring algorithm sends: all-gather and reduce-scatter
  ``(R-1)`` shards, all-reduce ``2(R-1)/R`` of the buffer, all-to-all ``(R-1)/R``; it pays
  ``R-1`` latencies (``2(R-1)`` for all-reduce). Its real gloo op is issued at once; ``wait``
  returns once the real op is done *and* the emulated deadline has passed;
- a P2P send is handed to the real backend at once; its deadline goes on a board in shared
  memory (keyed by sender, receiver, tag and sequence number), and the receiver's ``wait``
  returns only once that deadline has passed, so it sees the data exactly as late as the link
  would deliver it. No helper thread and no extra message: on a busy CPU a thread wake-up or a
  gloo message per send costs more than the sends being measured.

It replaces the functions on ``torch.distributed`` and ``distributed_c10d`` and rebinds every
module-level reference to them in Megatron's and in this plugin's modules (Megatron binds
``dist_all_gather_func`` and friends at import time), so stock Megatron and the plugin run on
the same link. Bytes are counted per op: if the plugin's bytes per step fall below stock's,
a transfer escaped the emulation.

CPU / gloo only: on GPU the real link is the one to measure.
"""

from __future__ import annotations

import inspect
import sys
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d
from torch.profiler import record_function

from ..trace.tracer import WAIT
from .deadline_board import DeadlineBoard

_COLLECTIVES = (
    "all_gather_single",
    "all_gather_into_tensor",
    "_all_gather_base",
    "reduce_scatter_single",
    "reduce_scatter_tensor",
    "_reduce_scatter_base",
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "all_to_all_single",
    "broadcast",
)
_P2P = ("isend", "irecv")
_REBIND_PREFIXES = ("megatron", "megatron_overlap")


@dataclass(frozen=True)
class LinkSpec:
    """Per-rank egress bandwidth and per-message latency of the emulated link."""

    bandwidth_GBps: float
    latency_us: float = 10.0

    def __post_init__(self):
        if not self.bandwidth_GBps > 0:
            raise ValueError(f"bandwidth_GBps must be > 0, got {self.bandwidth_GBps}")
        if self.latency_us < 0:
            raise ValueError(f"latency_us must be >= 0, got {self.latency_us}")

    def seconds(self, nbytes: float, messages: int = 1) -> float:
        return nbytes / (self.bandwidth_GBps * 1e9) + messages * self.latency_us * 1e-6

    def as_dict(self) -> dict:
        return {"bandwidth_GBps": self.bandwidth_GBps, "latency_us": self.latency_us, "ports": "1 egress per rank"}


@dataclass
class Span:
    """One transfer on this rank's link: issued, started on the port, done (deadline)."""

    op: str
    nbytes: int
    issued: float
    start: float
    done: float


@dataclass
class LinkStats:
    """Counters since the last ``reset``; times in seconds."""

    bytes_by_op: dict = field(default_factory=lambda: defaultdict(int))
    calls_by_op: dict = field(default_factory=lambda: defaultdict(int))
    busy_s: float = 0.0  # port occupancy: sum of bytes / bandwidth (+ latency)
    blocked_s: float = 0.0  # time callers spent blocked in wait(): exposed communication
    spans: list = field(default_factory=list)
    waits: list = field(default_factory=list)  # (start, end) of blocking waits

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes_by_op.values())


class _EmuWork:
    """A work handle whose wait() also honours the emulated deadline."""

    def __init__(self, link: "EmulatedLink", real, deadline: float):
        self._link = link
        self._real = real
        self._deadline = deadline
        self._done = False

    def wait(self, timeout=None):
        if self._done:
            return True
        t0 = time.perf_counter()
        with record_function(WAIT):  # marks stock Megatron's waits for --overlap-trace too
            if self._real is not None:
                self._real.wait() if timeout is None else self._real.wait(timeout)
            self._arrived()
            left = self._deadline - time.perf_counter()
            if left > 0:
                time.sleep(left)
        self._done = True
        self._link._blocked(t0, time.perf_counter())
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
        super().__init__(link, real, float("inf"))
        self._key = key

    def _arrived(self):
        if self._key is not None:
            self._deadline = self._link._board.take(*self._key)
            self._key = None


class EmulatedLink:
    """Install with ``with EmulatedLink(LinkSpec(...)) as link:``; see the module docstring."""

    def __init__(self, spec: LinkSpec, record_spans: bool = False):
        self.spec = spec
        self.record_spans = record_spans
        self.stats = LinkStats()
        self._free_at = 0.0
        self._originals: dict[str, Callable] = {}
        self._rebound: list = []
        self._local = threading.local()
        self._board: Optional[DeadlineBoard] = None
        self._rank = 0

    # ---------------------------------------------------------------- accounting
    def reset(self) -> LinkStats:
        """Start a new measurement window; returns the stats of the one that ends."""
        old, self.stats = self.stats, LinkStats()
        return old

    def _reserve(self, op: str, nbytes: int, messages: int) -> float:
        now = time.perf_counter()
        start = max(now, self._free_at)
        xfer = nbytes / (self.spec.bandwidth_GBps * 1e9)
        self._free_at = start + xfer
        done = start + xfer + messages * self.spec.latency_us * 1e-6
        stats = self.stats
        stats.bytes_by_op[op] += nbytes
        stats.calls_by_op[op] += 1
        stats.busy_s += done - start
        if self.record_spans:
            stats.spans.append(Span(op, nbytes, now, start, done))
        return done

    def _blocked(self, t0: float, t1: float):
        self.stats.blocked_s += t1 - t0
        if self.record_spans:
            self.stats.waits.append((t0, t1))

    # ---------------------------------------------------------------- wrappers
    def _collective_cost(self, name: str, bound: inspect.BoundArguments) -> tuple[int, int]:
        a = bound.arguments
        size = dist.get_world_size(a.get("group"))
        if size <= 1:
            return 0, 0
        if name in ("all_gather_single", "all_gather_into_tensor", "_all_gather_base"):
            return (size - 1) * a["input_tensor"].nbytes, size - 1
        if name in ("reduce_scatter_single", "reduce_scatter_tensor", "_reduce_scatter_base"):
            return (size - 1) * a["output"].nbytes, size - 1
        if name == "all_reduce":
            return int(2 * (size - 1) / size * a["tensor"].nbytes), 2 * (size - 1)
        if name == "all_gather":
            return (size - 1) * a["tensor"].nbytes, size - 1
        if name == "reduce_scatter":
            return (size - 1) * a["output"].nbytes, size - 1
        if name == "all_to_all_single":
            x = a["input"]
            splits = a.get("input_split_sizes")
            if splits:
                row = x.nbytes // max(1, x.shape[0])
                me = dist.get_rank(a.get("group"))
                return (sum(splits) - splits[me]) * row, size - 1
            return x.nbytes * (size - 1) // size, size - 1
        if name == "broadcast":
            return a["tensor"].nbytes, 1
        raise KeyError(name)

    def _wrap_collective(self, name: str, original: Callable) -> Callable:
        signature = inspect.signature(original)
        link = self

        def emulated(*args, **kwargs):
            if getattr(link._local, "inside", False):
                return original(*args, **kwargs)  # a deprecated alias calling the real one
            bound = signature.bind(*args, **kwargs)
            async_op = bool(bound.arguments.get("async_op", False))
            nbytes, messages = link._collective_cost(name, bound)
            deadline = link._reserve(name, nbytes, messages) if nbytes else time.perf_counter()
            bound.arguments["async_op"] = True
            link._local.inside = True
            try:
                real = original(*bound.args, **bound.kwargs)
            finally:
                link._local.inside = False
            work = _EmuWork(link, real, deadline)
            if async_op:
                return work
            work.wait()
            return None

        emulated.__name__ = name
        emulated.__wrapped__ = original
        return emulated

    def _wrap_isend(self, original: Callable) -> Callable:
        link = self

        def isend(tensor, dst=None, group=None, tag=0, group_dst=None):
            peer = dst if group_dst is None else dist.get_global_rank(group or dist.group.WORLD, group_dst)
            deadline = link._reserve("isend", tensor.nbytes, 1)
            link._board.post(link._rank, peer, tag, deadline)
            return _EmuWork(link, original(tensor, dst, group, tag, group_dst), deadline)

        isend.__name__ = "isend"
        isend.__wrapped__ = original
        return isend

    def _wrap_irecv(self, original: Callable) -> Callable:
        link = self

        def irecv(tensor, src=None, group=None, tag=0, group_src=None):
            if src is None and group_src is None:
                raise ValueError("emulated link: irecv needs an explicit source rank")
            peer = src if group_src is None else dist.get_global_rank(group or dist.group.WORLD, group_src)
            key = link._board.next_key(peer, link._rank, tag)
            return _RecvWork(link, original(tensor, src, group, tag, group_src), key)

        irecv.__name__ = "irecv"
        irecv.__wrapped__ = original
        return irecv

    # ---------------------------------------------------------------- install
    def install(self) -> "EmulatedLink":
        """Replace the functions (a collective call: every rank of the default group installs)."""
        if self._originals:
            return self
        self._open_board()
        wrappers: dict[int, Callable] = {}
        for name in _COLLECTIVES + _P2P:
            original = getattr(c10d, name, None)
            if original is None:
                continue
            self._originals[name] = original
            if name == "isend":
                wrapper = self._wrap_isend(original)
            elif name == "irecv":
                wrapper = self._wrap_irecv(original)
            else:
                wrapper = self._wrap_collective(name, original)
            wrappers[id(original)] = wrapper
            for module in (c10d, dist):
                if getattr(module, name, None) is original:
                    self._rebound.append((module, name, original))
                    setattr(module, name, wrapper)
        for module_name, module in list(sys.modules.items()):
            if module is None or not module_name.startswith(_REBIND_PREFIXES):
                continue
            for attr, value in list(vars(module).items()):
                wrapper = wrappers.get(id(value))
                if wrapper is not None:
                    self._rebound.append((module, attr, value))
                    setattr(module, attr, wrapper)
        return self

    def _open_board(self):
        self._rank = dist.get_rank()
        paths = [None]
        if self._rank == 0:
            self._board = DeadlineBoard(dist.get_world_size())
            paths = [self._board.path]
        dist.broadcast_object_list(paths, src=0)
        if self._rank != 0:
            self._board = DeadlineBoard(dist.get_world_size(), path=paths[0])
        dist.barrier()

    def uninstall(self):
        """Restore the functions (a collective call, like install)."""
        if self._board is not None:
            dist.barrier()
            self._board.close()
            self._board = None
        for module, attr, original in reversed(self._rebound):
            setattr(module, attr, original)
        self._rebound.clear()
        self._originals.clear()

    def __enter__(self) -> "EmulatedLink":
        return self.install()

    def __exit__(self, *exc):
        self.uninstall()
