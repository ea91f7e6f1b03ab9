"""The core attention of a sub-batched block (``integration/sub_batches.py``), one part of its
query rows at a time, with stock's key and value gradients.

A part's queries attend to every key, so its rows of the forward and of the query gradient are
stock's rows, computed by Megatron's own ``DotProductAttention.forward``. The key and value
gradients are sums over all query rows (``dK = alpha * Q^T dS``, ``dV = P^T dC``); summed per
part they would be a few ulp from stock's. So each part keeps what stock's two backward GEMMs
read (its rows of the attention probabilities ``P``, of the scores' gradient ``dS`` and of the
context's gradient ``dC``), and the last part autograd runs puts them in stock's row order and
runs those two GEMMs once, as autograd runs them for stock (``bmm``'s and ``baddbmm``'s
derivative formulas), then hands the results back through stock's own view and GQA-repeat ops.

Megatron's forward is run under a ``TorchFunctionMode`` that records its ``baddbmm`` and ``bmm``
(their operands, ``alpha`` and results). The first part checks that they are laid out as this
module rebuilds them for all rows; where they are not (another Megatron-core), every part
sums its own key and value gradients instead, a few ulp from stock's, said once.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch.overrides import TorchFunctionMode

from ..tp.sub_batch import ScratchPool


class _Record(TorchFunctionMode):
    """The ``torch.baddbmm`` / ``torch.bmm`` calls of one core-attention forward."""

    def __init__(self):
        super().__init__()
        self.baddbmm, self.bmm = [], []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is torch.baddbmm:
            self.baddbmm.append((args, kwargs, out))
        elif func is torch.bmm:
            self.bmm.append((args, out))
        return out


class CutAttention:
    """One block call's core attention cut into ``n`` parts of query rows (``index[j]``):
    what the parts' forwards and backwards share."""

    def __init__(self, n: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 notice: Callable[[str, str], None], pool: ScratchPool):
        self.n, self.notice, self.pool = n, notice, pool
        self.query = query.detach()  # [sq, b, np, hn]: the key gradient's GEMM reads all its rows
        self.shape = query.shape
        # leaves: part 0's graph reaches the key and value through them, and their gradients run
        # back through part 0's ops to them (``_key_value_grads``); the other parts read them detached
        self.key = key.detach().requires_grad_(key.requires_grad)
        self.value = value.detach().requires_grad_(value.requires_grad)
        self.exact: Optional[bool] = None  # the recorded ops laid out as rebuilt here (decided by part 0)
        self.alpha = 1.0
        self.probs = self.grad_scores = self.grad_context = None  # [b*np, sq, *]: all rows, stock's order
        self.batch2 = self.mat2 = None  # the key's and value's views the GEMMs read (part 0's)
        self._inner: dict = {}  # j -> (query rows leaf, output, scores, context) of part j's graph
        self._sums = [None, None]  # per-part key / value gradients where not exact
        self._done = 0

    def forward(self, j: int, index: torch.Tensor, query: torch.Tensor, run) -> torch.Tensor:
        q = query.detach().index_select(0, index).requires_grad_()
        leaves = j == 0 or not self.exact  # where exact, only part 0 keeps the key's and value's graph
        key, value = (self.key, self.value) if leaves else (self.key.detach(), self.value.detach())
        record = _Record()
        with torch.enable_grad(), record:
            out = run(q, key, value)
        if self.exact is None:
            self.exact = self._laid_out_as_rebuilt(q, record)
            if not self.exact:
                self.notice("attention-parts-sum", "`tp.sub_batches`: this Megatron-core's core attention is not laid "
                            "out as megatron-overlap rebuilds it, so its key and value gradients are summed per "
                            "sub-batch (a few ulp from stock's)")
        if self.exact:
            (_buf, batch1, batch2), kwargs, scores = record.baddbmm[0]
            (probs, mat2), context = record.bmm[0]
            if self.probs is None:
                self.alpha, self.batch2, self.mat2 = kwargs.get("alpha", 1), batch2, mat2
                self.probs = self.pool.take((probs.shape[0], self.shape[0], probs.shape[2]), probs)
            self.probs.index_copy_(1, index, probs.detach())
            self._inner[j] = (q, out, scores, context)
        else:
            self._inner[j] = (q, out, None, None)
        return out.detach()

    def _laid_out_as_rebuilt(self, q: torch.Tensor, record: _Record) -> bool:
        """Whether part 0's recorded ops are Megatron-core 0.16's: ``baddbmm(buffer, Q', K',
        beta=0, alpha)`` with ``Q' = q.reshape(sq, b*np, hn).transpose(0, 1)``, then
        ``bmm(P, V')`` with a contiguous ``P [b*np, sq, sk]``."""
        if len(record.baddbmm) != 1 or len(record.bmm) != 1:
            return False
        (args, kwargs, _scores), ((probs, mat2), _context) = record.baddbmm[0], record.bmm[0]
        if len(args) != 3 or kwargs.get("beta", 1) != 0 or set(kwargs) - {"alpha", "beta"}:
            return False
        if args[2].requires_grad != self.key.requires_grad or mat2.requires_grad != self.value.requires_grad:
            return False  # the key or value reached its GEMM some other way
        rebuilt = _query_view(q)
        batch1 = args[1]
        return (batch1.shape == rebuilt.shape and batch1.stride() == rebuilt.stride()
                and batch1.data_ptr() == rebuilt.data_ptr() and probs.is_contiguous()
                and probs.shape[:2] == batch1.shape[:2])

    def backward(self, j: int, index: torch.Tensor, grad: torch.Tensor):
        """Part ``j``'s query gradient (its rows; zeros elsewhere), and at the last part to run,
        the key's and value's (else None)."""
        q, out, scores, context = self._inner.pop(j)
        if self.exact:
            dq, d_scores, d_context = torch.autograd.grad(out, (q, scores, context), grad)
            if self.grad_scores is None:
                self.grad_scores = self.pool.take((d_scores.shape[0], self.shape[0], d_scores.shape[2]), d_scores)
                self.grad_context = self.pool.take((d_context.shape[0], self.shape[0], d_context.shape[2]), d_context)
            self.grad_scores.index_copy_(1, index, d_scores)
            self.grad_context.index_copy_(1, index, d_context)
        else:
            wanted = [q] + [t for t in (self.key, self.value) if t.requires_grad]
            grads = list(torch.autograd.grad(out, wanted, grad, allow_unused=True))
            dq = grads.pop(0)
            for i, leaf in enumerate((self.key, self.value)):
                if leaf.requires_grad:
                    g = grads.pop(0)
                    self._sums[i] = g if self._sums[i] is None else self._sums[i] + g
        grad_query = dq.new_zeros(self.shape).index_add_(0, index, dq)  # index_select's backward
        self._done += 1
        if self._done < self.n:
            return grad_query, None, None
        return (grad_query, *self._key_value_grads()) if self.exact else (grad_query, *self._sums)

    def _key_value_grads(self):
        """Stock's key and value gradients: autograd's derivatives of ``baddbmm`` (batch2:
        ``alpha * batch1^T @ grad``) and ``bmm`` (mat2: ``self^T @ grad``) over all rows, then
        back through the ops that made the GEMMs' operands from the key and value."""
        grads = []
        if self.key.requires_grad:
            d_batch2 = _query_view(self.query).transpose(1, 2).bmm(self.grad_scores)
            if self.alpha != 1:  # autograd's maybe_multiply
                d_batch2 = d_batch2 * self.alpha
            grads.append(torch.autograd.grad(self.batch2, self.key, d_batch2)[0])
        else:
            grads.append(None)
        if self.value.requires_grad:
            d_mat2 = self.probs.transpose(1, 2).bmm(self.grad_context)
            grads.append(torch.autograd.grad(self.mat2, self.value, d_mat2)[0])
        else:
            grads.append(None)
        self.pool.give(self.probs, self.grad_scores, self.grad_context)
        self.probs = self.grad_scores = self.grad_context = self.batch2 = self.mat2 = self.query = None
        return grads


def _query_view(query: torch.Tensor) -> torch.Tensor:
    """``baddbmm``'s batch1 as Megatron-core builds it from ``query [sq, b, np, hn]``."""
    sq, b, np_, _hn = query.shape
    return query.reshape(sq, b * np_, -1).transpose(0, 1)


class AttentionPart(torch.autograd.Function):
    """Part ``j`` of a ``CutAttention``: Megatron's core attention on query rows ``index``."""

    @staticmethod
    def forward(ctx, query, key, value, cut: CutAttention, j: int, index: torch.Tensor, run):
        ctx.cut, ctx.j, ctx.index = cut, j, index
        return cut.forward(j, index, query, run)

    @staticmethod
    def backward(ctx, grad):
        cut, ctx.cut = ctx.cut, None
        return (*cut.backward(ctx.j, ctx.index, grad), None, None, None, None)
