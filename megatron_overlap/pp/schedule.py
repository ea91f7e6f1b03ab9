"""Pipeline schedules as data: for each stage, the ordered actions it runs in one step.

    F(mb)    forward of micro-batch mb
    B(mb)    backward: the input gradient, and the weight gradient too unless the schedule is
             split (``Schedule.split``), where it only computes the input gradient
    W(mb)    the weight gradients held back from B(mb) (split schedules only)
    POST(c…) one ``batch_isend_irecv``: SEND / RECV of an activation (stage s -> s+1) or a
             gradient (s+1 -> s) of one micro-batch, any number of them, none waited for
    WAIT(c)  wait until the posted transfer ``c`` has completed

An F of a later stage waits for its activation's RECV, a B for its gradient's RECV; where the
WAIT sits is what makes a schedule blocking (Megatron's: every transfer waited right where it
is posted) or asynchronous (posted as early as the link order allows, waited just before
use). ``pp.validate`` checks a schedule before anything runs: order, matching, no deadlock,
memory. Pure Python; no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, List, Sequence, Tuple

F, B, W = "F", "B", "W"
POST, WAIT = "POST", "WAIT"
SEND, RECV = "SEND", "RECV"
ACT, GRAD = "act", "grad"
COMPUTE = (F, B, W)


@dataclass(frozen=True)
class Comm:
    """One transfer seen from one end: ``op`` SEND or RECV of ``kind`` (ACT or GRAD) of ``mb``
    with stage ``peer``."""

    op: str
    kind: str
    mb: int
    peer: int
    chunk: int = 0  # virtual pipelines (``pp/chunks.py``): this side's model chunk
    peer_chunk: int = 0  # and the peer's

    def __str__(self) -> str:
        arrow = "->" if self.op == SEND else "<-"
        if self.chunk or self.peer_chunk:
            return f"{self.op} {self.kind} {self.mb}@{self.chunk} {arrow}{self.peer}@{self.peer_chunk}"
        return f"{self.op} {self.kind} {self.mb} {arrow}{self.peer}"

    def mate(self, stage: int) -> "Comm":
        """The same transfer seen from the peer's end (this end is stage ``stage``)."""
        return Comm(RECV if self.op == SEND else SEND, self.kind, self.mb, stage, self.peer_chunk, self.chunk)


@dataclass(frozen=True)
class Action:
    op: str
    mb: int = -1
    comms: Tuple[Comm, ...] = ()
    chunk: int = 0  # the model chunk a compute action runs (virtual pipelines)

    def __str__(self) -> str:
        if self.op in COMPUTE:
            return f"{self.op}{self.mb}" + (f"@{self.chunk}" if self.chunk else "")
        if self.op == POST:
            return "POST[" + ", ".join(str(c) for c in self.comms) + "]"
        return f"WAIT {self.comms[0]}"


def compute(op: str, mb: int, chunk: int = 0) -> Action:
    return Action(op, mb, chunk=chunk)


def post(*comms: Comm) -> Action:
    return Action(POST, comms=tuple(comms))


def wait(comm: Comm) -> Action:
    return Action(WAIT, comms=(comm,))


@dataclass(frozen=True)
class Schedule:
    """``actions[s]``: stage s's ordered actions. ``memory_bound[s]``: the most micro-batches'
    activations stage s may hold at once (a split micro-batch waiting for its W counts
    ``w_share`` of one). ``inflight``: forwards stage 0 runs before its first backward.
    ``drain[s]`` (split schedules): how stage s runs the W actions after its last B so that
    its data-parallel gradient buckets fill as early as they can: ``""`` one micro-batch after
    the other, as listed; ``"w"`` all of them at the first one, layer by layer in the
    backward's order (each parameter's weight gradients still added in micro-batch order, so
    the sums are the same); ``"bw"`` the same, inside the last B itself (each layer's pending
    weight gradients right after its input gradient: only where that B sends nothing, stage
    0). ``chunks`` > 1: a virtual pipeline, ``placement[j]`` = (stage, chunk) of virtual stage
    j (``pp/chunks.py``); memory is then counted in one micro-batch's activations of a whole
    stage (a chunk's F adds ``1 / chunks``)."""

    name: str
    stages: int
    microbatches: int
    split: bool
    inflight: int
    actions: Tuple[Tuple[Action, ...], ...]
    memory_bound: Tuple[float, ...]
    w_share: float = 0.5
    forward_only: bool = False
    notes: Tuple[str, ...] = field(default=())
    drain: Tuple[str, ...] = field(default=())
    chunks: int = 1
    placement: Tuple[Tuple[int, int], ...] = field(default=())

    @property
    def virtual_stages(self) -> Tuple[Tuple[int, int], ...]:
        """(stage, chunk) of every virtual stage, in the model's order."""
        return self.placement or tuple((s, 0) for s in range(self.stages))

    def chunk_order(self, stage: int) -> List[Tuple[str, int, int]]:
        """(op, chunk, mb) of stage ``stage``'s compute actions, in order."""
        return [(a.op, a.chunk, a.mb) for a in self.actions[stage] if a.op in COMPUTE]

    def compute_order(self, stage: int) -> List[Tuple[str, int]]:
        return [(a.op, a.mb) for a in self.actions[stage] if a.op in COMPUTE]

    def describe(self, stage: int) -> str:
        return " ".join(str(a) for a in self.actions[stage])

    def comms(self, stage: int) -> Iterator[Comm]:
        for action in self.actions[stage]:
            if action.op == POST:
                yield from action.comms


# -- compute orders ---------------------------------------------------------------------------------
def warmup(stages: int, microbatches: int, stage: int, inflight: int) -> int:
    """Forwards stage ``stage`` runs before its first backward (``one_f_one_b_order``)."""
    return max(1, min(microbatches, max(stages - stage, inflight - 2 * stage)))


def one_f_one_b_order(stages: int, microbatches: int, stage: int, inflight: int) -> List[Tuple[str, int]]:
    """Megatron's non-interleaved order, generalised to ``inflight`` (K) forwards before the
    first backward on stage 0: warm-up forwards, then F(warm - 1 + k) and B(k) in turn, as
    Megatron's steady loop runs them, then the remaining backwards. 1F1B (K = p) warms stage s
    up with p - s. With more in flight each later stage takes two fewer, ``max(p - s, K - 2s)``:
    a transfer is hidden only when a stage is two micro-batches ahead of the next one (the
    activation's trip out and the gradient's trip back each need a compute to hide behind), so
    at K = 2p - 1 every steady-state transfer is, where K - s per stage hides almost none and
    holds more (``bench pp``; tests/test_pp_schedules.py)."""
    m = microbatches
    warm = warmup(stages, m, stage, inflight)
    order = [(F, i) for i in range(warm - 1)]
    for k in range(m - warm + 1):
        order += [(F, warm - 1 + k), (B, k)]
    order += [(B, k) for k in range(m - warm + 1, m)]
    return order


@dataclass
class _Stage:
    fb: List[Tuple[str, int]]
    next: int = 0
    free: float = 0.0
    pending_w: List[int] = field(default_factory=list)
    order: List[Tuple[str, int]] = field(default_factory=list)


def split_order(stages: int, microbatches: int, inflight: int, times: Sequence[float] = (1.0, 1.0, 1.0)
                ) -> List[List[Tuple[str, int]]]:
    """The B/W-split order of every stage (zero bubble): the forwards and backwards in
    ``one_f_one_b_order``'s order, and the weight gradients W placed by list scheduling in
    simulated time with ``times`` = (F, B, W) per micro-batch: a W runs where the stage's next
    forward or backward would wait for its input (it fills what would be a bubble), or before a
    forward when more than ``s`` of them wait (stage s's memory then stays within stage 0's:
    ``inflight - s`` micro-batches plus ``s`` held for their W). ``inflight = stages`` is ZB-H1."""
    p, m = stages, microbatches
    dur = dict(zip((F, B, W), times))
    st = [_Stage(fb=one_f_one_b_order(p, m, s, inflight)) for s in range(p)]
    ready = {(0, F, i): 0.0 for i in range(m)}  # (stage, op, mb) -> when its input is there
    left = sum(len(x.fb) for x in st) + p * m
    while left:
        best = None
        for s, x in enumerate(st):
            choice = _next_split_action(s, x, ready)
            if choice is not None and (best is None or (choice[0], s) < (best[0], best[1])):
                best = (choice[0], s, choice[1], choice[2])
        if best is None:
            raise RuntimeError("split schedule generation stalled (a bug: report it)")
        start, s, op, mb = best
        x = st[s]
        end = x.free = start + dur[op]
        x.order.append((op, mb))
        left -= 1
        if op == W:
            x.pending_w.remove(mb)
            continue
        x.next += 1
        if op == F:
            ready[(s + 1, F, mb) if s + 1 < p else (s, B, mb)] = end
        else:
            x.pending_w.append(mb)
            if s > 0:
                ready[(s - 1, B, mb)] = end
    return [x.order for x in st]


def _next_split_action(s, x, ready):
    """(start time, op, mb) stage ``s`` runs next, or None while that depends on a stage that
    has not got there (the caller advances stages in time order, so nothing unknown can
    arrive before the earliest start it picks)."""
    if x.next == len(x.fb):
        return (x.free, W, x.pending_w[0]) if x.pending_w else None
    op, mb = x.fb[x.next]
    if op == F and len(x.pending_w) > s:
        return x.free, W, x.pending_w[0]
    at = ready.get((s, op, mb))
    if at is not None and at <= x.free:
        return x.free, op, mb
    if x.pending_w:
        return x.free, W, x.pending_w[0]
    return (at, op, mb) if at is not None else None


# -- transfers ---------------------------------------------------------------------------------------
def megatron_actions(stages: int, microbatches: int, stage: int, forward_only: bool = False) -> List[Action]:
    """Megatron's ``forward_backward_pipelining_without_interleaving`` written out: its order of
    compute and of ``P2PCommunicator`` calls, each call one batch waited on the spot."""
    p, m, s = stages, microbatches, stage
    first, last = s == 0, s == p - 1
    out: List[Action] = []

    def call(*comms):
        comms = [c for c in comms if c is not None]
        if comms:
            out.append(post(*comms))
            out.extend(wait(c) for c in comms)

    recv_act = (lambda i: None) if first else (lambda i: Comm(RECV, ACT, i, s - 1))
    send_act = (lambda i: None) if last else (lambda i: Comm(SEND, ACT, i, s + 1))
    recv_grad = (lambda i: None) if last else (lambda i: Comm(RECV, GRAD, i, s + 1))
    send_grad = (lambda i: None) if first else (lambda i: Comm(SEND, GRAD, i, s - 1))
    warm = min(p - s - 1, m)
    for i in range(warm):
        call(recv_act(i))
        out.append(compute(F, i))
        call(send_act(i))
    rest = m - warm
    if rest:
        call(recv_act(warm))
    for k in range(rest):
        i = warm + k
        out.append(compute(F, i))
        if forward_only:
            call(send_act(i))
            if k < rest - 1:
                call(recv_act(i + 1))
            continue
        call(send_act(i), recv_grad(k))
        out.append(compute(B, k))
        if k == rest - 1:
            call(send_grad(k))
        else:
            call(send_grad(k), recv_act(i + 1))
    if not forward_only:
        for k in range(rest, m):
            call(recv_grad(k))
            out.append(compute(B, k))
            call(send_grad(k))
    return out


def _link_order(downstream_order: Sequence[Tuple[str, int]]) -> List[Tuple[str, int]]:
    """The order of the transfers on the link into a stage, as both ends post them: the
    stage's own order of the forwards that consume activations and the backwards that produce
    gradients (causality makes it consistent with the upstream stage's order)."""
    return [(ACT if op == F else GRAD, mb) for op, mb in downstream_order if op in (F, B)]


def asynchronous_actions(orders: Sequence[Sequence[Tuple[str, int]]], stage: int, forward_only: bool = False
                         ) -> List[Action]:
    """Stage ``stage``'s actions for the compute ``orders`` of all stages, every transfer
    posted as early as the link order allows (a send right after the compute that produced
    it, a receive right after the previous transfer on its link), all transfers that become
    postable at one point in one batch, each receive waited just before its compute, each
    activation send before its micro-batch's backward (its output may then be freed) and the
    gradient sends at the end."""
    p, s = len(orders), stage
    links = {}  # peer -> (the link's order, this side's ops keyed like it, pointer)
    if s > 0:  # link into this stage: receive activations, send gradients
        order = _link_order(orders[s])
        links[s - 1] = [order, {(ACT, mb): RECV for _k, mb in order if _k == ACT} | {(GRAD, mb): SEND for _k, mb in order
                                                                                    if _k == GRAD}, 0]
    if s < p - 1:  # link out of this stage: send activations, receive gradients
        order = _link_order(orders[s + 1])
        links[s + 1] = [order, {(ACT, mb): SEND for _k, mb in order if _k == ACT} | {(GRAD, mb): RECV for _k, mb in order
                                                                                    if _k == GRAD}, 0]
    produced = set()
    posted = set()
    out: List[Action] = []

    def flush():
        batch = []
        for peer, link in links.items():
            order, side, _ptr = link
            while link[2] < len(order):
                key = order[link[2]]
                op = side[key]
                if op == SEND and key not in produced:
                    break
                batch.append(Comm(op, key[0], key[1], peer))
                link[2] += 1
        if batch:
            out.append(post(*batch))
            posted.update(batch)

    flush()
    for op, mb in orders[s]:
        if op == F and s > 0:
            out.append(wait(_posted(posted, Comm(RECV, ACT, mb, s - 1))))
        if op == B and s < p - 1:
            out.append(wait(_posted(posted, Comm(SEND, ACT, mb, s + 1))))
            out.append(wait(_posted(posted, Comm(RECV, GRAD, mb, s + 1))))
        out.append(compute(op, mb))
        if op == F and s < p - 1:
            produced.add((ACT, mb))
        if op == B and s > 0:
            produced.add((GRAD, mb))
        flush()
    tail = [c for c in _in_post_order(out) if c.op == SEND and (c.kind == GRAD or forward_only)]
    out.extend(wait(c) for c in tail)
    return out


def _posted(posted, comm: Comm) -> Comm:
    if comm not in posted:
        raise RuntimeError(f"{comm} is used before it is posted (a bug in the schedule generator: report it)")
    return comm


def _in_post_order(actions) -> List[Comm]:
    return [c for a in actions if a.op == POST for c in a.comms]
