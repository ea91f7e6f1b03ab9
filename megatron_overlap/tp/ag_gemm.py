"""All-gather -> GEMM, overlapped as a ring of chunked P2P transfers.

    x_shard  [s, b, k]      this rank's rows of the sequence (s = S / R)
    weight   [n, k]         this rank's output columns (ColumnParallelLinear layout)
    out      [S, b, n]      = all_gather(x_shard, dim 0) @ weight^T

Each piece of the gathered input is multiplied as soon as it is local, while the pieces behind
it travel the ring. GEMMs on row pieces give the same bits as one GEMM on all rows wherever the
BLAS computes each output element the same way (seen on CPU fp32; the tests check it).
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

from ..comm.collectives import all_gather_into
from ..comm.rings import Piece, RingAllGather


def gather_matmul(
    x_shard: torch.Tensor,
    weight_t: torch.Tensor,
    group: dist.ProcessGroup,
    pieces: Sequence[Piece],
    gathered: Optional[torch.Tensor] = None,
    after_own: Optional[Callable[[], None]] = None,
) -> torch.Tensor:
    """``all_gather(x_shard) @ weight_t`` with the gather hidden behind the GEMM. When
    ``gathered [R*s, ...]`` is given it also receives the whole gathered input. ``after_own``
    runs once the local shard's GEMM is done, before the first remote piece is waited for
    (other work for the time the pieces travel: ``tp.wgrad_store``)."""
    size = dist.get_world_size(group)
    rows = x_shard.shape[0]
    out = torch.empty(
        (rows * size, *x_shard.shape[1:-1], weight_t.shape[1]), dtype=x_shard.dtype, device=x_shard.device
    )
    keep = gathered is not None
    if not keep:
        gathered = torch.empty((rows * size, *x_shard.shape[1:]), dtype=x_shard.dtype, device=x_shard.device)
    ring = RingAllGather(x_shard, gathered, group, pieces, copy_own=keep)
    own_rows, own = ring.own()
    torch.matmul(own, weight_t, out=out[own_rows])  # the local shard in one GEMM while pieces travel
    if after_own is not None:
        after_own()
    for step in range(1, size):
        for k in range(len(ring.pieces)):
            _owner, out_rows, piece = ring.take(step, k)
            torch.matmul(piece, weight_t, out=out[out_rows])
    ring.finish()
    return out


def ag_gemm(
    x_shard: torch.Tensor,
    weight: torch.Tensor,
    group: dist.ProcessGroup,
    pieces: Sequence[Piece],
    bias: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``all_gather(x_shard) @ weight.T (+ bias)`` (ColumnParallelLinear's layout)."""
    out = gather_matmul(x_shard, weight.t(), group, pieces)
    return out + bias if bias is not None else out


def ag_gemm_reference(
    x_shard: torch.Tensor,
    weight: torch.Tensor,
    group: dist.ProcessGroup,
    bias: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Stock collective, then one GEMM."""
    size = dist.get_world_size(group)
    gathered = torch.empty(
        (x_shard.shape[0] * size, *x_shard.shape[1:]), dtype=x_shard.dtype, device=x_shard.device
    )
    all_gather_into(gathered, x_shard.contiguous(), group)
    out = torch.matmul(gathered, weight.t())
    return out + bias if bias is not None else out
