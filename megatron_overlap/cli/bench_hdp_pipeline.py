"""``megatron-overlap bench hdp --emulate --pp P``: HDP's pipeline mode on the emulated cluster
(``lab/hdp_pp_cluster.py``): R = P x D ranks, each stage's D ranks one HDP group planned by the
runtime in mode ``pp``, Megatron's 1F1B over the stages, activations P2P on the emulated two-tier
link; per batch, HDP's plan and static CP's executed by the same runtime, beside the prediction
(``lab.hdp_pp_cluster.simulate_pp``, the independent check of ``hdp/pp_timeline.py``). megatron-core's
``BalancedCPScheduler`` is left out: its groups run with a barrier after each, which a pipeline's
fixed micro-batch count does not have.
"""

from __future__ import annotations

import json
import statistics

from .bench_hdp_emulate import BenchError, gathered_order


def simulated(cfg) -> list:
    """Per batch and scheduler: the predicted step (modelled ms) and the plan's slot count."""
    from dataclasses import replace

    from ..lab.hdp_cluster import cost_and_link
    from ..lab.hdp_pp_cluster import plan_pp, simulate_pp

    cost, link = cost_and_link(replace(cfg.lab, ranks=cfg.world))
    out = []
    for lens in cfg.lab.batches:
        glens, home = gathered_order(list(lens), cfg.dp)
        row = {}
        for name in cfg.lab.schedulers:
            plan = plan_pp(name, glens, cfg.dp, cfg.lab.capacity, cost, home, cfg.pp)
            plan.validate()
            row[name] = {"step_ms": simulate_pp(plan, cost, link, cfg.pp),
                         "microbatches": max(len(m) for m in plan.microbatches)}
        out.append(row)
    return out


def run(cfg, progress: bool = True) -> list:
    from tqdm import tqdm

    from ..lab.hdp_pp_cluster import HDPPipeRanks, config_dict
    from ..lab.rank_pool import RankPool
    from ..lab.session import RemoteSession

    with RankPool(cfg.world, timeout=3600, threads_per_rank=1) as pool:
        bar = tqdm(total=len(cfg.lab.batches) + 1, disable=not progress, unit="batch",
                   desc=f"bench hdp --emulate --pp {cfg.pp}: {cfg.world} ranks")
        ranks = RemoteSession(pool, HDPPipeRanks, config_dict(cfg))
        ranks.call("step", 0, cfg.lab.schedulers[0])  # warm-up
        bar.update(1)
        rounds = []
        for k in range(len(cfg.lab.batches)):
            rounds.append(ranks.call("round", k))
            bar.update(1)
        bar.close()
        ranks.close()
    return rounds


def summarize(cfg, rounds: list, sim: list) -> dict:
    tf = cfg.lab.time_factor
    batches = []
    for k, (per_rank, s) in enumerate(zip(rounds, sim)):
        row = {"sequences": len(cfg.lab.batches[k]), "tokens": sum(cfg.lab.batches[k]),
               "longest": max(cfg.lab.batches[k]), "schedulers": {}}
        for name in cfg.lab.schedulers:
            step = 1e3 * max(r[name]["link"]["wall_s"] for r in per_rank) / tf
            row["schedulers"][name] = {
                "step_ms": step, "predicted_step_ms": s[name]["step_ms"],
                "prediction_error": step / s[name]["step_ms"] - 1, "microbatches": s[name]["microbatches"],
                "late_ms": 1e3 * max(r[name]["link"]["late_s"] for r in per_rank) / tf,
                "cpu_ms": 1e3 * max(r[name]["link"]["cpu_s"] for r in per_rank),
                "cpu_share": max(r[name]["link"]["cpu_s"] / r[name]["link"]["wall_s"] for r in per_rank),
                "bytes_by_tier": {t: max(r[name]["link"]["bytes_by_tier"].get(t, 0) for r in per_rank)
                                  for t in ("intra", "inter")}}
            if all("free" in r[name] for r in per_rank):  # the limit: every transfer free
                limit = 1e3 * max(r[name]["free"]["wall_s"] for r in per_rank) / tf
                row["schedulers"][name].update(limit_ms=limit, exposed_ms=step - limit)
        sc = row["schedulers"]
        if "static" in sc:
            for r in sc.values():
                r["vs_static"] = sc["static"]["step_ms"] / r["step_ms"]
                r["predicted_vs_static"] = sc["static"]["predicted_step_ms"] / r["predicted_step_ms"]
        batches.append(row)
    return {"config": {"pp": cfg.pp, "dp": cfg.dp, "ranks": cfg.world, "capacity": cfg.lab.capacity,
                       "model": cfg.lab.model, "hardware": cfg.lab.hardware, "layer_groups": cfg.lab.layer_groups,
                       "time_factor": tf},
            "batches": batches}


def format_table(result: dict, source: str) -> str:
    c = result["config"]
    lines = [f"emulated cluster (times, not numerics): HDP pipeline mode, {c['model']} on {c['hardware']}, "
             f"PP = {c['pp']} x DP = {c['dp']} ({c['ranks']} ranks), C = {c['capacity']}, 1F1B, {source}; clock at "
             f"{c['time_factor']:.4g}x modelled time, times in modelled ms",
             "",
             f"{'batch':>5}{'scheduler':>10}{'step ms':>10}{'[sim]':>10}{'error':>8}{'vs static':>10}{'[sim]':>8}"
             f"{'mb':>5}{'limit':>10}{'exposed':>9}{'CPU ms':>8}{'CPU':>7}{'late':>7}"]
    for k, b in enumerate(result["batches"]):
        for name, r in b["schedulers"].items():
            lines.append(f"{k:>5}{name:>10}{r['step_ms']:>10.0f}{r['predicted_step_ms']:>10.0f}"
                         f"{100 * r['prediction_error']:>+7.1f}%{r.get('vs_static', 0):>9.2f}x"
                         f"{r.get('predicted_vs_static', 0):>7.2f}x{r['microbatches']:>5}"
                         + (f"{r['limit_ms']:>10.0f}{r['exposed_ms']:>9.0f}" if "limit_ms" in r else f"{'-':>10}{'-':>9}")
                         + f"{r['cpu_ms']:>8.0f}{100 * r['cpu_share']:>6.1f}%{r['late_ms']:>7.0f}")
        lines.append(f"{'':>5}{b['sequences']} sequences, {b['tokens']} tokens, longest {b['longest']}")
    lines.append("step: the slowest rank; [sim]: lab.hdp_pp_cluster.simulate_pp of the same plan (simulated); mb: "
                 "micro-batch slots per pipeline; limit: the same step with every transfer free (rings and stage hops); "
                 "exposed: step - limit; CPU ms / CPU: the busiest rank's CPU per step (wall ms) / its share of the wall "
                 "step; late: the most a device idled "
                 "behind its host (the lab's own error)")
    return "\n".join(lines)


def pipeline_main(args) -> int:
    """``bench hdp --emulate --pp P`` (``cli/main.py`` sends it here): the batches cut for one
    stage's DP group (D = R / P), then the run."""
    import argparse
    from dataclasses import replace

    from .hdp_batches import load_batches

    from ..lab.hdp_cluster import SCHEDULERS, HDPLabConfig
    from ..lab.hdp_pp_cluster import PP_SCHEDULERS, HDPPipeConfig, check_pp
    from ..tune.models import get_model
    from .bench_cluster import capacity
    from .bench_hdp_emulate import check

    args.ranks = args.ranks or 16
    if not args.lengths_file and not args.corpus:
        args.corpus = "pile"
    try:
        dp = check_pp(args.ranks, args.pp, get_model(args.model).layers, args.layer_groups)
        batches, source = load_batches(argparse.Namespace(**{**vars(args), "ranks": dp}))
    except (ValueError, OSError) as exc:
        raise BenchError(str(exc)) from None
    given = tuple(x.strip() for x in args.schedulers.split(",") if x.strip())
    names = PP_SCHEDULERS if given == SCHEDULERS else given  # the default of --schedulers: the two a pipeline runs
    bad = [n for n in names if n not in PP_SCHEDULERS]
    if bad or not names:
        raise BenchError(f"--schedulers with --pp: choose from {', '.join(PP_SCHEDULERS)}, got {args.schedulers!r}")
    most, why = capacity(0, 0.0)
    if args.ranks > most:
        raise BenchError(f"{args.ranks} emulated ranks (--ranks) is more than this machine holds: at most {most} ({why})")
    lab = HDPLabConfig(batches=tuple(tuple(b) for b in batches), ranks=dp, capacity=args.max_tokens_per_rank,
                       model=args.model, hardware=args.hardware, node_size=args.node_size, intra_GBps=args.intra_GBps,
                       inter_GBps=args.inter_GBps, layer_groups=args.layer_groups, schedulers=names, exposed=not args.no_exposed,
                       seed=args.seed)
    check(replace(lab, schedulers=("hdp",)))  # the batches fit the DP group, the link divides the ranks
    if args.node_size and args.ranks % args.node_size:
        raise BenchError(f"--node-size {args.node_size} does not divide the {args.ranks} ranks into nodes")
    if not args.step_s > 0:
        raise BenchError(f"--step-s must be > 0, got {args.step_s}")
    cfg = HDPPipeConfig(lab=lab, pp=args.pp)
    sim = simulated(cfg)
    median = statistics.median(p["step_ms"] for row in sim for p in row.values())
    cfg = replace(cfg, lab=replace(lab, time_factor=args.step_s * 1e3 / median))
    rounds = run(cfg, progress=not args.no_progress)
    result = summarize(cfg, rounds, sim)
    result["source"] = source
    print(format_table(result, source))
    if args.json:
        print(json.dumps(result, default=str))
    return 0
