"""Rank the strategies for one model, layout and machine; say which flags to pass.

Candidates: stock Megatron; ``p2p`` with the plugin's own chunk rule and with 1, 2, 4, 8
uniform chunks per rank, each with ``ring`` and (for TP > 2, where they differ) ``a2a``
reduce-scatter; ``symm-mem``; ``fused``; ``p2p`` (the plugin's chunk rule) with 2 and 3
sub-batches and ``symm-mem`` with 2 (``tune/sub_batches.py``); without sequence parallelism the
all-reduce path's (``ring`` only) and the all-reduce fusion with ``p2p`` and ``symm-mem``. Each is
simulated (``strategy_sim.simulate``); those that cannot run the configuration are listed with the reason.
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass

from .models import ModelSpec, RunSpec
from .strategy_sim import StrategyResult, simulate
from .strategies import Strategy


def candidates(run: RunSpec) -> list[Strategy]:
    """Without SP the linears all-reduce: no reduce-scatter to choose (``ring`` only), and the
    all-reduce fusion with p2p and symm-mem joins."""
    out = [Strategy("megatron")]
    sp = run.sequence_parallel
    for chunks in (0, 1, 2, 4, 8):
        for rs in ("ring", "a2a") if run.tp > 2 and sp else ("ring",):
            out.append(Strategy("p2p", chunks=chunks, rs=rs))
    out += [Strategy("symm-mem"), Strategy("fused")]
    out += [Strategy("p2p", sub_batches=n) for n in (2, 3)] + [Strategy("symm-mem", sub_batches=2)]
    if not sp:
        out += [Strategy("p2p", allreduce_fusion=True), Strategy("symm-mem", allreduce_fusion=True)]
    return out


@dataclass
class Plan:
    model: ModelSpec
    run: RunSpec
    hardware: object
    ranked: list  # applicable StrategyResults, fastest first
    not_applicable: list  # StrategyResults with .reason
    pipeline: list = None  # PP > 1, training: tune.pipeline.ScheduleResults with the best TP strategy

    @property
    def best(self) -> StrategyResult:
        return self.ranked[0]

    @property
    def stock(self) -> StrategyResult:
        return next(r for r in self.ranked if r.strategy.name == "megatron")

    def speedup(self, result: StrategyResult) -> float:
        return self.stock.step_ms / result.step_ms


class UnbuildableError(ValueError):
    """Megatron cannot build ``model`` in ``run``'s layout (``field``: the Megatron argument at
    fault, ``rules.model_shape_problems``): no strategy, stock included, is ranked."""

    def __init__(self, field: str, reason: str):
        self.field, self.reason = field, reason
        super().__init__(reason)


def check_buildable(model: ModelSpec, run: RunSpec) -> None:
    """Install's divisibility rules (``rules.model_shape_problems``), so the planner never ranks
    a layout Megatron refuses; the reason says what builds instead."""
    from ..rules import divisors_that_build, model_shape_problems

    seq = None if run.phase == "decode" else run.seq  # decode: cached tokens, nothing split over TP
    problems = model_shape_problems(run.tp, model.heads, model.kv_heads, seq, run.cp, run.sequence_parallel)
    if problems:
        field, reason = problems[0]
        if field.endswith("tensor_model_parallel_size"):
            sizes = divisors_that_build(max(8, run.tp), model.heads, model.kv_heads)
            reason += (f" ({model.heads} query heads, {model.kv_heads} key/value heads; TP sizes that build: "
                       f"{', '.join(map(str, sizes))})")
        raise UnbuildableError(field, f"Megatron cannot build {model.name} at TP={run.tp} CP={run.cp}: {reason}")


def make_plan(model: ModelSpec, run: RunSpec, hw, strategies: list = None) -> Plan:
    check_buildable(model, run)
    results = [simulate(model, run, hw, s) for s in (strategies or candidates(run))]
    ranked = sorted((r for r in results if r.applicable), key=lambda r: (r.step_ms, r.strategy.name != "megatron"))
    pipeline = None
    if run.pp > 1 and run.training and ranked:
        from .pipeline import simulate_schedules
        from .virtual import simulate_virtual

        pipeline = simulate_schedules(model, run, hw, ranked[0].strategy) + simulate_virtual(
            model, run, hw, ranked[0].strategy, buckets=("megatron", "every-chunk"))
    return Plan(model, run, hw, ranked, [r for r in results if not r.applicable], pipeline)


def describe_run(run: RunSpec) -> str:
    what = {"train": "training (fwd + bwd)", "prefill": f"inference prefill ({run.seq} tokens)",
            "decode": f"inference decode (1 new token per sequence, {run.seq} cached)"}[run.phase]
    layout = f"TP={run.tp}{'' if run.sequence_parallel or run.tp == 1 else ' without SP'} CP={run.cp} PP={run.pp} DP={run.dp}"
    batch = f"micro-batch {run.micro_batch}" + (f" x {run.micro_batches}" if run.training else "")
    return f"{layout}, seq {run.seq}, {batch}, {what}"


def format_plan(plan: Plan) -> str:
    width = max([17] + [len(r.name) + 1 for r in plan.ranked])
    lines = [
        f"{plan.model.name} on {plan.hardware.name}: {describe_run(plan.run)}",
        "",
        f"{'#':>2}  {'strategy':<{width}}{'step ms':>11}{'vs stock':>9}{'TP comm ms':>12}{'exposed ms':>12}"
        f"{'TP share':>9}  flags",
    ]
    for i, r in enumerate(plan.ranked, 1):
        lines.append(
            f"{i:>2}  {r.name:<{width}}{r.step_ms:>11.2f}{plan.speedup(r):>8.2f}x{r.comm_ms:>12.2f}"
            f"{r.exposed_comm_ms:>12.2f}{100 * r.comm_fraction:>8.0f}%  {r.flags}"
        )
    by_reason: dict = {}
    for r in plan.not_applicable:  # one line per reason (a 1-token decode rules out every overlap)
        by_reason.setdefault(r.reason, []).append(r.name)
    for reason, names in by_reason.items():
        p2p = [n for n in names if n.startswith("p2p")]
        if len(p2p) > 1:
            names = ["p2p (every chunk count and RS)"] + [n for n in names if not n.startswith("p2p")]
        lines.append(f"{'-':>2}  n/a: {', '.join(names)}: {reason}")
    other = {k: v for k, v in plan.stock.other_exposed_ms.items() if v > 0}
    lines += [
        "",
        f"best: {plan.best.name} ({plan.speedup(plan.best):.2f}x stock)  ->  {plan.best.flags}",
        "TP share: exposed TP communication / step time. TP comm ms: the transfers' link time "
        "(busy + latency, summed; pipelined latencies overlap each other).",
    ]
    if other:
        lines.append("other exposed communication per step (stock): "
                     + ", ".join(f"{k.upper()} {v:.2f} ms" for k, v in sorted(other.items())))
    if plan.pipeline:
        from .pipeline import format_schedules

        best = min(plan.pipeline, key=lambda r: r.step_ms)
        lines += ["", f"with {plan.best.name} inside each stage, " + format_schedules(plan.pipeline),
                  f"best schedule: {best.label} ({plan.pipeline[0].step_ms / best.step_ms:.2f}x stock 1F1B)  ->  "
                  f"{best.flags or '(stock)'}"]
    return "\n".join(lines)


def plan_json(plan: Plan) -> dict:
    return {
        "hardware": plan.hardware.name,
        "model": plan.model.name,
        "config": {"tp": plan.run.tp, "sequence_parallel": plan.run.sequence_parallel, "cp": plan.run.cp,
                   "pp": plan.run.pp, "dp": plan.run.dp, "seq": plan.run.seq,
                   "micro_batch": plan.run.micro_batch, "micro_batches": plan.run.micro_batches,
                   "phase": plan.run.phase},
        "strategies": [r.as_dict() for r in plan.ranked],
        "not_applicable": [{"name": r.name, "reason": r.reason} for r in plan.not_applicable],
        "best": plan.best.name,
        "pipeline": [vars(r) for r in plan.pipeline] if plan.pipeline else None,
    }


def draw_plan_timeline(plan: Plan, path: str) -> str:
    """One layer, forward then backward, of stock and of the best other strategy."""
    from ..trace import timeline

    shown = [plan.stock]
    other = next((r for r in plan.ranked if r.strategy.name != "megatron"), None)
    if other is not None:
        shown.append(other)
    width = max(r.layer_fwd_ms + r.layer_bwd_ms for r in shown)
    panels = []
    for r in shown:
        rows = []
        for stream, kind, label in (("compute", "compute", "compute"), ("blocked", "blocked", "blocked on comm"),
                                    ("link", "link", "TP link"), ("net", "link", "inter-node link")):
            spans = [(s["start_ms"], s["end_ms"]) for s in r.layer_spans if s["stream"] == stream]
            if spans or stream != "net":
                rows.append((label, kind, spans))
        phases = f"fwd {r.layer_fwd_ms:.3f} ms" + (f" + bwd {r.layer_bwd_ms:.3f} ms" if r.layer_bwd_ms else "")
        title = f"{r.name}: one layer, {phases} ({plan.speedup(r):.2f}x stock per step)"
        panels.append(timeline.Panel(title, width, rows))
    title = f"{plan.model.name} on {plan.hardware.name} (simulated)\n" + textwrap.fill(describe_run(plan.run), 72)
    return timeline.draw(panels, path, title=title, columns=1)
