"""Which attention blocks a context-parallel ring computes, for Megatron's load-balanced layout.

A sequence of S rows is cut into 2n chunks of ``c = S / 2n`` rows; ring position x holds chunks
x and 2n-1-x, back to back: its local block has ``2c`` rows (exactly the rows
``megatron.core.utils.get_batch_on_this_cp_rank`` gives CP rank x). Causal attention of the
local queries against the keys of position j (chunk index = position in the sequence)::

    j == x   own block: causal over the 2c local rows (positions x < 2n-1-x keep their order)
    j <  x   every local query row sees the first half of j's keys (chunk j), none of the second
    j >  x   only the second half of the queries (chunk 2n-1-x) sees j's keys, all of them

so every position computes one own block and n-1 blocks of ``2c x c`` score elements: the same
work on every rank. Key blocks travel in *pieces* (row ranges of the local block, within one
half); a piece nobody needs, e.g. the second half of position 0's keys, never travels.
"""

from __future__ import annotations

import abc
from typing import Iterable, Optional

import torch

from .block import CAUSAL, FULL, BlockPlan


class RingLayout(abc.ABC):
    """What ring position x computes against the key block of position j, piece by piece.

    ``size`` positions, each with a local block of ``rows`` query and key rows; ``pieces`` are
    the ``(start, stop)`` row ranges in which a key block travels. Subclasses give ``own(x)``
    (the block of x's keys, computed first, without waiting) and ``plan(x, j, i)`` (x's queries
    against piece i of j's keys, ``cols`` relative to the piece; None when nothing is visible).
    """

    size: int
    rows: int
    pieces: tuple

    @abc.abstractmethod
    def own(self, x: int) -> Optional[BlockPlan]:
        """The block of x's own keys."""

    @abc.abstractmethod
    def plan(self, x: int, j: int, i: int) -> Optional[BlockPlan]:
        """x's queries against piece i of j's keys; None when nothing is visible."""

    def needs(self, x: int, j: int, i: int) -> bool:
        return self.plan(x, j, i) is not None

    def travels(self, j: int, i: int) -> bool:
        """Piece i of position j's keys goes round the ring (some other position needs it).
        Every position evaluates this identically, so sender and receiver agree."""
        return any(self.needs(x, j, i) for x in range(self.size) if x != j)

    def active(self, j: int, i: int, contributors: Iterable[int]) -> bool:
        """The running dK/dV sum of piece i of j's keys is non-zero once ``contributors`` added
        theirs (and only then does it travel)."""
        return any(self.needs(x, j, i) for x in contributors)


def split_rows(start: int, stop: int, parts: int) -> list[tuple[int, int]]:
    """``[start, stop)`` in ``parts`` near-equal contiguous ranges, empty ones dropped."""
    n = stop - start
    bounds = [start + (n * p) // parts for p in range(parts + 1)]
    return [(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]


class ZigzagLayout(RingLayout):
    """Unpacked sequences in Megatron's zigzag layout (module docstring). ``pieces_per_half``
    splits each half of a key block into that many travelling pieces."""

    def __init__(self, size: int, rows: int, causal: bool, pieces_per_half: int = 1):
        self.size, self.rows, self.causal = size, rows, causal
        if size == 1:  # the whole sequence on one rank, in order: one block, nothing travels
            self.half, self.pieces = rows, ((0, rows),)
            return
        if rows % 2:
            raise ValueError(f"a zigzag block holds two equal chunks, got {rows} rows")
        self.half = rows // 2
        self.pieces = tuple(split_rows(0, self.half, pieces_per_half) + split_rows(self.half, rows, pieces_per_half))

    def own(self, x: int) -> BlockPlan:
        return BlockPlan(slice(None), slice(None), CAUSAL if self.causal else FULL)

    def plan(self, x: int, j: int, i: int) -> Optional[BlockPlan]:
        if not self.causal:
            return BlockPlan(slice(None), slice(None), FULL)
        first_half = self.pieces[i][1] <= self.half
        if j < x:
            return BlockPlan(slice(None), slice(None), FULL) if first_half else None
        return BlockPlan(slice(self.half, self.rows), slice(None), FULL)


def zigzag_index(seq_len: int, cp_size: int, cp_rank: int, device=None) -> torch.Tensor:
    """Rows of a length-``seq_len`` sequence that CP rank ``cp_rank`` holds: chunks ``cp_rank``
    and ``2*cp_size-1-cp_rank`` of ``2*cp_size`` (``get_batch_on_this_cp_rank``'s slicing)."""
    if seq_len % (2 * cp_size):
        raise ValueError(f"sequence length {seq_len} is not a multiple of 2 x CP = {2 * cp_size}")
    c = seq_len // (2 * cp_size)
    first, second = cp_rank * c, (2 * cp_size - 1 - cp_rank) * c
    return torch.cat([torch.arange(first, first + c, device=device), torch.arange(second, second + c, device=device)])


def zigzag_slice(x: torch.Tensor, cp_size: int, cp_rank: int, dim: int = 0) -> torch.Tensor:
    """This CP rank's zigzag rows of ``x`` along ``dim``."""
    return x.index_select(dim, zigzag_index(x.shape[dim], cp_size, cp_rank, x.device))


def group_to_natural(members: int, rows: int, device=None) -> torch.Tensor:
    """Row order that turns ``members`` zigzag blocks gathered back to back (positions
    ``m0, m0+1, ...``, each ``[chunk m; chunk 2n-1-m]`` of ``rows // 2``) into one zigzag block
    of ``members`` times coarser chunks: first halves in order, then second halves reversed.
    (For a group of all n positions that is the natural order of the whole sequence.)"""
    c = rows // 2
    idx = torch.arange(members * rows, device=device).view(members, 2, c)
    return torch.cat([idx[:, 0].reshape(-1), idx[:, 1].flip(0).reshape(-1)])
