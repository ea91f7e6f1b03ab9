"""Schedules as data: a list of tasks on in-order streams, and the times they run.

Each task runs on one stream (``compute``; ``link``: the rank's egress port on its TP fabric;
``net``: its NIC, when a group spans nodes). Streams are in order (a CUDA stream, a FIFO port,
the one host thread of a CPU rank): a task starts once its stream is free and every task it
depends on is done::

    start = max(stream_free, max(end of deps))
    compute:  end = start + duration                       stream_free = end
    link:     end = start + busy + latency                 stream_free = start + busy

Tasks are listed in issue order (the order the program posts them), which is each stream's
order. Ranks are symmetric, so one rank is simulated: what a rank receives at ring step i is
what its neighbour sent at step i - 1, which ends when this rank's own send of step i - 1 ends.

Exposed communication is the time the compute stream sits idle because a task waits on a
transfer. SM contention: a compute task marked ``contended`` runs slower while ``sm_comm`` link
tasks are busy beside it (:func:`contended_gemm_ms`); the schedule is recomputed with the
slowed durations until it settles (a few passes). With a share ``sigma`` of the SMs taken by the
communication kernels while they run (0 for copy-engine and symmetric-memory transfers,
~ CTAs / SMs for NCCL), a GEMM of ``T_g`` beside a transfer of ``T_c`` takes::

    contended(T_g, T_c) = min(T_g / (1 - sigma),  T_g + sigma * T_c)

(the GEMM runs at 1 - sigma of its rate while the transfer lasts, at full rate after it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

COMPUTE = "compute"
LINK_STREAMS = ("link", "net")


def contended_gemm_ms(gemm_ms: float, comm_ms: float, sm_fraction: float) -> float:
    """GEMM time while a communication kernel holding ``sm_fraction`` of the SMs runs for up to
    ``comm_ms`` beside it (module docstring)."""
    if not 0.0 <= sm_fraction < 1.0:
        raise ValueError(f"sm_fraction must be in [0, 1), got {sm_fraction}")
    if sm_fraction == 0.0 or comm_ms <= 0.0:
        return gemm_ms
    return min(gemm_ms / (1.0 - sm_fraction), gemm_ms + sm_fraction * comm_ms)


@dataclass
class Task:
    name: str
    stream: str
    busy_ms: float
    deps: tuple = ()
    latency_ms: float = 0.0
    contended: bool = False  # a GEMM that loses SMs to concurrent ``sm_comm`` transfers
    sm_comm: bool = False  # a transfer whose kernels run on SMs (NCCL)
    comm_kind: str = "tp"  # tp / cp / dp / pp: which communication it belongs to


@dataclass
class Graph:
    tasks: list = field(default_factory=list)

    def add(self, name: str, stream: str, busy_ms: float, deps=(), **kw) -> int:
        deps = tuple(d for d in deps if d is not None)
        for d in deps:
            if not 0 <= d < len(self.tasks):
                raise ValueError(f"task {name!r} depends on unknown task {d}")
        self.tasks.append(Task(name, stream, max(0.0, busy_ms), deps, **kw))
        return len(self.tasks) - 1

    def compute(self, name: str, ms: float, deps=(), contended: bool = False) -> int:
        return self.add(name, COMPUTE, ms, deps, contended=contended)

    def transfer(self, name: str, cost, deps=(), stream: str = "link", sm_comm: bool = False, kind: str = "tp") -> int:
        return self.add(name, stream, cost.busy_ms, deps, latency_ms=cost.latency_ms, sm_comm=sm_comm, comm_kind=kind)


@dataclass
class Span:
    name: str
    stream: str  # compute / link / net / blocked
    start_ms: float
    end_ms: float


@dataclass
class Schedule:
    start: list
    end: list
    makespan_ms: float
    blocked: list  # (start_ms, end_ms, kind): compute idle, waiting on a transfer of that kind
    spans: list

    def exposed_ms(self, kind: str = None) -> float:
        return sum(b - a for a, b, k in self.blocked if kind is None or k == kind)

    def busy_ms(self, tasks: list, kind: str = None) -> float:
        """Link time of the transfers (busy + latency), as the emulated link counts it."""
        return sum(
            self.end[i] - self.start[i]
            for i, t in enumerate(tasks)
            if t.stream in LINK_STREAMS and (kind is None or t.comm_kind == kind)
        )


def _run(tasks: list, durations: list) -> tuple[list, list, list]:
    free: dict = {}
    start, end, blocked = [], [], []
    for i, t in enumerate(tasks):
        ready = max((end[d] for d in t.deps), default=0.0)
        s = max(free.get(t.stream, 0.0), ready)
        if t.stream in LINK_STREAMS:
            e = s + durations[i] + t.latency_ms
            free[t.stream] = s + durations[i]
        else:
            e = s + durations[i]
            idle_from = max(free.get(t.stream, 0.0), max((end[d] for d in t.deps if tasks[d].stream not in LINK_STREAMS), default=0.0))
            if s > idle_from:  # waiting on a transfer: exposed communication
                waits = [d for d in t.deps if tasks[d].stream in LINK_STREAMS and end[d] > idle_from]
                kind = tasks[max(waits, key=lambda d: end[d])].comm_kind if waits else "tp"
                blocked.append((idle_from, s, kind))
            free[t.stream] = e
        start.append(s)
        end.append(e)
    return start, end, blocked


def _overlap(a: float, b: float, intervals: list) -> float:
    return sum(max(0.0, min(b, y) - max(a, x)) for x, y in intervals)


def schedule(graph: Graph | list, sm_fraction: float = 0.0, passes: int = 4) -> Schedule:
    tasks = graph.tasks if isinstance(graph, Graph) else graph
    base = [t.busy_ms for t in tasks]
    durations = list(base)
    start, end, blocked = _run(tasks, durations)
    if sm_fraction > 0 and any(t.contended for t in tasks) and any(t.sm_comm for t in tasks):
        for _ in range(passes):
            comm = [(start[i], start[i] + durations[i]) for i, t in enumerate(tasks) if t.sm_comm]
            new = [
                contended_gemm_ms(base[i], _overlap(start[i], start[i] + base[i], comm), sm_fraction)
                if t.contended else base[i]
                for i, t in enumerate(tasks)
            ]
            if all(abs(x - y) < 1e-9 for x, y in zip(new, durations)):
                break
            durations = new
            start, end, blocked = _run(tasks, durations)
    makespan = max(end, default=0.0)
    spans = [Span(t.name, t.stream, start[i], end[i]) for i, t in enumerate(tasks) if end[i] > start[i]]
    spans += [Span("blocked", "blocked", a, b) for a, b, _ in blocked]
    return Schedule(start, end, makespan, blocked, spans)
