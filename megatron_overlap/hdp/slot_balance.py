"""Mode ``pp``'s slot-balanced plans: every micro-batch slot's cells (one per DP rank) as equal
in time as the lengths allow, since a 1F1B pipeline pays each slot's largest cell
(``pp_timeline``).

One plan (``slot_balanced``), for a given count of short slots S and ring width:

    1. Rings: each sequence longer than C on a ring of its fewest ranks, ``ranks_needed(L, C)``
       (``wide``: on all D ranks, as static CP runs it), costliest first; a ring joins an
       earlier ring's slot where enough of that slot's ranks are free (its cells cost no more
       than that slot's first ring: they run beside it), else it opens a slot of its own.
    2. The free cells of ring slots take short sequences (costliest first, best fit) up to the
       slot's ring time and C rows: they run while the ring does, for nothing.
    3. The other short sequences, costliest first, onto S x D cells by LPT (each to the least
       loaded cell with room for its rows; a slot more when none has room): every cell about
       the same time, so each short slot's largest cell is about its mean.
    4. Slots ordered by their largest cell, largest first (``order="desc"``), or with the
       smallest slot first and the rest largest first (``order="small-first"``: a smaller
       warm-up bubble).

``candidates`` yields the plans mode ``pp`` scores by ``pp_timeline.pipeline_step_ms`` (the
scheduler keeps the best, static CP's own plan and the list-scheduled plan among them).
"""

from __future__ import annotations

import bisect
import heapq
from typing import Iterator, List, Sequence, Tuple

from .cost import HdpCostModel
from .shard import Shard, ranks_needed
from .step_plan import Plan

ORDERS = ("desc", "small-first")
EXTRA_SLOTS = 6  # short-slot counts tried above the fewest that hold the rows


def _cell_ms(shards: Sequence[Shard], cost: HdpCostModel) -> float:
    if not shards:
        return 0.0
    ring = next((s.ring for s in shards if s.ring), ())
    rows = sum(s.rows for s in shards if s.ring)
    pairs = sum(s.causal_pairs for s in shards if s.ring)
    t = sum(cost.compute_ms(s.rows, s.causal_pairs) for s in shards) + cost.microbatch_overhead_ms
    return t + (cost.exposed_ring_ms(rows, pairs, ring) if ring else 0.0)


def slot_balanced(lens: Sequence[int], R: int, C: int, cost: HdpCostModel, short_slots: int, wide: bool = False,
                  order: str = "desc", local_ms: Sequence[float] = None) -> Plan:
    """One slot-balanced plan (module docstring). ``local_ms``: per sequence, its cost held
    whole (``cost.sequence_ms(L)``; computed when not given)."""
    if order not in ORDERS:
        raise ValueError(f"unknown slot order {order!r}: choose one of {', '.join(ORDERS)}")
    return _ordered(lens, R, C, _cells(lens, R, C, cost, short_slots, wide, local_ms), wide, order)


def _cells(lens, R: int, C: int, cost: HdpCostModel, short_slots: int, wide: bool, local_ms=None):
    """Steps 1-3: (cells[slot][rank] shards, time[slot][rank] ms, ring slots)."""
    ms = list(local_ms) if local_ms is not None else [cost.sequence_ms(L) for L in lens]
    by_cost = sorted(range(len(lens)), key=lambda i: (-ms[i], -lens[i], i))
    cells, rows, busy, ring_time = _ring_slots([i for i in by_cost if lens[i] > C], lens, R, C, cost, wide)
    time = [[_cell_ms(c, cost) for c in slot] for slot in cells]
    rest = _beside_rings([i for i in by_cost if lens[i] <= C], lens, C, ms, cells, rows, time, busy, ring_time)
    first = len(cells)
    _lpt_cells(rest, lens, R, C, ms, cells, rows, time, short_slots)
    return cells, time, first


def _ring_slots(long_ids, lens, R: int, C: int, cost: HdpCostModel, wide: bool):
    """Step 1: (cells, rows, busy, ring time) per ring slot, ``busy[slot][rank]``: on a ring."""
    cells: List[List[List[Shard]]] = []
    rows: List[List[int]] = []
    busy: List[List[bool]] = []
    ring_time: List[float] = []
    for i in long_ids:
        n = min(R, R if wide else max(2, ranks_needed(lens[i], C)))
        w = _cell_ms([Shard(i, lens[i], tuple(range(n)), 0)], cost)
        for k in range(len(cells)):
            free = [r for r in range(R) if not busy[k][r]]
            if len(free) >= n and w <= ring_time[k]:
                break
        else:
            k = len(cells)
            cells.append([[] for _ in range(R)])
            rows.append([0] * R)
            busy.append([False] * R)
            ring_time.append(w)
            free = list(range(R))
        ring = tuple(free[:n])
        for x, r in enumerate(ring):
            shard = Shard(i, lens[i], ring, x)
            cells[k][r].append(shard)
            rows[k][r] += shard.rows
            busy[k][r] = True
    return cells, rows, busy, ring_time


def _beside_rings(short_ids, lens, C: int, ms, cells, rows, time, busy, ring_time) -> List[int]:
    """Step 2: short sequences (costliest first) into the ring slots' free cells, best fit up to
    the ring's time and C rows; returns those left, in order."""
    R = len(busy[0]) if busy else 0
    gaps = sorted((ring_time[k] - time[k][r], k, r) for k in range(len(cells)) for r in range(R) if not busy[k][r])
    rest = []
    for i in short_ids:
        for j, (room, k, r) in enumerate(gaps):
            if room >= ms[i] and rows[k][r] + lens[i] <= C:
                cells[k][r].append(Shard(i, lens[i]))
                rows[k][r] += lens[i]
                time[k][r] += ms[i]
                gaps.pop(j)
                if room - ms[i] > 0:
                    bisect.insort(gaps, (room - ms[i], k, r))
                break
        else:
            rest.append(i)
    return rest


def _lpt_cells(ids, lens, R: int, C: int, ms, cells, rows, time, short_slots: int) -> None:
    """Step 3: each sequence (costliest first) to the least loaded short cell with room for its
    rows, a slot more when none has room."""
    heap: List[Tuple[float, int, int]] = []

    def open_slot():
        k = len(cells)
        cells.append([[] for _ in range(R)])
        rows.append([0] * R)
        time.append([0.0] * R)
        for r in range(R):
            heapq.heappush(heap, (0.0, k, r))

    for _ in range(max(0, short_slots)):
        open_slot()
    for i in ids:
        held = []
        while heap:
            t, k, r = heapq.heappop(heap)
            if rows[k][r] + lens[i] <= C:
                break
            held.append((t, k, r))
        else:
            open_slot()
            t, k, r = heapq.heappop(heap)
        for item in held:
            heapq.heappush(heap, item)
        cells[k][r].append(Shard(i, lens[i]))
        rows[k][r] += lens[i]
        time[k][r] += ms[i]
        heapq.heappush(heap, (time[k][r], k, r))


def _ordered(lens, R: int, C: int, built, wide: bool, order: str) -> Plan:
    """Step 4: the slots in ``order`` (empty short slots dropped), as a plan."""
    cells, time, first = built
    keep = [k for k in range(len(cells)) if k < first or any(cells[k])]
    top = {k: max(time[k]) for k in keep}
    slots = sorted(keep, key=lambda k: (-top[k], k))
    if order == "small-first" and len(slots) > 1:
        slots = [slots[-1]] + slots[:-1]
    micro = tuple(tuple(tuple(cells[k][r]) for k in slots) for r in range(R))
    return Plan(scheduler="hdp", ranks=R, capacity_tokens=C, seq_lens=tuple(lens), microbatches=micro, mode="pp",
                notes=(f"slot-balanced: {first} ring slot(s) ({'on all ranks' if wide else 'fewest ranks'}), "
                       f"{len(slots) - first} short slot(s), order {order}",))


def fewest_short_slots(lens: Sequence[int], R: int, C: int) -> int:
    """A lower bound on the short slots: the short sequences' tokens over R cells of C rows."""
    short = sum(L for L in lens if L <= C)
    return max(1, -(-short // (R * C)))


def candidates(lens: Sequence[int], R: int, C: int, cost: HdpCostModel, local_ms: Sequence[float] = None
               ) -> Iterator[Plan]:
    """The slot-balanced plans mode ``pp`` scores: both ring widths, short-slot counts from the
    fewest to EXTRA_SLOTS more, both orders."""
    ms = list(local_ms) if local_ms is not None else [cost.sequence_ms(L) for L in lens]
    low = fewest_short_slots(lens, R, C)
    for wide in ((False, True) if any(L > C for L in lens) else (False,)):
        short = sum(1 for L in lens if L <= C)
        for S in range(low, low + EXTRA_SLOTS + 1):
            if S > low and (S - 1) * R >= short:  # every short sequence had a cell of its own already
                break
            built = _cells(lens, R, C, cost, S, wide, ms)
            for order in ORDERS:
                yield _ordered(lens, R, C, built, wide, order)
