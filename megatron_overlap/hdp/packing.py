"""Packing sequences into micro-batches of at most C rows (the HDP scheduler's step 3)."""

from __future__ import annotations

from typing import List, Sequence


def pack_first_fit(ids: Sequence[int], lens: Sequence[int], capacity: int) -> List[List[int]]:
    """First-fit decreasing into micro-batches of at most ``capacity`` rows (ids given longest
    first; a micro-batch's order is its insertion order)."""
    bins: List[List[int]] = []
    room: List[int] = []
    for i in ids:
        for b, left in enumerate(room):
            if lens[i] <= left:
                bins[b].append(i)
                room[b] -= lens[i]
                break
        else:
            bins.append([i])
            room.append(capacity - lens[i])
    return bins


def pack_next_fit(ids: Sequence[int], lens: Sequence[int], capacity: int) -> List[List[int]]:
    """Next-fit: consecutive ids (sorted by length) share a micro-batch until it is full, so a
    micro-batch holds neighbouring lengths."""
    bins: List[List[int]] = []
    left = 0
    for i in ids:
        if not bins or lens[i] > left:
            bins.append([])
            left = capacity
        bins[-1].append(i)
        left -= lens[i]
    return bins


def split_to(bins: List[List[int]], count: int, lens: Sequence[int]) -> List[List[int]]:
    """``bins`` (of ids sorted longest first) split until there are ``count`` of them, or every
    bin holds one sequence: the bin with the most rows is cut in two at its middle row. Bins
    stay contiguous runs of the sorted ids, so their order is still longest first."""
    bins = [list(b) for b in bins]
    while len(bins) < count:
        splittable = [k for k, b in enumerate(bins) if len(b) > 1]
        if not splittable:
            break
        k = max(splittable, key=lambda k: (sum(lens[i] for i in bins[k]), -k))
        b = bins[k]
        half, acc, cut = sum(lens[i] for i in b) / 2, 0, 1
        for j in range(1, len(b)):
            acc += lens[b[j - 1]]
            if acc >= half:
                cut = j
                break
        bins[k:k + 1] = [b[:cut], b[cut:]]
    return bins
