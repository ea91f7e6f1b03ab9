"""Pipeline schedules in the cost model (simulated): per-stage F, B and W from the layer model,
the stage-to-stage P2P from the link model, and each schedule of ``pp/`` simulated over them.

Per stage (``stage_times``):

- F: the forward of its layers (``ceil(layers / pp)``), plus the embedding on the first stage
  and the output layer + loss on the last;
- W: the weight-gradient GEMMs of those layers' linears (the tasks named ``wgrad`` in the
  backward schedule, at their modelled duration);
- B: the rest of the backward (its makespan minus W): what a split schedule keeps on the
  critical path;
- one transfer: the activation a stage hands on, ``[tokens / TP, hidden]`` (sequence parallel)
  in the model's dtype, over the link between the stages (InfiniBand when PP spans nodes);
- the data-parallel sync of the stage's parameters in Megatron DDP's buckets (``pp/buckets.py``:
  several on the first stage, one on the others): fp32 gradients reduce-scattered
  (distributed optimizer) as each bucket's last gradient is in, bf16 parameters all-gathered
  for the next step's first forward (``overlap_param_gather``): by the first forward's hook in
  Megatron's non-interleaved schedule, from the step's start in ours (``pp/schedule_sim.py``).

Assumptions beyond the layer model's own: stages are as balanced as whole layers allow; W is
deferrable only where the schedule splits B (``zb``); TP overlap inside a stage is priced by
the strategy given (stock unless told); activation memory per micro-batch is Korthikanti's
estimate with flash attention (``pp/memory.py``), times the micro-batches a schedule keeps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List

from ..config import PPConfig
from ..pp import build
from ..pp.memory import layer_activation_bytes
from ..pp.buckets import buckets, stage_bucket_size
from ..pp.schedule_sim import DPSync, LinkCost, StageTimes, simulate as simulate_pipeline
from ..pp.work import BlockWork, stage_params, stage_times
from .comm import all_gather_cost, all_reduce_cost, p2p_ms, reduce_scatter_cost
from .layer_ops import embedding_ops, head_ops, transformer_layer_ops
from .models import ModelSpec, RunSpec
from .strategy_sim import OpsResult, make_ctx, simulate_ops
from .strategies import Strategy

# (label, --overlap-pp mode, schedule kind, in flight: 0 = p, "2p-1": each stage two ahead of the next)
SCHEDULES = (
    ("stock Megatron 1F1B", "off", "megatron", 0),
    ("1f1b (async P2P)", "1f1b", "1f1b", 0),
    ("1f1b, K = 2p-1 in flight", "1f1b", "1f1b", "2p-1"),
    ("zb (ZB-H1)", "zb", "zb", 0),
)


@dataclass(frozen=True)
class DPOptions:
    """How Megatron DDP syncs the data-parallel replicas (Megatron-LM's flags): the distributed
    optimizer (``--use-distributed-optimizer``: gradients reduce-scattered, parameters
    all-gathered; else all-reduced), ``--overlap-grad-reduce`` (buckets reduced during the
    backward; else one reduction after it), ``--overlap-param-gather`` (parameters gathered by
    the next forward; else inside the optimizer step, outside the schedule)."""

    distributed_optimizer: bool = True
    overlap_grad_reduce: bool = True
    overlap_param_gather: bool = True

    def describe(self) -> str:
        return ("distributed optimizer" if self.distributed_optimizer else "all-reduce") + \
            (", overlap_grad_reduce" if self.overlap_grad_reduce else "") + \
            (", overlap_param_gather" if self.distributed_optimizer and self.overlap_param_gather else "")


@dataclass(frozen=True)
class PipelineCosts:
    times: List[StageTimes]
    transfer_ms: float
    latency_ms: float
    dp: List[DPSync]  # Megatron's: parameters gathered at the first forward
    activation_bytes: float  # one micro-batch on one stage
    work: List[List[BlockWork]]
    transfer_bytes: float  # one activation on the wire

    @property
    def dp_ms(self) -> float:
        """The largest stage's gradient reduction (all its buckets, one after the other)."""
        return max((d.reduce_total_ms for d in self.dp), default=0.0)

    def dp_ours(self) -> List[DPSync]:
        """The same traffic with the first parameter bucket dispatched at the step's start."""
        return [d.replace(gather_at_start=True) for d in self.dp]


@dataclass(frozen=True)
class ScheduleResult:
    label: str
    flags: str
    step_ms: float
    bubble: float  # on a free link: the schedule's own idle / step
    p2p_exposed_ms: float  # step without the DP sync - the same schedule's step on a free link
    dp_exposed_ms: float  # step - the same step without the DP sync
    peak_activation_gb: float  # stage 0, the most-loaded stage


def _split(res: OpsResult) -> tuple:
    """(F, B without the wgrads, W) of one op list."""
    w = sum(t.busy_ms for t in res.bwd_tasks if t.name.endswith("wgrad"))
    return res.fwd_ms, max(0.0, res.bwd_ms - w), w


def layer_params(model: ModelSpec, tp: int) -> tuple:
    """A transformer layer's parameters on one TP rank, as its two halves hold them: (input
    norm + QKV + output projection, MLP norm + fc1 + fc2)."""
    h = model.hidden
    return (h + h * model.qkv_out // tp + h * h // tp, h + h * model.fc1_out // tp + model.ffn * h // tp)


def _halves(model: ModelSpec, run: RunSpec, hw, ctx) -> tuple:
    """(attention half, MLP half) of one layer's (F, B, W): each half simulated on its own
    (norm, QKV, attention, projection | norm, fc1, activation, fc2), then scaled so the two add
    up to the whole layer's simulation."""
    ops = transformer_layer_ops(model, run, hw)
    cut = next(i for i, op in enumerate(ops) if op.name == "residual+norm")
    whole = _split(simulate_ops(ops, ctx, True))
    parts = [_split(simulate_ops(part, ctx, True)) for part in (ops[:cut], ops[cut:])]
    out = []
    for part in parts:
        out.append(tuple(w * x / (a + b) if a + b else w / 2 for w, x, a, b in zip(whole, part, *parts)))
    return tuple(out)


def stage_work(model: ModelSpec, run: RunSpec, hw, strategy: Strategy = Strategy("megatron")) -> List[List[BlockWork]]:
    """Per stage: the embedding (stage 0), ``ceil(layers / pp)`` transformer layers (each as its
    attention and MLP halves, as Megatron's modules run them and as DDP's buckets hold their
    parameters), the final norm and output layer (last stage), each with its F, B, W and
    parameters (module docstring)."""
    if run.pp < 2 or not run.training:
        raise ValueError(f"a pipeline schedule needs PP >= 2 and training, got PP={run.pp}, {run.phase}")
    ctx = make_ctx(run, hw, strategy)
    attn, mlp = _halves(model, run, hw, ctx)
    attn_params, mlp_params = layer_params(model, run.tp)
    head = _split(simulate_ops(head_ops(model, run, hw), ctx, True))
    embed = _split(simulate_ops(embedding_ops(model, run, hw), ctx, True))
    per_stage = math.ceil(model.layers / run.pp)
    table = model.vocab * model.hidden // run.tp
    out = []
    for stage in range(run.pp):
        blocks = []
        for i in range(per_stage):
            k = stage * per_stage + i
            blocks += [BlockWork(f"layer {k} attention", *attn, (attn_params,)),
                       BlockWork(f"layer {k} mlp", *mlp, (mlp_params,))]
        if stage == 0:
            blocks.insert(0, BlockWork("embedding", *embed, (table,)))
        if stage == run.pp - 1:
            blocks.append(BlockWork("output layer", *head, (model.hidden + table,)))
        out.append(blocks)
    return out


def dp_syncs(work: List[List[BlockWork]], run: RunSpec, hw, options: DPOptions = DPOptions(),
             gather_at_start: bool = False) -> List[DPSync]:
    """Each stage's data-parallel traffic in Megatron DDP's buckets (``pp/buckets.py``): fp32
    gradients reduce-scattered (distributed optimizer) or all-reduced, bf16 parameters
    all-gathered for the next step's forward (distributed optimizer with
    ``overlap_param_gather``), over the DP x CP group's fabric. Without ``overlap_grad_reduce``
    one reduction runs after the stage's last action."""
    ranks = run.dp * run.cp
    if ranks <= 1:
        return [DPSync() for _ in work]
    link = hw.link_for(run.tp * run.cp * run.dp)
    out = []
    for stage, params in enumerate(stage_params(work)):
        sizes = buckets(params, stage_bucket_size(ranks, stage, options.overlap_grad_reduce))
        reduce = reduce_scatter_cost if options.distributed_optimizer else all_reduce_cost
        rs = [reduce(4.0 * n, ranks, link) for n in sizes]
        ag = [all_gather_cost(hw.dtype_bytes * n, ranks, link) for n in reversed(sizes)] \
            if options.distributed_optimizer and options.overlap_param_gather else []
        out.append(DPSync(reduce_ms=tuple(c.busy_ms for c in rs), gather_ms=tuple(c.busy_ms for c in ag),
                          latency_ms=rs[0].latency_ms, gather_at_start=gather_at_start))
    return out


def stage_costs(model: ModelSpec, run: RunSpec, hw, strategy: Strategy = Strategy("megatron"),
                dp_options: DPOptions = DPOptions()) -> PipelineCosts:
    work = stage_work(model, run, hw, strategy)
    times = stage_times(work)
    link = hw.link_for(run.tp * run.pp)  # neighbouring stages: across nodes once TP x PP exceeds one
    nbytes = run.tokens / run.tp * model.hidden * hw.dtype_bytes
    transfer = p2p_ms(nbytes, link)
    per_stage = math.ceil(model.layers / run.pp)
    act = per_stage * layer_activation_bytes(run.seq, run.micro_batch, model.hidden, model.heads, run.tp, run.cp,
                                             hw.dtype_bytes, flash=True)
    return PipelineCosts(times, transfer, 0.0, dp_syncs(work, run, hw, dp_options), act, work, nbytes)


def simulate_schedules(model: ModelSpec, run: RunSpec, hw, strategy: Strategy = Strategy("megatron"),
                       dp_options: DPOptions = DPOptions(), placement=None) -> list:
    """Every schedule of ``SCHEDULES`` simulated for this model and layout (stock first), with
    the data-parallel sync priced as the emulated cluster measures it: Megatron's buckets, its
    parameter gather at the first forward for stock, at the step's start for ours. ``zb``
    places its weight gradients as the executor will (``placement``: the (F, B, W) it is given;
    None: ``pp.build.placement_times`` on these costs, what the install computes)."""
    from ..pp.build import placement_times

    costs = stage_costs(model, run, hw, strategy, dp_options)
    p, m = run.pp, run.micro_batches
    link, free = LinkCost(transfer_ms=costs.transfer_ms), LinkCost()
    out = []
    for label, mode, kind, inflight in SCHEDULES:
        if kind != "megatron" and m < p:
            continue
        k = min(m, 2 * p - 1) if inflight == "2p-1" else 0
        if kind == "zb" and placement is None:
            placement = placement_times(costs.times, m, link, costs.dp_ours())
        schedule = build(kind, p, m, k, times=placement or (1.0, 1.0, 1.0))
        dp = costs.dp if kind == "megatron" else costs.dp_ours()
        on_link = simulate_pipeline(schedule, costs.times, link, dp)
        no_dp = simulate_pipeline(schedule, costs.times, link)
        alone = simulate_pipeline(schedule, costs.times, free)
        flags = " ".join(PPConfig(mode=mode, max_inflight=k or None,
                                  explicit=frozenset({"max_inflight"}) if k else frozenset()).flags())
        held = max(schedule.memory_bound)
        out.append(ScheduleResult(label, flags, on_link.step_ms, alone.bubble, no_dp.step_ms - alone.step_ms,
                                  on_link.step_ms - no_dp.step_ms, held * costs.activation_bytes / 1e9))
    return out


def format_schedules(results: list, memory_gb: float = 0.0) -> str:
    stock = results[0]
    lines = ["pipeline schedules (simulated: pp/schedule_sim.py over the layer model's F, B, W per stage and one "
             "activation P2P per hop):",
             f"  {'schedule':32}{'step ms':>10}{'vs stock':>9}{'bubble':>8}{'exposed P2P':>13}{'exposed DP':>12}"
             f"{'act GB/stage':>13}  flags"]
    for r in sorted(results, key=lambda r: r.step_ms):
        over = memory_gb and r.peak_activation_gb > memory_gb
        lines.append(f"  {r.label:32}{r.step_ms:>10.1f}{stock.step_ms / r.step_ms:>8.2f}x{100 * r.bubble:>7.1f}%"
                     f"{r.p2p_exposed_ms:>11.1f}ms{r.dp_exposed_ms:>10.1f}ms{r.peak_activation_gb:>13.1f}  "
                     f"{r.flags or '(stock)'}" + ("  [over the memory budget]" if over else ""))
    lines.append("  bubble: idle / step on a free link; exposed P2P: the step without the DP sync - the same on a "
                 "free link; exposed DP: step - the same step without the DP sync (Megatron's buckets, distributed "
                 "optimizer: gradients reduce-scattered, parameters all-gathered; stock gathers at the first "
                 "forward, ours from the step's start); act: Korthikanti's estimate x micro-batches held on stage 0")
    return "\n".join(lines)


def zb_gain(model: ModelSpec, run: RunSpec, hw) -> tuple:
    """(ZB-H1 step / 1F1B step gain, ZB-H1 bubble / 1F1B bubble), both Megatron-order-free:
    our asynchronous 1F1B against our ZB-H1, so the gain is the split alone."""
    rows = {r.label: r for r in simulate_schedules(model, run, hw)}
    one, zb = rows["1f1b (async P2P)"], rows["zb (ZB-H1)"]
    return one.step_ms / zb.step_ms, (zb.bubble / one.bubble if one.bubble else float("nan"))
