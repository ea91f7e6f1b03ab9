"""A step's plan as data: per rank, the ordered micro-batches and the shards in each.

    plan.microbatches[r][k]   tuple of ``Shard``: what rank r holds in its k-th micro-batch
    plan.phases[r][k]         phase of that micro-batch; all ranks wait for each other between
                              phases (0 everywhere for ``hdp``; Megatron's scheduler has groups
                              separated by barriers)

Invariants (``validate``): every real token of every sequence is held exactly once; no rank
holds more than C rows in a micro-batch; a micro-batch holds at most one ring (the shards of one
sequence, or of several packed sequences sharing that ring); every peer of a ring holds it in the
same micro-batch, at the same (phase, index within the phase); rings shared by two ranks come in
the same order on both (no deadlock).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

from .cost import HdpCostModel
from .shard import Shard


@dataclass(frozen=True)
class Plan:
    scheduler: str
    ranks: int
    capacity_tokens: int
    seq_lens: Tuple[int, ...]
    microbatches: Tuple[Tuple[Tuple[Shard, ...], ...], ...]
    phases: Optional[Tuple[Tuple[int, ...], ...]] = None
    mode: str = "dp"
    notes: Tuple[str, ...] = field(default=())

    def __post_init__(self):
        if len(self.microbatches) != self.ranks:
            raise ValueError(f"plan has {len(self.microbatches)} rank lists for {self.ranks} ranks")
        if self.phases is None:
            object.__setattr__(self, "phases", tuple(tuple(0 for _ in mbs) for mbs in self.microbatches))

    def __getstate__(self):
        """Pickled without ``simulate``'s memo of its step times (recomputed where needed)."""
        return {k: v for k, v in self.__dict__.items() if k != "_simulated"}

    # -- structure -----------------------------------------------------------------------------
    @staticmethod
    def ring_of(mb: Sequence[Shard]) -> Tuple[int, ...]:
        """The one ring of a micro-batch, () when everything in it is local."""
        rings = {s.ring for s in mb if s.ring}
        if len(rings) > 1:
            raise ValueError(f"a micro-batch holds shards of {len(rings)} different rings")
        return rings.pop() if rings else ()

    @staticmethod
    def ring_key(mb: Sequence[Shard]) -> Tuple[int, ...]:
        """Identifies one ring instance: the sorted ids of the sequences on it."""
        return tuple(sorted(s.seq_id for s in mb if s.ring))

    def slot(self, rank: int, k: int) -> Tuple[int, int]:
        """(phase, index within the phase) of micro-batch k of ``rank``."""
        ph = self.phases[rank]
        first = ph.index(ph[k])
        return ph[k], k - first

    def microbatches_per_rank(self) -> List[int]:
        """Non-empty micro-batches of each rank."""
        return [sum(1 for mb in mbs if mb) for mbs in self.microbatches]

    def rows_per_microbatch(self) -> List[List[int]]:
        return [[sum(s.rows for s in mb) for mb in mbs] for mbs in self.microbatches]

    def tokens_per_microbatch(self) -> List[List[int]]:
        """Real tokens (padding excluded) per rank per micro-batch."""
        return [[sum(s.tokens for s in mb) for mb in mbs] for mbs in self.microbatches]

    def ring_sizes(self) -> Dict[int, int]:
        """seq id -> ranks it is sharded over (sharded sequences only)."""
        out = {}
        for mbs in self.microbatches:
            for mb in mbs:
                for s in mb:
                    if s.ring:
                        out[s.seq_id] = len(s.ring)
        return out

    # -- cost ----------------------------------------------------------------------------------
    def item_ms(self, mb: Sequence[Shard], cost: HdpCostModel, ring: Optional[Tuple[int, ...]] = None) -> float:
        """One rank's busy time for one micro-batch: compute of everything held plus the exposed
        communication of its ring (rows and pairs of the ring's sequences add). ``ring``: its
        ``ring_of(mb)`` where the caller has it already."""
        ring = self.ring_of(mb) if ring is None else ring
        compute = sum(cost.compute_ms(s.rows, s.causal_pairs) for s in mb)
        if mb:
            compute += cost.microbatch_overhead_ms
        if not ring:
            return compute
        rows = sum(s.rows for s in mb if s.ring)
        pairs = sum(s.causal_pairs for s in mb if s.ring)
        return compute + cost.exposed_ring_ms(rows, pairs, ring)

    def work_ms(self, cost: HdpCostModel) -> List[float]:
        """Per-rank busy time of the step (idle waits excluded)."""
        return [sum(self.item_ms(mb, cost) for mb in mbs) for mbs in self.microbatches]

    def imbalance(self, cost: HdpCostModel) -> float:
        """max / mean of per-rank work."""
        work = self.work_ms(cost)
        mean = sum(work) / len(work)
        return max(work) / mean if mean > 0 else 1.0

    def index_imbalance(self, cost: HdpCostModel) -> float:
        """Mean over micro-batch indices k of (max / mean over ranks of the work at index k),
        ranks without a k-th micro-batch counting 0: how far the ranks are from moving through
        the micro-batches in lockstep (what a pipeline needs)."""
        depth = max((len(m) for m in self.microbatches), default=0)
        ratios = []
        for k in range(depth):
            w = [self.item_ms(mbs[k], cost) if k < len(mbs) else 0.0 for mbs in self.microbatches]
            mean = sum(w) / len(w)
            if mean > 0:
                ratios.append(max(w) / mean)
        return sum(ratios) / len(ratios) if ratios else 1.0

    def moved_tokens(self, home: Sequence[int]) -> int:
        """Real tokens a rank holds that another rank loaded (``home[seq id]``: the rank whose
        data iterator loaded it): what the row exchange moves."""
        return sum(s.tokens if s.ring else s.seq_len  # a shard held whole holds all its tokens
                   for r, mbs in enumerate(self.microbatches) for mb in mbs for s in mb if home[s.seq_id] != r)

    def cp_comm_bytes(self, cost: HdpCostModel) -> float:
        """Bytes all ranks send through rings in the step: per ring and rank,
        ``HdpCostModel.ring_bytes`` (K/V twice in bf16, the dK/dV sums in fp32)."""
        total = 0.0
        for mbs in self.microbatches:
            for mb in mbs:
                ring = self.ring_of(mb)
                if ring:
                    total += cost.ring_bytes(sum(s.rows for s in mb if s.ring), len(ring))
        return total

    # -- checks --------------------------------------------------------------------------------
    def validate(self) -> None:
        """Raise ``AssertionError`` naming the first broken invariant (module docstring)."""
        held = defaultdict(list)
        ring_slots = defaultdict(dict)  # ring key -> {rank: slot}
        ring_peers = {}
        order = [[] for _ in range(self.ranks)]
        for r, mbs in enumerate(self.microbatches):
            assert len(self.phases[r]) == len(mbs), f"rank {r}: phases and micro-batches differ in length"
            assert list(self.phases[r]) == sorted(self.phases[r]), f"rank {r}: phases out of order"
            for k, mb in enumerate(mbs):
                rows = sum(s.rows for s in mb)
                assert rows <= self.capacity_tokens, f"rank {r} micro-batch {k}: {rows} rows > C={self.capacity_tokens}"
                ring = self.ring_of(mb)
                for s in mb:
                    assert 0 <= s.seq_id < len(self.seq_lens), f"unknown sequence {s.seq_id}"
                    assert s.seq_len == self.seq_lens[s.seq_id], f"sequence {s.seq_id}: wrong length"
                    if s.ring:
                        assert len(s.ring) >= 2, f"rank {r}: sequence {s.seq_id} on a ring of one rank {s.ring}"
                        assert 0 <= s.position < len(s.ring) and s.ring[s.position] == r, (
                            f"rank {r} is not position {s.position} of ring {s.ring}")
                        assert len(set(s.ring)) == len(s.ring), f"ring {s.ring} repeats a rank"
                    held[s.seq_id].extend(s.ranges)
                if ring:
                    key = self.ring_key(mb)
                    ring_slots[key][r] = self.slot(r, k)
                    assert ring_peers.setdefault(key, ring) == ring, f"sequences {key} on two rings"
                    order[r].append(key)
        for i, length in enumerate(self.seq_lens):
            spans = sorted(held.get(i, []))
            covered = 0
            for a, b in spans:
                assert a == covered, f"sequence {i}: tokens [{covered}, {a}) missing or [{a}, {b}) held twice"
                covered = b
            assert covered == length, f"sequence {i}: {covered} of {length} tokens held"
        for key, slots in ring_slots.items():
            ring = ring_peers[key]
            assert set(slots) == set(ring), f"ring of {key}: held by {sorted(slots)}, peers {ring}"
            assert len(set(slots.values())) == 1, f"ring of {key}: peers at different micro-batch slots {slots}"
        for a in range(self.ranks):
            pos_a = {key: i for i, key in enumerate(order[a])}
            for b in range(a + 1, self.ranks):
                shared = [key for key in order[b] if key in pos_a]
                assert [pos_a[key] for key in shared] == sorted(pos_a[key] for key in shared), (
                    f"ranks {a} and {b} run their shared rings in different orders")

    # -- the runtime's view --------------------------------------------------------------------
    def to_actions(self) -> List[List[dict]]:
        """Per rank, one dict per micro-batch, in order::

            {"index": k, "phase": p, "tokens": real tokens, "rows": rows incl. padding,
             "ring": [group ranks] or [],  "sequences": [
                 {"seq_id": i, "seq_len": L, "ranges": [[start, stop], ...],
                  "ring": [...], "position": x, "rows": rows incl. padding}, ...]}

        ``ranges`` are the real tokens of sequence i this rank loads (zigzag chunks x and
        2n-1-x of the sequence padded to a multiple of 2n, clipped to L); ``ring`` the ordered
        peers of the ring attention (this rank at ``position``), [] for a sequence held whole.
        An empty ``sequences`` list is an idle slot (the rank runs nothing at that index)."""
        out = []
        for r, mbs in enumerate(self.microbatches):
            acts = []
            for k, mb in enumerate(mbs):
                acts.append({
                    "index": k,
                    "phase": self.phases[r][k],
                    "tokens": sum(s.tokens for s in mb),
                    "rows": sum(s.rows for s in mb),
                    "ring": list(self.ring_of(mb)),
                    "sequences": [
                        {"seq_id": s.seq_id, "seq_len": s.seq_len, "ranges": [list(x) for x in s.ranges],
                         "ring": list(s.ring), "position": s.position, "rows": s.rows}
                        for s in mb
                    ],
                })
            out.append(acts)
        return out

    def signature(self) -> tuple:
        """The plan with every sequence id replaced by its length: equal for two batches that
        differ only by the order (ids) of their sequences."""
        return tuple(
            tuple(tuple(sorted((s.seq_len, s.ring, s.position) for s in mb)) for mb in mbs)
            for mbs in self.microbatches
        )
