"""A step's timeline from a plan and the cost model: when each rank ends.

Every rank runs its micro-batches in order. A local micro-batch starts when the rank is free. A
ring starts when all its peers have reached it and ends, for all of them, when the slowest peer's
share is done (``start + max over peers of item_ms``: ring steps exchange blocks, so no peer runs
ahead). Between phases all ranks wait for the last one (a barrier). The step ends with the last
rank::

    step_ms = max_r end_r          idle_r = end_r - work_r  (waiting for ring peers or barriers)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

from .cost import HdpCostModel
from .step_plan import Plan


@dataclass(frozen=True)
class StepTime:
    step_ms: float
    end_ms: List[float]
    work_ms: List[float]

    @property
    def idle_ms(self) -> List[float]:
        return [e - w for e, w in zip(self.end_ms, self.work_ms)]


def simulate(plan: Plan, cost: HdpCostModel) -> StepTime:
    try:  # a plan is immutable, so is a cost model: each plan simulated once per model
        hash(cost)
    except TypeError:
        return _simulate(plan, cost)
    memo = plan.__dict__.setdefault("_simulated", {})  # left out of pickles: Plan.__getstate__
    if cost not in memo:
        memo[cost] = _simulate(plan, cost)
    return memo[cost]


def _simulate(plan: Plan, cost) -> StepTime:
    R = plan.ranks
    rings, dur, keys = _items(plan, cost)
    now = [0.0] * R
    ptr = [0] * R
    phase_list = sorted({p for ph in plan.phases for p in ph})
    for phase in phase_list:
        start = max(now)
        now = [start] * R if len(phase_list) > 1 else now
        waiting = {}  # ring key -> set of ranks arrived
        remaining = sum(1 for r in range(R) for p in plan.phases[r][ptr[r]:] if p == phase)
        while remaining:
            progressed = False
            for r in range(R):
                while ptr[r] < len(dur[r]) and plan.phases[r][ptr[r]] == phase:
                    k = ptr[r]
                    if keys[r][k] is None:
                        now[r] += dur[r][k]
                        ptr[r] += 1
                        remaining -= 1
                        progressed = True
                        continue
                    arrived = waiting.setdefault(keys[r][k], set())
                    arrived.add(r)
                    peers = rings[r][k]
                    if len(arrived) < len(peers):
                        break
                    begin = max(now[p] for p in peers)
                    end = begin + max(dur[p][ptr[p]] for p in peers)
                    for p in peers:
                        now[p] = end
                        ptr[p] += 1
                    remaining -= len(peers)
                    del waiting[keys[r][k]]
                    progressed = True
            if not progressed:
                raise ValueError(f"plan deadlocks in phase {phase}: rings waiting {sorted(waiting)}")
    work = [sum(d) for d in dur]
    return StepTime(step_ms=max(now) if now else 0.0, end_ms=now, work_ms=work)


def _items(plan: Plan, cost):
    """Per rank and micro-batch: its ring (``Plan.ring_of``), busy time (``Plan.item_ms``) and
    ring key (``Plan.ring_key``, None for a local one), the same numbers: each shard's compute
    taken once per (length, ring size) and each ring's exposed traffic once per ring, not once
    per peer, then added in ``item_ms``' order."""
    compute: dict = {}  # (L, n) -> compute_ms of one shard
    exposed: dict = {}  # (rows, pairs, ring) -> exposed_ring_ms
    single: dict = {}  # (L, ring) -> item_ms of a micro-batch of that one shard
    overhead = cost.microbatch_overhead_ms
    rings, dur, keys = [], [], []
    for mbs in plan.microbatches:
        rs, ds, ks = [], [], []
        for mb in mbs:
            if not mb:
                rs.append(())
                ds.append(0)  # item_ms of an empty micro-batch: sum(()) = 0
                ks.append(None)
                continue
            if len(mb) == 1:  # the usual micro-batch: one shard, its time once per (length, ring)
                s = mb[0]
                key = (s.seq_len, s.ring)
                d = single.get(key)
                if d is None:  # item_ms: (0 + compute) + overhead (+ exposed), rows and pairs its own
                    d = cost.compute_ms(s.rows, s.causal_pairs) + overhead
                    d = single[key] = d + cost.exposed_ring_ms(s.rows, s.causal_pairs, s.ring) if s.ring else d
                rs.append(s.ring)
                ds.append(d)
                ks.append((s.seq_id,) if s.ring else None)
                continue
            total, on_ring = 0, []
            for s in mb:
                key = (s.seq_len, len(s.ring))
                c = compute.get(key)
                if c is None:
                    c = compute[key] = cost.compute_ms(s.rows, s.causal_pairs)
                total += c
                if s.ring:
                    on_ring.append(s)
            total += overhead
            ring = () if not on_ring else on_ring[0].ring
            if any(x.ring != ring for x in on_ring):
                ring = Plan.ring_of(mb)  # raises: several rings in one micro-batch
            if ring:
                rows, pairs = sum(s.rows for s in on_ring), sum(s.causal_pairs for s in on_ring)
                key = (rows, pairs, ring)
                e = exposed.get(key)
                if e is None:
                    e = exposed[key] = cost.exposed_ring_ms(rows, pairs, ring)
                total += e
                ks.append(tuple(sorted(s.seq_id for s in on_ring)))
            else:
                ks.append(None)
            rs.append(ring)
            ds.append(total)
        rings.append(rs)
        dur.append(ds)
        keys.append(ks)
    return rings, dur, keys


def sequence_options(seq_len: int, low: int, high: int, cost) -> Tuple[float, float]:
    """(the shortest per-peer time, the least total busy time) of one sequence over the ring
    sizes ``low``..``high`` (1: held whole), each ring within one node when it fits (the cheaper
    link)."""
    best, area = float("inf"), float("inf")
    if high - low > 16 and hasattr(cost, "peer_ms_many"):  # the same numbers, numpy for the long scan
        import numpy as np

        if low == 1:
            best = area = cost.sequence_ms(seq_len, 1)
        ns = np.arange(max(low, 2), high + 1)
        w = cost.peer_ms_many(seq_len, ns, ns <= cost.gpus_per_node)
        return min(best, float(w.min())), min(area, float((ns * w).min()))
    for n in range(low, high + 1):
        w = cost.sequence_ms(seq_len, n)
        best, area = min(best, w), min(area, n * w)
    return best, area


def _options(seq_len: int, ranks: int, capacity_tokens: int, cost) -> Tuple[float, float]:
    """``sequence_options`` from the fewest ranks that hold the sequence (1 when it fits one
    rank) to all ``ranks``."""
    from .shard import ranks_needed

    low = 1 if seq_len <= capacity_tokens else ranks_needed(seq_len, capacity_tokens)
    return sequence_options(seq_len, low, ranks, cost)


def options_many(seq_lens: Sequence[int], ranks: int, capacity_tokens: int, cost) -> Dict[int, Tuple[float, float]]:
    """``_options`` of every distinct length, by length: the lengths whose scan is long
    (``sequence_options``' numpy branch) scored together, a block of lengths x ring sizes at a
    time, in the same float operations elementwise (so the same numbers; sizes below a length's
    fewest ranks masked out of its minima); the others one by one."""
    from .shard import ranks_needed

    out: Dict[int, Tuple[float, float]] = {}
    wide = []
    for L in dict.fromkeys(seq_lens):
        low = 1 if L <= capacity_tokens else ranks_needed(L, capacity_tokens)
        if ranks - low > 16 and hasattr(cost, "peer_ms_many"):
            wide.append((L, low))
        else:
            out[L] = sequence_options(L, low, ranks, cost)
    if not wide:
        return out
    import numpy as np

    ns = np.arange(2, ranks + 1)
    intra = ns <= cost.gpus_per_node
    for k in range(0, len(wide), 512):
        block = wide[k:k + 512]
        lens = np.array([L for L, _ in block], dtype=np.int64)[:, None]
        lows = np.array([low for _, low in block])[:, None]
        w = np.where(ns[None, :] >= lows, cost.peer_ms_many(lens, ns[None, :], intra[None, :]), np.inf)
        best, area = w.min(axis=1).tolist(), (ns[None, :] * w).min(axis=1).tolist()
        for (L, low), b, a in zip(block, best, area):
            if low == 1:
                one = cost.sequence_ms(L, 1)
                b, a = min(one, b), min(one, a)
            out[L] = (b, a)
    return out


def lower_bound_ms(seq_lens: Sequence[int], ranks: int, capacity_tokens: int, cost) -> float:
    """No plan of these sequences on ``ranks`` ranks can take less (under ``cost``, micro-batch
    overheads left out)::

        max( sum_i min_n n w_i(n) / R ,  max_i min_n w_i(n) )

    w_i(n): sequence i's per-peer time on a ring of n (``cost.sequence_ms``), n from the fewest
    ranks that hold it to R. The first term is perfect balance of the least work, the second the
    longest sequence at its best spread."""
    options = options_many(seq_lens, ranks, capacity_tokens, cost)
    total = sum(options[L][1] for L in seq_lens)
    return max(total / ranks, max(options[L][0] for L in seq_lens))


def granularity_bound(seq_lens: Sequence[int], ranks: int, capacity_tokens: int, cost) -> float:
    """How far above perfect balance the longest sequence alone holds every plan of these
    sequences (under ``cost``)::

        max(1, max_i min_n w_i(n) / (sum_i min_n n w_i(n) / R))

    the longest sequence at its best spread against the least total work dealt evenly
    (``lower_bound_ms``' two terms): no plan's step is shorter than this times the even share of
    the least work. 1: the batch's pieces are fine enough for perfect balance, so an imbalance
    above it is the planner's, not the batch's."""
    options = options_many(seq_lens, ranks, capacity_tokens, cost)
    even = sum(options[L][1] for L in seq_lens) / ranks
    longest = max(options[L][0] for L in seq_lens)
    return max(1.0, longest / even) if even > 0 else 1.0
