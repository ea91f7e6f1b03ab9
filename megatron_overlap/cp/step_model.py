"""One training step of a transformer with context-parallel attention, simulated on a two-tier
link: what ``cp/ring.py``, ``cp/a2a.py`` and ``cp/hybrid.py`` do, as data, and the time it takes.

A sequence of S tokens on a CP group of n ranks (Megatron's zigzag layout: S / n rows per rank),
``layers`` transformer layers, one rank = one GPU (TP = 1, the ``hdp.cost.HdpCostModel``'s
assumption). Per rank and layer the program is, in the order the code runs it::

    forward    QKV linears | attention (the mode's exchanges and blocks) | projection + MLP
    backward   projection + MLP (B + W) | attention backward | QKV linears (B + W)
    and once   the output layer, after the last layer's forward and before the first backward

Programs are lists of actions (schedules as data), per rank::

    Compute(ms)            the device runs for ms (linears: rows x rate; a block of attention:
                           its causal (query, key) pairs x rate x the share of the heads it holds)
    Send(dst, bytes, key)  posted when the device reaches it; leaves when this rank's port is
                           free; delivered ``messages x latency + bytes / bandwidth`` later at the
                           tier of (rank, dst) (``tune.two_tier``)
    Wait(key)              the device waits until message ``key`` is delivered (a receive, or a
                           send the code waits for)

The generators mirror the code step by step (which pieces travel and which blocks a rank computes
come from the same ``ZigzagLayout``; every piece, every dK/dV running sum in fp32, every
all-to-all part), so the simulated bytes per rank are the bytes the code sends (checked against
the emulated cluster, ``tests/test_long_context_lab.py``). ``overlap=False`` is the waited ring:
every transfer waited before the block that needs it.

``layer_groups``: the emulated cluster runs G layer groups, each the compute, bytes and messages of
``layers / G`` layers (every layer's exchanges are alike, so a group of k layers is k times one
layer); the simulator takes the same grouping, which changes nothing but the count of messages.

What is left out: the gradient reduction and the optimizer (the same for every mode), the host
(it runs ahead of the device), the P2P kernels' share of the SMs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

from .block import CAUSAL, FULL, NONE
from .layout import ZigzagLayout

MODES = ("ring", "a2a", "hybrid")


@dataclass(frozen=True)
class Compute:
    ms: float
    label: str = ""


@dataclass(frozen=True)
class Send:
    dst: int
    nbytes: float
    key: tuple
    messages: int = 1


@dataclass(frozen=True)
class Wait:
    key: tuple


# -- costs --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LayerCosts:
    """Per-layer rates of one rank (TP = 1), from an ``HdpCostModel``: linears in ms per token
    (forward; backward B + W is twice), attention in ms per causal pair (forward, all heads;
    backward ``bwd_factor`` times), the heads and bytes the exchanges move."""

    qkv_ms_per_token: float
    post_ms_per_token: float
    head_ms_per_token: float
    pair_ms: float
    bwd_factor: float
    heads: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int
    layers: int

    @classmethod
    def of(cls, cost) -> "LayerCosts":
        rate = cost.peak_tflops * 1e12 * cost.gemm_fraction / 1e3  # FLOP per ms
        d = cost.head_dim
        qkv = cost.hidden * (cost.heads + 2 * cost.kv_heads) * d
        post = cost.hidden * cost.hidden + cost.hidden * cost.ffn * (3 if cost.gated else 2)
        return cls(qkv_ms_per_token=2.0 * qkv / rate, post_ms_per_token=2.0 * post / rate,
                   head_ms_per_token=2.0 * cost.vocab * cost.hidden / rate,
                   pair_ms=cost.attention_fwd_ms_per_pair / cost.layers, bwd_factor=cost.attention_bwd_factor,
                   heads=cost.heads, kv_heads=cost.kv_heads, head_dim=d, dtype_bytes=cost.dtype_bytes,
                   layers=cost.layers)


def block_pairs(rows: int, cols: int, kind: str) -> float:
    """Causal (query, key) pairs a block computes: a full block rows x cols, a causal (diagonal,
    square) one rows (rows + 1) / 2."""
    if kind == NONE:
        return 0.0
    if kind == CAUSAL:
        return rows * (rows + 1) / 2
    if kind == FULL:
        return float(rows) * cols
    raise ValueError(f"no pair count for a block of kind {kind!r}")


def _span(index, total: int) -> int:
    start, stop, _ = index.indices(total)
    return stop - start


# -- programs -----------------------------------------------------------------------------------
@dataclass
class _Prog:
    """One rank's actions while a program is generated; ``scale``: compute and bytes per layer
    group (layers per group), ``messages`` per send likewise."""

    actions: list = field(default_factory=list)
    sends: list = field(default_factory=list)  # send keys the code waits for at the end of a pass
    scale: int = 1

    def compute(self, ms: float, label: str):
        if ms > 0:
            self.actions.append(Compute(ms * self.scale, label))

    def send(self, dst: int, nbytes: float, key: tuple, wait_now: bool):
        self.actions.append(Send(dst, nbytes * self.scale, key, self.scale))
        if wait_now:
            self.actions.append(Wait(key))
        else:
            self.sends.append(key)

    def wait(self, key: tuple):
        self.actions.append(Wait(key))

    def wait_sends(self):
        self.actions.extend(Wait(k) for k in self.sends)
        self.sends = []


@dataclass(frozen=True)
class _Ring:
    """A ring as the code holds it: the ranks in ring order, this rank's position."""

    ranks: Tuple[int, ...]
    pos: int

    @property
    def size(self) -> int:
        return len(self.ranks)

    def at(self, offset: int) -> int:
        return (self.pos + offset) % self.size

    def peer(self, offset: int) -> int:
        return self.ranks[self.at(offset)]

    @property
    def me(self) -> int:
        return self.ranks[self.pos]


def _plan_pairs(plan, rows: int, piece_rows: int) -> float:
    return block_pairs(_span(plan.rows, rows), _span(plan.cols, piece_rows), plan.kind)


def ring_forward(p: _Prog, ring: _Ring, layout: ZigzagLayout, kv_bytes_per_row: float, pair_ms: float,
                 overlap: bool, tag: tuple):
    """``cp.ring.ring_forward``'s actions (its docstring: kv moves +1, pieces as they land)."""
    n, x = ring.size, ring.pos
    pieces = layout.pieces
    piece_rows = [b - a for a, b in pieces]
    recvs: Dict[int, Optional[tuple]] = {}

    def post(step: int, i: int):
        if step >= n - 1:
            return
        if layout.travels(ring.at(-step), i):
            p.send(ring.peer(1), 2 * piece_rows[i] * kv_bytes_per_row, tag + ("kvf", step, i, ring.me, ring.peer(1)),
                   wait_now=not overlap)
        if layout.travels(ring.at(-step - 1), i):
            key = tag + ("kvf", step, i, ring.peer(-1), ring.me)
            if not overlap:
                p.wait(key)
                key = None
            recvs[i] = key

    if overlap:
        for i in range(len(pieces)):
            post(0, i)
    own = layout.own(x)
    if own is not None:
        p.compute(_plan_pairs(own, layout.rows, layout.rows) * pair_ms, "attention")
    for step in range(1, n):
        if not overlap:
            for i in range(len(pieces)):
                post(step - 1, i)
        j = ring.at(-step)
        for i in range(len(pieces)):
            if i in recvs:
                key = recvs.pop(i)
                if key is not None:
                    p.wait(key)
            if overlap:
                post(step, i)
            plan = layout.plan(x, j, i)
            if plan is not None:
                p.compute(_plan_pairs(plan, layout.rows, piece_rows[i]) * pair_ms, "attention")
    p.wait_sends()


def ring_backward(p: _Prog, ring: _Ring, layout: ZigzagLayout, kv_bytes_per_row: float, dkv_bytes_per_row: float,
                  pair_ms: float, overlap: bool, tag: tuple):
    """``cp.ring.ring_backward``'s actions (K/V move -1 with the running dK/dV sums in fp32)."""
    n, x = ring.size, ring.pos
    pieces = layout.pieces
    piece_rows = [b - a for a, b in pieces]
    kv_in: Dict[int, tuple] = {}
    dkv_in: Dict[tuple, tuple] = {}

    def post_kv(t: int, i: int):
        if t >= n - 1:
            return
        if layout.travels(ring.at(t), i):
            p.send(ring.peer(-1), 2 * piece_rows[i] * kv_bytes_per_row, tag + ("kvb", t, i, ring.me, ring.peer(-1)),
                   wait_now=not overlap)
        if layout.travels(ring.at(t + 1), i):
            key = tag + ("kvb", t, i, ring.peer(1), ring.me)
            if overlap:
                kv_in[i] = key
            else:
                p.wait(key)

    def post_dkv_recv(t: int, i: int):
        contributors = [ring.at(c) for c in range(1, t + 1)]
        if layout.active(ring.at(t + 1), i, contributors):
            dkv_in[(t + 1, i)] = tag + ("dkv", t, i, ring.peer(1), ring.me)

    for t in range(1, n):
        j = ring.at(t)
        if not overlap:
            if t > 1:
                for i in range(len(pieces)):
                    post_kv(t - 1, i)
            for i in range(len(pieces)):
                post_dkv_recv(t, i)
        for i in range(len(pieces)):
            if overlap and i in kv_in:
                p.wait(kv_in.pop(i))
            if overlap:
                post_kv(t, i)
                post_dkv_recv(t, i)
            plan = layout.plan(x, j, i)
            acc = plan is not None
            if acc:
                p.compute(_plan_pairs(plan, layout.rows, piece_rows[i]) * pair_ms, "attention backward")
            if (t, i) in dkv_in:
                p.wait(dkv_in.pop((t, i)))
                acc = True
            if acc:
                p.send(ring.peer(-1), 2 * piece_rows[i] * dkv_bytes_per_row, tag + ("dkv", t, i, ring.me, ring.peer(-1)),
                       wait_now=not overlap)
    own = layout.own(x)
    if own is not None:
        p.compute(_plan_pairs(own, layout.rows, layout.rows) * pair_ms, "attention backward")
    for i in range(len(pieces)):
        if (n, i) in dkv_in:
            p.wait(dkv_in.pop((n, i)))
    if kv_in or dkv_in:
        raise AssertionError(f"ring backward left receives unused: {sorted(kv_in)}, {sorted(dkv_in)}")
    p.wait_sends()


def all_to_all(p: _Prog, members: _Ring, part_bytes: float, tag: tuple):
    """``cp.a2a._swap``: U - 1 paired exchanges posted in offset order, then every one waited."""
    keys = []
    for off in range(1, members.size):
        key = tag + ("a2a", off, members.me, members.peer(off))
        p.actions.append(Send(members.peer(off), part_bytes * p.scale, key, p.scale))
        keys += [key, tag + ("a2a", off, members.peer(-off), members.me)]
    for key in keys:
        p.wait(key)


@dataclass(frozen=True)
class Placement:
    """Where one rank sits: its all-to-all members (one rank: none) and its ring."""

    members: _Ring
    ring: _Ring


def placement(cp_ranks: Sequence[int], rank: int, mode: str, a2a_size: int = 1) -> Placement:
    """``cp.hybrid.hybrid_attention``'s groups: all-to-all inside U consecutive CP positions, a
    ring across the G = n / U groups (ring: U = 1; a2a: U = n)."""
    n = len(cp_ranks)
    U = {"ring": 1, "a2a": n}.get(mode, a2a_size)
    x = list(cp_ranks).index(rank)
    g, inner = divmod(x, U)
    members = tuple(cp_ranks[g * U:(g + 1) * U])
    ring = tuple(cp_ranks[gg * U + inner] for gg in range(n // U))
    return Placement(_Ring(members, members.index(rank)), _Ring(ring, ring.index(rank)))


def attention_forward(p: _Prog, where: Placement, rows: int, costs: LayerCosts, overlap: bool, tag: tuple):
    """``cp_attention`` forward of one layer: seq -> head, the ring over the gathered rows, head -> seq."""
    U, G = where.members.size, where.ring.size
    hq, hk, row_bytes = costs.heads // U, costs.kv_heads // U, costs.head_dim * costs.dtype_bytes
    if U > 1:
        all_to_all(p, where.members, rows * (hq + 2 * hk) * row_bytes, tag + ("seq->head",))
    layout = ZigzagLayout(G, U * rows, True)
    ring_forward(p, where.ring, layout, hk * row_bytes, costs.pair_ms / U, overlap, tag + ("ring",))
    if U > 1:
        all_to_all(p, where.members, rows * hq * row_bytes, tag + ("head->seq",))


def attention_backward(p: _Prog, where: Placement, rows: int, costs: LayerCosts, overlap: bool, tag: tuple):
    U, G = where.members.size, where.ring.size
    hq, hk, row_bytes = costs.heads // U, costs.kv_heads // U, costs.head_dim * costs.dtype_bytes
    if U > 1:
        all_to_all(p, where.members, rows * hq * row_bytes, tag + ("grad seq->head",))
    layout = ZigzagLayout(G, U * rows, True)
    ring_backward(p, where.ring, layout, hk * row_bytes, hk * costs.head_dim * 4, costs.pair_ms * costs.bwd_factor / U,
                  overlap, tag + ("ring backward",))
    if U > 1:
        all_to_all(p, where.members, rows * (hq + 2 * hk) * row_bytes, tag + ("grad head->seq",))


@dataclass(frozen=True)
class CPCase:
    """One step to simulate: ``seq`` tokens on every CP group of ``cp`` ranks (``world / cp``
    groups of consecutive ranks, Megatron's order at TP = 1), ``mode`` with ``a2a_size`` (hybrid),
    ``overlap`` (False: the waited ring), ``layer_groups`` (module docstring; 0: every layer its
    own)."""

    seq: int
    cp: int
    world: int
    mode: str = "ring"
    a2a_size: int = 1
    overlap: bool = True
    layer_groups: int = 0

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"unknown mode {self.mode!r}; one of {', '.join(MODES)}")
        if self.world % self.cp:
            raise ValueError(f"CP {self.cp} does not divide {self.world} ranks")
        if self.seq % (2 * self.cp):
            raise ValueError(f"sequence length {self.seq} is not a multiple of 2 x CP = {2 * self.cp}")

    @property
    def size(self) -> int:
        """The all-to-all size U."""
        return {"ring": 1, "a2a": self.cp}.get(self.mode, self.a2a_size)

    def label(self) -> str:
        if self.mode == "ring":
            return "ring" if self.overlap else "ring, waited"
        return "a2a (Ulysses)" if self.mode == "a2a" else f"hybrid U={self.a2a_size}"


def groups_of(layers: int, layer_groups: int) -> List[int]:
    """Layers per group: ``layer_groups`` near-equal groups (0: one layer each)."""
    g = layer_groups or layers
    if not 1 <= g <= layers:
        raise ValueError(f"layer groups must be in [1, {layers}], got {g}")
    return [layers * (k + 1) // g - layers * k // g for k in range(g)]


def programs(case: CPCase, costs: LayerCosts) -> List[list]:
    """Every rank's actions for one training step (module docstring)."""
    rows = case.seq // case.cp
    out = []
    groups = groups_of(costs.layers, case.layer_groups)
    for rank in range(case.world):
        base = rank - rank % case.cp
        where = placement(tuple(range(base, base + case.cp)), rank, case.mode, case.a2a_size)
        p = _Prog()
        for li, k in enumerate(groups):
            p.scale = k
            p.compute(rows * costs.qkv_ms_per_token, "qkv")
            attention_forward(p, where, rows, costs, case.overlap, (li, "fwd"))
            p.compute(rows * costs.post_ms_per_token, "proj + mlp")
        p.scale = 1
        p.compute(rows * costs.head_ms_per_token, "output layer")
        p.compute(2 * rows * costs.head_ms_per_token, "output layer backward")
        for li in reversed(range(len(groups))):
            p.scale = groups[li]
            p.compute(2 * rows * costs.post_ms_per_token, "proj + mlp backward")
            attention_backward(p, where, rows, costs, case.overlap, (li, "bwd"))
            p.compute(2 * rows * costs.qkv_ms_per_token, "qkv backward")
        out.append(p.actions)
    return out
