"""Predict ``megatron-overlap bench mlp`` from its own inputs: the emulated link and the
measured compute.

Inputs, all from the bench's JSON result except the optional rate table:

- ``link``: ``bandwidth_GBps`` and ``latency_us`` of the emulated link (one egress port per rank);
- ``config``: hidden, ffn, seq, micro-batch, TP, ``chunks`` (``--overlap-tp-chunks``, 0 = the
  plugin's tapered rule) and ``rs``;
- ``compute_ms``: the bench's compute-only replay of one rank's step (6 GEMMs, GeLU fwd/bwd,
  bias), measured in the same run as the step times. It sets the absolute compute rate.
- ``rates`` (optional; ``measure_cpu`` writes it): single-thread times of the bench's GEMM
  shapes cut into 1-16 chunks along M, and of GeLU fwd/bwd and the bias ops. They give the
  *relative* costs: the GEMM efficiency curve (fitted, so small pieces cost what they cost) and
  the element-wise share of the replay. Without them every GEMM runs at one rate and the
  replay's time is all GEMM.

Stock and overlap are simulated with ``strategy_sim.simulate_ops`` on the MLP op list: the stock
forward's AG and RS exposed, its backward as megatron-core 0.16 runs it; the plugin's rings
with the same pieces as the plugin, its Row backward's wgrad waiting for the whole gathered
grad-output, and half of fc1's input re-gathered early. Not modelled: Megatron's Python
overhead and the real (un-emulated) cost of gloo moving the bytes, which the bench's
free-link columns show to be a few percent of the step.
"""

from __future__ import annotations

import json
from dataclasses import replace

from .engine import COMPUTE
from .gemm import fit_efficiency, gemm_ms, table_from_rows
from .hardware import cpu_emulated_spec
from .layer_ops import mlp_ops
from .models import RunSpec
from .strategy_sim import make_ctx, simulate_ops
from .strategies import Strategy


def _replay_gemms(hidden, ffn, seq, batch, tp):
    """(M, N, K) of the replay's six GEMMs (fc1/fc2 forward, dgrad, wgrad on the full sequence)."""
    t, f = seq * batch, ffn // tp
    return [(t, f, hidden), (t, hidden, f), (t, f, hidden), (hidden, f, t), (t, hidden, f), (f, hidden, t)]


def cpu_spec_for_bench(result: dict, rates: dict = None):
    """The ``cpu-emulated`` spec and the activation's (fwd, bwd) ms for this bench result,
    scaled so the modelled replay takes exactly the measured ``compute_ms``."""
    cfg, link = result["config"], result["link"]
    gemms = _replay_gemms(cfg["hidden"], cfg["ffn"], cfg["seq"], cfg["micro_batch"], cfg["tp"])
    if rates:
        table = table_from_rows(rates["gemm_table"])
        peak_gflops = max(2 * m * n * k / ms / 1e6 for (m, n, k), ms in table.items())
        eff = fit_efficiency(table, peak_gflops / 1e3)
        e = rates["elementwise"]
        act = (e["gelu_fwd_ms"] + e["bias_add_ms"], e["gelu_bwd_ms"] + e["bias_grad_ms"])
        mem_GBps = 2 * e["elements"] * 4 / (e["bias_add_ms"] * 1e-3) / 1e9  # read + write, fp32
    else:
        eff, act, mem_GBps = None, (0.0, 0.0), None
        peak_gflops = sum(2 * m * n * k for m, n, k in gemms) / (result["compute_ms"] * 1e-3) / 1e9
    hw = cpu_emulated_spec(peak_gflops, mem_GBps or 10.0, link["bandwidth_GBps"], link["latency_us"], gemm=eff)
    modelled_ms = sum(gemm_ms(m, n, k, hw) for m, n, k in gemms) + sum(act)
    scale = result["compute_ms"] / modelled_ms  # > 1: this run's CPU was slower than the rate table's
    hw = replace(hw, peak_tflops=hw.peak_tflops / scale, hbm_GBps=hw.hbm_GBps / scale)
    return hw, (act[0] * scale, act[1] * scale), scale


def predict_mlp_bench(result: dict, rates: dict = None) -> dict:
    """``{"stock_ms", "overlap_ms", ...}`` predicted for the bench run that produced ``result``."""
    cfg = result["config"]
    hw, (act_fwd, act_bwd), scale = cpu_spec_for_bench(result, rates)
    run = RunSpec(tp=cfg["tp"], seq=cfg["seq"], micro_batch=cfg["micro_batch"], phase="train")
    ops = mlp_ops(cfg["hidden"], cfg["ffn"], act_fwd, act_bwd)
    out = {"compute_scale": scale, "link": dict(result["link"])}
    plans = {"stock": Strategy("megatron"), "overlap": Strategy("p2p", chunks=cfg["chunks"] // cfg["tp"], rs=cfg["rs"])}
    if cfg.get("sub_batches", 1) > 1:
        plans["sub"] = Strategy("p2p", chunks=cfg["chunks"] // cfg["tp"], rs=cfg["rs"], sub_batches=cfg["sub_batches"])
    for mode, strategy in plans.items():
        res = simulate_ops(ops, make_ctx(run, hw, strategy), training=True)
        compute = sum(e - s for sched, tasks in ((res.fwd, res.fwd_tasks), (res.bwd, res.bwd_tasks))
                      for t, s, e in zip(tasks, sched.start, sched.end) if t.stream == COMPUTE)
        out[f"{mode}_ms"] = res.fwd_ms + res.bwd_ms
        out[f"{mode}_exposed_comm_ms"] = res.exposed_ms("tp")
        out[f"{mode}_comm_ms"] = res.comm_ms("tp")
        out[f"{mode}_compute_ms"] = compute
        out[f"{mode}_result"] = res
    return out


def compare(result: dict, rates: dict = None) -> str:
    """A small table: predicted vs measured step, exposed communication, link time."""
    p = predict_mlp_bench(result, rates)
    lines = [f"{'':10}{'measured':>10}{'predicted':>11}{'error':>8}   exposed comm meas./pred.   link meas./pred."]
    for mode in (m for m in ("stock", "overlap", "sub") if f"{m}_ms" in p):
        meas, pred = result[mode]["step_ms"], p[f"{mode}_ms"]
        lines.append(f"{mode:10}{meas:>10.1f}{pred:>11.1f}{100 * (pred / meas - 1):>+7.1f}%"
                     f"   {result[mode]['exposed_comm_ms']:>8.1f} / {p[f'{mode}_exposed_comm_ms']:<8.1f}"
                     f"       {result[mode]['comm_ms']:>7.1f} / {p[f'{mode}_comm_ms']:.1f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description="Predict a `bench mlp --json` result from its link and compute.")
    parser.add_argument("result", help="a file holding the bench's JSON line")
    parser.add_argument("--rates", help="JSON from `python -m megatron_overlap.tune.measure_cpu`")
    args = parser.parse_args(argv)
    with open(args.result) as fh:
        result = json.loads(fh.read().strip().splitlines()[-1])
    rates = json.load(open(args.rates)) if args.rates else None
    print(compare(result, rates))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
