"""One pipeline step of a ``Schedule`` in simulated time: when each stage computes, waits and
ends, what is exposed of the P2P transfers and of the data-parallel gradient sync.

Assumptions (the cost model's, and the emulated link's on CPU):

- compute actions take their stage's ``StageTimes`` (F, B and W per micro-batch; a B of a
  schedule that is not split also does the W);
- a transfer leaves when its sender posts it (eager), behind every earlier transfer of the
  same sender (one egress port per rank), and takes ``latency + bytes / bandwidth``; a WAIT on a
  receive ends when the transfer has arrived, on a send when it has left the port;
- posting costs ``post_ms``;
- the data-parallel reduction of a stage's gradients (``dp_ms``) starts with the stage's last
  backward of the last micro-batch (B, or its W when split: buckets fill as it runs, as
  Megatron DDP's ``overlap_grad_reduce`` does) and the step ends when every stage has both
  finished its actions and its reduction.

Reported per stage: ``busy`` (compute), ``idle`` = step - busy, ``p2p_exposed`` (time waited
while the awaited bytes were on the wire), ``dp_exposed`` (reduction after the stage's last
action), and the step; ``bubble`` = mean idle / step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

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
class PipelineTime:
    step_ms: float
    busy_ms: List[float]
    end_ms: List[float]
    p2p_exposed_ms: List[float]
    dp_exposed_ms: List[float]
    timeline: List[List[Tuple[str, float, float]]]  # per stage: (label, start, end) of compute

    @property
    def idle_ms(self) -> List[float]:
        return [self.step_ms - b for b in self.busy_ms]

    @property
    def bubble(self) -> float:
        return sum(self.idle_ms) / (len(self.idle_ms) * self.step_ms) if self.step_ms else 0.0


def simulate(schedule: Schedule, times: Sequence[StageTimes], link: LinkCost = LinkCost(),
             dp_ms: Sequence[float] = ()) -> PipelineTime:
    p = schedule.stages
    if len(times) == 1:
        times = list(times) * p
    dp = list(dp_ms) or [0.0] * p
    clock = [0.0] * p
    ptr = [0] * p
    busy = [0.0] * p
    p2p = [0.0] * p
    port = [0.0] * p  # when each rank's egress port is free
    sent: Dict[Tuple[int, Comm], Tuple[float, float]] = {}  # (sender, its SEND) -> (leaves, arrives)
    dp_start = [None] * p
    timeline: List[List[Tuple[str, float, float]]] = [[] for _ in range(p)]
    last = {s: _last_backward(schedule, s) for s in range(p)}
    wire = link.latency_ms + link.transfer_ms
    while any(ptr[s] < len(schedule.actions[s]) for s in range(p)):
        moved = False
        for s in range(p):
            while ptr[s] < len(schedule.actions[s]):
                a = schedule.actions[s][ptr[s]]
                if a.op == POST:
                    clock[s] += link.post_ms
                    for c in a.comms:
                        if c.op == SEND:
                            leave = max(clock[s], port[s])
                            port[s] = leave + link.transfer_ms
                            sent[(s, c)] = (leave, leave + wire)
                elif a.op == WAIT:
                    c = a.comms[0]
                    key = (s, c) if c.op == SEND else (c.peer, Comm(SEND, c.kind, c.mb, s))
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
                    dur = {F: t.f, B: t.b if schedule.split else t.b + t.w, W: t.w}[a.op]
                    if (a.op, a.mb) == last[s]:
                        dp_start[s] = clock[s]
                    timeline[s].append((f"{a.op}{a.mb}", clock[s], clock[s] + dur))
                    clock[s] += dur
                    busy[s] += dur
                ptr[s] += 1
                moved = True
        if not moved:
            raise RuntimeError("simulation stalled: the schedule was not validated")
    ends = [max(clock[s], (dp_start[s] or 0.0) + dp[s]) if dp[s] else clock[s] for s in range(p)]
    step = max(ends) if ends else 0.0
    dp_exposed = [max(0.0, ends[s] - clock[s]) for s in range(p)]
    return PipelineTime(step_ms=step, busy_ms=busy, end_ms=ends, p2p_exposed_ms=p2p, dp_exposed_ms=dp_exposed,
                        timeline=timeline)


def _last_backward(schedule: Schedule, s: int):
    ops = [(a.op, a.mb) for a in schedule.actions[s] if a.op in COMPUTE]
    want = W if schedule.split else B
    backward = [x for x in ops if x[0] == want]
    return backward[-1] if backward else None

