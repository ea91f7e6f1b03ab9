"""Weight-gradient GEMMs kept back for the time a later transfer travels (Centauri's layer
level: the dgrad path is the critical one, the wgrad path can wait).

A linear's backward hands Megatron what stock hands it (the dummy grad, ``grad_added_to_main_grad``)
and pushes its ``main_grad += dy^T x`` here instead of running it. The tasks run, oldest first,
at fixed points of the backward pass, the same on every rank. Nothing depends on timing: a
rank that chose to compute while its peers did not would post its next transfer late and
make them wait (tried: letting a Column run its own task when its last hop had not arrived
made the tiny GPT's step 5-10% slower than this fixed order, BENCHMARKS.md).

- in a Row backward, after its local dgrad GEMM, while the grad-output pieces of its all-gather
  travel: every task held (a link-bound Row, such as attention's proj, gets the wgrad of the
  Column before it: fc1's);
- in a Column backward, once its reduce-scatter partials and input re-gather are on their way:
  the tasks held from before that backward began (its own task waits for the next Row: fc1's
  wgrad fills attention proj's wait);
- when more than ``limit`` tasks are held (each keeps its two inputs: memory stays bounded);
- at the end of the backward pass (``drain``, queued on autograd's engine), always.

Under a split pipeline schedule (``--overlap-pp zb``) the executor wraps each micro-batch's B in
:meth:`hold_for`: what is pushed there is kept for that micro-batch's W
(:meth:`run_microbatch`) and none of the points above runs it. At the end of a stage's step the
W left over run as a drain, layer by layer, so each DDP bucket's last gradient is in as early
as it can be: :meth:`run_layer_major` (after the last B), or :meth:`flush_for` around the last B
(each parameter's held tasks right after its own wgrad is pushed). Either way a parameter's
tasks still run in micro-batch order, so ``main_grad`` receives the same additions in the same
order.

Numerics are untouched: the same GEMM on the same tensors into the same ``main_grad``, only
later. Megatron DDP must not see the parameter as ready before its task ran: the integration
layer defers its ``register_grad_ready`` through :meth:`after` (``integration/ddp.py``). Tasks
exist only where stock itself accumulates into ``main_grad`` (gradient-accumulation fusion on a
DDP parameter); elsewhere the wgrad runs in place, as before.
"""

from __future__ import annotations

import collections
import contextlib
from typing import Callable, Optional

import torch


class WgradStore:
    """One per installation; see the module docstring."""

    def __init__(self, limit: int = 2):
        self.limit = limit
        self._tasks: collections.deque = collections.deque()  # (sequence number, param, fn)
        self._pushed = 0
        self._after: dict = {}  # id(param) -> callbacks once its last task ran
        self._drain_queued = False
        self._microbatch: Optional[int] = None  # the B being held for its W (``hold_for``)
        self._flushing = False  # inside ``flush_for``: a push runs the parameter's held tasks, then itself
        self._held: dict = {}  # micro-batch -> [(param, fn, nbytes)], for its W
        self._held_bytes: dict = {}  # micro-batch -> bytes its held tasks keep alive
        self.ran = 0  # tasks run so far (tests count them)
        self.late_inputs = 0  # tasks pushed with their input still travelling (the output layer's re-gather)

    def __len__(self) -> int:
        return len(self._tasks)

    def push(self, param: torch.Tensor, fn: Callable[[], None], nbytes: int = 0) -> None:
        """Keep ``fn`` (the wgrad of ``param``; ``nbytes``: what it keeps alive) for later. Call
        from inside a backward pass."""
        if self._flushing:
            with torch.no_grad():
                self._run_held_of(param, sorted(self._held))
                fn()
                self.ran += 1
            self._release(param)
            return
        if self._microbatch is not None:
            self._held.setdefault(self._microbatch, []).append((param, fn, nbytes))
            self._held_bytes[self._microbatch] = self._held_bytes.get(self._microbatch, 0) + nbytes
            return
        self._tasks.append((self._pushed, param, fn))
        self._pushed += 1
        if not self._drain_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self.drain)
            self._drain_queued = True
        while len(self._tasks) > self.limit:
            self._run_one()

    def mark(self) -> int:
        """A point in the push order: ``run(older_than=mark)`` runs only what came before."""
        return self._pushed

    def run(self, older_than: Optional[int] = None) -> None:
        """Run the tasks held (only those pushed before ``older_than``, when given)."""
        while self._tasks and (older_than is None or self._tasks[0][0] < older_than):
            self._run_one()

    def drain(self) -> None:
        self._drain_queued = False
        self.run()

    def pending(self, param: torch.Tensor) -> bool:
        return any(p is param for _seq, p, _fn in self._tasks) or any(
            p is param for tasks in self._held.values() for p, _fn, _n in tasks)

    @contextlib.contextmanager
    def hold_for(self, microbatch: int):
        """Everything pushed inside waits for ``run_microbatch(microbatch)``."""
        previous, self._microbatch = self._microbatch, microbatch
        try:
            yield
        finally:
            self._microbatch = previous

    @contextlib.contextmanager
    def flush_for(self, microbatch: int):
        """Inside (a micro-batch's B): each wgrad pushed runs at once, right after the tasks of
        the same parameter still held for earlier micro-batches (in micro-batch order)."""
        previous, self._flushing = self._flushing, True
        try:
            yield
        finally:
            self._flushing = previous

    def run_microbatch(self, microbatch: int) -> int:
        """Run micro-batch ``microbatch``'s held wgrads, in the order they were pushed (the
        backward's order, as stock runs them); returns how many ran."""
        tasks = self._held.pop(microbatch, [])
        self._held_bytes.pop(microbatch, None)
        with torch.no_grad():  # as inside the backward pass the tasks came from
            for param, fn, _n in tasks:
                fn()
                self.ran += 1
                self._release(param)
        return len(tasks)

    def run_layer_major(self, microbatches) -> int:
        """Run the held wgrads of ``microbatches`` parameter by parameter, in the order the
        backward pushed them (the last layer first), each parameter's in micro-batch order;
        returns how many ran."""
        mbs = sorted(mb for mb in set(microbatches) if mb in self._held)
        order, seen = [], set()
        for mb in mbs:
            for param, _fn, _n in self._held[mb]:
                if id(param) not in seen:
                    seen.add(id(param))
                    order.append(param)
        before = self.ran
        with torch.no_grad():
            for param in order:
                self._run_held_of(param, mbs)
                self._release(param)
        return self.ran - before

    def _run_held_of(self, param, microbatches) -> None:
        """Run (and drop) ``param``'s tasks held for ``microbatches``, in that order."""
        for mb in microbatches:
            tasks = self._held.get(mb)
            if not tasks:
                continue
            keep = []
            for entry in tasks:
                if entry[0] is param:
                    entry[1]()
                    self.ran += 1
                    self._held_bytes[mb] = self._held_bytes.get(mb, 0) - entry[2]
                else:
                    keep.append(entry)
            if keep:
                self._held[mb] = keep
            else:
                self._held.pop(mb)
                self._held_bytes.pop(mb, None)

    def held_microbatches(self) -> list:
        return sorted(self._held)

    def held_bytes(self) -> int:
        """Bytes kept alive for W by micro-batches whose B has finished."""
        return sum(n for mb, n in self._held_bytes.items() if mb != self._microbatch)

    def after(self, param: torch.Tensor, callback: Callable[[], None]) -> None:
        """Run ``callback`` once every task of ``param`` has run (now, if none is pending)."""
        if not self.pending(param):
            callback()
            return
        self._after.setdefault(id(param), []).append(callback)

    def _run_one(self) -> None:
        _seq, param, fn = self._tasks.popleft()
        fn()
        self.ran += 1
        self._release(param)

    def _release(self, param) -> None:
        if not self.pending(param):
            for callback in self._after.pop(id(param), ()):
                callback()
