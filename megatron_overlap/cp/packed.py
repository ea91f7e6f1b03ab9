"""Packed variable-length batches (THD, ``cu_seqlens``) under context parallelism.

Megatron's ``get_thd_batch_on_this_cp_rank`` slices a packed batch with Transformer Engine's
``thd_get_partitioned_indices``; this is the same partitioning in plain PyTorch. Documents lie
back to back, document ``i`` in rows ``[cu_padded[i], cu_padded[i+1])`` of the padded batch, its
real tokens first (``cu[i+1] - cu[i]`` of them) and padding after, each padded length a multiple
of ``2n``. Every document is cut in 2n chunks and CP rank r holds chunks r and 2n-1-r of every
document, document after document::

    local rows of rank r = [doc0 chunk r, doc0 chunk 2n-1-r, doc1 chunk r, doc1 chunk 2n-1-r, ...]

A "ring" of one rank (n = 1: ``--overlap-hdp``'s micro-batches of short sequences held whole) cuts
nothing: the multiple is 1, the rank holds every document whole and needs no padding (as
Megatron's ``get_thd_batch_on_this_cp_rank`` leaves a batch alone at CP = 1).

Attention is per document: a query token sees the keys of its own document (up to itself when
causal); padding tokens are never seen and see nothing (their output and gradients are 0).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..errors import OverlapConfigError
from .block import MASK, BlockPlan
from .layout import RingLayout, split_rows

_FAR = 1 << 62  # "no key here" for per-document minima


def _lengths(cu: torch.Tensor) -> torch.Tensor:
    return cu[1:] - cu[:-1]


def pad_multiple(cp_size: int) -> int:
    """Padded document lengths are multiples of this: ``2 * cp_size`` (two chunks per rank), 1 at
    ``cp_size == 1`` (documents held whole, nothing cut)."""
    return 2 * cp_size if cp_size > 1 else 1


def pad_cu_seqlens(cu_seqlens: torch.Tensor, cp_size: int) -> torch.Tensor:
    """Offsets of the padded batch: every document rounded up to a multiple of ``pad_multiple``
    (``2 * cp_size``; unchanged at ``cp_size == 1``)."""
    cu = cu_seqlens.long().cpu()
    m = pad_multiple(cp_size)
    padded = (_lengths(cu) + m - 1) // m * m
    return torch.cat([cu.new_zeros(1), padded.cumsum(0)]).to(cu_seqlens.dtype)


def partition_index(cu_seqlens_padded: torch.Tensor, cp_size: int, cp_rank: int) -> torch.Tensor:
    """Rows of the padded batch that CP rank ``cp_rank`` holds (TE's
    ``thd_get_partitioned_indices``): per document, chunks ``cp_rank`` and ``2n-1-cp_rank``; every
    row at ``cp_size == 1``."""
    cu = cu_seqlens_padded.long().cpu()
    if cp_size == 1:
        return torch.arange(int(cu[-1]))
    parts = []
    for start, length in zip(cu[:-1].tolist(), _lengths(cu).tolist()):
        if length % (2 * cp_size):
            raise ValueError(f"padded document length {length} is not a multiple of 2 x CP = {2 * cp_size}")
        c = length // (2 * cp_size)
        for chunk in (cp_rank, 2 * cp_size - 1 - cp_rank):
            parts.append(torch.arange(start + chunk * c, start + (chunk + 1) * c))
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


def real_index(cu_seqlens: torch.Tensor, cu_seqlens_padded: torch.Tensor) -> torch.Tensor:
    """Rows of the padded batch that hold real tokens, in order (one per real token)."""
    cu, cup = cu_seqlens.long().cpu(), cu_seqlens_padded.long().cpu()
    parts = [torch.arange(p, p + n) for p, n in zip(cup[:-1].tolist(), _lengths(cu).tolist())]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


def pad_packed(x: torch.Tensor, cu_seqlens: torch.Tensor, cu_seqlens_padded: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
    """``x [T, ...]`` (documents back to back) -> ``[T_padded, ...]`` with ``fill`` in the padding."""
    total = int(cu_seqlens_padded[-1])
    out = x.new_full((total, *x.shape[1:]), fill)
    return out.index_copy(0, real_index(cu_seqlens, cu_seqlens_padded).to(x.device), x)


def thd_batch_on_this_cp_rank(batch: dict, cu_seqlens_padded: torch.Tensor, cp_size: int, cp_rank: int,
                              seq_dim: int = 1) -> dict:
    """Megatron's ``get_thd_batch_on_this_cp_rank`` slicing without Transformer Engine: every
    tensor in ``batch`` (padded layout along ``seq_dim``) cut to this rank's rows; the keys
    Megatron leaves alone (masks, cu_seqlens, max_seqlen) stay as they are."""
    skip = {"attention_mask", "cu_seqlens", "cu_seqlens_padded", "max_seqlen"}
    out = dict(batch)
    for key, value in batch.items():
        if value is not None and key not in skip:
            out[key] = value.index_select(seq_dim, partition_index(cu_seqlens_padded, cp_size, cp_rank).to(value.device))
    return out


@dataclass(frozen=True)
class TokenInfo:
    """Per local row: document, position inside the document, real token (not padding)."""

    doc: torch.Tensor
    pos: torch.Tensor
    valid: torch.Tensor

    @staticmethod
    def cat(infos) -> "TokenInfo":
        return TokenInfo(*(torch.cat([getattr(t, f) for t in infos]) for f in ("doc", "pos", "valid")))

    def rows(self, start: int, stop: int) -> "TokenInfo":
        return TokenInfo(self.doc[start:stop], self.pos[start:stop], self.valid[start:stop])

    def to(self, device) -> "TokenInfo":
        return TokenInfo(self.doc.to(device), self.pos.to(device), self.valid.to(device))


class PackedSpec:
    """The documents of one packed batch split over ``cp_size`` ranks (module docstring)."""

    def __init__(self, cu_seqlens: torch.Tensor, cu_seqlens_padded: Optional[torch.Tensor], cp_size: int):
        cu = cu_seqlens.long().cpu()
        cup = cu if cu_seqlens_padded is None else cu_seqlens_padded.long().cpu()
        if cu.dim() != 1 or cu.shape != cup.shape or cu.numel() < 2 or int(cu[0]) != 0 or int(cup[0]) != 0:
            raise ValueError(f"cu_seqlens {cu.tolist()} / cu_seqlens_padded {cup.tolist()}: "
                             "1-D offsets from 0, one per document boundary, expected")
        lengths, padded = _lengths(cu), _lengths(cup)
        if (lengths < 0).any() or (padded < lengths).any():
            raise ValueError(f"padded document lengths {padded.tolist()} shorter than the real ones {lengths.tolist()}")
        m = pad_multiple(cp_size)
        if (padded % m).any():
            raise OverlapConfigError(
                "cp.mode",
                f"packed documents of padded lengths {padded.tolist()} are not multiples of 2 x CP = {m}: "
                "every document must be padded to a multiple of 2 x context-parallel size "
                "(cu_seqlens_q_padded; megatron_overlap.cp.packed.pad_cu_seqlens computes it)",
            )
        self.cu, self.cu_padded, self.cp_size = cu, cup, cp_size
        self.total = int(cup[-1])
        self.local_rows = self.total // cp_size

    def info(self, cp_rank: int) -> TokenInfo:
        rows = partition_index(self.cu_padded, self.cp_size, cp_rank)
        doc = torch.searchsorted(self.cu_padded, rows, right=True) - 1
        pos = rows - self.cu_padded[doc]
        return TokenInfo(doc, pos, pos < _lengths(self.cu)[doc])


def _doc_extremes(info: TokenInfo, docs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per document: last valid position among these rows (-1: none), first one (_FAR: none)."""
    doc, pos = info.doc[info.valid], info.pos[info.valid]
    last = torch.full((docs,), -1, dtype=torch.long).scatter_reduce(0, doc, pos, "amax")
    first = torch.full((docs,), _FAR, dtype=torch.long).scatter_reduce(0, doc, pos, "amin")
    return last, first


class PackedLayout(RingLayout):
    """Per-document masks for a ring whose position x holds the rows described by ``infos[x]``
    (all of equal length). Blocks are cut to the rows and columns that see anything and carry an
    explicit mask; blocks that see nothing are skipped, and pieces nobody sees never travel."""

    def __init__(self, infos: list, causal: bool, docs: int, device, pieces: int = 2):
        rows = {len(info.doc) for info in infos}
        if len(rows) != 1:
            raise ValueError(f"every ring position must hold the same number of rows, got {sorted(rows)}")
        self.size, self.rows, self.causal = len(infos), rows.pop(), causal
        self.pieces = tuple(split_rows(0, self.rows, pieces))
        self._infos = [info.to(device) for info in infos]
        self._q = [_doc_extremes(info, docs)[0] for info in infos]
        self._k = [[_doc_extremes(info.rows(a, b), docs)[1] for a, b in self.pieces] for info in infos]
        self._needs: dict = {}

    def _sees(self, q_last: torch.Tensor, k_first: torch.Tensor) -> bool:
        if self.causal:
            return bool((q_last >= k_first).any())
        return bool(((q_last >= 0) & (k_first < _FAR)).any())

    def needs(self, x: int, j: int, i: int) -> bool:
        key = (x, j, i)
        if key not in self._needs:
            self._needs[key] = self._sees(self._q[x], self._k[j][i])
        return self._needs[key]

    def _block(self, q: TokenInfo, k: TokenInfo) -> Optional[BlockPlan]:
        mask = (q.doc[:, None] == k.doc[None, :]) & q.valid[:, None] & k.valid[None, :]
        if self.causal:
            mask &= k.pos[None, :] <= q.pos[:, None]
        rows, cols = mask.any(1), mask.any(0)
        if not bool(rows.any()):
            return None
        rows_idx = slice(None) if bool(rows.all()) else rows.nonzero().squeeze(1)
        cols_idx = slice(None) if bool(cols.all()) else cols.nonzero().squeeze(1)
        if not isinstance(rows_idx, slice):
            mask = mask.index_select(0, rows_idx)
        if not isinstance(cols_idx, slice):
            mask = mask.index_select(1, cols_idx)
        return BlockPlan(rows_idx, cols_idx, MASK, mask)

    def own(self, x: int) -> Optional[BlockPlan]:
        return self._block(self._infos[x], self._infos[x])

    def plan(self, x: int, j: int, i: int) -> Optional[BlockPlan]:
        if not self.needs(x, j, i):
            return None
        return self._block(self._infos[x], self._infos[j].rows(*self.pieces[i]))
