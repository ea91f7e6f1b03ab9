"""What the demo's overlapped model runs when ``--overlap-tp-sub-batches auto`` (the default):
the cost model's pick for this CPU and this link, as ``--overlap-tp auto`` with
``--overlap-tp-sub-batches auto`` picks on a GPU it knows (``tune.auto.predicted_choice``).

The GPU datasheets do not describe a CPU, so the hardware is fitted to the demo's own
calibration step (stock Megatron on a free link, before anything is timed): the GEMM rate from
the step's GEMM time and their FLOPs, the element-wise rate so that the modelled stock step
takes the step's measured compute, the link as calibrated. The decomposition is the demo's
(``--overlap-tp-chunks``, ``--overlap-tp-rs``: its numerics choice), so the candidates are stock
and ``p2p`` with it, whole or cut into 2 or 3 sub-batches, every block or only the attention or
only the MLP blocks (``--overlap-tp-sub-batch-blocks``). Pure Python, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

SUB_BATCH_CANDIDATES = (1, 2, 3)
CUT_CANDIDATES = ("all", "attention", "mlp")  # the blocks a count above 1 cuts


@dataclass(frozen=True)
class Calibration:
    """One stock step on a free link, slowest rank: its GEMMs (``torch.matmul``) and compute
    (thread CPU time), and the emulated link the bytes of a step were then fitted to."""

    gemm_ms: float
    compute_ms: float
    bandwidth_GBps: float
    latency_us: float


def gemm_flops(cfg) -> float:
    """FLOPs of one training step's GEMMs on one TP rank: per layer QKV, projection, fc1 (SwiGLU:
    two halves) and fc2, then the output layer; forward once, dgrad and wgrad twice more."""
    t, h, r = cfg.seq * cfg.micro_batch, cfg.hidden, cfg.tp
    qkv = (cfg.heads + 2 * cfg.kv_heads) * (h // cfg.heads)
    per_layer = qkv * h + h * h + 2 * cfg.ffn * h + cfg.ffn * h
    return 3 * 2 * t * (cfg.layers * per_layer + cfg.vocab * h) / r


def _model_and_run(cfg):
    from ..tune.models import ModelSpec, RunSpec

    model = ModelSpec("demo tiny GPT", hidden=cfg.hidden, ffn=cfg.ffn, heads=cfg.heads, kv_heads=cfg.kv_heads,
                      layers=cfg.layers, vocab=cfg.vocab, seq=cfg.seq, gated=True)
    return model, RunSpec(tp=cfg.tp, seq=cfg.seq, micro_batch=cfg.micro_batch)


def fitted_hardware(cfg, cal: Calibration):
    """The ``cpu-emulated`` spec of this run: GEMMs at the measured rate, element-wise work at the
    rate that makes the modelled stock step (free link) take the measured compute."""
    from ..tune.hardware import cpu_emulated_spec
    from ..tune.strategy_sim import simulate
    from ..tune.strategies import Strategy

    model, run = _model_and_run(cfg)
    gflops = gemm_flops(cfg) / (cal.gemm_ms * 1e-3) / 1e9

    def stock_free_ms(mem_GBps: float) -> float:  # 1e6 GB/s: a free link
        return simulate(model, run, cpu_emulated_spec(gflops, mem_GBps, 1e6, 0.0), Strategy("megatron")).step_ms

    # the modelled step is a + b / mem: two points give both
    hi, lo = stock_free_ms(1e6), stock_free_ms(1.0)
    b = lo - hi
    rest = cal.compute_ms - hi
    mem = b / rest if rest > 0 and b > 0 else 1e6
    return cpu_emulated_spec(gflops, mem, cal.bandwidth_GBps, cal.latency_us)


def pick(cfg, cal: Calibration) -> dict:
    """``{"sub_batches": N or None (stock), "blocks": the blocks cut, "predicted_ms": {label: ms},
    "why": text}``."""
    from ..tune.strategy_ranking import make_plan
    from ..tune.strategies import Strategy

    from ..tune.strategy_ranking import UnbuildableError

    shape = dict(chunks=cfg.chunks // cfg.tp, rs=cfg.rs)
    cuts = (cfg.sub_batch_blocks,) if cfg.sub_batch_blocks else CUT_CANDIDATES
    allowed = [Strategy("megatron"), Strategy("p2p", **shape)] + [
        Strategy("p2p", sub_batches=n, cut=cut, **shape) for n in SUB_BATCH_CANDIDATES if n > 1 for cut in cuts]
    try:
        model, run = _model_and_run(cfg)
        hw = fitted_hardware(cfg, cal)
        plan = make_plan(model, run, hw, allowed)
    except (UnbuildableError, ValueError, ZeroDivisionError) as exc:  # no answer: ours runs per-op overlap
        return {"sub_batches": 1, "blocks": "all", "predicted_ms": {},
                "why": f"the cost model has no answer here ({exc})"}
    predicted = {_label(r.strategy): r.step_ms for r in plan.ranked}
    best = plan.ranked[0].strategy
    chosen = None if best.name == "megatron" else best.sub_batches
    stock = predicted["stock"]
    why = (f"the cost model's pick for this CPU (GEMMs at {hw.peak_tflops * 1e3:.1f} GFLOP/s, measured) and this "
           "link; predicted step: " + ", ".join(f"{k} {v:.0f} ms ({stock / v:.2f}x)" for k, v in predicted.items()))
    return {"sub_batches": chosen, "blocks": best.cut, "predicted_ms": predicted, "why": why}


def _label(strategy) -> str:
    if strategy.name == "megatron":
        return "stock"
    if strategy.sub_batches == 1:
        return "per-op overlap"
    return f"{strategy.sub_batches} sub-batches" + ("" if strategy.cut == "all" else f" ({strategy.cut} blocks)")
