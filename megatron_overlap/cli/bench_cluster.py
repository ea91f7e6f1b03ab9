"""``megatron-overlap bench pp --emulate``: pipelines with data parallelism at 8-16 ranks on this
machine, on the emulated cluster (``lab/cluster.py``), stock Megatron 1F1B and each of ours in
the same run.

Every rank is one GPU of the modelled run (one TP rank of its stage; TP itself is folded into
the cost model's times): its compute is a wait of the cost model's F, B and W per block (the
named model on the named GPU), its tensors are the modelled sizes times ``scale``, the link is
the modelled fabric (InfiniBand between the stages and the data-parallel replicas at TP=8)
with its bandwidth times ``scale``. The real executor, Megatron's 1F1B, DDP
(``overlap_grad_reduce``, buckets) and the distributed optimizer (``overlap_param_gather``)
run; what is measured is time, emulated (the losses are those of the blocks' cheap math).

Per schedule, medians over the rounds (each round: every schedule once, order alternating;
with ``--exposed`` each step also with the data-parallel traffic free, its collectives counted
and not run, and with every transfer free):

    step ms         the slowest rank's schedule call (Megatron's forward_backward_func, which
                    waits for the gradient reduction); the optimizer step (real CPU Adam on the
                    scaled shard, the same for every schedule) is reported apart
    bubble          mean over ranks of 1 - emulated compute / step
    exposed P2P     the step with DP free - the step with everything free
    exposed DP      the step - the step with DP free: the gradient reduce-scatter and the
                    parameter all-gather left on the critical path (each a median of the
                    rounds' differences)
    peak act GB     micro-batches held at the peak (counted as the blocks run) x the cost
                    model's activations of one micro-batch on a stage (Korthikanti, flash)
    CPU             the busiest rank's CPU time per step, and its share of the step
    predicted       pp/schedule_sim.py on the same F/B/W, link and the run's own DDP buckets
    floor           pp/optimal.py with the DP sync, at 1.05x 1F1B's activation memory (CP-SAT)
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from dataclasses import asdict, fields

from ..lab.cluster import ALL_MODES, MODES, ClusterConfig
from .cluster_report import FLOOR_MEMORY, draw_timeline, format_table
from .cluster_virtual import VIRTUAL_MODES, check_virtual, schedule_syncs, virtual_floor

KINDS = {"stock": "megatron", "1f1b": "1f1b", "zb": "zb", "1f1b-inflight": "1f1b", "zbv": "zbv", "1f1b-ec": "1f1b",
         "zb-ec": "zb", "zbv-ec": "zbv"}

RANKS_PER_CORE = 8  # emulated ranks one core serves with their wake-ups on time (BENCHMARKS.md, the lab check)
RANK_MEMORY_GB = 0.6  # resident memory per emulated rank: 0.43 GB measured (RSS, PP=8, shared pages counted), plus margin


class BenchError(SystemExit):
    """A refused command line: the message names what to change."""

    def __init__(self, message: str):
        super().__init__(f"the emulated cluster (bench pp --emulate, demo --cluster): {message}")


def capacity(cores: int = 0, memory_gb: float = 0.0) -> tuple:
    """(ranks this machine holds, what limits it)."""
    cores = cores or (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
    memory_gb = memory_gb or _available_gb()
    by_cpu = cores * RANKS_PER_CORE
    by_memory = int(memory_gb / RANK_MEMORY_GB)
    if by_memory < by_cpu:
        return by_memory, f"{memory_gb:.0f} GB of memory available at ~{RANK_MEMORY_GB} GB per rank"
    return by_cpu, (f"{cores} cores x {RANKS_PER_CORE} ranks per core: a rank's own CPU work (Python, gloo, "
                    "Megatron's bookkeeping; 4-8% of a core at these step sizes) must leave the cores idle enough "
                    "that every rank wakes up on time")


def _available_gb() -> float:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) / 1e6
    except OSError:
        pass
    return 8.0


def check(cfg: ClusterConfig, ranks: int = 0, cores: int = 0, memory_gb: float = 0.0) -> None:
    """Refuse, before any rank starts, what the emulated cluster cannot run."""
    from ..tune.hardware import HARDWARE
    from ..tune.models import MODELS

    if cfg.pp < 2 or cfg.dp < 1:
        raise BenchError(f"needs --pp >= 2 and --dp >= 1, got {cfg.pp} and {cfg.dp}")
    if cfg.microbatches < cfg.pp:
        raise BenchError(f"--micro-batches {cfg.microbatches} is below --pp {cfg.pp}: every schedule here needs at "
                         "least one micro-batch per stage")
    if ranks and ranks != cfg.world:
        raise BenchError(f"--ranks {ranks} is not --pp {cfg.pp} x --dp {cfg.dp} = {cfg.world}; give two of them")
    if not cfg.bucket_factor > 0 or cfg.bucket_factor == float("inf"):
        raise BenchError(f"--bucket-factor {cfg.bucket_factor}: the DDP bucket size's factor must be a positive number")
    if cfg.durations:
        from ..lab.durations import DurationsError, read

        try:
            read(cfg.durations, cfg.pp)
        except DurationsError as exc:
            raise BenchError(str(exc)) from None
    elif cfg.model not in MODELS:
        raise BenchError(f"no durations for model {cfg.model!r}: the cost model knows {', '.join(sorted(MODELS))} "
                         "(or give --durations FILE, measured on this CPU by `bench pp --write-durations`)")
    elif cfg.hardware not in HARDWARE:
        raise BenchError(f"no durations for hardware {cfg.hardware!r}: the cost model knows "
                         f"{', '.join(sorted(HARDWARE))}")
    from ..tune.strategies import STRATEGIES

    if cfg.tp_strategy not in STRATEGIES:
        raise BenchError(f"--tp-strategy {cfg.tp_strategy!r}: the cost model knows {', '.join(STRATEGIES)}")
    if not 0 <= cfg.scale <= 1:
        raise BenchError(f"--scale {cfg.scale:g} must be in (0, 1] (0: chosen), the factor on every byte")
    most, why = capacity(cores, memory_gb)
    if cfg.world > most:
        raise BenchError(f"{cfg.world} emulated ranks (PP {cfg.pp} x DP {cfg.dp}) is more than this machine holds: "
                         f"at most {most} ({why})")
    from ..lab.cluster import link_spec, modelled

    if cfg.node_size and cfg.world % cfg.node_size:
        raise BenchError(f"a two-tier link with --node-size {cfg.node_size} does not divide the {cfg.world} ranks "
                         f"into nodes: pick a node size that divides {cfg.world}")
    if not cfg.durations:
        from ..tune.models import get_model

        layers = get_model(cfg.model).layers
        if layers < cfg.pp:
            raise BenchError(f"{cfg.model} has {layers} layers, fewer than --pp {cfg.pp} stages")
    check_virtual(cfg, 0 if cfg.durations else layers, BenchError)
    link_spec(cfg, modelled(cfg)[2], 1.0).check_world(cfg.world)


def run(cfg: ClusterConfig, progress: bool = True, timeline_png: str = "", floor_time_s: float = 120.0) -> dict:
    from tqdm import tqdm

    from ..lab.cluster import ClusterRanks
    from ..lab.rank_pool import RankPool
    from ..lab.session import RemoteSession

    total = cfg.warmup + cfg.steps
    with RankPool(cfg.world, timeout=3600, threads_per_rank=1) as pool:
        bar = tqdm(total=total + 1, disable=not progress, unit="round",
                   desc=f"bench pp --emulate: {cfg.world} ranks (build, then {len(cfg.modes)} schedules per round)")
        ranks = RemoteSession(pool, ClusterRanks, asdict(cfg))
        described = ranks.started
        bar.update(1)
        rounds = ranks.rounds(cfg.warmup, cfg.steps, bar, record_last=bool(timeline_png))
        bar.close()
        ranks.close()
    result = summarize(cfg, rounds, described, floor_time_s)
    if timeline_png:
        result["timeline_png"] = draw_timeline(rounds[-1], cfg, timeline_png)
    return result


def predict(cfg: ClusterConfig, described: list) -> dict:
    """The simulator on this run: the cost model's F/B/W and link, each stage's DDP buckets as
    the ranks built them."""
    from ..lab.cluster import modelled, placement
    from ..pp import build
    from ..pp.schedule_sim import LinkCost, simulate

    costs, _run, hw = modelled(cfg)
    per_mode = {mode: stage_syncs(cfg, costs, described, hw, mode) for mode in cfg.modes}
    link, free = LinkCost(transfer_ms=costs.transfer_ms), LinkCost()
    times = placement(cfg, costs)  # the schedule the executor runs
    out = {}
    for mode in cfg.modes:
        kind = KINDS[mode]
        k = min(cfg.microbatches, 2 * cfg.pp - 1) if mode == "1f1b-inflight" else 0
        schedule = build(kind, cfg.pp, cfg.microbatches, k, times=times if kind in ("zb", "zbv") else (1.0, 1.0, 1.0),
                         chunks=cfg.vpp)
        dp = schedule_syncs(per_mode[mode], kind, cfg.vpp)
        on = simulate(schedule, costs.times, link, dp)
        no_dp = simulate(schedule, costs.times, link)
        alone = simulate(schedule, costs.times, free)
        out[mode] = {"step_ms": on.step_ms, "dp_exposed_ms": on.step_ms - no_dp.step_ms,
                     "p2p_exposed_ms": no_dp.step_ms - alone.step_ms, "bubble": on.bubble, "simulation": on,
                     "memory": max(schedule.memory_bound)}
    finest = [max((per_mode[mode][s] for mode in cfg.modes), key=lambda d: len(d.reduce_ms)) for s in range(cfg.pp)]
    return {"modes": out, "costs": costs, "syncs": finest}  # the floor's: a finer cut only relaxes it


def stage_syncs(cfg: ClusterConfig, costs, described: list, hw, mode: str = "") -> list:
    """Each stage's ``DPSync`` from the buckets its ranks built for ``mode`` (modelled elements: / scale)."""
    from ..pp.schedule_sim import DPSync
    from ..tune.virtual import bucket_sync

    if cfg.dp <= 1:
        return [DPSync() for _ in range(cfg.pp)]
    link = hw.link_for(cfg.tp * cfg.dp)
    by_stage = {d["stage"]: d for d in described}
    built = {s: d.get("mode_buckets", {}).get(mode) or (d["buckets"], d.get("bucket_chunks")) for s, d in by_stage.items()}
    return [bucket_sync([n / by_stage[s]["scale"] for n in built[s][0]], built[s][1] or [], cfg.dp, link,
                        hw.dtype_bytes, cfg.distributed_optimizer, cfg.distributed_optimizer) for s in range(cfg.pp)]


def summarize(cfg: ClusterConfig, rounds: list, described: list, floor_time_s: float = 120.0) -> dict:
    pred = predict(cfg, described)
    costs = pred["costs"]
    first = described[0]
    result = {"config": asdict(cfg), "scale": first["scale"], "rows": first["rows"], "link": first["link"],
              "buckets_per_stage": [len(next(d for d in described if d["stage"] == s)["buckets"])
                                    for s in range(cfg.pp)],
              "buckets_by_mode": {mode: [len(next(d for d in described if d["stage"] == s).get(
                  "mode_buckets", {}).get(mode, ([None],))[0]) for s in range(cfg.pp)] for mode in cfg.modes},
              "times_ms": [asdict(t) for t in costs.times], "transfer_ms": costs.transfer_ms,
              "dp_reduce_ms": [d.reduce_total_ms for d in pred["syncs"]],
              "dp_gather_ms": [d.gather_total_ms for d in pred["syncs"]], "modes": {}}
    variants = rounds[0][0][cfg.modes[0]].keys()

    def step(per_rank, mode, variant="link"):
        return 1e3 * max(r[mode][variant]["schedule_s"] for r in per_rank)

    for mode in cfg.modes:
        steps = [step(pr, mode) for pr in rounds]
        r = {"step_ms": statistics.median(steps), "worst_step_ms": max(steps),
             "bubble": statistics.median(statistics.mean(1 - x[mode]["link"]["busy_s"] / x[mode]["link"]["schedule_s"]
                                                          for x in pr) for pr in rounds),
             "cpu_ms": statistics.median(1e3 * max(x[mode]["link"]["cpu_s"] for x in pr) for pr in rounds),
             "optimizer_ms": statistics.median(1e3 * max(x[mode]["link"]["optimizer_s"] for x in pr) for pr in rounds),
             "peak_microbatches": max(x[mode]["link"]["peak_microbatches"] for pr in rounds for x in pr),
             "loss": [next(x for x in pr if x[mode]["link"].get("has_loss", x["stage"] == cfg.pp - 1))[mode]["link"]
                      ["loss"] for pr in rounds],
             "bytes": max(x[mode]["link"]["bytes"] for x in rounds[-1])}
        r["cpu_share"] = r["cpu_ms"] / r["step_ms"]
        r["peak_activation_gb"] = r["peak_microbatches"] * costs.activation_bytes / 1e9
        if "dp free" in variants:  # medians of each round's differences: a stalled step moves one of them
            r["dp_exposed_ms"] = statistics.median(step(pr, mode) - step(pr, mode, "dp free") for pr in rounds)
            r["p2p_exposed_ms"] = statistics.median(step(pr, mode, "dp free") - step(pr, mode, "free") for pr in rounds)
        p = pred["modes"][mode]
        r.update(predicted_step_ms=p["step_ms"], predicted_dp_exposed_ms=p["dp_exposed_ms"],
                 predicted_p2p_exposed_ms=p["p2p_exposed_ms"], predicted_bubble=p["bubble"],
                 prediction_error=r["step_ms"] / p["step_ms"] - 1)
        if "stock" in cfg.modes:
            r["speedup"] = statistics.median(step(pr, "stock") / step(pr, mode) for pr in rounds)
        result["modes"][mode] = r
    losses = [tuple(r["loss"]) for r in result["modes"].values()]
    result["losses_identical"] = len(set(losses)) == 1
    result["floor"] = virtual_floor(cfg, costs, pred["syncs"], floor_time_s) if cfg.vpp > 1 else \
        _floor(cfg, costs, pred["syncs"], floor_time_s)
    result["post_validation_ms"] = post_validation_ms(pred["modes"]["zb"]["simulation"]) if "zb" in cfg.modes else None
    for r in result["modes"].values():
        fl = result["floor"]
        r["vs_floor"] = r["step_ms"] / fl["bound_ms"] if "bound_ms" in fl else None
    return result


def post_validation_ms(sim) -> float:
    """What Zero Bubble's post-validation would shorten this step by (simulated): without the
    optimizer step's all-rank synchronisation each stage starts its next step when its own
    reduction is done, so the step is set by the first stage's end (the next step's first
    forward is there; a later stage's late reduction then overlaps its own warm-up wait)."""
    return max(0.0, sim.step_ms - sim.end_ms[0])


def _floor(cfg, costs, syncs, time_limit_s: float) -> dict:
    """The shortest step any schedule reaches with the DP sync, within 1.05x 1F1B's activation
    memory (``pp/optimal.py``; simulated)."""
    try:
        from ..pp.optimal import floor
    except ImportError as exc:  # pragma: no cover - ortools is a test dependency
        return {"error": str(exc)}
    try:
        f = floor(costs.times, cfg.microbatches, costs.transfer_ms, 0.0, memory=FLOOR_MEMORY * cfg.pp,
                  time_limit_s=time_limit_s, dp=[d.replace(gather_at_start=True) for d in syncs])
    except (ImportError, RuntimeError) as exc:
        return {"error": str(exc)}
    return {"step_ms": f.step_ms, "bound_ms": f.bound_ms, "optimal": f.optimal, "bubble": f.bubble_floor}


def add_emulate_args(parser) -> None:
    g = parser.add_argument_group("the emulated cluster (--emulate)")
    g.add_argument("--emulate", action="store_true",
                   help="PP x DP ranks whose compute is a wait of the cost model's times: 8-16 ranks on a few cores")
    g.add_argument("--dp", type=int, default=None, help="data-parallel size (default 2)")
    g.add_argument("--ranks", type=int, default=None, help="PP x DP (checked against --pp and --dp)")
    g.add_argument("--model", default=None, help="a model the cost model knows (default llama3-70b)")
    g.add_argument("--hardware", default=None, help="a GPU the cost model knows (default h100-sxm)")
    g.add_argument("--tp", type=int, default=None, help="tensor-parallel size folded into each rank (default 8)")
    g.add_argument("--scale", type=float, default=None, help="factor on every byte and on the link (0: chosen)")
    g.add_argument("--node-size", type=int, default=None,
                   help="emulated ranks per node: a two-tier link (default: GPUs per node / TP)")
    g.add_argument("--no-exposed", action="store_true",
                   help="skip the DP-free and free-link repeats (no exposed P2P / DP columns; 3x faster)")
    g.add_argument("--schedules", default=None,
                   help=f"comma-separated, of {', '.join(ALL_MODES)} (default {','.join(MODES)})")
    g.add_argument("--durations", default=None, metavar="FILE",
                   help="durations measured on this CPU (`bench pp --write-durations FILE`) instead of the cost "
                   "model's for --model / --hardware")
    g.add_argument("--tp-strategy", default=None,
                   help="the TP strategy inside each stage the cost model times (default megatron: stock TP)")
    g.add_argument("--vpp", type=int, default=None,
                   help="model chunks per stage (virtual pipelines): stock is then Megatron's interleaved 1F1B "
                   f"(default 1; schedules {', '.join(VIRTUAL_MODES)}, zbv needs 2)")
    g.add_argument("--bucket-factor", type=float, default=None,
                   help="DDP's bucket size as Megatron's default for the modelled run times this, for every schedule "
                   "(default 1; larger: fewer, larger buckets)")
    g.add_argument("--floor-time-limit", type=float, default=120.0, help="CP-SAT seconds for the floor")


EMULATE_ONLY = ("dp", "ranks", "model", "hardware", "tp", "scale", "node_size", "schedules", "tp_strategy",
                "durations", "vpp", "bucket_factor")
REAL_ONLY = ("layers", "hidden", "ffn", "heads", "kv_heads", "vocab", "comm_ratio", "latency_us")


def emulate_main(args) -> int:
    given = [n for n in REAL_ONLY if getattr(args, n, None) is not None]
    if given:
        names = ", ".join("--" + n.replace("_", "-") for n in given)
        raise BenchError(f"{names} shape the real tiny GPT of `bench pp`; the emulated cluster takes its model from "
                         "--model (the cost model's shapes)")
    d = ClusterConfig()
    values = {f.name: getattr(d, f.name) for f in fields(ClusterConfig)}
    for name, attr in (("pp", "pp"), ("microbatches", "microbatches"), ("steps", "steps"), ("warmup", "warmup"),
                       ("dp", "dp"), ("model", "model"), ("hardware", "hardware"), ("tp", "tp"),
                       ("scale", "scale"), ("node_size", "node_size"), ("seq", "seq"),
                       ("micro_batch", "micro_batch"), ("tp_strategy", "tp_strategy"), ("durations", "durations"),
                       ("vpp", "vpp"), ("bucket_factor", "bucket_factor")):
        v = getattr(args, attr, None)
        if v is not None:
            values[name] = v
    if values["durations"] and getattr(args, "tp", None) is None:
        values["tp"] = 1  # the measured ranks are whole stages of the CPU run
    if args.ranks and getattr(args, "dp", None) is None and args.ranks % values["pp"] == 0:
        values["dp"] = args.ranks // values["pp"]
    values["exposed"] = not args.no_exposed
    if args.schedules:
        modes = tuple(x.strip() for x in args.schedules.split(",") if x.strip())
        bad = [m for m in modes if m not in ALL_MODES]
        if bad or not modes:
            raise BenchError(f"--schedules {args.schedules!r}: choose from {', '.join(ALL_MODES)}")
        values["modes"] = modes
    elif (values["vpp"] or 1) > 1:
        values["modes"] = VIRTUAL_MODES if values["vpp"] == 2 else VIRTUAL_MODES[:3]
    cfg = ClusterConfig(**values)
    check(cfg, ranks=args.ranks or 0)
    result = run(cfg, progress=not args.no_progress, timeline_png=args.timeline, floor_time_s=args.floor_time_limit)
    print(format_table(result))
    if args.timeline:
        print(f"timeline: {result['timeline_png']}")
    if args.json:
        print(json.dumps(result, default=str))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit("use: megatron-overlap bench pp --emulate ...")
