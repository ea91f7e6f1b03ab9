"""``megatron-overlap bench cp``: context parallelism on a long sequence, every mode the code runs
at that CP size (ring, all-to-all where the heads divide, hybrid for every all-to-all size), the
planner's pick, and the waited ring; simulated (``cp/step_model.py``), and with ``--emulate``
measured on the emulated cluster (``lab/cp_cluster.py``, 16 ranks on this machine).

    step ms        the slowest rank's step (forward + backward of every layer), modelled ms
                   (its emulated device's end, measured on the wall clock, / the lab's time factor)
    limit          the replay: the same compute with every exchange a local copy (measured); the
                   simulator's is the busiest rank's compute
    exposed        step - limit (medians of per-round differences)
    vs waited      the waited ring's step / this one (per round, median): the ratio to stock's
                   counterpart (every transfer waited before its block)
    CPU            the busiest rank's CPU time per step and its share of the wall step (the lab's
                   budget: the rest is sleeping)
    predicted      the simulator on the same case (layer groups, link, rates)
"""

from __future__ import annotations

import json
import statistics
import sys
from dataclasses import asdict, fields, replace

from ..lab.cp_cluster import REPLAY, CPLabConfig, cost_and_link, variant_name


class BenchError(SystemExit):
    """A refused command line: the message names what to change."""

    def __init__(self, message: str):
        super().__init__(f"megatron-overlap bench cp: {message}")


def variants(cfg: CPLabConfig, cost) -> tuple:
    """Every candidate of the planner (``cp.step_timing.candidates``) and the waited ring."""
    from ..cp.step_timing import candidates

    return tuple((mode, size, True) for mode, size in candidates(cfg.cp, cost.heads, cost.kv_heads)) + \
        (("ring", 1, False),)


def check(cfg: CPLabConfig, emulate: bool = True, cores: int = 0, memory_gb: float = 0.0) -> None:
    """Refuse, before any rank starts, what cannot run (each message names the flag)."""
    from ..tune.hardware import HARDWARE
    from ..tune.models import MODELS, get_model

    if cfg.model not in MODELS:
        raise BenchError(f"--model {cfg.model!r}: the cost model knows {', '.join(sorted(MODELS))}")
    if cfg.hardware not in HARDWARE:
        raise BenchError(f"--hardware {cfg.hardware!r}: the cost model knows {', '.join(sorted(HARDWARE))}")
    for name in ("cp", "ranks", "seq", "rows", "layer_groups", "steps"):
        value = getattr(cfg, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise BenchError(f"--{name.replace('_', '-')} must be a whole number >= 1, got {value!r}")
    if cfg.cp < 2:
        raise BenchError(f"--cp {cfg.cp}: context parallelism needs at least 2 ranks")
    if cfg.ranks % cfg.cp:
        raise BenchError(f"--cp {cfg.cp} does not divide the {cfg.ranks} ranks (--ranks) into CP groups")
    if cfg.seq % (2 * cfg.cp):
        raise BenchError(f"--cp {cfg.cp} does not divide the sequence: --seq {cfg.seq} is not a multiple of 2 x CP = "
                         f"{2 * cfg.cp} (every sequence is cut in 2 x CP chunks)")
    if cfg.node_size and cfg.ranks % cfg.node_size:
        raise BenchError(f"--node-size {cfg.node_size} does not divide the {cfg.ranks} ranks into nodes")
    for name in ("intra_GBps", "inter_GBps", "step_s"):
        value = getattr(cfg, name)
        if not value >= 0 or value == float("inf"):
            raise BenchError(f"--{name.replace('_', '-')} must be a finite number >= 0, got {value!r}")
    layers = get_model(cfg.model).layers
    if layers % cfg.layer_groups:
        raise BenchError(f"--layer-groups {cfg.layer_groups} does not divide {cfg.model}'s {layers} layers into "
                         "equal groups")
    if not emulate:
        return
    if cfg.rows % (2 * cfg.cp) or cfg.seq % cfg.rows:
        raise BenchError(f"--rows {cfg.rows} (the emulated rows of the sequence) must be a multiple of 2 x CP = "
                         f"{2 * cfg.cp} and divide --seq {cfg.seq}")
    from .bench_cluster import capacity

    most, why = capacity(cores, memory_gb)
    if cfg.ranks > most:
        raise BenchError(f"{cfg.ranks} emulated ranks (--ranks) is more than this machine holds: at most {most} "
                         f"({why})")


def time_factor(cfg: CPLabConfig, cost, link) -> float:
    """Clock seconds per modelled second so the ring's simulated step lasts ``step_s`` seconds."""
    from ..cp.step_model import CPCase
    from ..cp.step_timing import predict

    ring = predict(CPCase(cfg.seq, cfg.cp, cfg.ranks, "ring", 1, True, cfg.layer_groups), cost, link)
    return cfg.step_s * 1e3 / ring.step_ms


def simulate(cfg: CPLabConfig) -> dict:
    """Every variant's prediction on the lab's case, and the planner's pick (per layer)."""
    from ..cp.step_model import CPCase
    from ..cp.step_timing import plan_mode, predict

    cost, link = cost_and_link(cfg)
    out = {}
    for v in cfg.variants:
        mode, size, overlap = v
        out[variant_name(v)] = predict(CPCase(cfg.seq, cfg.cp, cfg.ranks, mode, size, overlap, cfg.layer_groups),
                                       cost, link)
    pick, _ = plan_mode(cfg.seq, cfg.cp, cfg.ranks, cost, link)
    return {"variants": out, "pick": variant_name((pick.case.mode, pick.case.size, True)), "link": link.as_dict()}


def run(cfg: CPLabConfig, progress: bool = True) -> dict:
    from tqdm import tqdm

    from ..lab.cp_cluster import CPClusterRanks
    from ..lab.rank_pool import RankPool
    from ..lab.session import RemoteSession

    with RankPool(cfg.ranks, timeout=3600, threads_per_rank=1) as pool:
        bar = tqdm(total=cfg.warmup + cfg.steps, disable=not progress, unit="round",
                   desc=f"bench cp --emulate: {cfg.ranks} ranks, {len(cfg.variants) + 1} runs per round")
        ranks = RemoteSession(pool, CPClusterRanks, asdict(cfg))
        rounds = ranks.rounds(cfg.warmup, cfg.steps, bar)
        bar.close()
        ranks.close()
    return summarize(cfg, rounds, ranks.started)


def summarize(cfg: CPLabConfig, rounds: list, described: list) -> dict:
    """Medians over the rounds (module docstring), beside the simulator's numbers."""
    sim = simulate(cfg)
    tf, per_group, byte_factor = cfg.time_factor, described[0]["layers_per_group"], described[0]["byte_factor"]

    def step(per_rank, name):
        return 1e3 * max(r[name]["wall_s"] for r in per_rank) / tf

    result = {"config": asdict(cfg), "link": sim["link"], "emulated_link": described[0]["link"], "pick": sim["pick"],
              "limit_ms": statistics.median(step(p, REPLAY) for p in rounds), "variants": {}}
    waited = variant_name(("ring", 1, False))
    for v in cfg.variants:
        name = variant_name(v)
        pred = sim["variants"][name]
        steps = [step(p, name) for p in rounds]
        tiers = {}
        for r in rounds[-1]:
            for tier, n in r[name]["bytes_by_tier"].items():
                tiers[tier] = max(tiers.get(tier, 0.0), n * per_group / byte_factor)
        r = {"step_ms": statistics.median(steps), "steps_ms": steps,
             "vs_limit": statistics.median(step(p, name) / step(p, REPLAY) for p in rounds),
             "exposed_ms": statistics.median(step(p, name) - step(p, REPLAY) for p in rounds),
             "cpu_ms": statistics.median(1e3 * max(x[name]["cpu_s"] for x in p) for p in rounds),
             "late_ms": statistics.median(1e3 * max(x[name]["late_s"] for x in p) / tf for p in rounds),
             "wall_ms": statistics.median(1e3 * max(x[name]["wall_s"] for x in p) for p in rounds),
             "bytes_by_tier": tiers,
             "bytes": max(x[name]["bytes"] for x in rounds[-1]) * per_group / byte_factor,
             "predicted_step_ms": pred.step_ms, "predicted_exposed_ms": pred.exposed_ms,
             "predicted_limit_ms": pred.compute_limit_ms,
             "predicted_bytes": max(sum(t.values()) for t in pred.bytes_by_tier),
             "predicted_bytes_by_tier": {k: max(t.get(k, 0.0) for t in pred.bytes_by_tier)
                                         for k in ("intra", "inter")}}
        r["cpu_share"] = r["cpu_ms"] / r["wall_ms"]
        r["prediction_error"] = r["step_ms"] / r["predicted_step_ms"] - 1
        if waited in (variant_name(x) for x in cfg.variants):
            r["vs_waited"] = statistics.median(step(p, waited) / step(p, name) for p in rounds)
        result["variants"][name] = r
    overlapped = {n: r for n, r in result["variants"].items() if n != waited}
    best = min(overlapped, key=lambda n: overlapped[n]["step_ms"])
    result["measured_best"] = best
    result["pick_vs_best"] = overlapped[sim["pick"]]["step_ms"] / overlapped[best]["step_ms"] \
        if sim["pick"] in overlapped else None
    return result


def add_cp_args(parser) -> None:
    d = CPLabConfig()
    parser.add_argument("--emulate", action="store_true",
                        help="measure on the emulated cluster (ranks whose compute is a wait of the cost model's "
                        "times, real bytes on an emulated two-tier link); without it: simulated only")
    parser.add_argument("--model", default=d.model, help=f"a model the cost model knows (default {d.model})")
    parser.add_argument("--hardware", default=d.hardware, help=f"a GPU the cost model knows (default {d.hardware})")
    parser.add_argument("--seq", type=int, default=d.seq, help=f"tokens of the sequence (default {d.seq})")
    parser.add_argument("--cp", type=int, default=d.cp, help=f"context-parallel size (default {d.cp})")
    parser.add_argument("--ranks", type=int, default=d.ranks, help=f"emulated ranks, CP groups of --cp (default "
                        f"{d.ranks})")
    parser.add_argument("--node-size", type=int, default=d.node_size,
                        help="ranks per node of the two-tier link (default: the hardware's GPUs per node)")
    parser.add_argument("--intra-GBps", type=float, default=d.intra_GBps, dest="intra_GBps",
                        help="the link inside a node, GB/s per rank and direction (default: the hardware's NVLink)")
    parser.add_argument("--inter-GBps", type=float, default=d.inter_GBps, dest="inter_GBps",
                        help="the link between nodes, GB/s per rank and direction (default: the hardware's NIC)")
    parser.add_argument("--layer-groups", type=int, default=d.layer_groups,
                        help=f"the emulated layers, each the compute and bytes of layers / groups (default "
                        f"{d.layer_groups})")
    parser.add_argument("--rows", type=int, default=d.rows, help=f"emulated rows of the sequence (default {d.rows})")
    parser.add_argument("--step-s", type=float, default=d.step_s, dest="step_s",
                        help=f"wall seconds an emulated step lasts (sets the time factor; default {d.step_s})")
    parser.add_argument("--steps", type=int, default=d.steps, help="timed rounds (medians)")
    parser.add_argument("--warmup", type=int, default=d.warmup)
    parser.add_argument("--json", action="store_true", help="print one JSON line after the table")
    parser.add_argument("--no-progress", action="store_true")


def config_from(args) -> CPLabConfig:
    names = {f.name for f in fields(CPLabConfig)}
    return CPLabConfig(**{k: v for k, v in vars(args).items() if k in names})


def cp_main(args) -> int:
    from .cp_report import format_simulated, format_table

    cfg = config_from(args)
    check(cfg, emulate=args.emulate)
    cost, link = cost_and_link(cfg)
    cfg = replace(cfg, variants=variants(cfg, cost))
    if not args.emulate:
        sim = simulate(cfg)
        print(format_simulated(cfg, sim))
        if args.json:
            print(json.dumps({k: v for k, v in sim.items() if k != "variants"}
                             | {"variants": {n: p.step_ms for n, p in sim["variants"].items()}}))
        return 0
    cfg = replace(cfg, time_factor=time_factor(cfg, cost, link))
    result = run(cfg, progress=not args.no_progress)
    print(format_table(result))
    if args.json:
        print(json.dumps(result, default=str))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit("use: megatron-overlap bench cp ...")
