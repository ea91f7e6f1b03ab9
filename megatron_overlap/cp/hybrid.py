"""Hybrid context parallelism: all-to-all inside groups of U consecutive CP ranks, ring across
the n/U groups.

n CP positions (the ordered rank list), U = ``--overlap-cp-a2a-size``, G = n / U groups::

    group g       positions gU .. gU+U-1              seq -> head all-to-all among them
    ring r        positions r, U+r, 2U+r, ...          one member per group, same head group

Group g gathers zigzag chunks gU..gU+U-1 and their mirrors; reordered, that is chunks g and
2G-1-g of a sequence cut in 2G chunks of U times the size: the zigzag layout again, one level
up, so the ring across groups balances causal work exactly as the plain ring does.
U = 1 is the plain ring, U = n is Ulysses.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist

from ..errors import OverlapConfigError
from .a2a import check_a2a_heads, headsplit_attention
from .packed import PackedSpec
from .ring import RingOptions


def check_hybrid_size(cp_size: int, a2a_size: Optional[int]):
    if a2a_size is None:
        raise OverlapConfigError(
            "cp.a2a_size",
            f"`cp.mode` hybrid needs `cp.a2a_size` U: all-to-all inside groups of U "
            f"consecutive context-parallel ranks, a ring across the groups (U divides {cp_size})",
        )
    if a2a_size < 1 or cp_size % a2a_size:
        raise OverlapConfigError(
            "cp.a2a_size",
            f"hybrid context parallelism needs an all-to-all group size U >= 1 dividing the "
            f"context-parallel size {cp_size}, got {a2a_size}",
        )


def hybrid_attention(q, k, v, *, causal: bool, scale: float, group, ranks: Sequence[int], a2a_size: int,
                     spec: Optional[PackedSpec] = None, opts: Optional[RingOptions] = None) -> torch.Tensor:
    """``q [rows, b, hq, d]``, ``k, v [rows, b, hk, d]`` of CP position ``ranks.index(me)`` ->
    ``[rows, b, hq, d]``."""
    n, U = len(ranks), a2a_size
    check_hybrid_size(n, U)
    check_a2a_heads(q.shape[2], k.shape[2], U, "cp.a2a_size",
                    "Pick an `cp.a2a_size` that divides both head counts, or use `cp.mode` ring.")
    ranks = list(ranks)
    x = ranks.index(dist.get_rank(group)) if dist.get_rank(group) in ranks else None
    if x is None:
        raise ValueError(f"group rank {dist.get_rank(group)} is not among the CP ranks {ranks}")
    g, inner = divmod(x, U)
    G = n // U
    return headsplit_attention(
        q, k, v, causal=causal, scale=scale, group=group,
        a2a_ranks=ranks[g * U:(g + 1) * U],
        ring_ranks=[ranks[gg * U + inner] for gg in range(G)],
        spec=spec,
        cp_positions=[[gg * U + i for i in range(U)] for gg in range(G)],
        opts=opts,
    )
