"""How each strategy runs a column / row linear, forward and backward, as tasks (``engine``).

``megatron`` (stock megatron-core 0.16 ``layers.py`` / ``mappings.py``, sequence parallel):
    column fwd   AG(x), then the GEMM                                         (exposed)
    row fwd      GEMM, then RS(y)                                             (exposed)
    row bwd      AG(dy) (``_ReduceScatterToSequenceParallelRegion.backward``), then dgrad, wgrad
    column bwd   async AG(x) beside dgrad; wait; async RS(dgrad) beside wgrad; wait
``p2p`` (this plugin, ``tp/linear.py``, ``tp/backends/p2p.py``): chunked rings, the own shard in one GEMM, pieces
    forwarded as they land; RS partials per piece (ring: running sums; a2a: straight to the
    owner, added there); the row bwd gathers dy by ring, then starts the AG of
    ``prefetch_fraction`` of the preceding column's input and runs the wgrad whole once dy is
    all there (the code gathers it whole: 1.0); the column bwd gathers the rest, runs the RS of
    its dgrad pieces, and its wgrad waits for both. NCCL kernels take SMs (``HardwareSpec.nccl_sm_fraction``).
``symm-mem`` (PyTorch Async TP): one chunk per rank, copy-engine copies straight from / to the
    owner (no SM contention); RS as all-to-all + local reduce; the column bwd's re-gather of x
    is a plain NCCL all-gather started by the row bwd before it, as p2p's (``fused`` too).
``fused`` (this plugin's Triton backend, ``tp/backends/fused.py``, as implemented, not Flux's ideal):
    AG side: one GEMM whose tiles wait on chunk arrivals, the chunks brought by the NCCL P2P
    ring (SM contention), max(GEMM, transfer + fill) with fill the GEMM of the last
    1 / (R * fill_chunks) of the rows. RS side: the GEMM kernel writes every owner's slot, and
    the all-to-all of the slots starts only when the kernel has finished (across GPUs the
    in-kernel overlap needs device-initiated sends, not implemented), then a local reduce; the
    column bwd's wgrad runs beside that all-to-all. Its GEMM runs at the speed measured on an
    H200 (``fused_slowdown``, default from ``measured.FUSED_AG_GEMM_VS_CUBLAS``: 0.26x cuBLAS,
    i.e. 2.9x the time of a plain GEMM); ``fused_slowdown=0`` models the kernel at cuBLAS speed.
``flux`` (the published Flux design, for the published-vs-predicted table only; no flag selects
    it): tiles wait on chunk arrivals by copy engine (AG) or push their partial tiles to the
    owner from the epilogue (RS): max(GEMM, transfer + fill) on both sides.

Without sequence parallelism (``RunSpec.sequence_parallel`` False; ``tp/linear_ar.py``):
``megatron`` runs the Row forward's GEMM then a blocking all-reduce, and the Column backward's
dgrad GEMM then an async all-reduce beside its wgrad; ``p2p`` cuts both GEMMs into row pieces of
the whole sequence (the plugin's chunk rule times R, tapered) and all-reduces each piece as it is
done (the Column's wgrad after its last piece); ``symm-mem`` runs its fused reduce-scatter, then
an all-gather (the Column's beside its wgrad); ``fused`` does not run there. ``allreduce_fusion``
(p2p, symm-mem): the attention projection's all-reduce as the backend's reduce-scatter, the
residual add on T / R tokens, and a ring all-gather whose pieces feed the pre-MLP norm and fc1's
GEMM (``strategy_sim.simulate_ops``); its backward is stock's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .comm import all_gather_cost, all_reduce_cost, p2p_cost, reduce_scatter_cost
from .engine import Graph
from .gemm import elementwise_ms, gemm_ms
from .layer_ops import Attention, Elementwise, Exchange, Linear
from .measured import fused_slowdown
from .transfers import (chunked_all_reduce, copies_consume, copies_reduce, fused_gather, fused_reduce,
                        reduce_then_gather)

STRATEGIES = ("megatron", "p2p", "symm-mem", "fused", "flux")
CUT_BLOCKS = ("all", "attention", "mlp")  # the blocks sub-batches cut (tp.SUB_BATCH_BLOCKS)


@dataclass(frozen=True)
class Strategy:
    name: str = "megatron"
    chunks: int = 0  # p2p: chunks per rank; 0 = the plugin's rule (tapered, <= 5)
    rs: str = "ring"  # p2p: ring | a2a
    prefetch_fraction: float = 1.0  # of the column's input re-gathered early by the row bwd: the code's, whole
    fused_fill_chunks: int = 4
    fused_slowdown: Optional[float] = None  # None: measured for fused, 0 for flux (the paper's kernels)
    sub_batches: int = 1  # p2p / symm-mem: attention and MLP blocks cut into this many row parts (strategy_sim.py)
    cut: str = "all"  # with sub_batches > 1: the blocks cut, all | attention | mlp (--overlap-tp-sub-batch-blocks)
    allreduce_fusion: bool = False  # p2p / symm-mem without SP: --overlap-tp-allreduce-fusion

    def __post_init__(self):
        if self.name not in STRATEGIES:
            raise ValueError(f"unknown strategy {self.name!r}; one of {STRATEGIES}")
        if self.rs not in ("ring", "a2a") or self.chunks < 0:
            raise ValueError(f"invalid p2p options: chunks {self.chunks}, rs {self.rs!r}")
        if self.sub_batches < 1 or (self.sub_batches > 1 and self.name not in ("p2p", "symm-mem")):
            raise ValueError(f"sub-batches {self.sub_batches} with {self.name}: p2p and symm-mem only")
        if self.cut not in CUT_BLOCKS or (self.cut != "all" and self.sub_batches == 1):
            raise ValueError(f"sub-batch blocks {self.cut!r} with {self.sub_batches} sub-batches: one of {CUT_BLOCKS}, "
                             "more than 1 sub-batch")
        if self.allreduce_fusion and (self.name not in ("p2p", "symm-mem") or self.sub_batches > 1):
            raise ValueError(f"the all-reduce fusion with {self.name} x{self.sub_batches}: p2p and symm-mem, whole blocks")

    @property
    def slowdown(self) -> float:
        """Extra time of this strategy's fused GEMM over a plain one."""
        if self.fused_slowdown is not None:
            return self.fused_slowdown
        return fused_slowdown() if self.name == "fused" else 0.0

    def label(self, sequence_parallel: bool = True) -> str:
        cut = f" x{self.sub_batches} sub-batches" if self.sub_batches > 1 else ""
        cut += f" ({self.cut} blocks)" if self.cut != "all" else ""
        cut += " + AR fusion" if self.allreduce_fusion else ""
        if self.name != "p2p":
            return self.name + cut
        rs = f" {self.rs}" if sequence_parallel or self.allreduce_fusion else ""  # without SP: no RS but the fusion's
        return f"p2p {'auto' if self.chunks == 0 else self.chunks}/rank{rs}{cut}"

    def flags(self, tp: int, sequence_parallel: bool = True) -> str:
        """The megatron-overlap flags that select this plan (chunks counted over the TP group),
        as the config layer spells them (without SP, no ``--overlap-tp-rs`` but the fusion's)."""
        from ..config import OverlapConfig, TPConfig

        if self.name == "flux":
            return "(Flux itself: no megatron-overlap flag)"
        if self.name == "p2p":
            flags = OverlapConfig(tp=TPConfig(mode="p2p", chunks=self.chunks * tp, rs=self.rs,
                                              sub_batches=self.sub_batches, sub_batch_blocks=self.cut,
                                              allreduce_fusion=self.allreduce_fusion)).as_flags()
            if not sequence_parallel and not self.allreduce_fusion:
                from ..args import flag_for

                i = flags.index(flag_for("tp.rs"))
                flags = flags[:i] + flags[i + 2:]
            return " ".join(flags)
        mode = "off" if self.name == "megatron" else self.name
        return " ".join(OverlapConfig(tp=TPConfig(mode=mode, sub_batches=self.sub_batches, sub_batch_blocks=self.cut,
                                                  allreduce_fusion=self.allreduce_fusion)).as_flags())


def default_chunks_per_rank(rows_per_rank: int, batch: int = 1) -> int:
    """The plugin's rule (``tp.linear_plan.chunks_per_rank`` with ``--overlap-tp-chunks 0``)."""
    return max(1, min(5, rows_per_rank * batch // 256 + 1))


def piece_rows(rows: int, chunks: int, taper: bool) -> list[int]:
    """Row counts of ``comm.rings.split_pieces`` (one direction), empty pieces dropped."""
    weights = [1] + [2] * (chunks - 2) + [1] if taper and chunks > 2 else [1] * chunks
    total, acc, bounds = sum(weights), 0, [0]
    for w in weights:
        acc += w
        bounds.append(rows * acc // total)
    return [b - a for a, b in zip(bounds, bounds[1:]) if b > a]


@dataclass
class Ctx:
    """What the builders need: hardware, TP size, tokens, the TP link and the strategy."""

    hw: object
    tp: int
    tokens: int  # T: tokens per micro-batch on this rank (before the TP split)
    rows: int  # sequence rows per rank (s); tokens per rank = rows * batch
    batch: int
    link: object
    strategy: Strategy
    cp: int = 1
    cp_link: object = None
    cp_stream: str = "link"
    sequence_parallel: bool = True
    deferred: Optional[list] = None  # sub-batches: reduce-scatter adds finished after the last part

    @property
    def d(self) -> int:
        return self.hw.dtype_bytes

    @property
    def sm(self) -> bool:
        return self.hw.nccl_sm_fraction > 0

    def gemm(self, m, n, k) -> float:
        return gemm_ms(m, n, k, self.hw)

    def add_ms(self, tokens, n) -> float:
        return elementwise_ms(3 * tokens * n * self.d, self.hw)

    def pieces(self) -> list[int]:
        """Token counts of this rank's pieces."""
        s = self.strategy
        chunks = s.chunks or default_chunks_per_rank(self.rows, self.batch)
        return [r * self.batch for r in piece_rows(self.rows, chunks, taper=s.chunks == 0)]

    def ar_pieces(self) -> list[int]:
        """Token counts of the row pieces of the whole sequence the all-reduce path cuts a GEMM
        into (``tp.linear_plan.TPPlanner._make_ar``: R times the chunks per rank, at most one per row)."""
        s, rows = self.strategy, self.rows * self.tp
        chunks = min(rows, (s.chunks or default_chunks_per_rank(self.rows, self.batch)) * self.tp)
        return [r * self.batch for r in piece_rows(rows, chunks, taper=s.chunks == 0)]


# ------------------------------------------------------------------ shared building blocks


def _ring_gather_consume(g: Graph, ctx: Ctx, name, ready, bytes_per_token, gemm_of, pieces):
    """p2p ring all-gather feeding one GEMM per piece; returns (last compute, sends)."""
    R, sends = ctx.tp, {}
    for k, t in enumerate(pieces):
        sends[0, k] = g.transfer(f"{name} ring", p2p_cost(t * bytes_per_token, ctx.link), ready, sm_comm=ctx.sm)
    last = g.compute(f"{name} own", gemm_of(ctx.tokens / R), ready, contended=True)
    for step in range(1, R):
        for k, t in enumerate(pieces):
            arrived = sends[step - 1, k]  # the neighbour's send of step-1 ends when ours does
            if step < R - 1:
                sends[step, k] = g.transfer(f"{name} ring", p2p_cost(t * bytes_per_token, ctx.link), [arrived], sm_comm=ctx.sm)
            last = g.compute(f"{name} piece", gemm_of(t), [arrived], contended=True)
    return last, sends


def _ring_reduce_scatter(g: Graph, ctx: Ctx, name, ready, n_out, partial_of, pieces, algo, before_adds=None):
    """p2p reduce-scatter of per-piece partials (ring: running sums; a2a: straight to the owner),
    own rows in one GEMM, then ``before_adds(own)`` (e.g. the wgrad, hiding the RS tail), then
    the adds of what arrived (``rs.finish``); returns the last task. With ``ctx.deferred`` (a
    list: a sub-batch's reduce-scatter, finished after the last part), the adds are appended
    there as (name, ms, deps) instead and the own GEMM (or ``before_adds``) is returned."""
    R, sends = ctx.tp, {}
    for step in range(R - 1):
        for k, t in enumerate(pieces):
            p = g.compute(f"{name} partial", partial_of(t), ready, contended=True)
            if algo == "ring" and step > 0:
                p = g.compute(f"{name} add", ctx.add_ms(t, n_out), [p, sends[step - 1, k]])
            sends[step, k] = g.transfer(f"{name} {algo}", p2p_cost(t * n_out * ctx.d, ctx.link), [p], sm_comm=ctx.sm)
    last = g.compute(f"{name} own", partial_of(ctx.tokens / R), ready, contended=True)
    if before_adds is not None:
        last = before_adds(last)
    finals = [(k, sends[R - 2, k]) for k in range(len(pieces))] if algo == "ring" else [
        (k, sends[step, k]) for step in range(R - 1) for k in range(len(pieces))]
    if ctx.deferred is not None:
        ctx.deferred.extend((f"{name} add", ctx.add_ms(pieces[k], n_out), [last, arrived]) for k, arrived in finals)
        return last
    for k, arrived in finals:
        last = g.compute(f"{name} add", ctx.add_ms(pieces[k], n_out), [last, arrived])
    return last


# ------------------------------------------------------------------ linears


def linear_fwd(g: Graph, ctx: Ctx, op: Linear, ready: list) -> list:
    R, T, s, d = ctx.tp, ctx.tokens, ctx.strategy, ctx.d
    name = f"{op.name} fwd"
    if op.kind == "column":
        gemm_of = lambda m: ctx.gemm(m, op.n / R, op.k)  # noqa: E731
        if R == 1:
            return [g.compute(name, gemm_of(T), ready)]
        if not ctx.sequence_parallel:  # input replicated: no communication before a column linear
            return [g.compute(name, gemm_of(T), ready)]
        if s.name == "megatron":
            ag = g.transfer(f"{name} AG", all_gather_cost(T * op.k * d, R, ctx.link), ready, sm_comm=ctx.sm)
            return [g.compute(name, gemm_of(T), [ag], contended=True)]
        if s.name == "p2p":
            return [_ring_gather_consume(g, ctx, name, ready, op.k * d, gemm_of, ctx.pieces())[0]]
        if s.name == "symm-mem":
            return [copies_consume(g, ctx, name, ready, T / R * op.k * d, gemm_of)]
        return [fused_gather(g, ctx, name, ready, T * op.k * d, gemm_of)]
    gemm_of = lambda m: ctx.gemm(m, op.n, op.k / R)  # noqa: E731
    if R == 1:
        return [g.compute(name, gemm_of(T), ready)]
    if not ctx.sequence_parallel and s.name == "p2p":
        return [chunked_all_reduce(g, ctx, name, ready, op.n, gemm_of)]
    if not ctx.sequence_parallel and s.name == "symm-mem":
        return [reduce_then_gather(g, ctx, name, ready, op.n, gemm_of)]
    if s.name == "megatron" or not ctx.sequence_parallel:
        y = g.compute(name, gemm_of(T), ready, contended=True)
        if ctx.sequence_parallel:
            return [g.transfer(f"{name} RS", reduce_scatter_cost(T * op.n * d, R, ctx.link), [y], sm_comm=ctx.sm)]
        return [g.transfer(f"{name} AR", all_reduce_cost(T * op.n * d, R, ctx.link), [y], sm_comm=ctx.sm)]
    if s.name == "p2p":
        return [_ring_reduce_scatter(g, ctx, name, ready, op.n, gemm_of, ctx.pieces(), s.rs)]
    if s.name == "symm-mem":
        return [copies_reduce(g, ctx, name, ready, op.n, gemm_of)]
    return [fused_reduce(g, ctx, name, ready, op.n, gemm_of)]


def linear_bwd(g: Graph, ctx: Ctx, op: Linear, ready: list, prefetch=None, next_column: Linear = None):
    """Returns (ready list for the next op, prefetch handle for the next column's wgrad input)."""
    R, T, s, d = ctx.tp, ctx.tokens, ctx.strategy, ctx.d
    name = f"{op.name} bwd"
    if op.kind == "row":
        dgrad_of = lambda m: ctx.gemm(m, op.k / R, op.n)  # noqa: E731
        wgrad_ms = ctx.gemm(op.n, op.k / R, T)
        if R == 1 or not ctx.sequence_parallel or s.name == "megatron":
            deps = ready
            if R > 1 and ctx.sequence_parallel:
                deps = [g.transfer(f"{name} AG(dy)", all_gather_cost(T * op.n * d, R, ctx.link), ready, sm_comm=ctx.sm)]
            dx = g.compute(f"{name} dgrad", dgrad_of(T), deps)
            g.compute(f"{name} wgrad", wgrad_ms, [dx])
            return [dx], None
        if s.name == "p2p":
            last, _ = _ring_gather_consume(g, ctx, f"{name} dgrad", ready, op.n * d, dgrad_of, ctx.pieces())
        elif s.name == "symm-mem":
            last = copies_consume(g, ctx, f"{name} dgrad", ready, T / R * op.n * d, dgrad_of)
        else:
            last = fused_gather(g, ctx, f"{name} dgrad", ready, T * op.n * d, dgrad_of)
        handle = None  # every backend of the code starts the next column's re-gather here (tp/linear.py)
        if next_column is not None and s.prefetch_fraction > 0 and s.name != "flux":
            early = all_gather_cost(T * s.prefetch_fraction * next_column.k * d, R, ctx.link)
            handle = g.transfer(f"{next_column.name} bwd AG(x) early", early, [last], sm_comm=ctx.sm)
        g.compute(f"{name} wgrad", wgrad_ms, [last], contended=s.name == "p2p")
        return [last], handle

    dgrad_of = lambda m: ctx.gemm(m, op.k, op.n / R)  # noqa: E731
    wgrad_ms = ctx.gemm(op.n / R, op.k, T)
    if R > 1 and not ctx.sequence_parallel and s.name in ("p2p", "symm-mem"):
        wgrad = lambda last: g.compute(f"{name} wgrad", wgrad_ms, [last], contended=True)  # noqa: E731
        if s.name == "p2p":
            return [chunked_all_reduce(g, ctx, f"{name} dgrad", ready, op.k, dgrad_of, after=wgrad)], None
        return [reduce_then_gather(g, ctx, f"{name} dgrad", ready, op.k, dgrad_of, after=wgrad)], None
    if R == 1 or not ctx.sequence_parallel:
        dx = g.compute(f"{name} dgrad", dgrad_of(T), ready)
        if R > 1:  # input replicated: the dgrad is all-reduced (async, beside the wgrad)
            ar = g.transfer(f"{name} AR(dx)", all_reduce_cost(T * op.k * d, R, ctx.link), [dx], sm_comm=ctx.sm)
            g.compute(f"{name} wgrad", wgrad_ms, [dx], contended=True)
            return [g.compute(f"{name} wait", 0.0, [ar])], None
        g.compute(f"{name} wgrad", wgrad_ms, [dx])
        return [dx], None
    rest = 1.0 - (s.prefetch_fraction if prefetch is not None else 0.0)  # the Row before started the rest
    late = g.transfer(f"{name} AG(x)", all_gather_cost(T * rest * op.k * d, R, ctx.link), ready, sm_comm=ctx.sm)
    if s.name == "p2p":
        wgrad = lambda own: g.compute(f"{name} wgrad", wgrad_ms, [own, late, prefetch], contended=True)  # noqa: E731
        return [_ring_reduce_scatter(g, ctx, f"{name} dgrad", ready, op.k, dgrad_of, ctx.pieces(), s.rs, wgrad)], None
    ag = late if prefetch is None else g.compute(f"{name} AG(x) in", 0.0, [late, prefetch])
    if s.name == "megatron":
        dx = g.compute(f"{name} dgrad", dgrad_of(T), ready, contended=True)
        rs = g.transfer(f"{name} RS(dx)", reduce_scatter_cost(T * op.k * d, R, ctx.link), [dx, ag], sm_comm=ctx.sm)
        w = g.compute(f"{name} wgrad", wgrad_ms, [dx, ag], contended=True)
        return [g.compute(f"{name} wait", 0.0, [w, rs])], None
    if s.name == "symm-mem":
        dx = copies_reduce(g, ctx, f"{name} dgrad", ready, op.k, dgrad_of)
        w = g.compute(f"{name} wgrad", wgrad_ms, [dx, ag], contended=True)
        return [w], None
    # fused: the wgrad runs while the dgrad slots travel, then the reduce
    wgrad = lambda kernel: g.compute(f"{name} wgrad", wgrad_ms, [kernel, ag], contended=True)  # noqa: E731
    return [fused_reduce(g, ctx, f"{name} dgrad", ready, op.k, dgrad_of, after=wgrad)], None


# ------------------------------------------------------------------ other ops


def _collective(kind, total, ctx, link):
    return {"ag": all_gather_cost, "rs": reduce_scatter_cost, "ar": all_reduce_cost}[kind](total, ctx.tp, link)


def other_fwd(g: Graph, ctx: Ctx, op, ready: list) -> list:
    if isinstance(op, Elementwise):
        return [g.compute(op.name, op.fwd_ms, ready)]
    if isinstance(op, Exchange):
        c = g.compute(op.name, op.fwd_ms, ready)
        if op.fwd and ctx.tp > 1:
            return [g.transfer(f"{op.name} {op.fwd[0]}", _collective(*op.fwd, ctx, ctx.link), [c], sm_comm=ctx.sm)]
        return [c]
    if isinstance(op, Attention):
        return _attention(g, ctx, op, ready, op.fwd_ms, 1)
    raise TypeError(op)


def other_bwd(g: Graph, ctx: Ctx, op, ready: list) -> list:
    if isinstance(op, Elementwise):
        return [g.compute(f"{op.name} bwd", op.bwd_ms, ready)]
    if isinstance(op, Exchange):
        deps = ready
        if op.bwd and ctx.tp > 1:
            deps = [g.transfer(f"{op.name} bwd {op.bwd[0]}", _collective(*op.bwd, ctx, ctx.link), ready, sm_comm=ctx.sm)]
        return [g.compute(f"{op.name} bwd", op.bwd_ms, deps)]
    if isinstance(op, Attention):
        return _attention(g, ctx, op, ready, op.bwd_ms, 2)
    raise TypeError(op)


def _attention(g, ctx, op, ready, total_ms, kv_factor):
    """Core attention; with CP, a ring of CP steps: this rank's K/V (and in bwd their grads)
    travel while the attention of the chunk in hand runs (the next chunk waits for them)."""
    if ctx.cp == 1:
        return [g.compute(op.name, total_ms, ready)]
    last, sends = None, []
    for step in range(ctx.cp):
        if step < ctx.cp - 1:
            deps = ready if step == 0 else [sends[-1]]
            sends.append(g.transfer(f"{op.name} CP ring", p2p_cost(kv_factor * op.kv_bytes, ctx.cp_link), deps,
                                    stream=ctx.cp_stream, sm_comm=ctx.sm, kind="cp"))
        last = g.compute(f"{op.name} chunk", total_ms / ctx.cp, ready if step == 0 else [sends[step - 1]])
    return [last]
