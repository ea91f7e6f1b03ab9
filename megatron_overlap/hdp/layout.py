"""Which token rows a rank holds in one micro-batch: a pure function of the plan.

Per document of a micro-batch (documents sorted by sequence id, so every peer of a ring builds
the same ``cu_seqlens``), ring position x holds chunks x and 2n-1-x of the document padded to a
multiple of 2n (n = ring size; n = 1: the document whole, unpadded), exactly ``Shard.ranges``
plus padding, which :func:`row_layout` checks against the plan. With tensor parallelism the
rows are padded further to a multiple of the TP size (a last document of padding only).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence, Tuple

import torch

from ..cp.packed import pad_cu_seqlens, partition_index
from .step_plan import Plan
from .shard import Shard


def doc_order(mb: Sequence[Shard]) -> Tuple[Shard, ...]:
    """The documents of a micro-batch in the order its rows hold them: by sequence id, so every
    peer of a ring builds the same ``cu_seqlens``."""
    return tuple(sorted(mb, key=lambda s: s.seq_id))


@dataclass(frozen=True)
class RowLayout:
    """Which rows rank ``rank`` holds in one micro-batch (pure function of the plan).

    ``ring``: ordered group ranks of the attention ring, ``(rank,)`` for documents held whole;
    ``position`` = index of ``rank`` in it. ``cu_seqlens`` / ``cu_seqlens_padded``: the
    documents' real and padded offsets as the whole ring holds them (padded to 2n; unpadded at
    n = 1). Per local row: ``doc`` (index into ``seq_ids``), ``pos`` (position in the document,
    padding included) and ``valid`` (a real token)."""

    index: int
    ring: Tuple[int, ...]
    position: int
    seq_ids: Tuple[int, ...]
    seq_lens: Tuple[int, ...]
    cu_seqlens: torch.Tensor
    cu_seqlens_padded: torch.Tensor
    doc: torch.Tensor
    pos: torch.Tensor
    valid: torch.Tensor

    @property
    def rows(self) -> int:
        return self.doc.numel()


def arange_ranges(ranges) -> torch.Tensor:
    """The positions of ``[start, stop)`` ranges, in order (empty: a shard of padding only, e.g. a
    3-token sequence on a static ring of 4)."""
    parts = [torch.arange(a, b) for a, b in ranges]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


def _extra_rows(rows: int, multiple: int, n: int) -> int:
    """Rows to add so ``rows`` becomes a multiple of ``multiple``; on a ring (n > 1) an even
    number, so the padding document splits into 2n equal chunks like any other."""
    extra = -rows % multiple
    if n > 1 and extra % 2:
        extra += multiple  # rows is even on a ring, so an odd extra means an odd multiple: one more makes it even
    return extra


def row_layout(mb: Sequence[Shard], index: int, rank: int, multiple: int = 1) -> RowLayout:
    """The rows of micro-batch ``index`` of ``rank``, checked against the plan's ``Shard`` s
    (rows = ``Shard.rows``, real positions = ``Shard.ranges``). ``multiple``: the rows are padded
    to a multiple of it (tensor parallelism with sequence parallelism splits them over the TP
    ranks) with a last document of no real tokens, which every peer of a ring holds alike."""
    ring = Plan.ring_of(mb)
    if ring and any(not s.ring for s in mb):
        raise ValueError(f"rank {rank} micro-batch {index}: sequences held whole and shards of ring {ring} in one "
                         f"micro-batch; a micro-batch runs one attention ring")
    docs = doc_order(mb)
    if ring:
        positions = {s.position for s in docs}
        if len(positions) != 1 or ring[positions.pop()] != rank:
            raise ValueError(f"rank {rank} micro-batch {index}: not one position on ring {ring}")
    n = len(ring) or 1
    position = docs[0].position if ring else 0
    lens = [s.seq_len for s in docs]
    cu = torch.tensor([0] + lens, dtype=torch.int64).cumsum(0).to(torch.int32)
    cu_pad = pad_cu_seqlens(cu, n)
    planned = sum(s.rows for s in docs)
    extra = _extra_rows(planned, multiple, n)
    if extra:
        lens = lens + [0]
        cu = torch.cat([cu, cu[-1:]])
        cu_pad = torch.cat([cu_pad, cu_pad[-1:] + n * extra])
    rows = partition_index(cu_pad, n, position)
    cup = cu_pad.long()
    doc = torch.searchsorted(cup, rows, right=True) - 1
    pos = rows - cup[doc]
    valid = pos < torch.tensor(lens, dtype=torch.long)[doc]
    if rows.numel() != planned + extra:
        raise RuntimeError(f"rank {rank} micro-batch {index}: {rows.numel()} rows laid out, the plan counts "
                           f"{planned} (+ {extra} padding)")
    for i, s in enumerate(docs):
        want = arange_ranges(s.ranges)
        got = pos[(doc == i) & valid]
        if not torch.equal(got, want):
            raise RuntimeError(f"rank {rank} micro-batch {index}: rows of sequence {s.seq_id} at positions "
                               f"{got.tolist()}, the plan's ranges are {list(s.ranges)}")
    return RowLayout(index, tuple(ring) if ring else (rank,), position,
                     tuple(s.seq_id for s in docs) + ((-1,) if extra else ()), tuple(lens), cu, cu_pad, doc, pos, valid)


def idle_layout(rank: int, multiple: int = 1) -> RowLayout:
    """``multiple`` masked tokens (one document) held alone by ``rank``: the micro-batch of a rank
    without work (Megatron's schedules run at least one forward)."""
    cu = torch.tensor([0, multiple], dtype=torch.int32)
    zero = torch.zeros(multiple, dtype=torch.long)
    return RowLayout(-1, (rank,), 0, (-1,), (multiple,), cu, cu.clone(), zero, torch.arange(multiple),
                     torch.ones(multiple, dtype=torch.bool))
