"""GEMM -> all-reduce, overlapped: tensor parallelism without sequence parallelism.

    x        [S, b, k]      the whole sequence (replicated rows), this rank's slice of the reduction dim
    weight_t [k, n]
    out      [S, b, n]      = all_reduce(x @ weight_t)

The product is computed in row pieces of the sequence; each piece's all-reduce (the backend's
collective, asynchronous) is issued the moment its GEMM is done, so it travels while the next
piece computes. ``finish`` waits for them all. RowParallelLinear's forward and
ColumnParallelLinear's dgrad (``weight_t`` = its weight) are this op.

Numerics: rows are independent in a GEMM (pieces of tens of rows give the same bits as one GEMM
here; tests/test_parity.py), and an all-reduce over two ranks is a + b, the same bits as the
stock all-reduce of the whole tensor. Over R > 2 ranks the sum of each element runs in the
order the collective's algorithm gives it, which depends on the buffer it is handed (gloo's
ring cuts it into R segments): a piece's elements may be summed in another order than in the
whole tensor's all-reduce, a few ulp apart (bounded in the tests).
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from ..comm import waits
from ..comm.collectives import all_reduce_into
from ..comm.rings import Piece


class PendingAllReduce:
    """The pieces of ``out`` with their all-reduces in flight; ``finish`` waits and returns ``out``."""

    def __init__(self, out: torch.Tensor, group: dist.ProcessGroup):
        self.out = out
        self.group = group
        self.works: list = []  # (first row, work)

    def post(self, rows: slice) -> None:
        self.works.append((rows.start, all_reduce_into(self.out[rows], self.group, async_op=True)))

    def finish(self) -> torch.Tensor:
        for first, work in self.works:
            waits.wait(work, f"all-reduce of rows from {first}", self.group)
        self.works = []
        return self.out


def start_matmul_all_reduce(x: torch.Tensor, weight_t: torch.Tensor, group: dist.ProcessGroup,
                            pieces: Sequence[Piece]) -> PendingAllReduce:
    """Issue ``all_reduce(x @ weight_t)`` piece by piece (``pieces``: row ranges of ``x``'s dim 0,
    in order, covering it); ``.finish()`` on the result waits and gives the sum. Work issued
    between the two overlaps the last pieces' transfers."""
    out = torch.empty((*x.shape[:-1], weight_t.shape[1]), dtype=x.dtype, device=x.device)
    pending = PendingAllReduce(out, group)
    for piece in pieces:
        rows = slice(piece.start, piece.stop)
        torch.matmul(x[rows], weight_t, out=out[rows])
        pending.post(rows)
    return pending


def gemm_ar(x: torch.Tensor, weight: torch.Tensor, group: dist.ProcessGroup, pieces: Sequence[Piece]) -> torch.Tensor:
    """``all_reduce(x @ weight.T)`` (RowParallelLinear's layout, no sequence parallelism)."""
    return start_matmul_all_reduce(x, weight.t(), group, pieces).finish()


def gemm_ar_reference(x: torch.Tensor, weight: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """One GEMM, then the stock collective (what Megatron's RowParallelLinear does without SP)."""
    out = torch.matmul(x, weight.t()).contiguous()
    all_reduce_into(out, group)
    return out
