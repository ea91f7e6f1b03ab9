"""Split orders of virtual pipelines (``pp/chunks.py``): interleaved zero bubble (Megatron's
forwards and backwards, each backward split into B and W, W placed where the stage would
wait) and ZB-V (list scheduling under a memory cap). Both schedule in simulated time with
per-micro-batch ``times`` = (F, B, W) of a whole stage (a chunk takes ``1 / chunks`` of it),
as ``schedule.split_order`` does without chunks. Pure Python."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

from .chunks import Order, successor, v_placement
from .schedule import B, F, W


@dataclass
class _Rank:
    fb: Order = field(default_factory=list)
    next: int = 0
    free: float = 0.0
    pending_w: List[Tuple[int, int]] = field(default_factory=list)  # (chunk, mb) waiting for W
    order: Order = field(default_factory=list)
    next_f: List[int] = field(default_factory=list)  # v_order: next micro-batch per chunk
    next_b: List[int] = field(default_factory=list)
    mem: float = 0.0  # chunk activations held, a pending W counting w_share
    waiting_f1: int = 0  # v_order: micro-batches past this stage's chunk 0, not yet its chunk 1


def _run(ranks: List[_Rank], placement, microbatches: int, times, chunks: int, choose, on_run=None) -> List[Order]:
    """The list scheduler: the stage whose next action (``choose``) starts first runs it."""
    dur = {op: t / chunks for op, t in zip((F, B, W), times)}
    ready: Dict[tuple, float] = {(placement[0][0], F, placement[0][1], mb): 0.0 for mb in range(microbatches)}
    left = len(ranks) * microbatches * 3 * chunks
    while left:
        best = None
        for s, x in enumerate(ranks):
            choice = choose(s, x, ready)
            if choice is not None and (best is None or (choice[0], s) < (best[0], best[1])):
                best = (choice[0], s) + tuple(choice[1:])
        if best is None:
            raise RuntimeError("split schedule generation stalled (a bug: report it)")
        start, s, op, c, mb = best
        x = ranks[s]
        end = x.free = start + dur[op]
        x.order.append((op, c, mb))
        left -= 1
        if op == W:
            x.pending_w.remove((c, mb))
        else:
            nxt = successor(placement, (s, c), op, mb)
            if nxt is not None:
                ready[nxt] = end
            if op == B:
                x.pending_w.append((c, mb))
        if on_run is not None:
            on_run(x, op, c, mb)
    return [x.order for x in ranks]


def split_chunks(fb: Sequence[Order], placement, microbatches: int, chunks: int, hold: Sequence[int],
                 times: Sequence[float] = (1.0, 1.0, 1.0)) -> List[Order]:
    """``fb``'s forwards and backwards per stage in their order, each B's W placed where the
    stage's next F or B would wait, or before a forward when more than ``hold[s]`` wait."""
    ranks = [_Rank(fb=list(o)) for o in fb]

    def choose(s, x, ready):
        if x.next == len(x.fb):
            return (x.free, W, *x.pending_w[0]) if x.pending_w else None
        op, c, mb = x.fb[x.next]
        if op == F and len(x.pending_w) > hold[s]:
            return (x.free, W, *x.pending_w[0])
        at = ready.get((s, op, c, mb))
        if at is not None and at <= x.free:
            return x.free, op, c, mb
        if x.pending_w:
            return (x.free, W, *x.pending_w[0])
        return (at, op, c, mb) if at is not None else None

    def on_run(x, op, _c, _mb):
        if op != W:
            x.next += 1

    return _run(ranks, placement, microbatches, times, chunks, choose, on_run)


def v_order(stages: int, microbatches: int, times: Sequence[float] = (1.0, 1.0, 1.0), w_share: float = 0.5,
            cap: Optional[float] = None, reserve: float = 1.0) -> List[Order]:
    """ZB-V's orders (``pp/chunks.py``); ``cap``: chunk activations a stage may hold (default
    ``2 p``: p micro-batches of the stage's layers, 1F1B's first stage)."""
    p, m = stages, microbatches
    cap = 2.0 * p if cap is None else cap
    ranks = [_Rank(next_f=[0, 0], next_b=[0, 0]) for _ in range(p)]

    def choose(s, x, ready):
        cands = []  # (priority, op, chunk, mb, ready time)
        for c in (1, 0):
            if x.next_b[c] < m:
                cands.append((0, B, c, x.next_b[c]))
        if x.next_f[1] < m and x.mem + 1 <= cap + 1e-9:
            cands.append((1, F, 1, x.next_f[1]))
        if x.next_f[0] < m and x.mem + 1 + reserve <= cap + 1e-9:
            cands.append((2, F, 0, x.next_f[0]))
        known = [(ready[(s, op, c, mb)], prio, op, c, mb) for prio, op, c, mb in cands if (s, op, c, mb) in ready]
        now = [k for k in known if k[0] <= x.free]
        if now:
            _at, _prio, op, c, mb = min(now, key=lambda k: (k[1], k[0]))
            return x.free, op, c, mb
        if x.pending_w:
            return (x.free, W, *x.pending_w[0])
        if known:
            at, _prio, op, c, mb = min(known)
            return at, op, c, mb
        return None

    def on_run(x, op, c, mb):
        if op == F:
            x.next_f[c] += 1
            x.mem += 1
            x.waiting_f1 += 1 if c == 0 else -1
        elif op == B:
            x.next_b[c] += 1
            x.mem -= 1 - w_share
        else:
            x.mem -= w_share

    return _run(ranks, v_placement(p), m, times, 2, choose, on_run)
