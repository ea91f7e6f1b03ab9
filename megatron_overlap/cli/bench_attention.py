"""Ring attention forward+backward under the emulated link: overlapped ring vs the same ring
with its transfers not overlapped (each step waits for its block before computing), in one run.

The link is calibrated so that one key/value block's transfer takes as long as one block's
forward attention (``--comm-ratio 1``): the block time is measured on a free link (the whole
overlapped step, with its transfers costing nothing, over its ``3 n`` forward-block units:
n blocks forward, their backward at about twice the cost), and the bandwidth follows from the
bytes of one key/value block. Every round runs the compute replay, the free-link step, then
the non-overlapped and the overlapped ring (which of the two first alternates per round) back
to back, so drifts of the machine hit all alike; the summary takes medians of per-round ratios.

    compute  = the replay: this rank's block kernels and merges, forward and backward, on the
               same shapes and masks with every exchange a local copy (no communication at all;
               independent of the ring it bounds)
    transfer = time this rank's link port is busy in the overlapped step (bytes / bandwidth)
    limit    = max(compute, transfer); ceiling = waited / limit (what overlap could gain at most)

Causal attention in Megatron's zigzag layout: every position computes the same work, so no
rank waits for another; the work per rank is counted and printed (``BlockWork``).
"""


from __future__ import annotations

import statistics
from dataclasses import asdict

from ..lab.attention_bench import AttentionBench


def run(cfg: AttentionBench, progress: bool = True) -> dict:
    """Run on ``cfg.cp`` fresh gloo ranks (one thread each); return the summary."""
    from tqdm import tqdm

    from ..lab.attention_bench import AttentionBenchRanks
    from ..lab.rank_pool import RankPool
    from ..lab.session import RemoteSession

    with RankPool(cfg.cp, timeout=1800, threads_per_rank=1) as pool:
        bar = tqdm(total=cfg.warmup + cfg.steps, desc="ring attention (free link, serial, overlapped)",
                   unit="round", disable=not progress)
        ranks = RemoteSession(pool, AttentionBenchRanks, asdict(cfg))
        rounds = ranks.rounds(cfg.warmup, cfg.steps, bar)
        bar.close()
        closing = ranks.close()
    return summarize(cfg, rounds, closing)


def summarize(cfg: AttentionBench, rounds: list, closing: list) -> dict:
    """Per round: the slowest rank's wall time per mode, the mean port-busy time; medians."""
    def slowest(per_rank, key):
        return max(r[key] if key in ("free_s", "replay_s") else r[key]["wall_s"] for r in per_rank)

    result = {"config": asdict(cfg), "link": closing[0]["link"], "block_bytes": closing[0]["block_bytes"]}
    result["compute_ms"] = statistics.median(1e3 * slowest(p, "replay_s") for p in rounds)
    result["free_link_ms"] = statistics.median(1e3 * slowest(p, "free_s") for p in rounds)
    for mode in ("serial", "overlap"):
        result[mode] = {
            "step_ms": statistics.median(1e3 * slowest(p, mode) for p in rounds),
            "comm_ms": statistics.median(1e3 * statistics.mean(r[mode]["busy_s"] for r in p) for p in rounds),
            "exposed_comm_ms": statistics.median(1e3 * statistics.mean(r[mode]["blocked_s"] for r in p) for p in rounds),
            "bytes_per_step": int(statistics.median(max(r[mode]["bytes"] for r in p) for p in rounds)),
        }
    ratios_limit, ratios_serial_limit, speedups = [], [], []
    for p in rounds:
        limit = max(slowest(p, "replay_s"), statistics.mean(r["overlap"]["busy_s"] for r in p))
        ratios_limit.append(slowest(p, "overlap") / limit)
        ratios_serial_limit.append(slowest(p, "serial") / limit)
        speedups.append(slowest(p, "serial") / slowest(p, "overlap"))
    result["limit_ms"] = max(result["compute_ms"], result["overlap"]["comm_ms"])
    result["overlap_vs_limit"] = statistics.median(ratios_limit)
    result["serial_vs_limit"] = statistics.median(ratios_serial_limit)
    result["speedup_vs_serial"] = statistics.median(speedups)
    result["ceiling"] = result["serial_vs_limit"]  # waited / limit: the most overlap could gain
    result["fraction_of_ceiling"] = result["speedup_vs_serial"] / result["ceiling"]
    forward = [c["work"]["forward"] for c in closing]
    result["work_per_rank"] = forward
    result["work_max_over_mean"] = max(forward) / statistics.mean(forward)
    result["max_rel_diff_overlap_vs_serial"] = max(c["parity"] for c in closing)
    return result


def format_table(result: dict) -> str:
    cfg, link = result["config"], result["link"]
    lines = [
        f"ring attention fwd+bwd, CP={cfg['cp']}, seq {cfg['seq']} ({cfg['seq'] // cfg['cp']} rows/rank), "
        f"{cfg['heads']} q / {cfg['kv_heads']} kv heads x {cfg['head_dim']}, "
        f"{'causal (zigzag)' if cfg['causal'] else 'no mask'}, fp32, 1 thread/rank, {cfg['steps']} rounds (medians)",
        f"link: {link['bandwidth_GBps']:.4f} GB/s egress per rank, {link['latency_us']:.0f} us/message "
        f"(one {result['block_bytes'] / 1e6:.2f} MB K/V block = {cfg['comm_ratio']:g} x one block's forward)",
        f"compute (block kernels replayed, no communication) {result['compute_ms']:.1f} ms | transfer "
        f"{result['overlap']['comm_ms']:.1f} ms | limit = max(compute, transfer) {result['limit_ms']:.1f} ms "
        f"(overlapped ring on a free link: {result['free_link_ms']:.1f} ms)",
        "",
        f"{'':26}{'step ms':>9}{'x limit':>9}{'exposed comm ms':>17}{'MB/step':>9}",
    ]
    for mode, label in (("serial", "ring, transfers waited"), ("overlap", "ring, overlapped")):
        r = result[mode]
        lines.append(f"{label:26}{r['step_ms']:>9.1f}{result[mode + '_vs_limit']:>9.2f}"
                     f"{r['exposed_comm_ms']:>17.1f}{r['bytes_per_step'] / 1e6:>9.2f}")
    lines += [
        "",
        f"overlapped: {result['speedup_vs_serial']:.2f}x faster than waited, {result['overlap_vs_limit']:.2f}x the "
        f"limit; ceiling (waited / limit) {result['ceiling']:.2f}x, of which "
        f"{100 * result['fraction_of_ceiling']:.0f}% reached (medians of per-round ratios); causal score elements per rank {result['work_per_rank']} "
        f"(max/mean {result['work_max_over_mean']:.3f}); grads overlapped vs waited: max rel. diff "
        f"{result['max_rel_diff_overlap_vs_serial']:.1e}",
    ]
    return "\n".join(lines)
