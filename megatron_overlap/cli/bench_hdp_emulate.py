"""``megatron-overlap bench hdp --emulate``: the schedulers' plans executed by the HDP runtime on
the emulated cluster (``lab/hdp_cluster.py``: R = 16 ranks on this machine by default), each batch
of real document lengths (``--lengths-file``, or the shipped Pile sample, ``--corpus pile``, the
default) once per scheduler, beside what the simulator (``hdp/simulate.py``) predicts for the same
plan.

Per batch and scheduler (modelled ms: measured wall / the lab's time factor)::

    step        the slowest rank from the common start to its device's last op
    [sim]       hdp.simulate.simulate of the same plan with the same cost model and fabric
    exposed     step - the same step with every transfer free (measured); [sim] likewise
    bound       hdp.simulate.lower_bound_ms: no plan of the batch is shorter (simulated)
    vs mc       megatron-core's BalancedCPScheduler's step / this one (its plans run with a
                barrier after each of its groups, as its runtime does)
    vs static   static CP's step / this one
    CPU         the busiest rank's CPU time per step and its share of the wall step
    imbalance   of each plan: max / mean rank work under the cost model (``Plan.imbalance``)
"""

from __future__ import annotations

import json
import statistics
import sys
from dataclasses import asdict, replace

from ..lab.hdp_cluster import SCHEDULERS, HDPLabConfig, cost_and_link, plan_batch

STEP_S = 3.0  # default wall seconds of the median simulated step


class BenchError(SystemExit):
    def __init__(self, message: str):
        super().__init__(f"megatron-overlap bench hdp --emulate: {message}")


def add_emulate_args(parser) -> None:
    g = parser.add_argument_group("the emulated cluster (--emulate)")
    g.add_argument("--emulate", action="store_true",
                   help="execute each scheduler's plans with the HDP runtime on emulated ranks (compute a wait of the "
                   "cost model's times, real bytes on an emulated two-tier link); default --ranks 16, --corpus pile")
    g.add_argument("--node-size", type=int, default=0,
                   help="ranks per node of the two-tier link (default: the hardware's GPUs per node)")
    g.add_argument("--intra-GBps", type=float, default=0.0, dest="intra_GBps",
                   help="the link inside a node, GB/s per rank and direction (default: the hardware's)")
    g.add_argument("--inter-GBps", type=float, default=0.0, dest="inter_GBps",
                   help="the link between nodes, GB/s per rank and direction (default: the hardware's)")
    g.add_argument("--layer-groups", type=int, default=HDPLabConfig().layer_groups,
                   help="a ring micro-batch's emulated layers, each the compute and bytes of layers / groups")
    g.add_argument("--step-s", type=float, default=STEP_S, dest="step_s",
                   help=f"wall seconds of the median simulated step (sets the time factor; default {STEP_S:g})")
    g.add_argument("--schedulers", default=",".join(SCHEDULERS),
                   help=f"comma-separated, of {', '.join(SCHEDULERS)}")
    g.add_argument("--no-exposed", action="store_true", help="skip the free-link repeat (no exposed column)")
    g.add_argument("--pp", type=int, default=1,
                   help="pipeline stages: --ranks = PP x DP, HDP's pipeline mode over each stage's DP group, 1F1B "
                   "(schedulers hdp, static; default 1: no pipeline)")


def gathered_order(lens, ranks: int):
    """(lengths, loading rank) in the order the runtime's lengths all-gather gives them: rank
    0's samples, rank 1's, ... (sequence i loaded by rank i mod R)."""
    order = [i for r in range(ranks) for i in range(r, len(lens), ranks)]
    return [lens[i] for i in order], [i % ranks for i in order]


def check(cfg: HDPLabConfig, cores: int = 0, memory_gb: float = 0.0) -> None:
    from ..hdp.scheduler import check_batch
    from ..tune.models import get_model
    from .bench_cluster import capacity

    if cfg.ranks < 2:
        raise BenchError(f"--ranks {cfg.ranks}: the emulated cluster needs at least 2 ranks")
    most, why = capacity(cores, memory_gb)
    if cfg.ranks > most:
        raise BenchError(f"{cfg.ranks} emulated ranks (--ranks) is more than this machine holds: at most {most} "
                         f"({why})")
    if cfg.node_size < 0 or cfg.node_size and cfg.ranks % cfg.node_size:
        raise BenchError(f"--node-size {cfg.node_size} does not divide the {cfg.ranks} ranks into nodes")
    layers = get_model(cfg.model).layers
    if cfg.layer_groups < 1 or layers % cfg.layer_groups:
        raise BenchError(f"--layer-groups {cfg.layer_groups} does not divide {cfg.model}'s {layers} layers into "
                         "equal groups")
    bad = [s for s in cfg.schedulers if s not in SCHEDULERS]
    if bad or not cfg.schedulers:
        raise BenchError(f"--schedulers: choose from {', '.join(SCHEDULERS)}, got {','.join(cfg.schedulers)!r}")
    for k, lens in enumerate(cfg.batches):
        try:
            check_batch(lens, cfg.ranks, cfg.capacity)
        except ValueError as exc:
            raise BenchError(f"batch {k}: {exc}") from None


def simulated(cfg: HDPLabConfig) -> list:
    """Per batch: every scheduler's plan (as the ranks will plan it), its simulated step and the
    step with every transfer free, and the bound."""
    from ..hdp.simulate import lower_bound_ms, simulate

    cost, _link = cost_and_link(cfg)
    free = replace(cost, intra_link_GBps=1e12, inter_link_GBps=1e12, intra_latency_us=0.0, inter_latency_us=0.0)
    out = []
    for lens in cfg.batches:
        glens, home = gathered_order(list(lens), cfg.ranks)
        row = {"bound_ms": lower_bound_ms(glens, cfg.ranks, cfg.capacity, cost), "plans": {}}
        for name in cfg.schedulers:
            plan = plan_batch(name, glens, cfg.ranks, cfg.capacity, cost, home)
            plan.validate()
            row["plans"][name] = {"step_ms": simulate(plan, cost).step_ms, "free_ms": simulate(plan, free).step_ms,
                                  "imbalance": plan.imbalance(cost), "phases": len({p for ph in plan.phases for p in ph}),
                                  "microbatches": max(plan.microbatches_per_rank())}
        out.append(row)
    return out


def run(cfg: HDPLabConfig, progress: bool = True) -> list:
    """Every batch once (each scheduler in turn), after a warm-up on the first; per batch, every
    rank's results."""
    from tqdm import tqdm

    from ..lab.hdp_cluster import HDPClusterRanks
    from ..lab.rank_pool import RankPool
    from ..lab.session import RemoteSession

    with RankPool(cfg.ranks, timeout=3600, threads_per_rank=1) as pool:
        bar = tqdm(total=len(cfg.batches) + 1, disable=not progress, unit="batch",
                   desc=f"bench hdp --emulate: {cfg.ranks} ranks, {len(cfg.schedulers)} schedulers per batch")
        ranks = RemoteSession(pool, HDPClusterRanks, asdict(cfg))
        ranks.call("step", 0, cfg.schedulers[0])  # warm-up: imports, the first plan, the kernels' first calls
        bar.update(1)
        rounds = []
        for k in range(len(cfg.batches)):
            rounds.append(ranks.call("round", k))
            bar.update(1)
        bar.close()
        ranks.close()
    return rounds


def summarize(cfg: HDPLabConfig, rounds: list, sim: list) -> dict:
    tf = cfg.time_factor

    def ms(per_rank, name, variant="link"):
        return 1e3 * max(r[name][variant]["wall_s"] for r in per_rank) / tf

    batches = []
    for k, (per_rank, s) in enumerate(zip(rounds, sim)):
        row = {"sequences": len(cfg.batches[k]), "tokens": sum(cfg.batches[k]), "longest": max(cfg.batches[k]),
               "bound_ms": s["bound_ms"], "schedulers": {}}
        for name in cfg.schedulers:
            p = s["plans"][name]
            r = {"step_ms": ms(per_rank, name), "predicted_step_ms": p["step_ms"],
                 "predicted_exposed_ms": p["step_ms"] - p["free_ms"], "imbalance": p["imbalance"],
                 "phases": p["phases"], "microbatches": max(x[name]["link"]["microbatches"] for x in per_rank),
                 "cpu_ms": 1e3 * max(x[name]["link"]["cpu_s"] for x in per_rank),
                 "late_ms": 1e3 * max(x[name]["link"]["late_s"] for x in per_rank) / tf,
                 "wall_ms": 1e3 * max(x[name]["link"]["wall_s"] for x in per_rank),
                 "bytes_by_tier": {t: max(x[name]["link"]["bytes_by_tier"].get(t, 0) for x in per_rank)
                                   for t in ("intra", "inter")}}
            if "free" in per_rank[0][name]:
                r["exposed_ms"] = r["step_ms"] - ms(per_rank, name, "free")
            r["prediction_error"] = r["step_ms"] / r["predicted_step_ms"] - 1
            r["cpu_share"] = r["cpu_ms"] / r["wall_ms"]
            r["vs_bound"] = r["step_ms"] / s["bound_ms"]
            row["schedulers"][name] = r
        sc = row["schedulers"]
        for name, r in sc.items():
            if "megatron_balanced" in sc:
                r["vs_megatron"] = sc["megatron_balanced"]["step_ms"] / r["step_ms"]
            if "static" in sc:
                r["vs_static"] = sc["static"]["step_ms"] / r["step_ms"]
        batches.append(row)
    out = {"config": {k: v for k, v in asdict(cfg).items() if k != "batches"}, "batches": batches, "schedulers": {}}
    for name in cfg.schedulers:
        rows = [b["schedulers"][name] for b in batches]
        agg = {"step_ms": statistics.mean(r["step_ms"] for r in rows),
               "predicted_step_ms": statistics.mean(r["predicted_step_ms"] for r in rows),
               "worst_prediction_error": max((r["prediction_error"] for r in rows), key=abs),
               "cpu_share_max": max(r["cpu_share"] for r in rows)}
        for key in ("vs_megatron", "vs_static"):
            if key in rows[0]:
                agg[key] = statistics.mean(r[key] for r in rows)  # mean over batches of the per-batch ratio
                agg[key + "_min"] = min(r[key] for r in rows)
        out["schedulers"][name] = agg
    return out


def format_table(result: dict, source: str) -> str:
    cfg = result["config"]
    lines = [f"emulated cluster (times, not numerics): HDP runtime, {cfg['model']} on {cfg['hardware']} (TP = 1), "
             f"R = {cfg['ranks']}, C = {cfg['capacity']}, {source}; clock at {cfg['time_factor']:.4g}x modelled time, "
             "times in modelled ms",
             "",
             f"{'batch':>5}{'scheduler':>19}{'step ms':>10}{'[sim]':>10}{'error':>8}{'x bound':>9}{'vs mc':>8}"
             f"{'vs static':>10}{'exposed':>9}{'[sim]':>8}{'mb':>5}{'CPU':>6}{'late':>7}{'imbal.':>8}"]
    for k, b in enumerate(result["batches"]):
        for name, r in b["schedulers"].items():
            lines.append(f"{k:>5}{name:>19}{r['step_ms']:>10.0f}{r['predicted_step_ms']:>10.0f}"
                         f"{100 * r['prediction_error']:>+7.1f}%{r['vs_bound']:>9.3f}{r.get('vs_megatron', 0):>7.2f}x"
                         f"{r.get('vs_static', 0):>9.2f}x{r.get('exposed_ms', float('nan')):>9.0f}"
                         f"{r['predicted_exposed_ms']:>8.0f}{r['microbatches']:>5}{100 * r['cpu_share']:>5.1f}%"
                         f"{r['late_ms']:>7.0f}{r['imbalance']:>8.3f}")
        lines.append(f"{'':>5}{b['sequences']} sequences, {b['tokens']} tokens, longest {b['longest']}: bound "
                     f"{b['bound_ms']:.0f} ms (simulated)")
    lines.append("")
    for name, a in result["schedulers"].items():
        extra = "".join(f", {key.replace('vs_', 'vs ')} {a[key]:.2f}x (worst batch {a[key + '_min']:.2f}x)"
                        for key in ("vs_megatron", "vs_static") if key in a and name != key[3:])
        lines.append(f"{name}: mean step {a['step_ms']:.0f} ms [sim {a['predicted_step_ms']:.0f}], worst error "
                     f"{100 * a['worst_prediction_error']:+.1f}%{extra}")
    lines.append("step: the slowest rank; x bound: step / hdp.simulate.lower_bound_ms; vs mc / vs static: that "
                 "scheduler's step / this one on the same batch; exposed: step - the step with every transfer free; "
                 "mb: most micro-batches of a rank; CPU: the busiest rank's CPU per step / its wall step; late: the most a "
                 "rank's device sat idle because its host issued an op late (the lab's own error); imbal.: "
                 "max / mean rank work of the plan (cost model)")
    return "\n".join(lines)


def emulate_main(args) -> int:
    from .hdp_batches import load_batches

    args.ranks = args.ranks or 16
    if not args.lengths_file and not args.corpus:
        args.corpus = "pile"
    try:
        batches, source = load_batches(args)
    except (ValueError, OSError) as exc:
        raise BenchError(str(exc)) from None
    cfg = HDPLabConfig(batches=tuple(tuple(b) for b in batches), ranks=args.ranks, capacity=args.max_tokens_per_rank,
                       model=args.model, hardware=args.hardware, node_size=args.node_size, intra_GBps=args.intra_GBps,
                       inter_GBps=args.inter_GBps, layer_groups=args.layer_groups,
                       schedulers=tuple(x.strip() for x in args.schedulers.split(",") if x.strip()),
                       exposed=not args.no_exposed, seed=args.seed)
    check(cfg)
    if not args.step_s > 0:
        raise BenchError(f"--step-s must be > 0, got {args.step_s}")
    sim = simulated(cfg)
    median = statistics.median(p["step_ms"] for row in sim for p in row["plans"].values())
    cfg = replace(cfg, time_factor=args.step_s * 1e3 / median)
    rounds = run(cfg, progress=not args.no_progress)
    result = summarize(cfg, rounds, sim)
    result["source"] = source
    print(format_table(result, source))
    if args.json:
        print(json.dumps(result, default=str))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit("use: megatron-overlap bench hdp --emulate ...")
