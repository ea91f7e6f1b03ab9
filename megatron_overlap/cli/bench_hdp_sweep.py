"""``megatron-overlap bench hdp --sweep``: the schedulers over the batch sizes and rank counts a
user trains with, in one command. Simulated, as ``bench hdp``.

For every R in ``--sweep-ranks`` (default 64, 256) and every tokens per step T = m x R x C, m in
``--sweep-multiples`` (default 1, 2, 4, 8), full batches from the source (``--corpus``, a
``--lengths-file`` cut at T in file order, or a built-in distribution; the corpus's and the
distribution's documents cut at ``--max-len``, by default R x C / 8: 256K tokens at R = 64,
C = 32768; a lengths file's taken as they are), the first ``--steps`` of them, are planned by
every scheduler and scored as ``bench hdp`` scores them. Per scheduler::

    tw / bound       time-weighted: (sum of its steps) / (sum of the lower bounds), under our cost
                     model (plus the per-micro-batch overhead) and under megatron-core's L^2 / cp
    mean / bound     the per-step mean of step / bound (what ``bench hdp`` prints as vs bound)
    x megatron       time-weighted speedup over megatron-core's scheduler: its summed steps / ours
    worst            the worst batch against megatron-core's: max over batches of step / its step
    plan s           the planner's wall time per step, mean and max (hdp: ours, the guard, and
                     megatron-core's own scheduler, which the guard runs)
    guard            (hdp) the batches on which the guard kept megatron-core's plan
"""

from __future__ import annotations

import copy
import json
import sys
from typing import Dict, List

SHOWN = ("static", "megatron_balanced", "hdp")


def summarise(schedulers: Dict) -> Dict:
    """Per scheduler, the sweep's columns (module docstring) from ``bench_hdp.run``'s output."""
    ref = schedulers["megatron_balanced"]["per_step"]
    ref_by = {b: (ref["step_ms"][k], ref["square_ms"][k]) for k, b in enumerate(ref["batch"])}
    out = {}
    for name, s in schedulers.items():
        p = s["per_step"]
        if not p["step_ms"]:
            out[name] = None
            continue
        row = {"plan_s_mean": s["schedule_ms"] / 1e3, "plan_s_max": s["schedule_ms_max"] / 1e3,
               "guard_kept_megatron": s["guard_kept_megatron"]}
        for model, step, bound, k_ref in (("ours", "step_ms", "bound_ms", 0), ("l2", "square_ms", "square_bound_ms", 1)):
            row[f"{model}_tw_bound"] = sum(p[step]) / sum(p[bound])
            row[f"{model}_mean_bound"] = sum(a / b for a, b in zip(p[step], p[bound])) / len(p[step])
            common = [k for k, b in enumerate(p["batch"]) if b in ref_by]
            theirs = sum(ref_by[p["batch"][k]][k_ref] for k in common)
            row[f"{model}_x_megatron"] = theirs / sum(p[step][k] for k in common) if common else None
            row[f"{model}_worst"] = max(p[step][k] / ref_by[p["batch"][k]][k_ref] for k in common) if common else None
        out[name] = row
    return out


def format_sweep(rows: List[Dict], source: str) -> str:
    head = (f"{'R':>4}{'T / RC':>7}{'batches':>8}  {'scheduler':<18}{'tw/bound':>9}{'mean/bnd':>9}{'x megatr':>9}"
            f"{'worst':>7}  |{'L2 tw/b':>8}{'L2 x meg':>9}{'L2 worst':>9}  |{'plan s':>7}{'max s':>7}{'guard':>6}")
    lines = [f"HDP sweep (simulated): {source}", "our cost model + overhead per micro-batch  |  megatron-core's "
             "L^2/cp model  |  planner wall time per step", head]
    for r in rows:
        for name in SHOWN:
            x = r["summary"].get(name)
            if x is None:
                lines.append(f"{r['ranks']:>4}{r['multiple']:>7}{r['batches']:>8}  {name:<18}failed on every batch")
                continue
            lines.append(f"{r['ranks']:>4}{r['multiple']:>7}{r['batches']:>8}  {name:<18}{x['ours_tw_bound']:>8.3f}x"
                         f"{x['ours_mean_bound']:>8.3f}x{x['ours_x_megatron']:>8.3f}x{x['ours_worst']:>7.3f}  |"
                         f"{x['l2_tw_bound']:>7.3f}x{x['l2_x_megatron']:>8.3f}x{x['l2_worst']:>9.3f}  |"
                         f"{x['plan_s_mean']:>7.2f}{x['plan_s_max']:>7.2f}"
                         f"{x['guard_kept_megatron'] if name == 'hdp' else '':>6}")
    lines.append("tw/bound: summed steps / summed lower bounds; x megatr: megatron-core's summed steps / this one's; "
                 "worst: the worst batch's step / megatron-core's on it; guard: batches on which the guard kept "
                 "megatron-core's plan")
    return "\n".join(lines)


def sweep_main(args) -> int:
    """``bench hdp --sweep`` (module docstring)."""
    from tqdm import tqdm

    from ..hdp.cost import HdpCostModel
    from .bench_hdp import SCHEDULER_NAMES, run
    from .hdp_batches import load_batches

    C = args.max_tokens_per_rank
    ranks = [int(x) for x in args.sweep_ranks.split(",")]
    multiples = [int(x) for x in args.sweep_multiples.split(",")]
    cost = HdpCostModel.named(args.hardware, args.model)
    jobs = []
    try:
        if C <= 0 or any(R < 1 for R in ranks) or any(m < 1 for m in multiples):
            raise ValueError(f"--sweep needs C, R and multiples >= 1, got C={C}, R={ranks}, multiples={multiples}")
        for R in ranks:
            for m in multiples:
                a = copy.copy(args)
                a.ranks, a.batch_tokens = R, m * R * C
                a.max_len = args.max_len or R * C // 8
                batches, source = load_batches(a)
                jobs.append((R, m, batches[:args.steps], source))
    except (ValueError, OSError) as exc:
        print(f"bench hdp: {exc}", file=sys.stderr)
        return 2
    rows = []
    total = sum(len(b) for _, _, b, _ in jobs) * len(SCHEDULER_NAMES)
    with tqdm(total=total, desc="bench hdp --sweep", unit="plan", disable=args.no_progress, file=sys.stderr) as bar:
        for R, m, batches, source in jobs:
            bar.set_postfix_str(f"R={R} T={m}xRC")
            result = run(batches, R, C, cost, mode=args.mode, progress=False, overhead_ms=args.microbatch_overhead_ms,
                         guard=not args.no_guard, bar=bar)
            rows.append({"ranks": R, "multiple": m, "batches": len(batches), "source": source,
                         "sequences": sum(len(b) for b in batches), "summary": summarise(result)})
    print(format_sweep(rows, jobs[0][3].split(" (")[0] + f", C={C}, cut at {args.max_len or 'R x C / 8'}, "
                       f"{args.steps} batches per point, {args.hardware} / {args.model}, "
                       f"{args.microbatch_overhead_ms:g} ms per micro-batch"))
    if args.json:
        print(json.dumps({"sweep": rows}))
    return 0
