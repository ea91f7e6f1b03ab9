"""Which rows of a sequence a rank holds: whole (local) or a zigzag shard over an ordered ring.

A sequence of L tokens over n ranks (n >= 2) is padded to ``P = 2 n c`` rows, ``c = ceil(L / 2n)``
(real tokens first, padding after, as ``cp.packed.pad_cu_seqlens`` and Transformer Engine's THD
layout pad every document to a multiple of 2n), and cut in 2n chunks of c rows. Ring position x
holds chunks x and 2n-1-x (``get_batch_on_this_cp_rank``'s zigzag)::

    position x rows   [x c, (x+1) c)  and  [(2n-1-x) c, (2n-x) c),   each clipped to [0, L)
    rows held         2c  (padding included; what the capacity C must hold)
    causal pairs      ~ L^2 / 2n on every position (zigzag balance)

Fewest ranks: 2c <= C  <=>  ceil(L / 2n) <= floor(C / 2)  <=>  n >= L / (2 floor(C / 2)), so

    n(L, C) = 1                          L <= C   (held whole, no padding, no ring)
    n(L, C) = ceil(L / C_even)           L >  C,  C_even = 2 floor(C / 2)

For an even C that is ceil(L / C). For an odd C the zigzag rounding can leave ceil(L / C) ranks
with 2c = C + 1 rows; then n is one more (``ceil(L / (C-1))``, which exceeds ceil(L / C) by one
at most while L < C (C - 1)).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple


def ranks_needed(seq_len: int, capacity_tokens: int) -> int:
    """Fewest ranks holding a ``seq_len`` sequence with at most ``capacity_tokens`` rows each
    (module docstring)."""
    if seq_len <= capacity_tokens:
        return 1
    even = 2 * (capacity_tokens // 2)
    if even == 0:
        raise ValueError(f"a zigzag shard holds 2 rows at least: capacity {capacity_tokens} cannot shard a "
                         f"{seq_len}-token sequence")
    return -(-seq_len // even)


def chunk_tokens(seq_len: int, cp_size: int) -> int:
    """c = ceil(L / 2n): rows of one zigzag chunk."""
    return -(-seq_len // (2 * cp_size))


def zigzag_ranges(seq_len: int, cp_size: int, position: int) -> Tuple[Tuple[int, int], ...]:
    """Token ranges ``[start, stop)`` of the real tokens ring ``position`` holds (empty ranges,
    i.e. pure padding, dropped). ``cp_size == 1``: the whole sequence."""
    if cp_size == 1:
        return ((0, seq_len),)
    c = chunk_tokens(seq_len, cp_size)
    out = []
    for chunk in (position, 2 * cp_size - 1 - position):
        start, stop = chunk * c, min((chunk + 1) * c, seq_len)
        if stop > start:
            out.append((start, stop))
    return tuple(out)


def rows_held(seq_len: int, cp_size: int) -> int:
    """Rows a rank holds, padding included: L whole, 2 ceil(L / 2n) as a shard."""
    return seq_len if cp_size == 1 else 2 * chunk_tokens(seq_len, cp_size)


@dataclass(frozen=True)
class Shard:
    """Rows of sequence ``seq_id`` (``seq_len`` tokens) one rank holds in one micro-batch.

    ``ring``: the ordered peers (group ranks) that run the sequence's ring attention, this rank at
    ``ring[position]``; empty for a sequence held whole (no CP peer, no communication).
    """

    seq_id: int
    seq_len: int
    ring: Tuple[int, ...] = ()
    position: int = 0

    @property
    def cp_size(self) -> int:
        return max(1, len(self.ring))

    @property
    def ranges(self) -> Tuple[Tuple[int, int], ...]:
        return zigzag_ranges(self.seq_len, self.cp_size, self.position)

    @property
    def tokens(self) -> int:
        """Real tokens held (padding excluded): the lengths of ``ranges``, without building them."""
        L = self.seq_len
        if len(self.ring) < 2:
            return L
        n = len(self.ring)
        c = chunk_tokens(L, n)
        total = 0
        for chunk in (self.position, 2 * n - 1 - self.position):
            total += max(0, min((chunk + 1) * c, L) - chunk * c)
        return total

    @property
    def rows(self) -> int:
        """Rows held, padding included."""
        return rows_held(self.seq_len, self.cp_size)

    @property
    def causal_pairs(self) -> float:
        """(query, key) pairs this rank's attention computes: L (L+1) / 2 over n positions."""
        return self.seq_len * (self.seq_len + 1) / 2 / self.cp_size

