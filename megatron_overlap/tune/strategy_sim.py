"""Simulate one training step (or one inference forward) of a transformer under a strategy.

One layer's forward and backward are scheduled as task graphs (``strategies`` builds them,
``engine`` times them), as are the output head and the embedding; a step is assembled from
them for the parallel layout (ranks ordered TP, CP, DP, PP: TP innermost, as Megatron's
default ``tp-cp-ep-dp-pp``):

    per micro-batch on the busiest stage   t_f = L/PP * layer_f + head_f (+ embedding_f),  t_b likewise
    step   = (M + PP - 1) (t_f + t_b)  +  PP exposed  +  DP exposed           (1F1B, M micro-batches)
    PP     = (M + PP - 1) * 2 P2P of the stage's activation [T/TP, h]      (not overlapped by
             non-interleaved 1F1B: the anchors' Megatron #4385)
    DP     = max(0, RS of the stage's fp32 grads over DP x CP - t_b) + max(0, AG of its bf16
             params - t_f)   (distributed optimizer with overlap_grad_reduce / overlap_param_gather:
             grads reduce only during the last micro-batch's backward, params gather during the
             first one's forward)

``comm_fraction`` is the exposed TP communication over the step time (the "TP communication
share"); ``comm_ms`` the TP transfers' link time (busy + latency) per step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .comm import all_gather_ms, p2p_ms, reduce_scatter_ms
from .engine import Graph, Schedule, schedule
from .layer_ops import Elementwise, Linear, embedding_ops, head_ops, transformer_layer_ops
from .models import ModelSpec, RunSpec
from .strategies import Ctx, Strategy, default_chunks_per_rank, linear_bwd, linear_fwd, other_bwd, other_fwd


@dataclass
class OpsResult:
    """Forward and backward schedules of one op list (one layer, the head, ...)."""

    fwd: Schedule
    bwd: Schedule
    fwd_tasks: list
    bwd_tasks: list

    @property
    def fwd_ms(self) -> float:
        return self.fwd.makespan_ms

    @property
    def bwd_ms(self) -> float:
        return self.bwd.makespan_ms

    def exposed_ms(self, kind: str = "tp") -> float:
        return self.fwd.exposed_ms(kind) + self.bwd.exposed_ms(kind)

    def comm_ms(self, kind: str = "tp") -> float:
        return self.fwd.busy_ms(self.fwd_tasks, kind) + self.bwd.busy_ms(self.bwd_tasks, kind)


@dataclass
class StrategyResult:
    strategy: Strategy
    name: str
    flags: str
    applicable: bool
    reason: str = ""
    step_ms: float = float("nan")
    comm_ms: float = 0.0
    exposed_comm_ms: float = 0.0
    comm_fraction: float = 0.0
    other_exposed_ms: dict = field(default_factory=dict)
    layer_fwd_ms: float = 0.0
    layer_bwd_ms: float = 0.0
    layer_spans: list = field(default_factory=list)  # {"phase", "name", "stream", "start_ms", "end_ms"}

    def as_dict(self) -> dict:
        return {"name": self.name, "flags": self.flags, "step_ms": self.step_ms, "comm_fraction": self.comm_fraction,
                "exposed_comm_ms": self.exposed_comm_ms}


def simulate_ops(ops: list, ctx: Ctx, training: bool) -> OpsResult:
    """Schedule ``ops`` forward (and, when training, backward in reverse order)."""
    sm = ctx.hw.nccl_sm_fraction
    n = ctx.strategy.sub_batches
    g, ready = Graph(), []
    if n > 1:
        from . import sub_batches

        ready = sub_batches.forward(g, ctx, ops, n)
    index = 0
    while n == 1 and index < len(ops):
        op = ops[index]
        if _fusable(ctx, ops, index):  # proj, residual+norm, fc1 as the all-reduce fusion runs them
            ready = _fused_forward(g, ctx, ops[index:index + 3], ready)
            index += 3
            continue
        ready = linear_fwd(g, ctx, op, ready) if isinstance(op, Linear) else other_fwd(g, ctx, op, ready)
        index += 1
    g.compute("end", 0.0, ready)  # the next layer needs the output: trailing transfers count as exposed
    fwd_tasks = g.tasks
    fwd = schedule(g, sm)
    gb, ready = Graph(), []
    if training and n > 1:
        from . import sub_batches

        gb.compute("end", 0.0, sub_batches.backward(gb, ctx, ops, n))
    elif training:
        prefetch: dict = {}
        # per-op: a Row starts the Column's whole input re-gather once its own pieces are in
        # (tp.linear.GatherSlot.start; ``Strategy.prefetch_fraction`` 1.0)
        for index in range(len(ops) - 1, -1, -1):
            op = ops[index]
            if not isinstance(op, Linear):
                ready = other_bwd(gb, ctx, op, ready)
                continue
            if op.kind == "row":  # the column that ran just before it in forward
                column = next((o for o in reversed(ops[:index]) if isinstance(o, Linear) and o.kind == "column"), None)
                ready, handle = linear_bwd(gb, ctx, op, ready, next_column=column)
                if column is not None and handle is not None:
                    prefetch[column.name] = handle
            else:
                ready, _ = linear_bwd(gb, ctx, op, ready, prefetch=prefetch.pop(op.name, None))
        gb.compute("end", 0.0, ready)
    return OpsResult(fwd, schedule(gb, sm), fwd_tasks, gb.tasks)


def _fusable(ctx: Ctx, ops: list, index: int) -> bool:
    """``ops[index:index + 3]`` is the attention projection, the residual + norm and fc1, and the
    all-reduce fusion runs them (``--overlap-tp-allreduce-fusion``, no SP, TP > 1)."""
    if not ctx.strategy.allreduce_fusion or ctx.sequence_parallel or ctx.tp == 1 or index + 2 >= len(ops):
        return False
    a, b, c = ops[index:index + 3]
    return isinstance(a, Linear) and a.kind == "row" and isinstance(b, Elementwise) and \
        isinstance(c, Linear) and c.kind == "column"


def _fused_forward(g: Graph, ctx: Ctx, ops: list, ready: list) -> list:
    """The fusion (``tp/allreduce_fusion.py``): the projection's GEMM-RS (the backend's), the
    residual add on this rank's T / R tokens (3/5 of ``residual+norm``'s traffic), then a ring
    all-gather of the sum whose pieces feed the norm (2/5, per piece) and fc1's GEMM."""
    from .strategies import _ring_gather_consume, _ring_reduce_scatter
    from .transfers import copies_reduce

    proj, residual, fc1 = ops
    R, T, d = ctx.tp, ctx.tokens, ctx.d
    partial_of = lambda m: ctx.gemm(m, proj.n, proj.k / R)  # noqa: E731
    if ctx.strategy.name == "p2p":
        h = _ring_reduce_scatter(g, ctx, "proj fwd", ready, proj.n, partial_of, ctx.pieces(), ctx.strategy.rs)
    else:
        h = copies_reduce(g, ctx, "proj fwd", ready, proj.n, partial_of)
    o = g.compute("bias+dropout+residual (shard)", 0.6 * residual.fwd_ms / R, [h])
    consume = lambda m: 0.4 * residual.fwd_ms * m / T + ctx.gemm(m, fc1.n / R, fc1.k)  # noqa: E731
    last, _ = _ring_gather_consume(g, ctx, "fc1 fwd (fused AG)", [o], proj.n * d, consume, ctx.pieces())
    return [last]


def not_applicable(run: RunSpec, hw, strategy: Strategy) -> str:
    """Why ``strategy`` cannot run this configuration ('' when it can)."""
    if strategy.name == "megatron":
        return ""
    if run.tp == 1:
        return "TP=1: nothing to overlap"
    sp = run.sequence_parallel
    if not sp and strategy.name == "fused":
        return "without SP its GEMM-reduce-scatter hides nothing (refused)"
    if run.tokens % run.tp and (sp or strategy.name == "symm-mem" or strategy.allreduce_fusion):
        why = "sequence parallelism" if sp else "its reduce-scatter"
        return f"{run.tokens} token(s) per micro-batch do not split over TP={run.tp} ({why} needs it)"
    if strategy.allreduce_fusion and (sp or run.cp > 1):
        return "the all-reduce fusion needs TP without SP and CP = 1"
    rows = run.tokens // run.micro_batch // run.tp if run.phase != "decode" else run.tokens // run.tp
    if strategy.sub_batches > 1 and (run.phase == "decode" or rows // strategy.sub_batches < max(1, strategy.chunks)):
        return f"{strategy.sub_batches} sub-batches of {rows} rows per rank leave too few rows per part"
    if strategy.name == "p2p":
        chunks = strategy.chunks or default_chunks_per_rank(rows, run.micro_batch)
        if chunks > rows:
            return f"{chunks} chunks per rank exceed the {rows} rows per rank"
        return ""
    if hw.name.startswith("cpu"):
        return f"{strategy.name} needs GPUs"
    if run.tp > hw.gpus_per_node:
        return f"{strategy.name} needs the TP group inside one node (symmetric memory)"
    return ""


def make_ctx(run: RunSpec, hw, strategy: Strategy) -> Ctx:
    tp_link = hw.link_for(run.tp)
    cp_span = run.tp * run.cp
    cp_link = hw.link_for(cp_span)
    cp_stream = "link" if cp_link is tp_link else "net"
    rows = run.tokens // run.micro_batch // run.tp if run.phase != "decode" else max(1, run.tokens // run.tp)
    batch = run.micro_batch if run.phase != "decode" else 1
    sp = run.sequence_parallel and run.tokens % run.tp == 0
    return Ctx(hw=hw, tp=run.tp, tokens=run.tokens, rows=rows, batch=batch, link=tp_link, strategy=strategy,
               cp=run.cp, cp_link=cp_link, cp_stream=cp_stream, sequence_parallel=sp)


def _spans(res: OpsResult) -> list:
    out = []
    for phase, sched, offset in (("fwd", res.fwd, 0.0), ("bwd", res.bwd, res.fwd_ms)):
        for s in sched.spans:
            out.append({"phase": phase, "name": s.name, "stream": s.stream,
                        "start_ms": offset + s.start_ms, "end_ms": offset + s.end_ms})
    return out


def simulate(model: ModelSpec, run: RunSpec, hw, strategy: Strategy) -> StrategyResult:
    result = StrategyResult(strategy, strategy.label(run.sequence_parallel),
                            strategy.flags(run.tp, run.sequence_parallel), applicable=False)
    result.reason = not_applicable(run, hw, strategy)
    if result.reason:
        return result
    result.applicable = True
    ctx = make_ctx(run, hw, strategy)
    training = run.training
    layer = simulate_ops(transformer_layer_ops(model, run, hw), ctx, training)
    head = simulate_ops(head_ops(model, run, hw) if training else head_ops(model, run, hw)[:2], ctx, training)
    embed = simulate_ops(embedding_ops(model, run, hw), ctx, training)
    per_stage = math.ceil(model.layers / run.pp)
    extras = [head, embed] if run.pp == 1 else [max(head, embed, key=lambda r: r.fwd_ms + r.bwd_ms)]
    t_f = per_stage * layer.fwd_ms + sum(r.fwd_ms for r in extras)
    t_b = per_stage * layer.bwd_ms + sum(r.bwd_ms for r in extras)
    micro = run.micro_batches if training else 1
    slots = micro + run.pp - 1

    def per_step(metric, kind):
        return slots * (per_stage * metric(layer, kind) + sum(metric(r, kind) for r in extras))

    other = {"cp": per_step(OpsResult.exposed_ms, "cp")}
    if run.pp > 1:
        pp_link = hw.link_for(run.world)
        other["pp"] = slots * (2 if training else 1) * p2p_ms(run.tokens / run.tp * model.hidden * hw.dtype_bytes, pp_link)
    if training and run.dp * run.cp > 1:
        # distributed optimizer: fp32 grads reduce-scattered during the last micro-batch's
        # backward, bf16 params all-gathered during the first one's forward
        params, group = model.params / (run.tp * run.pp), run.dp * run.cp
        dp_link = hw.link_for(run.tp * run.cp * run.dp)
        grads_ms = reduce_scatter_ms(4.0 * params, group, dp_link)
        gather_ms = all_gather_ms(2.0 * params, group, dp_link)
        other["dp"] = max(0.0, grads_ms - t_b) + max(0.0, gather_ms - t_f)
    result.step_ms = slots * (t_f + t_b) + other.get("pp", 0.0) + other.get("dp", 0.0)
    result.comm_ms = per_step(OpsResult.comm_ms, "tp")
    result.exposed_comm_ms = per_step(OpsResult.exposed_ms, "tp")
    result.comm_fraction = result.exposed_comm_ms / result.step_ms if result.step_ms > 0 else 0.0
    result.other_exposed_ms = other
    result.layer_fwd_ms, result.layer_bwd_ms = layer.fwd_ms, layer.bwd_ms
    result.layer_spans = _spans(layer)
    return result
