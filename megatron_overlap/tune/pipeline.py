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
- the data-parallel gradient reduce-scatter of the stage's parameters (fp32, distributed
  optimizer), which ``pp/simulate.py`` starts with the stage's last backward.

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
from ..pp.simulate import LinkCost, StageTimes, simulate as simulate_pipeline
from .comm import p2p_ms, reduce_scatter_ms
from .layer_ops import embedding_ops, head_ops, transformer_layer_ops
from .models import ModelSpec, RunSpec
from .simulate import OpsResult, make_ctx, simulate_ops
from .strategies import Strategy

# (label, --overlap-pp mode, schedule kind, in flight: 0 = p, "2p-1": each stage two ahead of the next)
SCHEDULES = (
    ("stock Megatron 1F1B", "off", "megatron", 0),
    ("1f1b (async P2P)", "1f1b", "1f1b", 0),
    ("1f1b, K = 2p-1 in flight", "1f1b", "1f1b", "2p-1"),
    ("zb (ZB-H1)", "zb", "zb", 0),
)


@dataclass(frozen=True)
class PipelineCosts:
    times: List[StageTimes]
    transfer_ms: float
    latency_ms: float
    dp_ms: float
    activation_bytes: float  # one micro-batch on one stage


@dataclass(frozen=True)
class ScheduleResult:
    label: str
    flags: str
    step_ms: float
    bubble: float  # on a free link: the schedule's own idle / step
    p2p_exposed_ms: float  # step - the same schedule's step on a free link
    dp_exposed_ms: float
    peak_activation_gb: float  # stage 0, the most-loaded stage


def _split(res: OpsResult) -> tuple:
    """(F, B without the wgrads, W) of one op list."""
    w = sum(t.busy_ms for t in res.bwd_tasks if t.name.endswith("wgrad"))
    return res.fwd_ms, max(0.0, res.bwd_ms - w), w


def stage_costs(model: ModelSpec, run: RunSpec, hw, strategy: Strategy = Strategy("megatron")) -> PipelineCosts:
    if run.pp < 2 or not run.training:
        raise ValueError(f"a pipeline schedule needs PP >= 2 and training, got PP={run.pp}, {run.phase}")
    ctx = make_ctx(run, hw, strategy)
    layer = _split(simulate_ops(transformer_layer_ops(model, run, hw), ctx, True))
    head = _split(simulate_ops(head_ops(model, run, hw), ctx, True))
    embed = _split(simulate_ops(embedding_ops(model, run, hw), ctx, True))
    per_stage = math.ceil(model.layers / run.pp)
    times = []
    for stage in range(run.pp):
        extra = embed if stage == 0 else head if stage == run.pp - 1 else (0.0, 0.0, 0.0)
        times.append(StageTimes(*(per_stage * x + e for x, e in zip(layer, extra))))
    link = hw.link_for(run.tp * run.pp)  # neighbouring stages: across nodes once TP x PP exceeds one
    nbytes = run.tokens / run.tp * model.hidden * hw.dtype_bytes
    transfer = p2p_ms(nbytes, link)
    dp_ms = 0.0
    if run.dp * run.cp > 1:
        params = model.params / (run.tp * run.pp)
        dp_ms = reduce_scatter_ms(4.0 * params, run.dp * run.cp, hw.link_for(run.tp * run.cp * run.dp))
    act = per_stage * layer_activation_bytes(run.seq, run.micro_batch, model.hidden, model.heads, run.tp, run.cp,
                                             hw.dtype_bytes, flash=True)
    return PipelineCosts(times, transfer, 0.0, dp_ms, act)


def simulate_schedules(model: ModelSpec, run: RunSpec, hw, strategy: Strategy = Strategy("megatron")) -> list:
    """Every schedule of ``SCHEDULES`` simulated for this model and layout (stock first)."""
    costs = stage_costs(model, run, hw, strategy)
    p, m = run.pp, run.micro_batches
    link, free = LinkCost(transfer_ms=costs.transfer_ms), LinkCost()
    dp = [costs.dp_ms] * p
    out = []
    for label, mode, kind, inflight in SCHEDULES:
        if kind != "megatron" and m < p:
            continue
        k = min(m, 2 * p - 1) if inflight == "2p-1" else 0
        schedule = build(kind, p, m, k, times=(costs.times[0].f, costs.times[0].b, costs.times[0].w))
        on_link = simulate_pipeline(schedule, costs.times, link, dp)
        alone = simulate_pipeline(schedule, costs.times, free)
        flags = " ".join(PPConfig(mode=mode, max_inflight=k or None,
                                  explicit=frozenset({"max_inflight"}) if k else frozenset()).flags())
        held = max(schedule.memory_bound)
        out.append(ScheduleResult(label, flags, on_link.step_ms, alone.bubble, on_link.step_ms - alone.step_ms
                                  - max(on_link.dp_exposed_ms), max(on_link.dp_exposed_ms),
                                  held * costs.activation_bytes / 1e9))
    return out


def format_schedules(results: list, memory_gb: float = 0.0) -> str:
    stock = results[0]
    lines = ["pipeline schedules (simulated: pp/simulate.py over the layer model's F, B, W per stage and one "
             "activation P2P per hop):",
             f"  {'schedule':24}{'step ms':>10}{'vs stock':>9}{'bubble':>8}{'exposed P2P':>13}{'exposed DP':>12}"
             f"{'act GB/stage':>13}  flags"]
    for r in sorted(results, key=lambda r: r.step_ms):
        over = memory_gb and r.peak_activation_gb > memory_gb
        lines.append(f"  {r.label:24}{r.step_ms:>10.1f}{stock.step_ms / r.step_ms:>8.2f}x{100 * r.bubble:>7.1f}%"
                     f"{r.p2p_exposed_ms:>11.1f}ms{r.dp_exposed_ms:>10.1f}ms{r.peak_activation_gb:>13.1f}  "
                     f"{r.flags or '(stock)'}" + ("  [over the memory budget]" if over else ""))
    lines.append("  bubble: idle / step on a free link; exposed P2P: step - the same schedule on a free link "
                 "(DP excluded); act: Korthikanti's estimate x micro-batches held on stage 0")
    return "\n".join(lines)


def zb_gain(model: ModelSpec, run: RunSpec, hw) -> tuple:
    """(ZB-H1 step / 1F1B step gain, ZB-H1 bubble / 1F1B bubble), both Megatron-order-free:
    our asynchronous 1F1B against our ZB-H1, so the gain is the split alone."""
    rows = {r.label: r for r in simulate_schedules(model, run, hw)}
    one, zb = rows["1f1b (async P2P)"], rows["zb (ZB-H1)"]
    return one.step_ms / zb.step_ms, (zb.bubble / one.bubble if one.bubble else float("nan"))
