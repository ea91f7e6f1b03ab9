"""The two schedulers HDP is compared with, as ``Plan`` s scored by the same cost model.

``static``: what a run without HDP does. One CP size for the whole run, the smallest divisor of
R whose ring holds the longest sequence (``n_max = ranks_needed(max L, C)``; CP must divide
DP x CP), so R / cp DP groups of cp consecutive ranks; every sequence, short or long, is zigzag
sharded over its group's ring. Packing is greedy and by tokens, as data loaders pack: sequences
longest first, first-fit into micro-batches of at most C rows per rank (a sequence takes
``2 ceil(L / 2cp)`` rows on each peer); micro-batches, fullest first, to the DP group with the
fewest tokens so far. It balances tokens, not work: attention grows as L^2, so the groups with
the long sequences work longest; and short sequences pay ring communication (their attention is
too small to hide it) and zigzag padding.

``megatron_balanced``: megatron-core's own ``BalancedCPScheduler``
(``megatron/core/pipeline_parallel/hybrid_cp_schedule.py``), run unmodified through
``get_groups_and_subsamples``, which is what its hybrid-CP data path calls. It needs only
``dp_cp_group.size()`` from its process group, so it gets a stand-in with ``size()`` and no
torch.distributed. What it returns: groups (separated by barriers in its runtime); per group and
rank, the sample ids that rank runs, one sample per forward step. The conversion:

    phase         = group index (``Plan.phases``: all ranks wait for each other between groups)
    ring          = the ranks whose id list in that group holds the sample, ascending (its runtime
                    takes the CP size the same way, counting them: ``partner_cp_size``)
    micro-batch   = one sample (its runtime packs nothing), zigzag over the ring

What it cannot place, and what the adapter does instead (recorded in ``Plan.notes``):

* its CP sizes are powers of two, ``2^ceil(log2(L / C))``, so a sequence needing more than R
  ranks that way (R not a power of two) is never placed, and its loop would then fail an assert.
  Such sequences are left out of its input and run after its groups, each on all R ranks (its
  largest hybrid-CP group is the whole DP x CP group), one phase each.
* it is given ``max_seq_len_per_rank = 2 floor(C / 2)``: its L / n <= C guarantees the zigzag
  rows 2 ceil(L / 2n) <= C only for an even C.
* if it raises anyway, the batch gets no plan from it: the error is re-raised as
  ``MegatronSchedulerError`` with the lengths that triggered it, and the bench reports the
  failed steps instead of scores. Seen here: an ``IndexError`` in its ``fill_empty_gpus`` for
  some batches when R is not a power of two (it widens groups to the next power of two and
  shifts the others past the last rank); never for a power-of-two R in the tests' random cases.
"""

from __future__ import annotations

import math
from typing import List, Optional, Sequence, Tuple

from .cost import HdpCostModel
from .collector_pause import gc_paused
from .packing import pack_first_fit
from .step_plan import Plan
from .batch_input import check_batch
from .shard import Shard, ranks_needed, rows_held


class MegatronSchedulerError(RuntimeError):
    """megatron-core's ``BalancedCPScheduler`` failed on a batch."""


def static_cp_size(max_len: int, ranks: int, capacity_tokens: int) -> int:
    """Smallest divisor of ``ranks`` that is >= the ranks the longest sequence needs."""
    need = ranks_needed(max_len, capacity_tokens)
    return min(d for d in range(need, ranks + 1) if ranks % d == 0)


def schedule_static(seq_lens: Sequence[int], ranks: int, capacity_tokens: int,
                    cost: Optional[HdpCostModel] = None) -> Plan:
    """Fixed CP size, greedy token packing (module docstring)."""
    lens = check_batch(seq_lens, ranks, capacity_tokens)
    R, C = ranks, capacity_tokens
    cp = static_cp_size(max(lens), R, C)
    groups = R // cp
    rows = [rows_held(L, cp) for L in lens]
    order = sorted(range(len(lens)), key=lambda i: (-lens[i], i))
    bins = pack_first_fit(order, rows, C)
    bin_tokens = [sum(lens[i] for i in b) for b in bins]
    tokens = [0] * groups
    per_group: List[List[int]] = [[] for _ in range(groups)]
    for b in sorted(range(len(bins)), key=lambda b: (-bin_tokens[b], b)):
        g = min(range(groups), key=lambda g: (tokens[g], g))
        per_group[g].append(b)
        tokens[g] += bin_tokens[b]
    out = [[] for _ in range(R)]
    for g in range(groups):
        ring = tuple(range(g * cp, (g + 1) * cp)) if cp > 1 else ()
        for b in per_group[g]:
            for x in range(cp):
                out[g * cp + x].append(tuple(Shard(i, lens[i], ring, x) for i in bins[b]))
    return Plan(
        scheduler="static",
        ranks=R,
        capacity_tokens=C,
        seq_lens=lens,
        microbatches=tuple(tuple(m) for m in out),
        notes=(f"CP {cp} x DP {groups} for every sequence (longest {max(lens)} tokens needs "
               f"{ranks_needed(max(lens), C)} ranks)",),
    )


class _Group:
    """Stand-in for the DP x CP process group: ``BalancedCPScheduler`` only calls ``size()``."""

    def __init__(self, size: int):
        self._size = size

    def size(self) -> int:
        return self._size


def _megatron_cp_size(seq_len: int, max_per_rank: int) -> int:
    """``BalancedCPScheduler.gpus_needed``'s formula (to pick out what it cannot place)."""
    return max(1, 2 ** math.ceil(math.log2(seq_len / max_per_rank)))


@gc_paused
def schedule_balanced_cp(scheduler_cls, seq_lens: Sequence[int], ranks: int, capacity_tokens: int,
                         cost: Optional[HdpCostModel] = None) -> Plan:
    """``scheduler_cls`` (megatron-core's ``BalancedCPScheduler``, handed in by
    ``integration.baselines``, which imports it) run on one batch and converted to a ``Plan``
    (module docstring)."""
    lens = check_batch(seq_lens, ranks, capacity_tokens)
    R, C = ranks, capacity_tokens
    per_rank = 2 * (C // 2) if C > 1 else C
    notes = []
    sizes = {L: _megatron_cp_size(L, per_rank) for L in set(lens)}
    fits = [(i, L) for i, L in enumerate(lens) if sizes[L] <= R]
    too_big = [i for i, L in enumerate(lens) if sizes[L] > R]
    if per_rank != C:
        notes.append(f"given max_seq_len_per_rank={per_rank} (C={C} is odd; zigzag shards need an even C)")
    out: List[List[Tuple[Shard, ...]]] = [[] for _ in range(R)]
    phases: List[List[int]] = [[] for _ in range(R)]
    groups = []
    if fits:
        scheduler = scheduler_cls(max_seq_len_per_rank=per_rank, dp_cp_group=_Group(R))
        try:
            _, groups = scheduler.get_groups_and_subsamples(fits, None)
        except (AssertionError, IndexError, KeyError, ValueError) as exc:
            hint = (f"; its hybrid-CP groups are powers of two and R={R} is not one" if R & (R - 1) else "")
            raise MegatronSchedulerError(
                f"megatron-core's BalancedCPScheduler failed ({type(exc).__name__}: {exc}) on R={R}, C={C}, "
                f"{len(lens)} sequences{hint}; lengths={list(lens)}") from exc
    for g, ids_per_rank in enumerate(groups):
        members = {}
        for r, ids in enumerate(ids_per_rank):
            for sid in ids:
                members.setdefault(sid, []).append(r)
        rings = {sid: tuple(m) if len(m) > 1 else () for sid, m in members.items()}
        pos = {(sid, r): k for sid, m in members.items() if len(m) > 1 for k, r in enumerate(m)}
        for r, ids in enumerate(ids_per_rank):
            for sid in ids:
                ring = rings[sid]
                out[r].append((Shard(sid, lens[sid], ring, pos[sid, r] if ring else 0),))
                phases[r].append(g)
    for k, i in enumerate(too_big):
        ring = tuple(range(R)) if R > 1 else ()  # R = 1: only an odd C's last row made it "too big"
        for r in range(R):
            out[r].append((Shard(i, lens[i], ring, r if ring else 0),))
            phases[r].append(len(groups) + k)
    if too_big:
        notes.append(f"{len(too_big)} sequences need a power-of-two CP size > R={R}, which megatron-core's "
                     f"scheduler cannot place (it would fail an assert): run after its groups on all {R} ranks, "
                     f"one phase each")
    notes.append(f"{len(groups)} group{'' if len(groups) == 1 else 's'} (a barrier after each), one sample per "
                 f"micro-batch")
    return Plan(
        scheduler="megatron_balanced",
        ranks=R,
        capacity_tokens=C,
        seq_lens=lens,
        microbatches=tuple(tuple(m) for m in out),
        phases=tuple(tuple(p) for p in phases),
        notes=tuple(notes),
    )
