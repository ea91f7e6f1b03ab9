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

The helper is one process per rank (a fresh interpreter, not a fork: forking is unsafe once CUDA
or NCCL threads exist), started with the iterator, at ``nice`` +10 so a training rank's threads
win its core when both want it; the planner is pure Python and would hold the GIL in a thread. A data
iterator that ends while the next step is read ends the iteration after this step: the next
``start_step()`` raises ``StopIteration``, as the plain iterator does. The plan is the same as
inline planning (``Planner`` is the runtime's own, pickled), which the tests check.
"""

from __future__ import annotations

import os
import pickle
import select
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, List, Optional, Sequence

from .step_plan import Plan
from .samples import as_samples

HELPER_NICE = 10
PLAN_TIMEOUT_S = 600.0  # how long a step waits for its plan without --overlap-timeout-s (NCCL's default)


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
    stages: Optional[int] = None  # mode pp: the pipeline's stages (hdp.pp_timeline.DEFAULT_STAGES when None)

    def __call__(self, seq_lens: Sequence[int], home: Optional[Sequence[int]] = None) -> Plan:
        from . import schedule

        kwargs = {"mode": self.mode, "home": home} if self.scheduler == "hdp" else {}
        if self.scheduler == "hdp" and self.mode == "pp" and self.stages is not None:
            kwargs["stages"] = self.stages
        plan = schedule(self.scheduler, list(seq_lens), self.ranks, self.capacity_tokens, self.cost, **kwargs)
        if self.peer is None or self.scheduler != "hdp" or self.mode != "dp":
            return plan
        from .baselines import MegatronSchedulerError
        from .bound_tradeoff import for_both
        from .cost import HdpCostModel
        from .guard import guarded

        try:
            other = self.peer(list(seq_lens), self.ranks, self.capacity_tokens)
        except MegatronSchedulerError:
            other = None
        cost = self.cost or HdpCostModel()
        return guarded(for_both(plan, cost, home=home), other, cost)


class Helper:
    """One planning process (module docstring): ``python -m megatron_overlap.hdp.planahead``, fed
    pickled (function, arguments) on its stdin, one at a time, answering on its stdout. A plain
    subprocess, not ``multiprocessing``: a rank that is itself a daemon process (a test's or the
    demo's rank pool) may not start ``multiprocessing`` children."""

    def __init__(self):
        self._proc: Optional[subprocess.Popen] = None

    def start(self) -> None:
        """Start the process now (it imports the planner while the first step runs)."""
        if self._proc is None:
            env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
            self._proc = subprocess.Popen([sys.executable, "-m", "megatron_overlap.hdp.planahead"],
                                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)

    def submit(self, fn: Callable, *args) -> "Pending":
        self.start()
        pickle.dump((fn, args), self._proc.stdin)
        self._proc.stdin.flush()
        return Pending(self._proc)

    def close(self) -> None:
        if self._proc is not None:
            proc, self._proc = self._proc, None
            try:
                proc.stdin.close()
            except OSError:  # it was stopped (a timed-out wait) with a request unread
                pass
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


class Pending:
    """An answer the helper owes: ``result()`` waits for it (re-raising the helper's error)."""

    def __init__(self, proc):
        self._proc = proc

    def result(self, timeout_s: Optional[float] = None):
        """The answer, waiting at most ``timeout_s`` (default: ``--overlap-timeout-s`` where it
        is set, else :data:`PLAN_TIMEOUT_S`); a helper that does not answer in time is killed and
        the wait ends in an error naming it."""
        from ..comm import waits

        limit = timeout_s if timeout_s is not None else (waits.current().timeout_s or PLAN_TIMEOUT_S)
        # One request is outstanding at a time, so nothing of this answer sits in the reader's buffer yet
        ready, _, _ = select.select([self._proc.stdout], [], [], limit)
        if not ready:
            self._proc.kill()
            self._proc.wait(timeout=30)
            raise RuntimeError(f"the HDP planning helper (pid {self._proc.pid}) gave no plan within {limit:g} s; "
                               "it was stopped (a planner that hangs, or a machine too loaded to run it: raise "
                               "comm.timeout_s, or plan inline)")
        try:
            ok, value = pickle.load(self._proc.stdout)
        except EOFError:
            raise RuntimeError(f"the HDP planning helper exited (code {self._proc.poll()}) without a plan") from None
        if not ok:
            raise value
        return value


def _serve() -> None:
    """The helper's loop: the protocol keeps the real stdout; prints go to stderr."""
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    try:
        os.nice(HELPER_NICE)
    except OSError:  # not allowed here: the helper runs at the rank's priority
        pass
    source = sys.stdin.buffer
    while True:
        try:
            fn, args = pickle.load(source)
        except EOFError:
            return
        try:
            answer = (True, fn(*args))
        except Exception as exc:  # handed back to the rank, which raises it
            answer = (False, exc)
        pickle.dump(answer, out)
        out.flush()


class HdpDataIterator:
    """Wraps a data iterator that yields, per step, this rank's samples (``as_samples``
    formats). ``start_step()`` plans the next step (collective) and returns this rank's number of
    micro-batches for the schedule; then ``next()`` yields them as Megatron batch dicts, each with
    ``hdp`` (the ``MicroBatch``) for ``forward_step``. ``plan_ahead``: the following step is
    planned in a helper process while this one trains (module docstring); ``plan_wait_s`` sums
    the time ``start_step()`` waited for a plan, ``plan_s`` the planner's own time,
    ``ahead_steps`` counts the steps planned ahead."""

    def __init__(self, data_iterator: Iterable, runtime, plan_ahead: bool = False):
        self._source: Iterator = iter(data_iterator)
        self.runtime = runtime
        self.plan_ahead = plan_ahead
        self.current = None
        self._started: List[dict] = []  # the step's micro-batches, as start_step() queued them
        self._queue: List[dict] = []
        self._next = None  # (samples, gathered, future) of the step planned ahead
        self._ended = False
        self._helper = Helper() if plan_ahead else None
        self._warm = None
        if self._helper is not None:
            self._warm = self._helper.submit(_noop)
        self.plan_wait_s = 0.0
        self.plan_s = 0.0
        self.ahead_steps = 0  # steps whose plan the helper made

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
        self._started = list(self._queue)
        return len(self._queue)

    @property
    def rows(self) -> List[int]:
        """Token rows of each micro-batch of the step started, in order."""
        return [int(b["tokens"].shape[-1]) for b in self._started]

    def _planned_step(self):
        if self._next is None:
            if self._ended:
                raise StopIteration
            self._next = self._read_ahead(inline=True)
        samples, gathered, future = self._next
        self._next = None
        t0 = time.perf_counter()
        plan, plan_s = future.result() if isinstance(future, Pending) else future
        self.ahead_steps += isinstance(future, Pending)
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
        if self._warm is not None:  # the helper answers in order: collect its warm-up first
            self._warm, warm = None, self._warm
            warm.result()
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


if __name__ == "__main__":
    _serve()
