"""An emulated interconnect, so overlap can be measured on a CPU with gloo.

Every transfer completes no earlier than ``latency + bytes / bandwidth`` after the rank's
egress port is free to start it, and waiting for it costs no CPU (the waiting thread sleeps):

- one egress port per rank (a switch, as NVSwitch or a NIC): transfers a rank issues queue
  behind each other; ``bandwidth_GBps`` is that port's rate. With ``LinkSpec.ports ==
  "group"`` a rank has one such port per process group (communicators side by side), and with
  ``node_size`` two tiers (a transfer inside a node at the intra-node rate; bytes counted per
  tier, ``LinkStats.bytes_by_tier``);
- a collective over R ranks sends what a ring algorithm sends: all-gather and reduce-scatter
  ``(R-1)`` shards, all-reduce ``2(R-1)/R`` of the buffer, all-to-all ``(R-1)/R``; it pays
  ``R-1`` latencies (``2(R-1)`` for all-reduce). Its real gloo op is issued at once; ``wait``
  returns once the real op is done *and* the emulated deadline has passed;
- a P2P send is handed to the real backend at once; its deadline goes on a board in shared
  memory (keyed by process group, sender, receiver, tag and sequence number), and the
  receiver's ``wait`` returns only once that deadline has passed, so it sees the data exactly as
  late as the link would deliver it. No helper thread and no extra message: on a busy CPU a
  thread wake-up or a gloo message per send costs more than the sends being measured;
- collectives issued inside ``torch.distributed._coalescing_manager`` (Megatron DDP's bucket
  all-reduces / reduce-scatters) are only recorded by torch and run as one coalesced op when the
  block ends: the link counts each, books the port for their sum when the block ends, and the
  coalesced work (``cm.wait()``, or the block's own end when synchronous) returns no earlier than
  that deadline;
  on gloo an asynchronous block's collectives run as separate asynchronous ops instead (the same
  bytes, one booking): torch 2.13's coalesced gloo all-gathers, dozens outstanding at once (Megatron's
  ``align_param_gather`` dispatches every bucket's at the step's start) beside P2P on another group,
  corrupt the heap (``scripts/gloo_coalesced_crash.py``);
- a communicator listed in ``free_channels`` is free: its collectives are counted and not run
  (no real op, a work that is already done), as if the traffic cost nothing, on the host
  too. The emulated cluster's "DP free" variants use it; waiting there for real gloo
  reductions instead put their CPU time (tens of ms on a busy 2-core machine) into the
  step that was meant to have no data-parallel cost;
- torch's two names of a collective (``all_gather_into_tensor`` calls ``all_gather_single``,
  ``reduce_scatter_tensor`` calls ``reduce_scatter_single``) count once: an alias calling the
  other passes through.

It replaces the functions on ``torch.distributed`` and ``distributed_c10d`` and rebinds every
module-level reference to them in Megatron's and in this plugin's modules (Megatron binds
``dist_all_gather_func`` and friends at import time), so stock Megatron and the plugin run on
the same link. Bytes are counted per op: if the plugin's bytes per step fall below stock's,
a transfer escaped the emulation.

With a ``ComputeClock`` attached (``link.clock``, the emulated cluster), a transfer posted right
after an op leaves when that op ended on the emulated device, and a wait that returns tells
the clock when its transfer arrived (``lab/compute_clock.py``). With ``stream_waits`` as well,
a wait does not sleep until the deadline: it returns once the real op is done and the clock's
device waits instead, as ``Work.wait()`` on a GPU orders the streams and leaves the host to
run ahead (the long-context lab: sleeping there put every rank's host wake-up after each
blocking exchange, 16 ranks on 2 cores at once, into the emulated device's time).

CPU / gloo only: on GPU the real link is the one to measure.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
import zlib
import threading
import time
from typing import Callable, Optional

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from .deadline_board import DeadlineBoard
from .link_spec import LinkSpec, LinkStats, Span
from .link_work import _EmuWork, _RecvWork

__all__ = ["EmulatedLink", "LinkSpec", "LinkStats", "Span"]

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
_COALESCING = "_coalescing_manager"
_REBIND_PREFIXES = ("megatron", "megatron_overlap")


class _Batch(list):
    """The collectives of one open coalescing block, ``(op, bytes, messages)``; ``cm``: where
    they run as separate ops (gloo, asynchronous), else None; ``free``: on a free communicator
    (counted, not run)."""

    cm = None
    free = False


class EmulatedLink:
    """Install with ``with EmulatedLink(LinkSpec(...)) as link:``; see the module docstring."""

    def __init__(self, spec: LinkSpec, record_spans: bool = False):
        self.spec = spec
        self.record_spans = record_spans
        self.stats = LinkStats()
        self._free_at: dict = {}  # port -> when it is free
        self._group_ranks: dict = {}  # id(group) -> its global ranks
        self.clock = None  # a lab.compute_clock.ComputeClock (the emulated cluster)
        self.stream_waits = False  # with a clock: a wait holds the emulated device, not the host (link_work)
        self.free_channels: tuple = ()  # process groups (``_channel``) whose transfers take no time
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

    def _ranks(self, group) -> tuple:
        group = group if group is not None else c10d._get_default_group()
        ranks = self._group_ranks.get(id(group))
        if ranks is None:
            ranks = self._group_ranks[id(group)] = tuple(dist.get_process_group_ranks(group))
        return ranks

    def _reserve(self, op: str, nbytes: int, messages: int, ops: Optional[list] = None, group=None,
                 ranks: Optional[tuple] = None) -> float:
        """Book the egress port for ``nbytes``; the deadline. ``ops``: the ``(op, bytes)`` to count
        (default: ``[(op, nbytes)]``; a coalesced batch books once and counts each). ``group``:
        the process group (its port with ``ports == "group"``); ``ranks``: the global ranks the
        transfer is among (its tier; default: the group's)."""
        now = time.perf_counter()
        spec = self.spec
        if self.is_free(group):
            for name, counted in ops or [(op, nbytes)]:  # counted, not delayed: a free communicator
                self.stats.bytes_by_op[name] += counted
                self.stats.calls_by_op[name] += 1
            return now
        port = self._channel(group) if spec.ports == "group" else 0
        among = (ranks if ranks is not None else self._ranks(group)) if spec.node_size else ()
        gbps, latency_us, launch_us = spec.tier(among) if spec.node_size else \
            (spec.bandwidth_GBps, spec.latency_us, spec.launch_us)
        self.stats.bytes_by_tier[spec.tier_name(among)] += nbytes
        ready = self.clock.ready(now) if self.clock is not None else now
        start = max(ready, self._free_at.get(port, 0.0))
        xfer = nbytes / (gbps * 1e9)
        self._free_at[port] = start + xfer
        done = start + xfer + (messages * latency_us + launch_us) * 1e-6
        stats = self.stats
        for name, counted in ops or [(op, nbytes)]:
            stats.bytes_by_op[name] += counted
            stats.calls_by_op[name] += 1
        stats.busy_s += done - start
        if self.record_spans:
            stats.spans.append(Span(op, nbytes, now, start, done))
        return done

    def is_free(self, group) -> bool:
        """Whether ``group``'s collectives are free (``free_channels``: counted, not run)."""
        return bool(self.free_channels) and self._channel(group) in self.free_channels

    def _reserve_batch(self, batch: list, group=None) -> float:
        """One port booking for a coalesced batch of ``(op, bytes, messages)``; each op's bytes
        counted under its own name."""
        if not batch:
            return time.perf_counter()
        total = sum(nbytes for _op, nbytes, _m in batch)
        return self._reserve("coalesced " + batch[0][0], total, max(m for _op, _b, m in batch),
                             ops=[(op, nbytes) for op, nbytes, _m in batch], group=group)

    def _coalescing_batch(self, group):
        """The open coalescing batch of ``group`` (None: not inside ``_coalescing_manager``)."""
        stack = getattr(self._local, "coalescing", None)
        if not stack:
            return None
        group = group if group is not None else c10d._get_default_group()
        for owner, batch in reversed(stack):
            if owner is group:
                return batch
        return None

    def _blocked(self, t0: float, t1: float, op: str = ""):
        self.stats.blocked_s += t1 - t0
        self.stats.blocked_by_op[op] += t1 - t0
        if self.record_spans:
            self.stats.waits.append((t0, t1))
            self.stats.wait_ops.append(op)

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
            batch = link._coalescing_batch(bound.arguments.get("group"))
            if batch is not None:  # torch only records it; the coalesced op runs at the block's end
                if nbytes:
                    batch.append((name, nbytes, messages))
                if batch.free:
                    return None
                if batch.cm is not None:  # gloo, asynchronous: a separate op (module docstring)
                    bound.arguments["async_op"] = True
                link._local.inside = True
                try:
                    real = original(*bound.args, **bound.kwargs)
                finally:
                    link._local.inside = False
                if batch.cm is None:
                    return real
                batch.cm.append(real)
                return None
            group = bound.arguments.get("group")
            deadline = link._reserve(name, nbytes, messages, group=group) if nbytes else time.perf_counter()
            if nbytes and link.is_free(group):  # counted by _reserve, not run (a one-rank copy still runs)
                work = _EmuWork(link, None, deadline, name)
                return work if async_op else None
            bound.arguments["async_op"] = True
            link._local.inside = True
            try:
                real = original(*bound.args, **bound.kwargs)
            finally:
                link._local.inside = False
            work = _EmuWork(link, real, deadline, name)
            if async_op:
                return work
            work.wait()
            return None

        emulated.__name__ = name
        emulated.__wrapped__ = original
        return emulated

    def _wrap_coalescing(self, original: Callable) -> Callable:
        link = self

        @contextlib.contextmanager
        def coalescing(group=None, device=None, async_ops=False):
            owner = group if group is not None else c10d._get_default_group()
            batch = _Batch()
            stack = getattr(link._local, "coalescing", None)
            if stack is None:
                stack = link._local.coalescing = []
            stack.append((owner, batch))
            deadline = None
            batch.free = link.is_free(owner) and dist.get_world_size(owner) > 1
            separate = batch.free or (async_ops and dist.get_backend(owner) == "gloo")
            try:
                with contextlib.nullcontext(c10d._CoalescingManager()) if separate else \
                        original(group, device, async_ops) as cm:
                    batch.cm = cm if separate else None
                    yield cm
                    stack.pop()
                    deadline = link._reserve_batch(batch, group)  # booked as the coalesced op is issued
            finally:
                if stack and stack[-1][1] is batch:
                    stack.pop()
            if deadline is None or not batch:
                return
            op = "coalesced " + batch[0][0]
            if async_ops:
                cm.works = [_EmuWork(link, work, deadline, op) for work in cm.works] or \
                    [_EmuWork(link, None, deadline, op)]
            else:
                _EmuWork(link, None, deadline, op).wait()

        coalescing.__wrapped__ = original
        return coalescing

    @staticmethod
    def _channel(group) -> int:
        """The board channel of ``group``: from its name, the same on every rank."""
        name = getattr(group, "group_name", None) if group is not None else None
        return zlib.crc32(str(name or "default").encode()) & 0xFFFFF

    def _wrap_isend(self, original: Callable) -> Callable:
        link = self

        def isend(tensor, dst=None, group=None, tag=0, group_dst=None):
            peer = dst if group_dst is None else dist.get_global_rank(group or dist.group.WORLD, group_dst)
            deadline = link._reserve("isend", tensor.nbytes, 1, group=group, ranks=(link._rank, peer))
            link._board.post(link._rank, peer, tag, deadline, link._channel(group))
            return _EmuWork(link, original(tensor, dst, group, tag, group_dst), deadline, "isend")

        isend.__name__ = "isend"
        isend.__wrapped__ = original
        return isend

    def _wrap_irecv(self, original: Callable) -> Callable:
        link = self

        def irecv(tensor, src=None, group=None, tag=0, group_src=None):
            if src is None and group_src is None:
                raise ValueError("emulated link: irecv needs an explicit source rank")
            peer = src if group_src is None else dist.get_global_rank(group or dist.group.WORLD, group_src)
            key = link._board.next_key(peer, link._rank, tag, link._channel(group))
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
        original = c10d.__dict__[_COALESCING]
        wrappers[id(original)] = self._wrap_coalescing(original)
        for module in (c10d, dist):
            if getattr(module, _COALESCING, None) is original:
                self._rebound.append((module, _COALESCING, original))
                setattr(module, _COALESCING, wrappers[id(original)])
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
