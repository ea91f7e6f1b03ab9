"""The emulated cluster's report (``bench pp --emulate``): the table and the per-rank timeline."""

from __future__ import annotations

from ..lab.cluster import ClusterConfig
from .cluster_virtual import VIRTUAL_NAMES

NAMES = {"stock": "stock Megatron 1F1B", "1f1b": "1f1b (async P2P)", "zb": "zb (ZB-H1, drained)",
         "1f1b-inflight": "1f1b, K = 2p-1", "zbv": "zbv (ZB-V)"}
FLOOR_MEMORY = 1.05  # the floor's bound on activation memory, x stock's (1F1B, or interleaved)


def _names(cfg) -> dict:
    return VIRTUAL_NAMES if (cfg["vpp"] if isinstance(cfg, dict) else cfg.vpp) > 1 else NAMES


def format_table(result: dict) -> str:
    cfg = result["config"]
    t = result["times_ms"]
    link = result["link"]
    names = _names(cfg)
    lines = [
        f"emulated cluster (times, not numerics): "
        + (f"durations measured on this CPU ({cfg['durations']})" if cfg.get("durations") else
           f"{cfg['model']} on {cfg['hardware']}, TP={cfg['tp']} folded into each rank")
        + f", PP={cfg['pp']} x DP={cfg['dp']} = {cfg['pp'] * cfg['dp']} ranks on this machine, m = "
        f"{cfg['microbatches']}"
        + (f", {cfg['vpp']} model chunks per stage" if cfg.get("vpp", 1) > 1 else "") + f", {cfg['steps']} rounds (medians)",
        f"compute: {'the measured' if cfg.get('durations') else 'the cost model' + chr(39) + 's'} F/B/W per block as "
        "waits; per stage F/B/W ms per micro-batch: "
        + "; ".join(f"{x['f']:.1f}/{x['b']:.1f}/{x['w']:.1f}" for x in t),
        f"bytes x {result['scale']:.3g} (parameters, activations: {result['rows']} rows x 64), link bandwidth x the "
        f"same: {link['bandwidth_GBps'] / result['scale']:.3g} GB/s per GPU port (modelled), "
        f"{link['latency_us']:.1f} us + {link.get('launch_us', 0):.1f} us per op, a port per process group"
        + (f", nodes of {link['node_size']} ranks at {link['intra_GBps'] / result['scale']:.0f} GB/s" if
           link.get("node_size") else ""),
        f"P2P {result['transfer_ms']:.2f} ms per activation; DP per step: gradients reduce-scattered "
        f"{max(result['dp_reduce_ms']):.1f} ms, parameters all-gathered {max(result['dp_gather_ms']):.1f} ms "
        f"(largest stage; Megatron DDP buckets per stage: {result['buckets_per_stage']}"
        + (f" at {result['config'].get('bucket_factor')}x Megatron's default bucket size"
           if result["config"].get("bucket_factor", 1.0) != 1.0 else "")
        + "".join(f", {m}: {n}" for m, n in result.get("buckets_by_mode", {}).items()
                  if n != result["buckets_per_stage"]) + ")",
        "",
        f"{'':32}{'step ms':>9}{'vs stock':>9}{'bubble':>8}{'exp. P2P':>10}{'exp. DP':>9}{'act GB':>8}"
        f"{'CPU ms':>8}{'CPU':>6}{'predicted':>11}{'error':>7}{'x floor':>8}",
    ]
    for mode, r in result["modes"].items():
        lines.append(
            f"{names[mode]:32}{r['step_ms']:>9.1f}{r.get('speedup', 1.0):>8.2f}x{100 * r['bubble']:>7.1f}%"
            f"{r.get('p2p_exposed_ms', float('nan')):>10.1f}{r.get('dp_exposed_ms', float('nan')):>9.1f}"
            f"{r['peak_activation_gb']:>8.1f}{r['cpu_ms']:>8.0f}{100 * r['cpu_share']:>5.1f}%"
            f"{r['predicted_step_ms']:>11.1f}{100 * r['prediction_error']:>+6.1f}%"
            + (f"{r['vs_floor']:>8.3f}" if r.get("vs_floor") else f"{'-':>8}"))
    lines.append("simulated (pp/schedule_sim.py, this run's F/B/W, link and buckets): " + "; ".join(
        f"{names[m]} exposed P2P {r['predicted_p2p_exposed_ms']:.1f} ms, DP {r['predicted_dp_exposed_ms']:.1f} ms"
        for m, r in result["modes"].items()))
    fl = result["floor"]
    if "error" in fl:
        lines.append(f"floor: not computed ({fl['error']})")
    elif "placement" in fl:
        lines.append(f"floor (simulated, pp/optimal.py over the interleaved and V placements, the DP sync relaxed to "
                     f"stay a bound (cli/cluster_virtual.py), within {FLOOR_MEMORY}x stock interleaved's activation "
                     f"memory): {fl['bound_ms']:.1f} ms ({fl['placement']})"
                     + ("" if fl["optimal"] else f" (proved bound; best found {fl['step_ms']:.1f} ms)"
                        if fl["step_ms"] < float("inf") else " (proved bound; the solver found no schedule in time)"))
    else:
        lines.append(f"floor (simulated, pp/optimal.py with the DP sync, within {FLOOR_MEMORY}x 1F1B's activation "
                     f"memory): {fl['bound_ms']:.1f} ms" + ("" if fl["optimal"] else
                                                            f" (proved bound; best found {fl['step_ms']:.1f} ms)"))
    if result.get("post_validation_ms") is not None:
        lines.append(f"post-validation of the optimizer step (Zero Bubble) would shorten zb's step by "
                     f"{result['post_validation_ms']:.1f} ms (simulated): not built")
    lines.append("step: the slowest rank's schedule call; exposed DP: step - the step with DP free; exposed P2P: the "
                 "step with DP free - with every transfer free; act: micro-batches held at the peak x the cost "
                 "model's per micro-batch; CPU: the busiest rank's CPU time per step (the rest is sleeping); "
                 f"optimizer step (real CPU, outside the step) {max(r['optimizer_ms'] for r in result['modes'].values()):.0f} ms")
    lines.append(f"losses (the blocks' cheap math) {'identical across schedules' if result['losses_identical'] else 'DIFFER'}")
    return "\n".join(lines)


def draw_timeline(per_rank: list, cfg: ClusterConfig, path: str) -> str:
    """One step per rank (one rank per stage, DP rank 0), each schedule measured: F, B, W as
    the blocks ran, P2P and DP traffic on the link, the rest idle."""
    from ..trace import timeline

    kinds = {"F": "forward", "B": "backward", "W": "wgrad"}
    panels = []
    ranks = [r for r in per_rank if r["dp_rank"] == 0]
    width = max(1e3 * r[m]["link"]["schedule_s"] for r in ranks for m in cfg.modes)
    for mode in cfg.modes:
        rows = []
        for r in sorted(ranks, key=lambda x: x["stage"]):
            trace = r[mode]["link"]["trace"]
            s = r["stage"]
            for op in "FBW":
                rows.append((f"stage {s} {op}", kinds[op], _merge([(1e3 * a, 1e3 * b) for o, a, b in trace["compute"]
                                                                    if o == op])))
            rows.append((f"stage {s} P2P", "link", _merge([(1e3 * a, 1e3 * b) for o, a, b in trace["link"]
                                                          if o == "isend"])))
            rows.append((f"stage {s} DP", "dp", _merge([(1e3 * a, 1e3 * b) for o, a, b in trace["link"]
                                                       if "reduce_scatter" in o or "all_gather" in o
                                                       or "all_reduce" in o and o.startswith("coalesced")])))
            busy = _merge([(1e3 * a, 1e3 * b) for _o, a, b in trace["compute"]])
            rows.append((f"stage {s} idle", "idle", timeline.subtract((0.0, 1e3 * r[mode]["link"]["schedule_s"]),
                                                                        busy)))
        panels.append(timeline.Panel(f"{_names(cfg)[mode]} (measured, emulated cluster)", width, rows))
    return timeline.draw(panels, path, title=f"PP={cfg.pp} x DP={cfg.dp}, m={cfg.microbatches}, {cfg.model} on "
                         f"{cfg.hardware} (emulated): one step per stage", columns=1)


def _merge(spans, gap: float = 0.05) -> list:
    out = []
    for a, b in sorted(spans):
        if out and a - out[-1][1] <= gap:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out
