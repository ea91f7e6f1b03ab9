"""The HDP scheduler: one step's full batch onto R = DP x CP ranks, each sequence on at least the
ranks that hold it (more where that shortens the step), every rank's work per step within a
small slack of the others.

Input: the sequence lengths of the full batch, the ranks R, the per-rank capacity C
(``--overlap-hdp-max-tokens-per-rank``: rows one rank holds in a micro-batch, zigzag padding included;
the TP padding of ``layout.row_layout`` comes on top) and the
cost model (``cost.HdpCostModel``; every scheduler is scored by the same one). Output: a
``plan.Plan``, per rank the ordered micro-batches. Pure Python, no communication, deterministic:
every rank computes the same plan from the same lengths (ties are broken by length, then by
sequence id, then by rank id; no hashing, no clock, no randomness).

Sizing (``shard.ranks_needed``)::

    L <= C   held whole by one rank, packed with other short sequences into micro-batches of
             at most C rows: no ring, no CP communication
    L >  C   a ring of at least n = ceil(L / C) ranks (any integer, not only powers of two; C
             even; one more for an odd C when the zigzag rounding needs it), zigzag shards of
             2 ceil(L/2n) rows each, so every peer has the same rows and the same causal pairs
             L (L+1) / 2n

Spread for balance (``spread=True``, the default): a sequence may get more ranks than it needs,
any number up to R, when that makes the step shorter. One or two long sequences can dominate a
step's attention work (it grows as L^2); on the fewest ranks they leave the others idle while
they finish. For each ring (costliest first) every size from the fewest to R is tried and the
one with the shortest estimated step kept, ``max(ring end, (work placed + the ring's busy and
idle time + work still to place) / R)``: more ranks end the sequence sooner but cost ring
traffic the attention does not hide, zigzag padding and the gaps its peers wait in. A short
sequence whose work alone exceeds a balanced rank's share is tried the same way (from 1).
Sized one at a time, a first dominant ring can take ranks the next long one needed to run
beside it; where the plan ends more than BOUND_SLACK above the bound, up to FIRST_SIZES other
sizes of the first ring are tried (the rest sized as above) and the shortest step kept.
``simulate.lower_bound_ms`` is what no plan can beat.

Locality (``home``: per sequence, the rank whose data iterator loaded it): after step 1 the
ranks are renamed, nodes onto nodes and ranks inside a node, so the most ring tokens stay where
they were loaded (``locality.relabel``: the step depends on the ranks only through which share
a node); a short sequence takes a gap on its home rank when one fits there; after the rings,
each short sequence goes home while its home still ends by LPT's step, the rest where they fit
by then (``locality.home_first``; LPT's own assignment when they do not all fit). Fewer tokens
cross ranks in the exchange, at the same step.

Costs: a ring costs each peer ``w = compute(rows, pairs) + exposed ring communication`` (the
same on every peer, so no peer waits inside a ring); a short sequence costs its rank
``compute(L, L (L+1) / 2)``. Work is measured in time, not tokens: a 32K-token sequence costs
its rank about as much attention as linear work, a 256K one over 8 ranks eight times more
attention than linear (``cost`` module docstring).

Algorithm, ``mode="dp"`` (balance each rank's work per step; list scheduling, longest first)::

    1. Rings, longest sequence first, sized as above. Each rank has a clock t_r (when its last ring ends). A
       ring of n goes on the n ranks where it ends earliest: end = max_{r in S} t_r + w(S),
       S among the n ranks with the smallest clocks (ties: lower rank id) and, when n fits in
       a node, each node's n least-busy ranks (an intra-node ring is never slower; one is taken
       over an inter-node one unless it ends more than NODE_SLACK x w later). Peers whose
       clock is behind the ring's start get a gap: start - t_r of idle time before the ring.
    2. Short sequences, costliest first (LPT). Each goes into the gap where it fits tightest
       (best fit: the smallest gap left >= its cost), so it runs while the rank would have
       waited for its ring peers and delays nothing; what fits no gap goes after the rings on
       the rank that ends first (LPT: the last items placed are the smallest, so the ends
       differ by about one small sequence at most).
    3. Micro-batches: the short sequences of one gap, and those after the rings, are packed
       first-fit decreasing into micro-batches of at most C rows; a ring is a micro-batch of
       its own. Ring slots: rings are walked in start order; a ring takes, on every peer, the
       index max over peers of (micro-batches that peer has so far); peers behind get empty
       (idle) slots. So every peer holds a ring at the same index, and two ranks meet their
       shared rings in the same (start) order: no deadlock, and the plan's timeline is the one
       step 1 computed (``simulate`` reproduces it); the micro-batch packing is ``packing.py``.

    Ranks with lighter rings take more short sequences, hence more micro-batches.

``mode="pp"`` (a 1F1B pipeline: every rank the same slot count, each slot costing its largest
cell): the plan below, the slot-balanced plans (``slot_balance``) and static CP's own, each
priced by ``pp_timeline.pipeline_step_ms`` for the pipeline's stages, the shortest kept
(``_pipeline_plan``; ``spread`` and the first ring's resizing are not used). The plan below
(sequences of similar length travel through the pipeline together): steps 1 and 2
without the gaps (a pipeline runs its micro-batches in order, so work put before a ring delays
the pipeline instead of filling a wait). Every rank runs its rings first (the longest sequences),
then its short sequences sorted longest first and packed next-fit, so a micro-batch holds
neighbouring lengths; every rank gets the same number of micro-batch slots (a pipeline schedule
runs a fixed count): a rank with fewer cuts its fullest micro-batch in two, by rows, until it
has as many or each holds one sequence, then idles in empty slots at the end. Index k then holds
about the same lengths on every rank, which is what ``Plan.index_imbalance`` measures.

The balance this reaches: the clocks after step 1 and the LPT of step 2 leave
``max_r work_r - mean_r work_r`` at about one short sequence's cost plus the gaps no short
sequence fitted, which is small when the batch holds many more short sequences than ranks (the
usual shape of long-context data, heavy-tailed). It cannot fix a single ring whose per-peer
work ``w`` exceeds the mean work per rank on its fewest ranks: spreading it is the lever.
"""

from __future__ import annotations

import bisect
import heapq
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from .batch_input import CAPACITY_FIELD, MODES, check_batch  # noqa: F401  (re-exported: callers read them here)
from .cost import HdpCostModel, local_ms, ring_ms  # noqa: F401  (ring_ms: re-exported, the tests read it here)
from .collector_pause import gc_paused
from .locality import check_home, home_first, relabel_rings
from .packing import pack_first_fit, pack_next_fit, split_to
from .step_plan import Plan
from .shard import Shard, ranks_needed
from .simulate import options_many, sequence_options
from .ring_sizes import spread_choice

FIRST_SIZES = 8  # at most this many sizes of the first ring tried again (schedule_hdp)
BOUND_SLACK = 0.01  # a plan this close to the lower bound is not searched further


@dataclass
class _Ring:
    seq_id: int
    seq_len: int
    ring: Tuple[int, ...]
    start: float
    end: float


def _place_rings(lens: Sequence[int], ring_ids: Sequence[int], short_ids: Sequence[int], R: int, C: int,
                 cost: HdpCostModel, spread: bool, cache: Optional[dict] = None,
                 first: Optional[Tuple[int, int]] = None):
    """Step 1: rings, costliest first, each sized by ``sizes.spread_choice`` and placed where it ends
    earliest. ``ring_ids``: the sequences longer than C, and with ``spread`` the short ones whose
    work alone exceeds a balanced rank's (one that stays on one rank goes back to the short
    sequences). ``first``: (sequence id, ring size) of one ring whose size is given (the others
    sized as above). Returns (rings, clock, gaps, ids back to short) with
    gaps[(rank, ring index)] = idle time before that ring on that rank."""
    clock = [0.0] * R
    rings: List[_Ring] = []
    gaps: Dict[Tuple[int, int], float] = {}
    low = {i: ranks_needed(lens[i], C) if lens[i] > C else 1 for i in ring_ids}

    cache = {} if cache is None else cache
    options = {}  # by length: the least busy time over the sizes it may take
    if spread:  # low is _options' fewest ranks: its scan, all lengths at once
        todo = [lens[i] for i in ring_ids if ("area", lens[i], spread) not in cache]
        for L, (_, area) in options_many(todo, R, C, cost).items():
            cache[("area", L, spread)] = area
    for i in ring_ids:
        key = ("area", lens[i], spread)
        if key not in cache:
            cache[key] = sequence_options(lens[i], low[i], R if spread else low[i], cost)[1]
        options[lens[i]] = cache[key]
    area = {i: options[lens[i]] for i in ring_ids}
    ms = _local_table(lens, cost, cache)
    rest = sum(area.values()) + sum(ms[i] for i in short_ids)
    back = []
    for i in ring_ids:
        rest -= area[i]
        if first is not None and i == first[0]:
            n, ring, start, end = spread_choice(lens[i], first[1], clock, cost, rest, False, cache)
        else:
            n, ring, start, end = spread_choice(lens[i], low[i], clock, cost, rest, spread, cache)
        if n == 1:
            back.append(i)
            rest += ms[i]
            continue
        for r in ring:
            if start > clock[r]:
                gaps[(r, len(rings))] = start - clock[r]
            clock[r] = end
        rings.append(_Ring(i, lens[i], ring, start, end))
    return rings, clock, gaps, back


def _fill_gaps(short_ids: Sequence[int], ms: Sequence[float], gaps: Dict[Tuple[int, int], float],
               home: Optional[Sequence[int]] = None):
    """Step 2a: best fit of the short sequences (costliest first) into the gaps; with ``home``,
    the tightest gap on the rank that loaded the sequence when one fits there (a gap delays
    nothing either way). Returns ({(rank, ring index): [seq ids]}, the ids left over, in the same
    order). ``ms``: per sequence id, its ``local_ms``."""
    free = sorted((cap, key) for key, cap in gaps.items())
    filled: Dict[Tuple[int, int], List[int]] = {}
    rest = []
    for i in short_ids:
        c = ms[i]
        k = bisect.bisect_left(free, (c, (-1, -1)))
        if k == len(free):
            rest.append(i)
            continue
        if home is not None:
            k = next((j for j in range(k, len(free)) if free[j][1][0] == home[i]), k)
        cap, key = free.pop(k)
        filled.setdefault(key, []).append(i)
        if cap - c > 0:
            bisect.insort(free, (cap - c, key))
    return filled, rest


def _lpt(ids: Sequence[int], ms: Sequence[float], clock: List[float]) -> List[List[int]]:
    """Step 2b: each sequence (costliest first) to the rank that ends first (``ms``: per sequence
    id, its ``local_ms``)."""
    heap = [(t, r) for r, t in enumerate(clock)]
    heapq.heapify(heap)
    out: List[List[int]] = [[] for _ in clock]
    for i in ids:
        t, r = heapq.heappop(heap)
        out[r].append(i)
        heapq.heappush(heap, (t + ms[i], r))
    return out


@gc_paused
def schedule_hdp(seq_lens: Sequence[int], ranks: int, capacity_tokens: int,
                 cost: Optional[HdpCostModel] = None, mode: str = "dp", spread: bool = True,
                 home: Optional[Sequence[int]] = None, resize_first: bool = True,
                 stages: Optional[int] = None) -> Plan:
    """The HDP plan of one full batch (module docstring). ``spread``: rings may take more ranks
    than they need where the step gets shorter (False: always the fewest, ``ceil(L / C)``);
    ``home``: per sequence, the rank that loaded it (sequences stay there where the step allows).
    The plan is built with and without each (``_build``) and the one with the shortest simulated
    step under ``cost`` kept, among equal steps the one that moves the fewest tokens.
    ``resize_first``: where the best plan ends more than BOUND_SLACK above the lower bound, the
    first ring's other sizes are tried too (below; ``bound_tradeoff.for_both``'s re-plans skip it).
    ``mode="pp"``: the plans of ``_pipeline_plan`` scored by the 1F1B timeline of ``stages``
    pipeline stages (``pp_timeline``; default ``pp_timeline.DEFAULT_STAGES``).
    Raises ``OverlapConfigError`` / ``ValueError`` on bad input (``check_batch``)."""
    from .simulate import simulate

    lens = check_batch(seq_lens, ranks, capacity_tokens, mode)
    cost = cost or HdpCostModel()
    home = check_home(home, len(lens), ranks)
    if mode == "pp":
        return _pipeline_plan(lens, ranks, capacity_tokens, cost, home, stages)
    best, best_key = None, None
    cache: dict = {}  # peer times by (length, ring size, in one node), shared by the plans tried

    def consider(wide, first=None):
        nonlocal best, best_key
        for homed in ((home, None) if home is not None and first is None else (home,)):
            plan = _build(lens, ranks, capacity_tokens, cost, mode, wide, homed, home, cache, first)
            step = simulate(plan, cost).step_ms
            key = (step, plan.moved_tokens(home) if home is not None else 0)
            # the shortest step; among steps equal within 1e-9, the fewest tokens moved
            if best is None or key[0] < best_key[0] * (1 - 1e-9) or (
                    key[0] <= best_key[0] * (1 + 1e-9) and key[1] < best_key[1]):
                best, best_key = plan, key

    for wide in ((False, True) if spread and mode == "dp" else (False,)):
        consider(wide)
    if resize_first and spread and mode == "dp" and cache[("rings", True, None)][0]:
        # rings sized one at a time, longest first: the first can take so many ranks that the next
        # long ones find too few free to end in time (each then waits for it, and the step runs
        # past the bound while other ranks idle). Its other sizes, from the fewest ranks that
        # hold it to the one it took (the rest sized as before), up to FIRST_SIZES of them
        # evenly spaced, the shortest simulated step kept (more plans tried: never a longer step;
        # placed by locality only, where ``home`` is given: half the planning time)
        from .simulate import lower_bound_ms

        bound = lower_bound_ms(lens, ranks, capacity_tokens, cost)
        top = cache[("rings", True, None)][0][0]
        low = ranks_needed(top.seq_len, capacity_tokens) if top.seq_len > capacity_tokens else 2
        high = len(top.ring) - 1
        count = min(FIRST_SIZES, high - low + 1)
        sizes = sorted({low + (high - low) * k // max(1, count - 1) for k in range(count)}) if count > 0 else []
        for n in sizes:
            if best_key[0] <= bound * (1 + BOUND_SLACK):
                break
            consider(True, (top.seq_id, n))
    return best


def _pipeline_plan(lens, R: int, C: int, cost: HdpCostModel, home, stages: Optional[int]) -> Plan:
    """Mode ``pp`` (module docstring): the list-scheduled plan (``_build``), the slot-balanced ones
    (``slot_balance.candidates``) and static CP's own, the shortest 1F1B step kept (the first
    among equal steps): never a longer pipeline step than static CP's, under the same model."""
    import dataclasses

    from .pp_timeline import DEFAULT_STAGES, check_stages, pipeline_step_ms, static_pp_candidates
    from .slot_balance import candidates

    P = DEFAULT_STAGES if stages is None else check_stages(stages)
    cache: dict = {}
    ms = _local_table(lens, cost, cache)
    best, best_ms, tried = None, None, 0
    seen = set()

    def consider(plan):
        nonlocal best, best_ms, tried
        if plan.microbatches in seen:  # the same plan from two candidates: priced once
            return
        seen.add(plan.microbatches)
        tried += 1
        t = pipeline_step_ms(plan, cost, P)
        if best is None or t < best_ms * (1 - 1e-9):
            best, best_ms = plan, t

    consider(_build(lens, R, C, cost, "pp", False, home, home, cache))
    for plan in candidates(lens, R, C, cost, ms):
        consider(plan)
    for plan in static_pp_candidates(lens, R, C, cost):
        consider(plan)
    note = f"1F1B step {best_ms:.1f} ms at {P} stages, the shortest of {tried} plans (hdp/pp_timeline.py)"
    return dataclasses.replace(best, notes=tuple(best.notes) + (note,))


def _build(lens, R: int, C: int, cost: HdpCostModel, mode: str, spread: bool, home, loaded,
           cache: Optional[dict] = None, first: Optional[Tuple[int, int]] = None) -> Plan:
    """One plan; ``home``: placement by locality (or None), ``loaded``: the loading ranks the
    notes count moved tokens against; ``first``: (sequence id, ring size) given (``_place_rings``)."""
    cache = {} if cache is None else cache
    key = ("rings", spread, first)  # steps 1 and the order of step 2 do not depend on home: the plans share them
    if key not in cache:
        cache[key] = _rings_of(lens, R, C, cost, spread, cache, first)
    rings, clock, gaps, short_ids = cache[key]
    ms = _local_table(lens, cost, cache)
    if home is not None:
        rings, gaps, clock = relabel_rings(rings, gaps, clock, home, cost)
    if mode == "dp":
        filled, rest = _fill_gaps(short_ids, ms, gaps, home)
    else:
        filled, rest = {}, short_ids
    tail = _lpt(rest, ms, clock)
    local = False
    if home is not None and mode == "dp":
        tail, local = home_first(rest, lens, clock, home, cost, tail, ms)
    plan = _emit(lens, R, C, mode, rings, filled, tail, cache.setdefault("whole", {}))
    return _with_notes(plan, rings, filled, short_ids, C, loaded, local or home is None)


def _local_table(lens, cost: HdpCostModel, cache: dict) -> List[float]:
    """Per sequence id, ``local_ms`` of its length (each length's computed once, kept in ``cache``)."""
    if "local" not in cache:
        by_len: Dict[int, float] = {}
        cache["local"] = [by_len[L] if L in by_len else by_len.setdefault(L, local_ms(L, cost)) for L in lens]
    return cache["local"]


def _rings_of(lens, R: int, C: int, cost: HdpCostModel, spread: bool, cache: dict,
              first: Optional[Tuple[int, int]] = None):
    """Step 1 (``_place_rings``) on the batch's sequences, longest first: (rings, clock, gaps,
    the short sequences, longest first, those a ring did not keep included)."""
    by_length = cache.get("by_length")
    if by_length is None:
        import numpy as np  # longest first, ties by id: sorted(key=(-L, i))

        by_length = cache["by_length"] = np.lexsort((np.arange(len(lens)), -np.array(lens, dtype=np.int64))).tolist()
    ms = _local_table(lens, cost, cache)
    short_ids = [i for i in by_length if lens[i] <= C]
    share = sum(ms[i] for i in short_ids) / R
    # with spread, a short sequence whose work alone exceeds a balanced rank's may get a ring too
    ring_ids = [i for i in by_length if lens[i] > C or (spread and ms[i] > share)]
    chosen = set(ring_ids)
    short_ids = [i for i in short_ids if i not in chosen]
    rings, clock, gaps, back = _place_rings(lens, ring_ids, short_ids, R, C, cost, spread, cache, first)
    if back:
        rank = {i: k for k, i in enumerate(by_length)}
        short_ids = sorted(short_ids + back, key=rank.__getitem__)
    return rings, clock, gaps, short_ids


def _emit(lens, R: int, C: int, mode: str, rings, filled, tail, whole: Optional[dict] = None) -> Plan:
    """Step 3: the micro-batches (module docstring). ``whole``: the shards of sequences held whole,
    by id, shared by the plans of one batch (a ``Shard`` is immutable)."""
    whole = {} if whole is None else whole

    def held(i):
        s = whole.get(i)
        if s is None:
            s = whole[i] = Shard(i, lens[i])
        return s

    out: List[List[Tuple[Shard, ...]]] = [[] for _ in range(R)]

    def local_mbs(ids):
        ids = sorted(ids, key=lambda i: (-lens[i], i))
        return [tuple(held(i) for i in b) for b in pack_first_fit(ids, lens, C)]

    for idx in sorted(range(len(rings)), key=lambda j: (rings[j].start, j)):
        ring = rings[idx]
        for r in ring.ring:
            out[r].extend(local_mbs(filled.get((r, idx), [])))
        slot = max(len(out[r]) for r in ring.ring)
        for x, r in enumerate(ring.ring):
            out[r].extend([()] * (slot - len(out[r])))
            out[r].append((Shard(ring.seq_id, ring.seq_len, ring.ring, x),))
    if mode == "dp":
        for r in range(R):
            out[r].extend(local_mbs(tail[r]))
    else:
        bins = [pack_next_fit(sorted(tail[r], key=lambda i: (-lens[i], i)), lens, C) for r in range(R)]
        slots = max(len(out[r]) + len(bins[r]) for r in range(R))
        for r in range(R):
            for b in split_to(bins[r], slots - len(out[r]), lens):
                out[r].append(tuple(held(i) for i in b))
            out[r].extend([()] * (slots - len(out[r])))
    return Plan(scheduler="hdp", ranks=R, capacity_tokens=C, seq_lens=tuple(lens),
                microbatches=tuple(tuple(mbs) for mbs in out), mode=mode)


def _with_notes(plan: Plan, rings, filled, short_ids, C: int, home, local: bool) -> Plan:
    import dataclasses

    n_gap = sum(len(v) for v in filled.values())
    sizes = ", ".join(str(n) for n in sorted({len(x.ring) for x in rings}))
    wider = sum(len(x.ring) > (ranks_needed(x.seq_len, C) if x.seq_len > C else 1) for x in rings)
    notes = [
        (f"{len(rings)} sequences on rings of {sizes} ranks" + (f", {wider} of them on more ranks than they need "
                                                                 f"(spread for balance)" if wider else ""))
        if rings else "no ring, no CP traffic",
        f"{len(short_ids)} sequences held whole" + (f", {n_gap} of them in the gaps before rings" if n_gap else ""),
    ]
    if home is not None:
        notes.append(f"locality: {plan.moved_tokens(home)} of {sum(plan.seq_lens)} tokens move to another rank"
                     + ("" if local or plan.mode == "pp" else " (short sequences dealt by LPT: home first would "
                        "lengthen the step)"))
    return dataclasses.replace(plan, notes=tuple(notes))
