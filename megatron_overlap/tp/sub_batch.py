"""Sub-batches across the ops of an MLP block (Centauri's workload partitioning; DeepSpeed
Domino's row split): each rank's sequence rows are cut into N sub-batches that run
fc1 -> activation -> fc2 one after another, so one sub-batch's transfers travel while another
computes, across the op boundary that per-op overlap cannot cross.

Forward, sub-batch j (rows are independent in every op of the block):

    fc1   AG(x_j) @ w1^T      j = 0: the chunked ring; j > 0: gathered while fc2_{j-1} computed
    act   Megatron's own code (the MLP's forward runs once per sub-batch)
    fc2   RS(a_j @ w2^T)      the all-gather of x_{j+1} is posted first; this reduce-scatter's
                              last hop is waited only after the last sub-batch (``Join``)

Backward mirrors it. Autograd runs the sub-batches' chains last one first: the chain that runs
first gathers its grad-output with the ring, every later one finds it gathered (posted by the
chain before it right after its fc2 dgrad), and fc1's reduce-scatter of each chain is waited
only once every chain has run (``Split``'s backward). The attention block (``integration/
sub_batches.py``) cuts its core attention and projection the same way.

Numerics: every forward row and every input-gradient row is computed by the same GEMMs on
the same rows as stock (bit-identical on the backends here). A weight gradient is a sum over all
rows, so no sub-batch computes its own: each keeps its grad-output and input rows
(``collect``), and the last chain autograd runs puts every part's rows back in stock's order and
runs stock's one GEMM on them: stock's bits (tests/test_training.py checks ``==``). Bytes moved
equal stock's: the same gathers and reduce-scatters, cut into sub-batches.
"""

from __future__ import annotations

import threading
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ..comm.collectives import all_gather_into
from ..comm import waits


def split_sizes(rows: int, n: int) -> List[int]:
    """``rows`` cut into ``n`` near-equal parts, the larger first (3 -> 1, 1, 1; 8 / 3 -> 3, 3, 2)."""
    base, extra = divmod(rows, n)
    return [base + (1 if i < extra else 0) for i in range(n)]


class ScratchPool:
    """Buffers for the tensors the cut puts back together (a weight gradient's rows, the
    attention's probabilities and gradients over all query rows), handed back once their GEMM
    ran and reused by the next block call of the same shape. A fresh tensor of tens of MB costs
    its first touch of every page on the CPU (measured: 64 MB, 29 ms of page faults against 9 ms
    of copying); a caching allocator (CUDA's) has no such cost, and there the pool only keeps what
    the allocator would have kept. One per installation; backward may run on another thread."""

    def __init__(self):
        self._free: Dict[tuple, List[torch.Tensor]] = {}
        self._lock = threading.Lock()

    def take(self, shape, like: torch.Tensor) -> torch.Tensor:
        key = (tuple(shape), like.dtype, like.device)
        with self._lock:
            free = self._free.get(key)
            if free:
                return free.pop()
        return like.new_empty(shape)

    def give(self, *tensors: torch.Tensor) -> None:
        with self._lock:
            for t in tensors:
                self._free.setdefault((tuple(t.shape), t.dtype, t.device), []).append(t)


class SubBatches:
    """The state of one block call cut into sub-batches: the parts, the gathers posted ahead and the
    reduce-scatters waited behind. The patched linears find it on the installation while the
    block runs (forward) and in their autograd context (backward)."""

    def __init__(self, group: dist.ProcessGroup, sizes: Sequence[int], row=None, pool: Optional[ScratchPool] = None):
        self.group, self.sizes, self.row = group, list(sizes), row  # row: the Row linear whose output is cut
        self.pool = pool if pool is not None else ScratchPool()
        self.n = len(self.sizes)
        # the attention's cut: the first part's Row backward starts the whole QKV input re-gather (what
        # runs in between, the parts' core attention backwards, has no transfers of its own); an MLP
        # part's Row starts its own part's fc1 input re-gather
        self.gather_whole_early = False
        self.slot = None  # that Column's re-gather (linear.GatherSlot), claimed by part 0's Row forward
        self.index = 0  # the sub-batch the forward is running
        self.parts: Tuple[torch.Tensor, ...] = ()
        self.grads: Tuple[torch.Tensor, ...] = ()
        self._gathers: Dict[Tuple[str, int], Tuple[torch.Tensor, object]] = {}
        self._pending: Dict[Tuple[str, int], object] = {}  # ("out" | "dx", j) -> a reduce-scatter's pending
        self._collected: Dict[str, Dict[int, Tuple[torch.Tensor, ...]]] = {}  # "column" | "row" -> j -> rows
        self.where = waits.current()  # the block's labels, for the waits of its backward

    # -- gathers posted ahead ---------------------------------------------------------------------
    def prefetch(self, kind: str, j: int) -> None:
        """Post the all-gather of part ``j`` of the input (``kind`` "x") or of the grad-output ("dy")."""
        source = self.parts if kind == "x" else self.grads
        if not 0 <= j < len(source) or (kind, j) in self._gathers:
            return
        x = source[j].contiguous()
        size = dist.get_world_size(self.group)
        buf = torch.empty((size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
        self._gathers[(kind, j)] = (buf, all_gather_into(buf, x, self.group, async_op=True))

    def gathered(self, kind: str, j: int) -> Optional[torch.Tensor]:
        """Part ``j`` gathered in rank order, as one all-gather returns it, or None if not posted."""
        entry = self._gathers.pop((kind, j), None)
        if entry is None:
            return None
        buf, work = entry
        waits.wait(work, f"sub-batch {j} all-gather of its {'input' if kind == 'x' else 'grad-output'}", self.group)
        return buf

    def has_gather(self, kind: str, j: int) -> bool:
        return (kind, j) in self._gathers

    # -- weight gradients over all rows ------------------------------------------------------------
    def collect(self, key: str, j: int, *tensors) -> Optional[List[torch.Tensor]]:
        """Keep part ``j``'s ``tensors`` (each ``[R * rows_j, ...]`` as its gather left them: rank
        r's rows of part j at ``r * rows_j``; R = 1 without sequence parallelism; or a callable
        that waits for one, called only then) until every part's are in; then return each put
        back together in stock's row order (rank r's rows of every part, in part order, at
        ``r * rows``), else None."""
        parts = self._collected.setdefault(key, {})
        parts[j] = tensors
        if len(parts) < self.n:
            return None
        del self._collected[key]
        wholes = []
        for t in range(len(tensors)):
            rows = [parts[i][t] for i in range(self.n)]
            wholes.append(self._whole([r() if callable(r) else r for r in rows]))
        return wholes

    def _whole(self, parts: Sequence[torch.Tensor]) -> torch.Tensor:
        ranks, rows = parts[0].shape[0] // self.sizes[0], sum(self.sizes)
        if any(p.shape[0] != ranks * n for p, n in zip(parts, self.sizes)):
            raise RuntimeError(f"megatron-overlap: sub-batch rows {[p.shape[0] for p in parts]} do not match the "
                               f"cut {self.sizes} over {ranks} ranks")
        whole = self.pool.take((ranks * rows, *parts[0].shape[1:]), parts[0])
        for r in range(ranks):
            first = r * rows
            for part, n in zip(parts, self.sizes):
                whole[first:first + n].copy_(part[r * n:(r + 1) * n])
                first += n
        return whole

    # -- reduce-scatters waited behind ------------------------------------------------------------
    def defer(self, kind: str, j: int, pending) -> None:
        self._pending[(kind, j)] = pending

    def finish(self, kind: str, parts: Sequence[torch.Tensor]) -> torch.Tensor:
        """The parts in order, each deferred one replaced by its finished reduce-scatter."""
        out = [self._pending.pop((kind, j)).finish() if (kind, j) in self._pending else p for j, p in enumerate(parts)]
        return torch.cat(out, dim=0)


class Split(torch.autograd.Function):
    """``x`` -> its N row parts (forward); the input gradient, with each part's deferred fc1
    reduce-scatter waited here, once every chain has run (backward)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, sub: SubBatches):
        ctx.sub = sub
        parts = x.split(sub.sizes, dim=0)
        sub.parts = parts
        return parts

    @staticmethod
    def backward(ctx, *grads):
        sub, ctx.sub = ctx.sub, None
        with waits.restored(sub.where, "backward"):
            return sub.finish("dx", grads), None


class Join(torch.autograd.Function):
    """The N fc2 outputs -> one tensor, each deferred reduce-scatter waited here (forward); the
    grad-output cut into the parts the chains take (backward)."""

    @staticmethod
    def forward(ctx, sub: SubBatches, *outs: torch.Tensor):
        ctx.sub = sub
        return sub.finish("out", outs)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        sub, ctx.sub = ctx.sub, None
        sub.grads = tuple(grad.contiguous().split(sub.sizes, dim=0))
        return (None, *sub.grads)
