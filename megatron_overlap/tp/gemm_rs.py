"""GEMM -> reduce-scatter, overlapped: partial sums are sent while the next ones are computed.

    x        [S, b, k]      full sequence, this rank's slice of the reduction dim (k = K / R)
    weight   [n, k]         RowParallelLinear layout
    out      [s, b, n]      = reduce_scatter(x @ weight^T, dim 0), s = S / R

This rank's partial for rank j's rows is ``x[j*s:(j+1)*s] @ weight^T``: row pieces of it are
computed in the order the reduce-scatter needs them (``ring``: running sums travel the ring;
``a2a``: partials go straight to their owner, which adds them). For R = 2 both give the same
bits as stock (a + b == b + a); for R > 2 the sum runs in ring order, which differs from the
collective's order in the last bits.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist

from ..comm.collectives import reduce_scatter_into
from ..comm.rings import Piece, make_reduce_scatter


def row_partial(x: torch.Tensor, weight_t: torch.Tensor, shard_rows: int):
    """Partial producer for the reduce-scatter engines: rows of ``x @ weight_t`` for one piece."""

    def partial(dest: int, piece: Piece, out: Optional[torch.Tensor]) -> torch.Tensor:
        rows = x[dest * shard_rows + piece.start : dest * shard_rows + piece.stop]
        if out is None:
            return torch.matmul(rows, weight_t)
        return torch.matmul(rows, weight_t, out=out)

    return partial


def start_matmul_reduce_scatter(
    x: torch.Tensor,
    weight_t: torch.Tensor,
    group: dist.ProcessGroup,
    pieces: Sequence[Piece],
    algo: str = "ring",
):
    """Run every step of ``reduce_scatter(x @ weight_t)`` but the last receives; ``.finish()``
    on the returned engine adds them and gives the shard. Work issued between the two
    overlaps the last hop."""
    size = dist.get_world_size(group)
    if x.shape[0] % size:
        raise ValueError(f"gemm_rs: {x.shape[0]} rows do not split over {size} ranks")
    shard_rows = x.shape[0] // size
    out = torch.empty((shard_rows, *x.shape[1:-1], weight_t.shape[1]), dtype=x.dtype, device=x.device)
    rs = make_reduce_scatter(algo, out, group, pieces, row_partial(x, weight_t, shard_rows))
    for step in range(size - 1):
        for k in range(len(rs.pieces)):
            rs.run(step, k)
    rs.run_own()  # own rows in one GEMM while the last partials travel
    return rs


def gemm_rs(
    x: torch.Tensor,
    weight: torch.Tensor,
    group: dist.ProcessGroup,
    pieces: Sequence[Piece],
    algo: str = "ring",
) -> torch.Tensor:
    """``reduce_scatter(x @ weight.T)`` along dim 0 (RowParallelLinear's layout)."""
    return start_matmul_reduce_scatter(x, weight.t(), group, pieces, algo).finish()


def gemm_rs_reference(x: torch.Tensor, weight: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """One GEMM, then the stock collective."""
    size = dist.get_world_size(group)
    full = torch.matmul(x, weight.t()).contiguous()
    out = torch.empty((full.shape[0] // size, *full.shape[1:]), dtype=full.dtype, device=full.device)
    reduce_scatter_into(out, full, group)
    return out
