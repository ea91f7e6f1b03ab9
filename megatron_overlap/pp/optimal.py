"""The shortest step any pipeline schedule can reach, proved by a constraint solver: a floor
computed independently of our schedule generator, to score it against.

The model is the simulator's (``pp/schedule_sim.py``), with every choice left free:

- each stage runs its forwards F, backwards B and (split) weight gradients W of one step, one
  at a time, with the given durations; W(k) after B(k) after F(k); each kind in micro-batch
  order (as every schedule here and Megatron's run them);
- an activation leaves stage s for s + 1 once F(s, k) has run, a gradient leaves s for s - 1
  once B(s, k) has run; each takes ``transfer_ms`` on its sender's one egress port (transfers
  of one port one after the other, in any order) and arrives ``latency_ms`` later; F(s, k)
  waits for its activation, B(s, k) for its gradient;
- memory: a micro-batch holds one activation on a stage from the start of its F to the end of
  its B, and ``w_share`` of one from then to the end of its W; at no time may a stage hold more
  than ``memory`` activations (1F1B holds ``p`` on stage 0, ``p - s`` on stage s);
- ``piece``: W may be cut in two, a piece of ``piece[0]`` ms holding ``piece[1]`` of an
  activation, which runs apart from the rest (a linear layer's weight gradient held back
  further than the others);
- not split (``split=False``): B does the weight gradients too, nothing is held after it;
- the data-parallel sync (``dp``, one ``DPSync`` per stage, on a port of its own, as the
  simulator has it): the gradient reduction occupies the stage's DP port for all its buckets
  and ends before the step does (the optimizer step follows); it cannot start before the last
  micro-batch's backward has started (no parameter's gradient is complete earlier) and, with
  one bucket, before the stage's last weight gradient has ended; it ends no earlier than that
  last weight gradient plus the last bucket's reduction. The parameter all-gather (distributed
  optimizer) runs from the step's start: the stage's first forward starts once the first
  bucket is in and ends no earlier than the last bucket is in (each a relaxation of what any
  schedule does, so the floor stays a floor).

Posting and per-action overheads are free; the order of a port's transfers is the solver's.
Both only shorten steps, so the answer is a floor for every schedule the simulator can score
(under the micro-batch-order assumption above). The solver is CP-SAT (OR-tools, ``pip install
ortools``); an answer it cannot prove optimal within ``time_limit_s`` is reported with its
proved bound.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

from .schedule_sim import DPSync, StageTimes, _per_stage

_TIME = 100  # solver ticks per ms
_MEM = 100  # memory ticks per activation


@dataclass(frozen=True)
class Floor:
    step_ms: float  # the best schedule found
    bound_ms: float  # no schedule is shorter (equals step_ms when proved optimal)
    optimal: bool
    busy_ms: List[float]
    orders: List[List[str]]  # per stage, the found schedule's actions in order ("F0", "B0", "W0", ...)

    @property
    def bubble(self) -> float:
        """Mean idle / step over the stages of the found schedule."""
        return 1 - sum(self.busy_ms) / (len(self.busy_ms) * self.step_ms)

    @property
    def bubble_floor(self) -> float:
        """No schedule's bubble is below this (the bubble at the proved bound)."""
        return 1 - sum(self.busy_ms) / (len(self.busy_ms) * self.bound_ms)


def _solver_module():
    try:
        from ortools.sat.python import cp_model
    except ImportError as exc:
        raise ImportError("the pipeline floor needs OR-tools' CP-SAT solver: pip install ortools "
                          "(or megatron-overlap[floor])") from exc
    return cp_model


def floor(times: Sequence[StageTimes], microbatches: int, transfer_ms: float, latency_ms: float = 0.0,
          memory: Optional[Sequence[float] | float] = None, w_share: float = 0.5, split: bool = True,
          piece: Optional[Tuple[float, float]] = None, time_limit_s: float = 60.0,
          dp: Sequence[DPSync] | DPSync = (), placement: Sequence[Tuple[int, int]] = (),
          bound_only: bool = False) -> Floor:
    """The shortest step over every schedule of ``len(times)`` stages and ``microbatches``
    micro-batches in the model above. ``memory``: activations a stage may hold (a number, or
    one per stage; default: 1F1B's peak, ``p`` on every stage). ``placement``: a virtual
    pipeline, (stage, chunk) of every virtual stage (``pp/chunks.py``): a chunk takes ``1 / v``
    of its stage's times and holds ``1 / v`` of its activation, a hand-over between two chunks
    of one stage takes no link. ``bound_only``: where the solver finds no schedule in time, the
    bound it proved is still returned (``step_ms`` infinite, no orders)."""
    cp_model = _solver_module()
    p, m = len(times), microbatches
    if p < 2 or m < 1:
        raise ValueError(f"a pipeline floor needs >= 2 stages and >= 1 micro-batch, got {p} and {m}")
    caps = [float(p)] * p if memory is None else ([float(memory)] * p if isinstance(memory, (int, float))
                                                   else [float(x) for x in memory])
    if len(caps) != p:
        raise ValueError(f"memory: {len(caps)} values for {p} stages")
    if min(caps) < 1:
        raise ValueError(f"memory is {min(caps):g} activations on a stage: below one micro-batch's, no schedule runs")
    if not 0 <= w_share <= 1:
        raise ValueError(f"w_share is {w_share:g}: the part of an activation a pending W holds is in [0, 1]")
    vs = list(placement) or [(s, 0) for s in range(p)]
    v = len(vs) // p
    ops = [[(op, d / v, h) for op, d, h in _ops([times[r]], split, piece, w_share)[0]] for r, _c in vs]
    model = cp_model.CpModel()
    syncs = _per_stage(dp, p) if dp else []
    dp_total = sum(x.reduce_total_ms + x.gather_total_ms for x in syncs)
    horizon = _ticks(m * sum(d for j in range(len(vs)) for _o, d, _h in ops[j])
                     + 2 * m * len(vs) * (transfer_ms + latency_ms) + dp_total + 1)
    start, end, iv = {}, {}, {}
    for j in range(len(vs)):
        for op, dur, _held in ops[j]:
            for k in range(m):
                a, e = model.NewIntVar(0, horizon, ""), model.NewIntVar(0, horizon, "")
                iv[j, op, k] = model.NewIntervalVar(a, _ticks(dur, down=True), e, "")
                start[j, op, k], end[j, op, k] = a, e
    spans = []  # per stage: when its last gradient (B or W) ends
    for s in range(p):
        mine = [j for j, (r, _c) in enumerate(vs) if r == s]
        model.AddNoOverlap([iv[j, op, k] for j in mine for op, _d, _h in ops[j] for k in range(m)])
        held, demand = [], []
        for j in mine:
            _order_and_hold(model, ops[j], j, m, start, end, horizon, held, demand, v)
        model.AddCumulative(held, demand, math.ceil(caps[s] * _MEM))
        spans.append(_busy_span(model, ops, mine, m, start, end, horizon))
    # durations and demands rounded down, capacities up: the floor stays below the exact one
    _transfers(model, vs, m, start, end, horizon, _ticks(transfer_ms, down=True), _ticks(latency_ms, down=True))
    step = model.NewIntVar(0, horizon, "step")
    ends = [end[j, op, m - 1] for j in range(len(vs)) for op, _d, _h in ops[j]]
    ends += _dp_sync(model, vs, m, ops, start, end, horizon, syncs, spans)
    model.AddMaxEquality(step, ends)
    model.Minimize(step)
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = time_limit_s
    solver.parameters.num_workers = 2
    status = solver.Solve(model)
    busy = [m * sum(d for j, (r, _c) in enumerate(vs) if r == s for _o, d, _h in ops[j]) for s in range(p)]
    if status == cp_model.UNKNOWN and bound_only and solver.BestObjectiveBound() > 0:
        return Floor(step_ms=math.inf, bound_ms=solver.BestObjectiveBound() / _TIME, optimal=False, busy_ms=busy,
                     orders=[])
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        raise RuntimeError(f"the solver found no schedule within {time_limit_s:g} s ({solver.StatusName(status)})")
    label = (lambda j, op, k: f"{op}{k}") if v == 1 else (lambda j, op, k: f"{op}{k}@{vs[j][1]}")
    orders = [[label(j, op, k) for _t, j, op, k in sorted((solver.Value(start[j, op, k]), j, op, k)
                                                          for j, (r, _c) in enumerate(vs) if r == s
                                                          for op, _d, _h in ops[j] for k in range(m))]
              for s in range(p)]
    return Floor(step_ms=solver.Value(step) / _TIME, bound_ms=solver.BestObjectiveBound() / _TIME,
                 optimal=status == cp_model.OPTIMAL, busy_ms=busy, orders=orders)


def _order_and_hold(model, ops, j, m, start, end, horizon, held, demand, v):
    """Virtual stage ``j``'s order (each kind in micro-batch order, F before B before W) and the
    activations it holds (``1 / v`` of a stage's per micro-batch)."""
    for k in range(m):
        for op, _d, _h in ops:
            if k:
                model.Add(start[j, op, k] >= end[j, op, k - 1])
            if op != "F":
                model.Add(start[j, op, k] >= end[j, "B" if op != "B" else "F", k])
        held.append(_span(model, start[j, "F", k], end[j, "B", k], horizon))
        demand.append(math.floor(_MEM / v))
        for op, _d, share in ops:
            if share is not None:
                held.append(_span(model, end[j, "B", k], end[j, op, k], horizon))
                demand.append(math.floor(share * _MEM / v))


def _ops(times, split, piece, w_share):
    """Per stage: (op, ms, the part of an activation it holds from its B to its end; None for F
    and B)."""
    out = []
    for t in times:
        if not split:
            out.append([("F", t.f, None), ("B", t.b + t.w, None)])
        elif piece is None:
            out.append([("F", t.f, None), ("B", t.b, None), ("W", t.w, w_share)])
        else:
            ms, share = piece
            if not 0 < ms < t.w or not 0 <= share <= w_share:
                raise ValueError(f"piece of W is {ms:g} ms holding {share:g} of an activation: it must be shorter "
                                 f"than the stage's W ({t.w:g} ms) and hold at most what W holds ({w_share:g})")
            out.append([("F", t.f, None), ("B", t.b, None), ("W", t.w - ms, w_share - share), ("V", ms, share)])
    return out


def _busy_span(model, ops, mine, m, start, end, horizon):
    """When the stage's last gradient (B or W) ends, and the implied bound on it that the
    solver's no-overlap propagation does not find by itself: every action of the stage starts
    after the first forward of its first virtual stage (each kind in micro-batch order, every
    later virtual stage's fed through it) and ends by its last gradient, one at a time, so that
    span holds all of the stage's busy time."""
    last = model.NewIntVar(0, horizon, "")
    model.AddMaxEquality(last, [end[j, op, m - 1] for j in mine for op, _d, _h in ops[j] if op != "F"])
    busy = m * sum(_ticks(d, down=True) for j in mine for _o, d, _h in ops[j])
    model.Add(last >= start[mine[0], "F", 0] + busy)
    return last


def _dp_sync(model, vs, m, ops, start, end, horizon, syncs, spans) -> list:
    """The data-parallel constraints of the module docstring; the times the step must cover."""
    out = []
    for s, sync in enumerate(syncs):
        mine = [j for j, (r, _c) in enumerate(vs) if r == s]
        if sync.gather_ms:
            model.Add(start[mine[0], "F", 0] >= _ticks(sync.gather_ms[0] + sync.latency_ms, down=True))
            model.Add(end[mine[-1], "F", 0] >= _ticks(sync.gather_total_ms, down=True))
        if not sync.reduce_ms:
            continue
        grad_end = spans[s]
        last_b = model.NewIntVar(0, horizon, "")
        model.AddMinEquality(last_b, [start[j, "B", m - 1] for j in mine])
        r_start = model.NewIntVar(0, horizon, "")
        model.Add(r_start >= (grad_end if len(sync.reduce_ms) == 1 else last_b))
        r_end = model.NewIntVar(0, horizon, "")
        model.Add(r_end >= r_start + _ticks(sync.reduce_total_ms, down=True))
        model.Add(r_end >= grad_end + _ticks(sync.reduce_ms[-1] + sync.latency_ms, down=True))
        out.append(r_end)
    return out


def _span(model, a, e, horizon):
    return model.NewIntervalVar(a, model.NewIntVar(0, horizon, ""), e, "")


def _transfers(model, vs, m, start, end, horizon, transfer, latency):
    """Activations j -> j + 1 after F, gradients j -> j - 1 after B, each on its sender's port;
    between two chunks of one stage a hand-over with no link."""
    ports = {}
    for j, (r, _c) in enumerate(vs):
        for k in range(m):
            for op, dest in (("F", j + 1), ("B", j - 1)):
                if not 0 <= dest < len(vs):
                    continue
                if vs[dest][0] == r:
                    model.Add(start[dest, op, k] >= end[j, op, k])
                    continue
                leave = model.NewIntVar(0, horizon, "")
                model.Add(leave >= end[j, op, k])
                ports.setdefault(r, []).append(model.NewIntervalVar(leave, transfer, leave + transfer, ""))
                model.Add(start[dest, op, k] >= leave + transfer + latency)
    for port in ports.values():
        model.AddNoOverlap(port)


def _ticks(ms: float, down: bool = False) -> int:
    return math.floor(ms * _TIME) if down else math.ceil(ms * _TIME)
