"""``megatron-overlap demo --pp 2``: the tiny GPT trained over a 2-stage pipeline, stock
Megatron's 1F1B against ``--overlap-pp zb``, on the emulated link (one gloo rank per stage and
per core, stage-to-stage transfers calibrated to ``--comm-ratio`` x a stage's compute).

Both start from the same parameters and train side by side, one step of each per round (the
order alternates); the losses must be identical (the split changes when a weight gradient is
computed, not what it is). Per step: the slowest stage's wall time; the speedup is the median of
the per-round ratios. The timeline shows ours measured and stock simulated from the same F, B
and W times (Megatron's schedule exposes no per-action timing).
"""

from __future__ import annotations

import os
import statistics
from dataclasses import asdict

from ..lab.pp_bench import PPBench

STEPS = 8
PP_HIDDEN, PP_HEADS = PPBench.hidden, PPBench.heads  # --hidden (the FFN 4x it; 768, 3072 by default)


def run_pp_demo(stages: int = 2, steps: int = STEPS, timeline_png: str = "runs/demo/pp_timeline.png",
                progress: bool = True, hidden: int = PP_HIDDEN) -> dict:
    from tqdm import tqdm

    from ..lab.pp_bench import PPBenchRanks
    from ..lab.rank_pool import RankPool
    from ..lab.session import RemoteSession
    from .bench_pp import draw_timeline

    if stages < 2:
        raise SystemExit(f"demo --pp needs at least 2 stages, got {stages}")
    cfg = PPBench(pp=stages, layers=2 * stages, hidden=hidden, ffn=4 * hidden)
    bar = tqdm(total=2, desc=f"demo --pp {stages} (calibrate the link, then {steps} steps of each schedule)",
               disable=not progress)
    with RankPool(stages, timeout=1800, threads_per_rank=1) as pool:
        ranks = RemoteSession(pool, PPBenchRanks, asdict(cfg))
        described = ranks.call("describe")
        bar.update(1)
        per_rank = ranks.call("train", steps)
        bar.update(1)
        ranks.close()
    bar.close()
    modes = ("stock", "zb")
    losses = {m: per_rank[0][m]["loss"] for m in modes}
    walls = {m: [max(r[m]["wall_s"][i] for r in per_rank) for i in range(steps)] for m in modes}
    timed = range(1, steps)  # the first step of each warms up
    result = {"config": asdict(cfg), "link": described[0]["link"], "times_ms": [d["times_ms"] for d in described],
              "losses": losses, "step_ms": {m: [1e3 * w for w in walls[m]] for m in modes},
              "speedup": statistics.median(walls["stock"][i] / walls["zb"][i] for i in timed),
              "identical": losses["stock"] == losses["zb"]}
    os.makedirs(os.path.dirname(timeline_png) or ".", exist_ok=True)
    last = [{"zb": {"trace": r["zb"]["trace"], "wall_s": r["zb"]["wall_s"][-1]},
             "stock": {"wall_s": r["stock"]["wall_s"][-1]}} for r in per_rank]
    result["timeline_png"] = draw_timeline(last, described, cfg, timeline_png, modes=("stock", "zb"))
    return result


def format_pp_demo(result: dict) -> str:
    cfg = result["config"]
    lines = [f"PP={cfg['pp']} (one rank per stage and per core), m={cfg['microbatches']} micro-batches, tiny GPT "
             f"({cfg['layers']} layers, hidden {cfg['hidden']}), link {result['link']['bandwidth_GBps']:.4f} GB/s "
             f"(transfers = {cfg['comm_ratio']} x a stage's compute)", "",
             f"{'step':>4}{'stock loss':>14}{'zb loss':>14}{'stock ms':>10}{'zb ms':>9}"]
    for i, (a, b) in enumerate(zip(result["losses"]["stock"], result["losses"]["zb"])):
        lines.append(f"{i:>4}{a:>14.7f}{b:>14.7f}{result['step_ms']['stock'][i]:>10.1f}{result['step_ms']['zb'][i]:>9.1f}")
    lines += ["", f"losses: {'identical' if result['identical'] else 'DIFFERENT'}; "
              f"speedup {result['speedup']:.2f}x (median per-round stock / zb, first step left out)",
              f"timeline: {result['timeline_png']}"]
    return "\n".join(lines)
