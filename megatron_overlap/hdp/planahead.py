"""Planning off the critical path: step k+1 is planned while step k trains.

A step of the runtime is three parts (``HdpRuntime``): ``gather`` (the lengths all-gather, a
small collective), ``planner(lengths, home)`` (pure, deterministic, the same on every rank) and
``load`` (the row exchange and the micro-batches). Only the middle one takes time that grows
with the batch (0.1-1 s per step at R = 256 on a CPU core), and it needs nothing but the
lengths. So :class:`HdpDataIterator` with ``plan_ahead=True``, at each ``start_step()``:

    1. waits for the plan of this step (submitted one step earlier; the first step plans now)
       and loads it: exchange, micro-batches
    2. reads the NEXT step's samples from the data iterator, all-gathers their lengths (the
       collectives stay on the training thread, in the same order on every rank) and hands
       (lengths, home) to a helper process that plans them while this step trains
    3. returns this step's micro-batch count

The helper is one ``spawn`` process per rank (``fork`` is unsafe once CUDA or NCCL threads
exist), started at the first plan-ahead, at ``nice`` +10 so a training rank's threads win its
core when both want it; the planner is pure Python and would hold the GIL in a thread. A data
iterator that ends while the next step is read ends the iteration after this step: the next
``start_step()`` raises ``StopIteration``, as the plain iterator does. The plan is the same as
inline planning (``Planner`` is the runtime's own, pickled), which the tests check.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, List, Optional, Sequence

from .plan import Plan
from .samples import as_samples

HELPER_NICE = 10


@dataclass(frozen=True)
class Planner:
    """The runtime's planning as a picklable value: ``scheduler`` (hdp or static) over ``ranks``
    at ``capacity_tokens``, planned with ``cost``; with ``peer`` (megatron-core's scheduler,
    ``integration.baselines.schedule_megatron_balanced``) the hdp plan is guarded
    (``guard.guarded``: never more than 1% slower than the peer's under either cost model)."""

    scheduler: str
    ranks: int
    capacity_tokens: int
    mode: str = "dp"
    cost: object = None
    peer: Optional[Callable] = None

    def __call__(self, seq_lens: Sequence[int], home: Optional[Sequence[int]] = None) -> Plan:
        from . import schedule

        kwargs = {"mode": self.mode, "home": home} if self.scheduler == "hdp" else {}
        plan = schedule(self.scheduler, list(seq_lens), self.ranks, self.capacity_tokens, self.cost, **kwargs)
        if self.peer is None or self.scheduler != "hdp" or self.mode != "dp":
            return plan
        from .baselines import MegatronSchedulerError
        from .cost import HdpCostModel
        from .guard import guarded

        try:
            other = self.peer(list(seq_lens), self.ranks, self.capacity_tokens)
        except MegatronSchedulerError:
            other = None
        return guarded(plan, other, self.cost or HdpCostModel())


def _helper_start() -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        os.nice(HELPER_NICE)
    except OSError:  # not allowed here: the helper runs at the rank's priority
        pass


class Helper:
    """One planning process (module docstring), started on the first ``submit``."""

    def __init__(self):
        self._pool: Optional[ProcessPoolExecutor] = None

    def start(self) -> None:
        """Start the process now (it imports the planner while the first step runs)."""
        self.submit(_noop)

    def submit(self, fn: Callable, *args) -> Future:
        if self._pool is None:
            import multiprocessing

            self._pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"),
                                             initializer=_helper_start)
        return self._pool.submit(fn, *args)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None


class HdpDataIterator:
    """Wraps a data iterator that yields, per step, this rank's samples (``as_samples``
    formats). ``start_step()`` plans the next step (collective) and returns this rank's number of
    micro-batches for the schedule; then ``next()`` yields them as Megatron batch dicts, each with
    ``hdp`` (the ``MicroBatch``) for ``forward_step``. ``plan_ahead``: the following step is
    planned in a helper process while this one trains (module docstring); ``plan_wait_s`` sums
    the time ``start_step()`` waited for a plan, ``plan_s`` the planner's own time."""

    def __init__(self, data_iterator: Iterable, runtime, plan_ahead: bool = False):
        self._source: Iterator = iter(data_iterator)
        self.runtime = runtime
        self.plan_ahead = plan_ahead
        self.current = None
        self._queue: List[dict] = []
        self._next = None  # (samples, gathered, future) of the step planned ahead
        self._ended = False
        self._helper = Helper() if plan_ahead else None
        if self._helper is not None:
            self._helper.start()
        self.plan_wait_s = 0.0
        self.plan_s = 0.0

    def start_step(self) -> int:
        if self._queue:
            raise RuntimeError(f"start_step() with {len(self._queue)} micro-batches of the previous step unused: "
                               f"the schedule must run every micro-batch start_step() counted")
        if not self.plan_ahead:
            t0 = time.perf_counter()
            self.current = self.runtime.step(next(self._source))
            self.plan_wait_s += time.perf_counter() - t0
        else:
            self.current = self._planned_step()
        self._queue = [mb.batch() for mb in self.current.microbatches]
        if not self._queue:
            self._queue = [self.runtime.idle_microbatch().batch()]
        for b in self._queue:
            b["global_tokens"] = self.current.global_tokens
        return len(self._queue)

    def _planned_step(self):
        if self._next is None:
            if self._ended:
                raise StopIteration
            self._next = self._read_ahead(inline=True)
        samples, gathered, future = self._next
        self._next = None
        t0 = time.perf_counter()
        plan, plan_s = future.result() if isinstance(future, Future) else future
        self.plan_wait_s += time.perf_counter() - t0
        self.plan_s += plan_s
        step = self.runtime.load(samples, gathered, plan)
        try:
            self._next = self._read_ahead()
        except StopIteration:
            self._ended = True
            self.close()
        return step

    def _read_ahead(self, inline: bool = False):
        samples = as_samples(next(self._source))
        gathered = self.runtime.gather(samples)
        args = (self.runtime.planner, gathered.seq_lens, gathered.home)
        if inline:  # nothing trains yet to hide it behind
            return samples, gathered, _timed(*args)
        return samples, gathered, self._helper.submit(_timed, *args)

    def close(self) -> None:
        """Stop the helper process (also when the data ends)."""
        if self._helper is not None:
            self._helper.close()

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        if not self._queue:
            raise RuntimeError("no HDP micro-batch left: call start_step() before each step's schedule and run "
                               "exactly the number of micro-batches it returned")
        return self._queue.pop(0)


def _noop() -> None:
    from . import scheduler  # noqa: F401 (the planner's imports, paid before the first plan is needed)


def _timed(planner: Planner, seq_lens, home):
    t0 = time.perf_counter()
    plan = planner(seq_lens, home)
    return plan, time.perf_counter() - t0
