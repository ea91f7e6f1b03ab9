"""MLP block (Column fc1 -> GeLU -> Row fc2, SP; or all-reduces with ``--no-sequence-parallel``)
forward+backward: stock Megatron vs the plugin, on the same emulated link, in one run.

Each rank runs with one intra-op thread, as many ranks as cores, so a rank that sleeps on an
emulated transfer never lends its core to another. The link is calibrated so that a step's
transfer time equals its compute time (``--comm-ratio 1``): compute is timed by replaying
this rank's GEMMs and activation on local tensors with no communication at all, and the bytes
are counted from one stock step. Every round runs the replay, a stock step and an overlapped
step back to back (which of the two first alternates per round), so drifts of the machine hit
all alike; the summary takes medians of per-round ratios.

Physical limit = max(compute, transfer) per step. The ceiling of any overlap is stock / limit
(stock already hides part of its backward communication, so it is below 2 at ratio 1); the
table says which fraction of it the plugin reaches (its speedup / the ceiling).
"""


from __future__ import annotations

import statistics
from dataclasses import asdict

from ..lab.mlp_bench import MLPBench


LABELS = {"stock": "stock Megatron", "overlap": "megatron-overlap", "sub": "+ sub-batches",
          "fusion": "+ all-reduce fusion"}
TITLES = {"mlp": "MLP block (fc1 -> GeLU -> fc2)",
          "layer": "transformer layer (norm, QKV, causal attention, proj, norm, fc1, GeLU, fc2)"}


def run(cfg: MLPBench, progress: bool = True, timeline_png: str = "") -> dict:
    """Run the benchmark on ``cfg.tp`` fresh gloo ranks (one thread each); return the summary.
    With ``timeline_png``, the last round is traced and drawn there."""
    from tqdm import tqdm

    from ..lab.mlp_bench import MLPBenchRanks
    from ..lab.rank_pool import RankPool
    from ..lab.session import RemoteSession

    with RankPool(cfg.tp, timeout=1800, threads_per_rank=1) as pool:
        bar = tqdm(total=cfg.warmup + cfg.steps, desc=f"{cfg.block} bench (replay, free link, emulated link)", unit="round",
                   disable=not progress)
        ranks = RemoteSession(pool, MLPBenchRanks, asdict(cfg))
        rounds = ranks.rounds(cfg.warmup, cfg.steps, bar, record_last=bool(timeline_png))
        bar.close()
        closing = ranks.close()
    result = summarize(cfg, rounds, closing)
    if timeline_png:
        result["timeline_png"] = draw_timeline(rounds[-1], timeline_png, TITLES[cfg.block], cfg.sequence_parallel)
    return result


def draw_timeline(per_rank: list, path: str, title: str = "", sequence_parallel: bool = True) -> str:
    """Both modes of one round, the whole step, per rank: compute, blocked, link."""
    from ..trace import timeline

    panels = []
    modes = [m for m in LABELS if m in per_rank[0]]
    width = 1e3 * max(r[m]["trace"]["step"][1] - r[m]["trace"]["step"][0] for r in per_rank for m in modes)
    for mode, label in ((m, LABELS[m]) for m in modes):
        rows = []
        for rank, r in enumerate(per_rank):
            trace = r[mode]["trace"]
            start, end = trace["step"]
            rows.append((f"rank {rank} compute", "compute",
                         timeline.clip(timeline.subtract((start, end), trace["blocked"]), start, end)))
            rows.append((f"rank {rank} blocked", "blocked", timeline.clip(trace["blocked"], start, end)))
            rows.append((f"rank {rank} link", "link", timeline.clip(trace["link"], start, end)))
        panels.append(timeline.Panel(f"{label}: fwd+bwd", width, rows))
    sp = "TP + SP" if sequence_parallel else "TP without SP (all-reduces)"
    return timeline.draw(panels, path, title=f"{title or TITLES['mlp']}, {sp}, emulated link", columns=1)


def summarize(cfg: MLPBench, rounds: list, closing: list) -> dict:
    """Medians over rounds; per round, the slowest rank's wall time (a step ends when the last
    rank is done) and the mean over ranks of link time and blocked time."""
    compute_ms = statistics.median(1e3 * max(r["compute_s"] for r in per_rank) for per_rank in rounds)
    result = {"config": asdict(cfg), "link": closing[0]["link"], "compute_ms": compute_ms}
    for mode in cfg.modes:
        wall = [1e3 * max(r[mode]["wall_s"] for r in per_rank) for per_rank in rounds]
        blocked = [1e3 * statistics.mean(r[mode]["blocked_s"] for r in per_rank) for per_rank in rounds]
        busy = [1e3 * statistics.mean(r[mode]["busy_s"] for r in per_rank) for per_rank in rounds]
        nbytes = [max(r[mode]["bytes"] for r in per_rank) for per_rank in rounds]
        step_ms, comm_ms, exposed_ms = statistics.median(wall), statistics.median(busy), statistics.median(blocked)
        result[mode] = {
            "step_ms": step_ms,
            "step_ms_min": min(wall),
            "step_ms_max": max(wall),
            "comm_ms": comm_ms,
            "exposed_comm_ms": exposed_ms,
            "exposed_fraction": exposed_ms / comm_ms if comm_ms else 0.0,
            "bytes_per_step": int(statistics.median(nbytes)),
        }
    for mode in cfg.modes:
        result[mode]["free_link_step_ms"] = statistics.median(
            1e3 * max(r[f"{mode}_free"]["wall_s"] for r in per_rank) for per_rank in rounds)
    limit = max(compute_ms, result["stock"]["comm_ms"])
    result["limit_ms"] = limit
    # The same bound with the program's own compute (stock Megatron on a free link: GEMMs plus
    # framework overhead and the real, un-emulated cost of moving the bytes on this CPU).
    result["program_limit_ms"] = max(result["stock"]["free_link_step_ms"], result["stock"]["comm_ms"])

    # Ratios per round, then the median: each round measures its limit and both steps within
    # seconds of each other, so a machine that speeds up or slows down between rounds (a shared
    # VM does) does not bias them.
    def per_round(numerator, bound):
        ratios = []
        for per_rank in rounds:
            compute = max(r["compute_s"] for r in per_rank)
            transfer = statistics.mean(r["stock"]["busy_s"] for r in per_rank)
            free = max(r["stock_free"]["wall_s"] for r in per_rank)
            step = max(r[numerator]["wall_s"] for r in per_rank)
            ratios.append(step / max(compute if bound == "strict" else free, transfer))
        return statistics.median(ratios)

    # Forward and backward run one after the other: each phase is bound by its own compute or
    # transfer, whichever is longer (the MLP's forward moves 2 of its 5 tensors and does 1/3 of
    # its compute), so max(compute, transfer) of the whole step is below what any schedule reaches.
    def phase_limit(per_rank):
        compute = max(r["compute_s"] for r in per_rank)
        forward = max(r["compute_forward_s"] for r in per_rank)
        transfer = statistics.mean(r["stock"]["busy_s"] for r in per_rank)
        share = per_rank[0]["forward_bytes_share"]
        return max(forward, share * transfer) + max(compute - forward, (1 - share) * transfer)

    result["phase_limit_rounds_ms"] = [1e3 * phase_limit(per_rank) for per_rank in rounds]
    result["phase_limit_ms"] = statistics.median(result["phase_limit_rounds_ms"])
    result["phases"] = phases(cfg, rounds)
    for mode in cfg.modes:
        result[mode]["forward_ms"] = statistics.median(
            1e3 * max(r[mode]["forward_s"] for r in per_rank) for per_rank in rounds)
        result[f"{mode}_vs_phase_limit"] = statistics.median(
            max(r[mode]["wall_s"] for r in per_rank) / phase_limit(per_rank) for per_rank in rounds)
    result["overlap_vs_limit"] = per_round("overlap", "strict")
    result["stock_vs_limit"] = per_round("stock", "strict")
    result["ceiling"] = result["stock_vs_limit"]  # stock / limit: what any overlap could gain at most
    result["overlap_vs_program_limit"] = per_round("overlap", "program")
    result["speedup"] = statistics.median(
        max(r["stock"]["wall_s"] for r in per_rank) / max(r["overlap"]["wall_s"] for r in per_rank)
        for per_rank in rounds
    )
    result["fraction_of_ceiling"] = result["speedup"] / result["ceiling"]
    result["max_rel_diff_vs_stock"] = max(c["parity"] for c in closing)
    for mode in ("sub", "fusion"):  # the modes beside per-op overlap: sub-batches, the all-reduce fusion
        if mode in cfg.modes:
            result[f"{mode}_vs_limit"] = per_round(mode, "strict")
            result[f"{mode}_vs_program_limit"] = per_round(mode, "program")
            for base in ("stock", "overlap"):
                result[f"{mode}_speedup_vs_{base}"] = statistics.median(
                    max(r[base]["wall_s"] for r in per_rank) / max(r[mode]["wall_s"] for r in per_rank)
                    for per_rank in rounds)
            result[f"{mode}_max_rel_diff_vs_stock"] = max(c["parity_by_mode"][mode] for c in closing)
    return result


def phases(cfg: MLPBench, rounds: list) -> dict:
    """Forward and backward apart, per mode (medians over rounds, slowest rank; blocked: mean over
    ranks), each beside its own bound, max(its compute, its transfer). For a layer, the forward's
    bound with attention's synchronisation too: every forward transfer after the QKV all-gather
    carries the attention's output, so the link idles at least while the first part of the query
    rows (all of them when whole) computes its attention: forward transfer + attention / parts."""
    med = lambda values: 1e3 * statistics.median(values)  # noqa: E731
    out = {"compute_forward_ms": med(max(r["compute_forward_s"] for r in pr) for pr in rounds),
           "compute_backward_ms": med(max(r["compute_s"] - r["compute_forward_s"] for r in pr) for pr in rounds),
           "compute_attention_ms": med(max(r.get("compute_attention_s", 0.0) for r in pr) for pr in rounds)}
    share = rounds[0][0]["forward_bytes_share"]
    transfer = [statistics.mean(r["stock"]["busy_s"] for r in pr) for pr in rounds]
    out["transfer_forward_ms"], out["transfer_backward_ms"] = med(t * share for t in transfer), med(
        t * (1 - share) for t in transfer)
    out["forward_bound_ms"] = max(out["compute_forward_ms"], out["transfer_forward_ms"])
    out["backward_bound_ms"] = max(out["compute_backward_ms"], out["transfer_backward_ms"])
    # each round's own bounds (the medians above come from different rounds, so their sum is not
    # the median round's phase limit on a noisy machine; each round's is, exactly)
    out["rounds"] = []
    for pr, t in zip(rounds, transfer):
        fwd, comp = max(r["compute_forward_s"] for r in pr), max(r["compute_s"] for r in pr)
        out["rounds"].append({"forward_bound_ms": 1e3 * max(fwd, share * t),
                              "backward_bound_ms": 1e3 * max(comp - fwd, (1 - share) * t)})
    if cfg.block == "layer" and not cfg.sequence_parallel:
        # without SP a layer's first forward transfer is the projection's all-reduce: none can leave
        # before the norm and the QKV GEMM (the replay's, timed) have run, whatever the schedule
        out["compute_pre_attention_ms"] = med(max(r.get("compute_pre_attention_s", 0.0) for r in pr) for pr in rounds)
        out["forward_link_bound_ms"] = out["transfer_forward_ms"] + out["compute_pre_attention_ms"]
        out["step_bound_ms"] = max(out["forward_bound_ms"], out["forward_link_bound_ms"]) + out["backward_bound_ms"]
    for mode in cfg.modes:
        parts = cfg.sub_batches if mode == "sub" else 1
        out[mode] = {
            "forward_ms": med(max(r[mode]["forward_s"] for r in pr) for pr in rounds),
            "backward_ms": med(max(r[mode]["wall_s"] - r[mode]["forward_s"] for r in pr) for pr in rounds),
            "forward_blocked_ms": med(statistics.mean(r[mode]["forward_blocked_s"] for r in pr) for pr in rounds),
            "backward_blocked_ms": med(statistics.mean(r[mode]["blocked_s"] - r[mode]["forward_blocked_s"] for r in pr)
                                       for pr in rounds),
            "forward_sync_bound_ms": max(out["compute_forward_ms"],
                                         out["transfer_forward_ms"] + out["compute_attention_ms"] / parts)}
    return out


def format_phases(result: dict) -> list:
    ph, cfg = result["phases"], result["config"]
    layer = cfg.get("block", "mlp") == "layer"
    lines = ["", f"per phase: forward bound {ph['forward_bound_ms']:.1f} ms (compute {ph['compute_forward_ms']:.1f}, "
             f"transfer {ph['transfer_forward_ms']:.1f}), backward bound {ph['backward_bound_ms']:.1f} ms (compute "
             f"{ph['compute_backward_ms']:.1f}, transfer {ph['transfer_backward_ms']:.1f})"
             + (f"; replay's attention forward {ph['compute_attention_ms']:.1f} ms" if layer else ""),
             f"{'':18}{'forward':>9}{'blocked':>9}" + (f"{'sync bd':>9}" if layer else "")
             + f"{'backward':>10}{'blocked':>9}{'unblocked':>10}"]
    for mode in (m for m in LABELS if m in ph):
        r = ph[mode]
        label = LABELS[mode] if mode != "sub" else f"+ {cfg['sub_batches']} sub-batches"
        lines.append(f"{label:18}{r['forward_ms']:>9.1f}{r['forward_blocked_ms']:>9.1f}"
                     + (f"{r['forward_sync_bound_ms']:>9.1f}" if layer else "")
                     + f"{r['backward_ms']:>10.1f}{r['backward_blocked_ms']:>9.1f}"
                     f"{r['backward_ms'] - r['backward_blocked_ms']:>10.1f}")
    if "forward_link_bound_ms" in ph:
        lines.append(f"without SP no forward transfer leaves before the norm and the QKV GEMM ({ph['compute_pre_attention_ms']:.1f} "
                     f"ms in the replay): forward >= {ph['forward_link_bound_ms']:.1f} ms, step >= "
                     f"{ph['step_bound_ms']:.1f} ms (= {ph['step_bound_ms'] / result['limit_ms']:.2f}x the limit) for any schedule")
    lines.append("(sync bd: the forward's bound with attention's synchronisation, forward transfer + the first query "
                 "part's attention; unblocked: backward time not waiting on the link, against the replay's backward "
                 "compute)" if layer else "(unblocked: backward time not waiting on the link, against the replay's "
                 "backward compute)")
    return lines


def format_table(result: dict) -> str:
    link, cfg = result["link"], result["config"]
    lines = [
        f"{TITLES[cfg.get('block', 'mlp')]} fwd+bwd, hidden {cfg['hidden']}, ffn {cfg['ffn']}, seq {cfg['seq']}, "
        f"TP={cfg['tp']} {'+ SP' if cfg.get('sequence_parallel', True) else 'without SP (all-reduces)'}, fp32, "
        f"1 thread/rank, {cfg['steps']} rounds (medians)",
        f"link: {link['bandwidth_GBps']:.4f} GB/s egress per rank, {link['latency_us']:.0f} us/message "
        f"(transfers = {cfg['comm_ratio']:g} x compute)",
        f"compute only {result['compute_ms']:.1f} ms | transfer {result['stock']['comm_ms']:.1f} ms | "
        f"limit = max(compute, transfer) {result['limit_ms']:.1f} ms; per phase, max(fwd compute, fwd transfer) + "
        f"max(bwd compute, bwd transfer) = {result['phase_limit_ms']:.1f} ms",
        "",
        f"{'':18}{'free link':>10}{'emulated':>10}{'x limit':>9}{'x phase':>9}{'forward':>9}{'exposed comm':>14}"
        f"{'hidden':>8}{'MB/step':>9}",
    ]
    for mode in (m for m in LABELS if m in result):
        r, label = result[mode], LABELS[mode] if mode != "sub" else f"+ {cfg['sub_batches']} sub-batches"
        lines.append(
            f"{label:18}{r['free_link_step_ms']:>10.1f}{r['step_ms']:>10.1f}"
            f"{result[mode + '_vs_limit']:>9.2f}{result[mode + '_vs_phase_limit']:>9.2f}{r['forward_ms']:>9.1f}"
            f"{r['exposed_comm_ms']:>14.1f}"
            f"{100 * (1 - r['exposed_fraction']):>7.0f}%{r['bytes_per_step'] / 1e6:>9.1f}"
        )
    lines += [
        "",
        "(x limit, speedup: medians of per-round ratios)",
        f"speedup {result['speedup']:.2f}x over stock on the emulated link, of a ceiling (stock / limit) of "
        f"{result['ceiling']:.2f}x: {100 * result['fraction_of_ceiling']:.0f}% of it; "
        f"{result['overlap_vs_limit']:.2f}x the limit "
        f"({result['overlap_vs_program_limit']:.2f}x when compute is stock's own free-link step); "
        f"max rel. diff of grads vs stock {result['max_rel_diff_vs_stock']:.1e}",
    ]
    if "sub" in result:
        lines.append(
            f"{cfg['sub_batches']} sub-batches: {result['sub_vs_limit']:.2f}x the limit "
            f"({result['sub_vs_program_limit']:.2f}x against stock's free-link step), "
            f"{result['sub_speedup_vs_overlap']:.2f}x over per-op overlap, {result['sub_speedup_vs_stock']:.2f}x over "
            f"stock; max rel. diff of grads vs stock {result['sub_max_rel_diff_vs_stock']:.1e}")
    if "fusion" in result:
        lines.append(
            f"all-reduce fusion: {result['fusion_vs_limit']:.2f}x the limit "
            f"({result['fusion_vs_program_limit']:.2f}x against stock's free-link step), "
            f"{result['fusion_speedup_vs_overlap']:.2f}x over per-op overlap, {result['fusion_speedup_vs_stock']:.2f}x "
            f"over stock; max rel. diff of grads vs stock {result['fusion_max_rel_diff_vs_stock']:.1e}")
    if "phases" in result:
        lines += format_phases(result)
    if result.get("timeline_png"):
        lines.append(f"timeline: {result['timeline_png']}")
    return "\n".join(lines)
