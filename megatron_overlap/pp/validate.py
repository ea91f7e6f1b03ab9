"""Checks a ``Schedule`` before it runs; ``ScheduleError`` names the stage, the action and what
is wrong.

1. Compute: every micro-batch has one F, one B and (split schedules only) one W per stage, in
   micro-batch order (the data iterator is read in order, and gradients accumulate in stock's
   order), F before B before W.
2. Transfers: each stage sends and receives exactly the activations and gradients its position
   needs, each posted once and waited once after its POST; an F waits for its activation
   before it runs, a B for its gradient, a send is posted after the compute that produced it.
3. Matching: in each direction of each link both ends post the same transfers in the same
   order (transfers from one rank to another are matched in order: gloo by tag, NCCL by
   stream); between directions the order does not matter.
4. No deadlock, under both ways a backend may execute posted transfers: each direction of a
   link a FIFO of its own (gloo), or every batch of a rank in posting order,
   a batch finishing only when the peers' matching batches are executing (one NCCL
   communicator for the pipeline group, as ``batch_isend_irecv`` uses). The message passing is
   simulated until every stage ends.
5. Memory: activations held never exceed the schedule's bound on any stage (F adds one
   micro-batch; B frees it, or all but ``w_share`` of it in a split schedule, W the rest).
6. Drains (``Schedule.drain``): only in split schedules, one per stage; ``"bw"`` only where
   the last B sends nothing and only W actions follow it (stage 0).
"""

from __future__ import annotations

from typing import Dict, List, Tuple

from .schedule import ACT, B, COMPUTE, F, GRAD, POST, RECV, SEND, WAIT, W, Comm, Schedule


class ScheduleError(ValueError):
    """A schedule that must not run (module docstring)."""


def validate(schedule: Schedule) -> Dict[str, List[float]]:
    """Raise ``ScheduleError`` on the first problem; return the peak memory per stage."""
    for s in range(schedule.stages):
        _check_compute(schedule, s)
        _check_transfers(schedule, s)
        _check_drain(schedule, s)
    _check_matching(schedule)
    for model in ("link", "batch"):
        _simulate(schedule, model)
    return {"peak_memory": [_check_memory(schedule, s) for s in range(schedule.stages)]}


def _fail(schedule, stage, index, message):
    where = f"stage {stage}" + (f", action {index} ({schedule.actions[stage][index]})" if index is not None else "")
    raise ScheduleError(f"schedule {schedule.name!r} ({schedule.stages} stages, {schedule.microbatches} micro-batches) "
                        f"is rejected: {where}: {message}")


def _check_compute(schedule: Schedule, s: int) -> None:
    m = schedule.microbatches
    wanted = [F] if schedule.forward_only else ([F, B, W] if schedule.split else [F, B])
    chunks = [c for r, c in schedule.virtual_stages if r == s]
    seen = {(op, c): [] for op in COMPUTE for c in chunks}
    done = set()
    for i, a in enumerate(schedule.actions[s]):
        if a.op not in COMPUTE:
            continue
        if a.op not in wanted:
            _fail(schedule, s, i, f"{a.op} has no place in this schedule")
        if not 0 <= a.mb < m:
            _fail(schedule, s, i, f"micro-batch {a.mb} is outside 0..{m - 1}")
        if a.chunk not in chunks:
            _fail(schedule, s, i, f"model chunk {a.chunk} is not placed on this stage (it holds {chunks})")
        need = {F: None, B: F, W: B}[a.op]
        if need is not None and (need, a.chunk, a.mb) not in done:
            _fail(schedule, s, i, f"{a} runs before {need}{a.mb}" + (f"@{a.chunk}" if a.chunk else ""))
        past = seen[(a.op, a.chunk)]
        if past and a.mb <= past[-1]:
            _fail(schedule, s, i, f"{a} out of micro-batch order (after {a.op}{past[-1]})")
        past.append(a.mb)
        done.add((a.op, a.chunk, a.mb))
    for (op, c), mbs in seen.items():
        if op in wanted and len(mbs) != m:
            _fail(schedule, s, None, f"{len(mbs)} {op} actions of chunk {c} for {m} micro-batches")


def _check_drain(schedule: Schedule, s: int) -> None:
    if not schedule.drain:
        return
    if not schedule.split or len(schedule.drain) != schedule.stages:
        raise ScheduleError(f"schedule {schedule.name!r} is rejected: a drain needs a split schedule and one entry "
                            f"per stage, got {schedule.drain!r}")
    how = schedule.drain[s]
    if how not in ("", "w", "bw"):
        _fail(schedule, s, None, f"drain {how!r} is not one of '', 'w', 'bw'")
    if how != "bw":
        return
    acts = schedule.actions[s]
    last_b = max(i for i, a in enumerate(acts) if a.op == B)
    if s > 0:
        _fail(schedule, s, last_b, "drains its weight gradients inside its last B, which sends a gradient: only "
              "stage 0 may ('w' drains after it)")
    after = [a for a in acts[last_b + 1:] if a.op in COMPUTE]
    if any(a.op != W for a in after):
        _fail(schedule, s, last_b, "drains inside its last B, but a forward or backward follows it")


def neighbours(schedule: Schedule, s: int, chunk: int):
    """((stage, chunk) before, (stage, chunk) after) the virtual stage that ``chunk`` of stage
    ``s`` runs; None at the model's ends."""
    vs = schedule.virtual_stages
    j = vs.index((s, chunk))
    return (vs[j - 1] if j else None), (vs[j + 1] if j + 1 < len(vs) else None)


def _needed(schedule: Schedule, s: int) -> set:
    """The transfers stage ``s`` posts; none between two chunks of one stage."""
    need = set()
    for r, c in schedule.virtual_stages:
        if r != s:
            continue
        prev, nxt = neighbours(schedule, s, c)
        for mb in range(schedule.microbatches):
            if prev is not None and prev[0] != s:
                need.add(Comm(RECV, ACT, mb, prev[0], c, prev[1]))
                if not schedule.forward_only:
                    need.add(Comm(SEND, GRAD, mb, prev[0], c, prev[1]))
            if nxt is not None and nxt[0] != s:
                need.add(Comm(SEND, ACT, mb, nxt[0], c, nxt[1]))
                if not schedule.forward_only:
                    need.add(Comm(RECV, GRAD, mb, nxt[0], c, nxt[1]))
    return need


def _input_ready(schedule, s, a, waited, done) -> str:
    """Why compute action ``a`` of stage ``s`` may not run yet ('' when it may)."""
    prev, nxt = neighbours(schedule, s, a.chunk)
    if a.op == F and prev is not None:
        if prev[0] != s and Comm(RECV, ACT, a.mb, prev[0], a.chunk, prev[1]) not in waited:
            return "runs before its activation's receive was waited for"
        if prev[0] == s and (F, prev[1], a.mb) not in done:
            return f"runs before F{a.mb}@{prev[1]}, on this stage, produced its input"
    if a.op == B and nxt is not None:
        if nxt[0] != s and Comm(RECV, GRAD, a.mb, nxt[0], a.chunk, nxt[1]) not in waited:
            return "runs before its gradient's receive was waited for"
        if nxt[0] == s and (B, nxt[1], a.mb) not in done:
            return f"runs before B{a.mb}@{nxt[1]}, on this stage, produced its gradient"
    return ""


def _check_transfers(schedule: Schedule, s: int) -> None:
    posted, waited, done = set(), set(), set()
    for i, a in enumerate(schedule.actions[s]):
        if a.op == POST:
            for c in a.comms:
                if c in posted:
                    _fail(schedule, s, i, f"{c} is posted twice")
                producer = (F if c.kind == ACT else B, c.chunk, c.mb)
                if c.op == SEND and producer not in done:
                    _fail(schedule, s, i, f"{c} is posted before {producer[0]}{producer[2]} produced it")
                posted.add(c)
        elif a.op == WAIT:
            c = a.comms[0]
            if c not in posted:
                _fail(schedule, s, i, f"waits for {c}, which is not posted before")
            if c in waited:
                _fail(schedule, s, i, f"waits twice for {c}")
            waited.add(c)
        else:
            why = _input_ready(schedule, s, a, waited, done)
            if why:
                _fail(schedule, s, i, why)
            done.add((a.op, a.chunk, a.mb))
    need = _needed(schedule, s)
    if posted != need:
        extra, missing = sorted(map(str, posted - need)), sorted(map(str, need - posted))
        _fail(schedule, s, None, f"transfers wrong: not needed {extra or 'none'}, missing {missing or 'none'}")
    if waited != posted:
        _fail(schedule, s, None, f"never waited for: {sorted(map(str, posted - waited))}")


def _channel(schedule: Schedule, s: int, src: int, dst: int) -> List[Tuple[str, int]]:
    """(kind, mb) of every transfer from ``src`` to ``dst`` that stage ``s`` (one of the two)
    posts, in order."""
    op, peer = (SEND, dst) if s == src else (RECV, src)
    out = [(c.kind, c.mb, c.chunk, c.peer_chunk) for c in schedule.comms(s) if c.peer == peer and c.op == op]
    return [(k, mb, *((x, y) if op == SEND else (y, x))) for k, mb, x, y in out]  # (.., sender's chunk, receiver's)


def _check_matching(schedule: Schedule) -> None:
    p = schedule.stages
    for src, dst in ((a, b) for a in range(p) for b in range(p) if a != b):
        a, b = _channel(schedule, src, src, dst), _channel(schedule, dst, src, dst)
        for k, (x, y) in enumerate(zip(a, b)):
            if x != y:
                raise ScheduleError(
                    f"schedule {schedule.name!r} is rejected: transfer {k} from stage {src} to stage {dst} is "
                    f"{x[0]} {x[1]} where it is sent but {y[0]} {y[1]} where it is received: both ends must post "
                    "the transfers of one direction in the same order")


def _simulate(schedule: Schedule, model: str) -> None:
    """Run the message passing (module docstring, point 4); raise on a deadlock."""
    p = schedule.stages
    acts = schedule.actions
    ptr = [0] * p
    channel_posts: Dict[Tuple[int, int, str], List[Comm]] = {}  # (stage, peer, op) -> posted, in order
    batches: List[List[Tuple[Comm, ...]]] = [[] for _ in range(p)]  # per stage: posted batches
    active = [0] * p  # index of each stage's executing batch (model "batch")
    complete = set()  # (stage, comm)
    pending: List[List[Comm]] = [[] for _ in range(p)]  # model "link": posted, not complete
    position: Dict[Tuple[int, Comm], int] = {}  # (stage, comm) -> its place on its channel

    def mate(s, c):
        return c.peer, c.mate(s)

    def settle():
        changed = True
        while changed:
            changed = False
            for s in range(p):
                if model == "link":
                    for c in pending[s]:
                        if (s, c) in complete:
                            continue
                        peer, m = mate(s, c)
                        mine = position[(s, c)]
                        theirs = channel_posts.get((peer, s, m.op), [])
                        if mine < len(theirs) and theirs[mine] == m:
                            complete.update({(s, c), (peer, m)})
                            changed = True
                    pending[s] = [c for c in pending[s] if (s, c) not in complete]
                else:
                    while active[s] < len(batches[s]):
                        batch = batches[s][active[s]]
                        for c in batch:
                            peer, m = mate(s, c)
                            if (s, c) not in complete and active[peer] < len(batches[peer]) and \
                                    m in batches[peer][active[peer]]:
                                complete.update({(s, c), (peer, m)})
                                changed = True
                        if all((s, c) in complete for c in batch):
                            active[s] += 1
                            changed = True
                        else:
                            break

    while True:
        moved = False
        for s in range(p):
            while ptr[s] < len(acts[s]):
                a = acts[s][ptr[s]]
                if a.op == WAIT and (s, a.comms[0]) not in complete:
                    settle()
                    if (s, a.comms[0]) not in complete:
                        break
                if a.op == POST:
                    batches[s].append(a.comms)
                    for c in a.comms:
                        channel = channel_posts.setdefault((s, c.peer, c.op), [])
                        position[(s, c)] = len(channel)
                        channel.append(c)
                        pending[s].append(c)
                ptr[s] += 1
                moved = True
        if all(ptr[s] == len(acts[s]) for s in range(p)):
            settle()
            return
        if not moved:
            settle()
            if not any(acts[s][ptr[s]].op == WAIT and (s, acts[s][ptr[s]].comms[0]) in complete
                       for s in range(p) if ptr[s] < len(acts[s])):
                stuck = "; ".join(f"stage {s} at action {ptr[s]} ({acts[s][ptr[s]]})" for s in range(p)
                                  if ptr[s] < len(acts[s]))
                how = "each direction of a link in order" if model == "link" else "each rank's batches in order"
                raise ScheduleError(f"schedule {schedule.name!r} is rejected: it deadlocks when transfers run "
                                    f"{how}: {stuck}")


def _check_memory(schedule: Schedule, s: int) -> float:
    if schedule.forward_only:
        return 0.0
    live = peak = 0.0
    w = schedule.w_share if schedule.split else 0.0
    unit = 1.0 / schedule.chunks  # a chunk's share of the stage's layers
    for i, a in enumerate(schedule.actions[s]):
        if a.op == F:
            live += unit
        elif a.op == B:
            live -= (1.0 - w) * unit
        elif a.op == W:
            live -= w * unit
        if live > schedule.memory_bound[s] + 1e-9:
            _fail(schedule, s, i, f"holds {live:g} micro-batches' activations, above its bound "
                  f"{schedule.memory_bound[s]:g}")
        peak = max(peak, live)
    return peak
