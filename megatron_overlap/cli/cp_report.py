"""``bench cp``'s tables: the simulated one, and the emulated cluster's beside the simulator's."""

from __future__ import annotations


def _fabric(cfg: dict, link: dict) -> str:
    return (f"nodes of {link['node_size']} ranks: {link['intra_GBps']:.0f} GB/s inside "
            f"({link['intra_latency_us']:.1f} us), {link['inter_GBps']:.0f} GB/s between "
            f"({link['inter_latency_us']:.1f} us), per rank and direction")


def _head(cfg: dict, link: dict) -> str:
    return (f"{cfg['model']} on {cfg['hardware']} (TP = 1: one rank = one GPU), {cfg['seq']} tokens, CP = {cfg['cp']} x "
            f"DP = {cfg['ranks'] // cfg['cp']} on {cfg['ranks']} ranks; {_fabric(cfg, link)}")


def format_simulated(cfg, sim: dict) -> str:
    from dataclasses import asdict

    c = asdict(cfg)
    lines = ["simulated (cp/step_model.py; no run): " + _head(c, sim["link"]), "",
             f"{'':22}{'step ms':>10}{'x limit':>9}{'exposed ms':>12}{'inter-node MB/rank':>20}"]
    for name, p in sim["variants"].items():
        inter = max(t.get("inter", 0.0) for t in p.bytes_by_tier) / 1e6
        lines.append(f"{name:22}{p.step_ms:>10.1f}{p.step_ms / p.compute_limit_ms:>9.4f}{p.exposed_ms:>12.1f}"
                     f"{inter:>20.1f}")
    lines.append(f"the planner's pick: {sim['pick']} (the shortest simulated step)")
    return "\n".join(lines)


def format_table(result: dict) -> str:
    cfg, link = result["config"], result["link"]
    per = cfg["seq"] // cfg["rows"]
    lines = [
        "emulated cluster (times, not numerics): " + _head(cfg, link),
        f"the product's cp_attention, blocks and linears waits of the cost model's times; {cfg['rows']} emulated rows "
        f"of {per} tokens, heads 1 element wide, {cfg['layer_groups']} layer groups; the clock at "
        f"{cfg['time_factor']:.4g}x modelled time, bytes and link scaled alike; {cfg['steps']} rounds (medians); "
        "times in modelled ms",
        "",
        f"{'':16}{'step ms':>10}{'[sim]':>10}{'error':>8}{'x limit':>9}{'vs waited':>10}{'exposed':>9}"
        f"{'[sim]':>8}{'inter MB':>10}{'CPU ms':>8}{'CPU':>6}",
    ]
    for name, r in result["variants"].items():
        inter = r["bytes_by_tier"].get("inter", 0.0) / 1e6
        lines.append(
            f"{name:16}{r['step_ms']:>10.1f}{r['predicted_step_ms']:>10.1f}{100 * r['prediction_error']:>+7.1f}%"
            f"{r['vs_limit']:>9.3f}{r.get('vs_waited', float('nan')):>9.2f}x{r['exposed_ms']:>9.1f}"
            f"{r['predicted_exposed_ms']:>8.1f}{inter:>10.1f}{r['cpu_ms']:>8.0f}{100 * r['cpu_share']:>5.1f}%")
    first = next(iter(result["variants"].values()))
    lines += [
        f"limit (the replay: the same compute, every exchange a local copy): {result['limit_ms']:.1f} ms measured, "
        f"{first['predicted_limit_ms']:.1f} ms simulated",
        f"the planner's pick: {result['pick']}; measured best: {result['measured_best']}"
        + (f" (the pick at {result['pick_vs_best']:.4f}x the best)" if result["pick_vs_best"] else ""),
        "step: the slowest rank; exposed: step - limit; inter MB: modelled bytes a rank sends between nodes per step; "
        "CPU: the busiest rank's CPU time per step (wall ms) and its share of the wall step",
    ]
    return "\n".join(lines)
