"""One pipeline step of a ``Schedule`` in simulated time: when each stage computes, waits and
ends, what is exposed of the P2P transfers and of the data-parallel sync.

Assumptions (the cost model's, and the emulated link's on CPU):

- compute actions take their stage's ``StageTimes`` (F, B and W per micro-batch; a B of a
  schedule that is not split also does the W);
- a transfer leaves when its sender posts it (eager), behind every earlier transfer of the
  same sender (one egress port per rank), and takes ``latency + bytes / bandwidth``; a WAIT on a
  receive ends when the transfer has arrived, on a send when it has left the port;
- posting costs ``post_ms``;
- the data-parallel traffic of a stage (``DPSync``, Megatron DDP with ``overlap_grad_reduce``,
  and with the distributed optimizer's ``overlap_param_gather``) runs on a port of its own
  beside the pipeline's (the data-parallel communicator runs next to the pipeline's, as NCCL
  communicators do on their own streams; the P2P traffic is a small share of a port, so the
  sharing this leaves out moves little), one collective after the other:

  * gradient buckets: a bucket's reduce-scatter (or all-reduce) starts once its last gradient
    is in. With several buckets (Megatron buckets only the first stage) they fill in order
    over the stage's last gradient segment: its last B (not split), its last W (split), or,
    where the schedule drains its weight gradients layer by layer (``Schedule.drain``), the
    trailing W actions together (``"w"``), or the last B with them (``"bw"``); one bucket is
    complete at the end of that segment;
  * parameter buckets (distributed optimizer): the first forward of the step needs them in
    order; bucket 0 is dispatched at the step's start (``gather_at_start``) or by the first
    forward's hook (Megatron's non-interleaved schedule), bucket k + 1 when the forward has
    waited for bucket k; the forward's share of a bucket's layers runs once it is gathered.

  * virtual pipelines with one DDP per model chunk (``DPSync.reduce_chunks``, Megatron-LM's
    ``get_model`` with ``--virtual-pipeline-model-parallel-size``): each chunk's buckets are
    dispatched together when its last gradient is in, or ``sync_delay`` backwards later (stock),
    or one by one as they fill over that last gradient action (``DPSync.fill``: ours), and each
    chunk's first forward waits for its own parameter buckets (``_ChunkDP``).

  The step ends when every stage has finished its actions and its reductions (the optimizer
  step that follows synchronises the stages: gradient clipping's norm).

Reported per stage: ``busy`` (compute), ``idle`` = step - busy, ``p2p_exposed`` (time waited
while the awaited bytes were on the wire), ``dp_exposed`` (the reductions after the stage's
last action, plus the forward's waits for parameters), and the step; ``bubble`` = mean idle /
step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

from .schedule import B, COMPUTE, F, POST, SEND, WAIT, W, Comm, Schedule


@dataclass(frozen=True)
class StageTimes:
    f: float
    b: float
    w: float


@dataclass(frozen=True)
class LinkCost:
    transfer_ms: float = 0.0  # one activation (or gradient) of one micro-batch, on the wire
    latency_ms: float = 0.0
    post_ms: float = 0.0


@dataclass(frozen=True)
class DPSync:
    """One stage's data-parallel traffic per step (module docstring). ``reduce_ms``: each
    gradient bucket's reduction on the port, in the order the backward fills them (Megatron's
    bucket 0 holds the last layers); ``gather_ms``: each parameter bucket's all-gather, in the
    order the forward needs them (empty: no distributed optimizer, or no overlap);
    ``latency_ms`` per collective."""

    reduce_ms: Tuple[float, ...] = ()
    gather_ms: Tuple[float, ...] = ()
    latency_ms: float = 0.0
    gather_at_start: bool = False
    # virtual pipelines (one DDP per model chunk): the chunk of each reduce and gather bucket;
    # ``sync_delay``: a chunk's buckets leave that many backwards after its last one (Megatron's
    # interleaved schedule staggers them by the pipeline rank); ``gather_aligned``: a chunk's
    # gathers leave in bucket order, last layers first (Megatron's ``start_param_sync`` under
    # ``align_param_gather``), so its first forward waits for all of them; see ``_ChunkDP``
    reduce_chunks: Tuple[int, ...] = ()
    gather_chunks: Tuple[int, ...] = ()
    sync_delay: int = 0
    gather_aligned: bool = False
    # ``fill``: a chunk's buckets leave as they fill over its last gradient action (DDP's hooks, ours)
    fill: bool = False

    def __post_init__(self):
        if any(x < 0 for x in self.reduce_ms + self.gather_ms) or self.latency_ms < 0:
            raise ValueError(f"data-parallel times must be >= 0, got {self}")

    @property
    def reduce_total_ms(self) -> float:
        return sum(self.reduce_ms) + (self.latency_ms if self.reduce_ms else 0.0)

    @property
    def gather_total_ms(self) -> float:
        return sum(self.gather_ms) + (self.latency_ms if self.gather_ms else 0.0)

    def replace(self, **kw) -> "DPSync":
        from dataclasses import replace

        return replace(self, **kw)


NO_DP = DPSync()


@dataclass(frozen=True)
class PipelineTime:
    step_ms: float
    busy_ms: List[float]
    end_ms: List[float]
    p2p_exposed_ms: List[float]
    dp_exposed_ms: List[float]
    timeline: List[List[Tuple[str, float, float]]]  # per stage: (label, start, end) of compute
    dp_reduce_exposed_ms: List[float] = field(default_factory=list)  # reductions after the last action
    dp_gather_wait_ms: List[float] = field(default_factory=list)  # the first forward's waits for parameters
    dp_spans: List[List[Tuple[str, float, float]]] = field(default_factory=list)  # per stage: ("RS"/"AG", start, end)

    @property
    def idle_ms(self) -> List[float]:
        return [self.step_ms - b for b in self.busy_ms]

    @property
    def bubble(self) -> float:
        return sum(self.idle_ms) / (len(self.idle_ms) * self.step_ms) if self.step_ms else 0.0


def simulate(schedule: Schedule, times: Sequence[StageTimes], link: LinkCost = LinkCost(),
             dp: Sequence[DPSync] | DPSync = ()) -> PipelineTime:
    p = schedule.stages
    if len(times) == 1:
        times = list(times) * p
    syncs = _per_stage(dp, p)
    clock = [0.0] * p
    ptr = [0] * p
    busy = [0.0] * p
    p2p = [0.0] * p
    port = [0.0] * p  # when each rank's egress port is free
    sent: Dict[Tuple[int, Comm], Tuple[float, float]] = {}  # (sender, its SEND) -> (leaves, arrives)
    timeline: List[List[Tuple[str, float, float]]] = [[] for _ in range(p)]
    dp_state = [_ChunkDP(sync, schedule, s) if sync.reduce_chunks else _DPState(sync) for s, sync in enumerate(syncs)]
    segments = [grad_segment(schedule, s) for s in range(p)]
    first_f = [_first_forwards(schedule, s, bool(syncs[s].reduce_chunks)) for s in range(p)]
    wire = link.latency_ms + link.transfer_ms
    while any(ptr[s] < len(schedule.actions[s]) for s in range(p)):
        moved = False
        for s in range(p):
            while ptr[s] < len(schedule.actions[s]):
                i = ptr[s]
                a = schedule.actions[s][i]
                if a.op == POST:
                    clock[s] += link.post_ms
                    for c in a.comms:
                        if c.op == SEND:
                            leave = max(clock[s], port[s])
                            port[s] = leave + link.transfer_ms
                            sent[(s, c)] = (leave, leave + wire)
                elif a.op == WAIT:
                    c = a.comms[0]
                    key = (s, c) if c.op == SEND else (c.peer, c.mate(s))
                    if key not in sent:
                        break  # the sender has not posted it yet
                    leave, arrive = sent[key]
                    done = leave + link.transfer_ms if c.op == SEND else arrive
                    start = clock[s]
                    if done > start:
                        p2p[s] += done - max(start, leave)
                        clock[s] = done
                else:
                    t = times[s]
                    dur = {F: t.f, B: t.b if schedule.split else t.b + t.w, W: t.w}[a.op] / schedule.chunks
                    start = clock[s]
                    if i in first_f[s]:
                        start = dp_state[s].forward(start, dur, a.chunk)
                        end = dp_state[s].forward_end
                    else:
                        end = start + dur
                    timeline[s].append((str(a), start, end))
                    clock[s] = end
                    busy[s] += dur
                    dp_state[s].segment(i, segments[s], start, end)
                ptr[s] += 1
                moved = True
        if not moved:
            raise RuntimeError("simulation stalled: the schedule was not validated")
    reduce_exposed = [max(0.0, dp_state[s].reduce_end - clock[s]) for s in range(p)]
    ends = [max(clock[s], dp_state[s].reduce_end) for s in range(p)]
    step = max(ends) if ends else 0.0
    gather_wait = [d.gather_wait for d in dp_state]
    return PipelineTime(step_ms=step, busy_ms=busy, end_ms=ends, p2p_exposed_ms=p2p,
                        dp_exposed_ms=[r + g for r, g in zip(reduce_exposed, gather_wait)], timeline=timeline,
                        dp_reduce_exposed_ms=reduce_exposed, dp_gather_wait_ms=gather_wait,
                        dp_spans=[d.spans for d in dp_state])


def _per_stage(dp, p: int) -> List[DPSync]:
    if isinstance(dp, DPSync):
        return [dp] * p
    dp = list(dp)
    if not dp:
        return [NO_DP] * p
    if len(dp) == 1:
        return dp * p
    if len(dp) != p:
        raise ValueError(f"{len(dp)} data-parallel syncs for {p} stages")
    return dp


class _DPState:
    """One stage's data-parallel port and its buckets during the simulation."""

    def __init__(self, sync: DPSync):
        self.sync = sync
        self.port = 0.0
        self.gather_wait = 0.0
        self.reduce_end = 0.0
        self.forward_end = 0.0
        self.spans: List[Tuple[str, float, float]] = []
        self._seg_start: Optional[float] = None
        self._gathered: Optional[float] = None
        if sync.gather_ms and sync.gather_at_start:
            self._gathered = self._book("AG", 0.0, sync.gather_ms[0])

    def _book(self, kind: str, ready: float, ms: float) -> float:
        start = max(ready, self.port)
        self.port = start + ms
        done = self.port + self.sync.latency_ms
        self.spans.append((kind, start, done))
        return done

    def forward(self, start: float, dur: float, chunk: int = 0) -> float:
        """The step's first forward, starting at ``start`` (its input in hand): its parameter
        buckets gathered in order, each bucket's share of the forward once it is in. Returns
        when the forward's compute began (``forward_end`` is set to its end)."""
        gather = self.sync.gather_ms
        if not gather:
            self.forward_end = start + dur
            return start
        total = sum(gather)
        shares = [ms / total for ms in gather] if total else [1.0 / len(gather)] * len(gather)
        t = start
        done = self._gathered if self._gathered is not None else self._book("AG", start, gather[0])
        began = None
        for k, share in enumerate(shares):
            if done > t:
                self.gather_wait += done - t
                t = done
            if began is None:
                began = t
            if k + 1 < len(gather):  # the hook that waited for bucket k dispatches bucket k + 1
                done = self._book("AG", t, gather[k + 1])
            t += dur * share
        self.forward_end = t
        return began

    def segment(self, index: int, seg: Tuple[int, int], start: float, end: float) -> None:
        """Compute action ``index`` ran over [start, end]; at the segment's last action the
        gradient buckets are booked."""
        if not self.sync.reduce_ms or seg is None:
            return
        first, last = seg
        if index == first:
            self._seg_start = start
        if index != last:
            return
        reduce = self.sync.reduce_ms
        seg_start = self._seg_start if self._seg_start is not None else start
        if len(reduce) == 1:
            ready = [end]
        else:
            total, acc, ready = sum(reduce) or 1.0, 0.0, []
            for ms in reduce:
                acc += ms
                ready.append(seg_start + (end - seg_start) * acc / total)
        for r, ms in zip(ready, reduce):
            self.reduce_end = max(self.reduce_end, self._book("RS", r, ms))


def grad_segment(schedule: Schedule, s: int) -> Optional[Tuple[int, int]]:
    """(first, last) action index of stage ``s``'s last gradient segment (module docstring):
    where its gradient buckets fill."""
    acts = schedule.actions[s]
    compute = [(i, a.op) for i, a in enumerate(acts) if a.op in COMPUTE]
    backward = [i for i, op in compute if op == B]
    if not backward:
        return None
    last_b = backward[-1]
    if not schedule.split:
        return last_b, last_b
    ws = [i for i, op in compute if op == W]
    if not ws:
        return None
    drain = schedule.drain[s] if schedule.drain else ""
    trailing = [i for i in ws if i > last_b]
    if drain == "bw" and trailing:
        return last_b, trailing[-1]
    if drain == "w" and trailing:
        return trailing[0], trailing[-1]
    return ws[-1], ws[-1]


def _first_forwards(schedule: Schedule, s: int, per_chunk: bool) -> set:
    """Indices of the forwards that wait for parameters: the stage's first, or each chunk's."""
    firsts: Dict[int, int] = {}
    for i, a in enumerate(schedule.actions[s]):
        if a.op == F and (a.chunk if per_chunk else 0) not in firsts:
            firsts[a.chunk if per_chunk else 0] = i
    return set(firsts.values())


class _ChunkDP(_DPState):
    """A stage of a virtual pipeline with one DDP per model chunk (``DPSync.reduce_chunks``):
    as Megatron's interleaved schedule drives them (``align_grad_reduce`` and
    ``align_param_gather``, its defaults), a chunk's gradient buckets are all dispatched when its
    last gradient is in (the end of its last B, or of its last W in a split schedule), or
    ``sync_delay`` backwards later; those of a chunk that never reaches that point at the stage's
    last compute; with ``fill`` (ours: every chunk bucketed, DDP's hooks sending each bucket once
    its gradients are in) bucket k leaves once its share of that last action has run. Parameter buckets: chunks 0 and 1 all dispatched at the step's start
    (``gather_at_start``, else at their first forward), a later chunk's at its first forward,
    in the order the forward needs them, or with ``gather_aligned`` in bucket order (stock's: the
    first layers' bucket last); a chunk's first forward runs each bucket's share once it is
    gathered."""

    def __init__(self, sync: DPSync, schedule: Schedule, s: int):
        super().__init__(sync.replace(gather_at_start=False))
        self.sync = sync
        acts = schedule.actions[s]
        grad = W if schedule.split else B
        last = {a.chunk: i for i, a in enumerate(acts) if a.op == grad}
        backwards = [i for i, a in enumerate(acts) if a.op == B]
        compute = [i for i, a in enumerate(acts) if a.op in COMPUTE]
        self.ready_at: Dict[int, List[int]] = {}
        for c, i in last.items():
            if sync.sync_delay:
                k = backwards.index(max(j for j in backwards if acts[j].chunk == c)) + sync.sync_delay
                i = max(i, backwards[k] if k < len(backwards) else compute[-1])
            self.ready_at.setdefault(i, []).append(c)
        self.gathered: Dict[int, List[float]] = {}
        if sync.gather_ms and sync.gather_at_start:
            for c in sorted(set(sync.gather_chunks))[:2]:
                self._gather(c, 0.0)

    def _gather(self, chunk: int, ready: float) -> List[float]:
        """Book ``chunk``'s gathers on the port; when each is in, in the order the forward needs them."""
        sizes = [ms for ms, c in zip(self.sync.gather_ms, self.sync.gather_chunks) if c == chunk]
        if self.sync.gather_aligned:
            self.gathered[chunk] = [self._book("AG", ready, ms) for ms in reversed(sizes)][::-1]
        else:
            self.gathered[chunk] = [self._book("AG", ready, ms) for ms in sizes]
        return self.gathered[chunk]

    def forward(self, start: float, dur: float, chunk: int = 0) -> float:
        sizes = [ms for ms, c in zip(self.sync.gather_ms, self.sync.gather_chunks) if c == chunk]
        if not sizes:
            self.forward_end = start + dur
            return start
        done = self.gathered.get(chunk) or self._gather(chunk, start)
        total = sum(sizes)
        t, began = start, None
        for d, ms in zip(done, sizes):
            if d > t:
                self.gather_wait += d - t
                t = d
            began = t if began is None else began
            t += dur * (ms / total if total else 1.0 / len(sizes))
        self.forward_end = t
        return began

    def segment(self, index: int, seg, start: float, end: float) -> None:
        for c in self.ready_at.get(index, ()):
            sizes = [ms for ms, bc in zip(self.sync.reduce_ms, self.sync.reduce_chunks) if bc == c]
            total, acc = sum(sizes) or 1.0, 0.0
            for ms in sizes:  # with ``fill`` bucket k is in after its share of the action, else all at its end
                acc += ms
                ready = start + (end - start) * acc / total if self.sync.fill else end
                self.reduce_end = max(self.reduce_end, self._book("RS", ready, ms))
