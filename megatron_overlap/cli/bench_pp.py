"""``megatron-overlap bench pp``: Megatron's 1F1B against each of our pipeline schedules on the
same emulated link, in one run.

PP stages, one gloo rank per stage and per core, the tiny GPT split over them, m micro-batches
per step; stage-to-stage transfers through the emulated link, calibrated so a stage's transfers
take ``--comm-ratio`` (0.2) of its compute per step. Each round runs stock and each of ours
once on the link and once on a free link (order reversed every other round); medians over
rounds. Per schedule:

    step ms          the slowest stage's wall time of the schedule call
    bubble           idle / step, mean over the stages (idle = step - the rank's thread CPU time)
    slowest          the slowest stage's idle / step (a lighter stage's wait for a heavier one,
                     stage imbalance, left out)
    exposed P2P ms   step - the same schedule's step on a free link, in the same round
    peak act MB      bytes autograd held for backward (saved-tensor hooks; distinct storages),
                     plus what waits for a W, at the peak, on the stage with the most
    predicted ms     the schedule simulated (pp/schedule_sim.py) from this run's F, B, W times per
                     stage and the link's transfer time: simulated, beside the measurement

Beside them, the floor: the shortest step any schedule reaches on the run's F/B/W and link
within 1.05x 1F1B's activation memory, proved by CP-SAT (``pp/optimal.py``; simulated; needs
``ortools``, else the line says it was not computed).

Schedules: stock Megatron 1F1B, ``--overlap-pp 1f1b`` (K = p), ``1f1b`` with K = 2p - 1 in
flight, ``zb`` (ZB-H1).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import asdict, fields

from ..lab.pp_bench import MODES, PPBench

NAMES = {"stock": "stock Megatron 1F1B", "1f1b": "1f1b (async P2P)", "1f1b-inflight": "1f1b, K = 2p-1 in flight",
         "zb": "zb (ZB-H1)"}


def write_durations(path: str, cfg: PPBench, result: dict) -> None:
    """This run's measured F/B/W per stage (on a free link), the tiny GPT's parameter tensors
    per stage and the link it was calibrated to, for the emulated cluster (``lab/durations.py``)."""
    from ..lab import durations

    stages = [{"f_ms": t["F"], "b_ms": t["B"], "w_ms": t["W"], "layers": cfg.layers // cfg.pp, "params": params}
              for t, params in zip(result["times_ms"], result["params"])]
    durations.write(path, stages, result["act_bytes"], result["link"], 4,
                    f"bench pp on this CPU: tiny GPT, {cfg.layers} layers, hidden {cfg.hidden}, ffn {cfg.ffn}, seq "
                    f"{cfg.seq}, PP={cfg.pp}, m={cfg.microbatches}, comm ratio {cfg.comm_ratio}")


def run(cfg: PPBench, progress: bool = True, timeline_png: str = "") -> dict:
    from tqdm import tqdm

    from ..lab.pp_bench import PPBenchRanks
    from ..lab.rank_pool import RankPool
    from ..lab.session import RemoteSession

    with RankPool(cfg.pp, timeout=1800, threads_per_rank=1) as pool:
        bar = tqdm(total=cfg.warmup + cfg.steps + 1, desc="bench pp (calibrate, then stock and ours per round)", unit="round",
                   disable=not progress)
        ranks = RemoteSession(pool, PPBenchRanks, asdict(cfg))
        described = ranks.call("describe")
        bar.update(1)
        rounds = ranks.rounds(cfg.warmup, cfg.steps, bar, record_last=bool(timeline_png))
        bar.close()
        ranks.close()
    result = summarize(cfg, rounds, described)
    if timeline_png:
        result["timeline_png"] = draw_timeline(rounds[-1], described, cfg, timeline_png)
    return result


def predict(cfg: PPBench, described: list) -> dict:
    from ..pp import build
    from ..pp.schedule_sim import LinkCost, StageTimes, simulate

    times = [StageTimes(d["times_ms"]["F"], d["times_ms"]["B"], d["times_ms"]["W"]) for d in described]
    link = LinkCost(transfer_ms=described[0]["transfer_ms"], latency_ms=described[0]["link"]["latency_us"] * 1e-3)
    kinds = {"stock": ("megatron", 0), "1f1b": ("1f1b", 0),
             "1f1b-inflight": ("1f1b", min(cfg.microbatches, 2 * cfg.pp - 1)), "zb": ("zb", 0)}
    out = {}
    for mode, (kind, k) in kinds.items():
        sim = simulate(build(kind, cfg.pp, cfg.microbatches, k), times, link)
        free = simulate(build(kind, cfg.pp, cfg.microbatches, k), times, LinkCost(transfer_ms=0.0, latency_ms=0.0))
        out[mode] = {"step_ms": sim.step_ms, "bubble": sim.bubble, "p2p_exposed_ms": sim.step_ms - free.step_ms,
                     "free_bubble": free.bubble, "critical": 1 - max(sim.busy_ms) / sim.step_ms,
                     "free_critical": 1 - max(free.busy_ms) / free.step_ms, "simulation": sim}
    return out


def summarize(cfg: PPBench, rounds: list, described: list) -> dict:
    pred = predict(cfg, described)
    result = {"config": asdict(cfg), "link": described[0]["link"],
              "times_ms": [d["times_ms"] for d in described], "modes": {},
              "params": [d.get("params", []) for d in described], "act_bytes": described[0]["act_bytes"]}
    for mode in MODES:
        step = [1e3 * max(r[mode]["wall_s"] for r in per_rank) for per_rank in rounds]
        bubble = [statistics.mean(1 - r[mode]["busy_s"] / max(x[mode]["wall_s"] for x in per_rank) for r in per_rank)
                  for per_rank in rounds]
        # exposed P2P: the step minus the same schedule's step on a free link, same round
        exposed = [1e3 * (max(r[mode]["wall_s"] for r in per_rank) - max(r[mode]["free_wall_s"] for r in per_rank))
                   for per_rank in rounds]
        free_bubble = [statistics.mean(1 - r[mode]["free_busy_s"] / max(x[mode]["free_wall_s"] for x in per_rank)
                                       for r in per_rank) for per_rank in rounds]
        blocked = [1e3 * max(r[mode]["blocked_s"] for r in per_rank) for per_rank in rounds]
        # the slowest stage's idle / step: the pipeline's own bubble, without the idle of a
        # lighter stage waiting for a heavier one (stage imbalance, which no schedule removes)
        critical = [1 - max(r[mode]["busy_s"] for r in per_rank) / max(r[mode]["wall_s"] for r in per_rank)
                    for per_rank in rounds]
        free_critical = [1 - max(r[mode]["free_busy_s"] for r in per_rank) / max(r[mode]["free_wall_s"]
                                                                                  for r in per_rank)
                         for per_rank in rounds]
        peak = [max(r[mode]["peak_bytes"] for r in per_rank) for per_rank in rounds]
        result["modes"][mode] = {
            "step_ms": statistics.median(step), "bubble": statistics.median(bubble),
            "p2p_exposed_ms": statistics.median(exposed), "peak_bytes": max(peak),
            "free_link_bubble": statistics.median(free_bubble), "blocked_ms": statistics.median(blocked),
            "critical_bubble": statistics.median(critical), "free_link_critical_bubble": statistics.median(free_critical),
            "predicted_critical_bubble": pred[mode]["critical"], "predicted_free_link_critical_bubble":
                pred[mode]["free_critical"],
            "predicted_free_link_bubble": pred[mode]["free_bubble"],
            "loss": rounds[-1][0][mode]["loss"], "bytes": sum(r[mode]["link_bytes"] for r in rounds[-1]),
            "predicted_step_ms": pred[mode]["step_ms"], "predicted_bubble": pred[mode]["bubble"],
            "predicted_p2p_exposed_ms": pred[mode]["p2p_exposed_ms"],
            "speedup": statistics.median(
                max(r["stock"]["wall_s"] for r in per_rank) / max(r[mode]["wall_s"] for r in per_rank)
                for per_rank in rounds),
        }
    result["floor"] = _floor(cfg, described)
    stock = result["modes"]["stock"]
    for mode, r in result["modes"].items():
        r["bubble_vs_stock"] = r["bubble"] / stock["bubble"] if stock["bubble"] else None
        for key in ("free_link_bubble", "critical_bubble", "free_link_critical_bubble"):
            r[key + "_vs_stock"] = r[key] / stock[key] if stock[key] else None
        r["p2p_vs_stock"] = r["p2p_exposed_ms"] / stock["p2p_exposed_ms"] if stock["p2p_exposed_ms"] else None
        r["memory_vs_stock"] = r["peak_bytes"] / stock["peak_bytes"] if stock["peak_bytes"] else None
        r["prediction_error"] = r["predicted_step_ms"] / r["step_ms"] - 1
    return result


FLOOR_MEMORY = 1.05  # the bound on ZB-H1's peak activation memory we hold it to, x 1F1B's


def _floor(cfg: PPBench, described: list) -> dict:
    """The shortest step any schedule reaches on this run's F/B/W and link within 1.05x 1F1B's
    activation memory (``pp/optimal.py``; simulated), or why it was not computed."""
    from ..pp.schedule_sim import StageTimes
    from .floor import compare

    times = [StageTimes(d["times_ms"]["F"], d["times_ms"]["B"], d["times_ms"]["W"]) for d in described]
    try:
        return compare(times, cfg.microbatches, described[0]["transfer_ms"], described[0]["link"]["latency_us"] * 1e-3,
                       FLOOR_MEMORY, w_share=0.5, time_limit_s=120)
    except ImportError as exc:
        return {"error": str(exc)}


def format_table(result: dict) -> str:
    cfg = result["config"]
    t = result["times_ms"]
    lines = [
        f"PP={cfg['pp']}, m={cfg['microbatches']}, tiny GPT ({cfg['layers']} layers, hidden {cfg['hidden']}, ffn "
        f"{cfg['ffn']}, seq {cfg['seq']}), fp32, 1 rank per stage, {cfg['steps']} rounds (medians)",
        f"link: {result['link']['bandwidth_GBps']:.4f} GB/s, {result['link']['latency_us']:.0f} us (stage transfers = "
        f"{cfg['comm_ratio']} x a stage's compute); F/B/W ms per micro-batch: "
        + "; ".join(f"stage {s}: {x['F']:.1f}/{x['B']:.1f}/{x['W']:.1f}" for s, x in enumerate(t)),
        "",
        f"{'':26}{'step ms':>9}{'vs stock':>9}{'bubble':>8}{'(x stock)':>10}{'slowest':>9}{'(x stock)':>10}"
        f"{'exposed P2P':>12}{'(x stock)':>10}{'peak act MB':>12}{'(x stock)':>10}{'predicted':>10}{'error':>7}",
    ]
    ratio = lambda x: f"{x:.2f}" if x is not None else "-"  # noqa: E731
    for mode, r in result["modes"].items():
        lines.append(
            f"{NAMES[mode]:26}{r['step_ms']:>9.1f}{r['speedup']:>8.2f}x{100 * r['bubble']:>7.1f}%"
            f"{ratio(r['bubble_vs_stock']):>10}{100 * r['critical_bubble']:>8.1f}%{ratio(r['critical_bubble_vs_stock']):>10}"
            f"{r['p2p_exposed_ms']:>10.1f}ms{ratio(r['p2p_vs_stock']):>10}"
            f"{r['peak_bytes'] / 1e6:>12.1f}{ratio(r['memory_vs_stock']):>10}{r['predicted_step_ms']:>10.1f}"
            f"{100 * r['prediction_error']:>+6.1f}%")
    lines.append("on a free link (the schedule alone), bubble / slowest stage's: " + "; ".join(
        f"{NAMES[m]} {100 * r['free_link_bubble']:.1f}% / {100 * r['free_link_critical_bubble']:.1f}% "
        f"(x{ratio(r['free_link_critical_bubble_vs_stock'])})" for m, r in result["modes"].items()))
    lines.append("simulated (pp/schedule_sim.py, from this run's F/B/W and link): " + "; ".join(
        f"{NAMES[m]} bubble {100 * r['predicted_bubble']:.1f}%, slowest {100 * r['predicted_critical_bubble']:.1f}% "
        f"(free link {100 * r['predicted_free_link_critical_bubble']:.1f}%), exposed P2P "
        f"{r['predicted_p2p_exposed_ms']:.1f} ms" for m, r in result["modes"].items()))
    lines.append("bubble: mean idle / step over the stages (idle = step - thread CPU time); slowest: the slowest "
                 "stage's idle / step (imbalance left out); exposed P2P: step - the same schedule's step on a free "
                 "link (same round); peak act: saved tensors + held for W")
    lines.append(_floor_line(result))
    losses = {r["loss"] for r in result["modes"].values()}
    lines.append(f"losses of the last round: {'identical' if len(losses) == 1 else sorted(losses)}")
    return "\n".join(lines)


def _floor_line(result: dict) -> str:
    fl = result.get("floor", {})
    if "error" in fl or not fl:
        return f"floor: not computed ({fl.get('error', 'no floor')})"
    split, whole = fl["schedules"]["floor, B/W split"], fl["schedules"]["floor, B and W together"]
    stock = result["modes"]["stock"]["bubble"]
    proved = lambda r: "" if r["optimal"] else " (bound)"  # noqa: E731
    return (f"floor (simulated, pp/optimal.py: no schedule within {FLOOR_MEMORY}x 1F1B's activation memory does better "
            f"on these F/B/W and this link): B/W split {split['bound_ms']:.1f} ms{proved(split)}, bubble >= "
            f"{100 * split['bubble']:.1f}% = {split['bubble'] / stock if stock else float('nan'):.2f}x stock's measured, "
            f"{split['bubble_vs_stock']:.2f}x its simulated; B and W together {whole['bound_ms']:.1f} ms{proved(whole)}, "
            f"bubble >= {100 * whole['bubble']:.1f}%")


def draw_timeline(per_rank: list, described: list, cfg: PPBench, path: str, modes=("stock", "1f1b", "zb")) -> str:
    """Ours measured (F, B, W and link waits per stage); stock's 1F1B simulated from the same
    F/B/W times (its schedule is Megatron's code, which exposes no per-action timing)."""
    from ..trace import timeline

    kinds = {"F": "forward", "B": "backward", "W": "wgrad"}
    panels = []
    width = max(1e3 * max(r[m]["wall_s"] for r in per_rank) for m in modes)
    for mode in modes:
        rows = []
        if mode == "stock":
            sim = predict(cfg, described)["stock"]["simulation"]
            for s, events in enumerate(sim.timeline):
                for op in "FB":
                    rows.append((f"stage {s} {op}", kinds[op], [(a, b) for label, a, b in events if label[0] == op]))
            panels.append(timeline.Panel("stock Megatron 1F1B (simulated from the measured F/B/W)", width, rows))
            continue
        for s, r in enumerate(per_rank):
            trace = r[mode]["trace"]
            for op in ("FBW" if mode == "zb" else "FB"):
                rows.append((f"stage {s} {op}", kinds[op],
                             [(1e3 * a, 1e3 * b) for o, a, b in trace["events"] if o == op]))
            rows.append((f"stage {s} blocked", "blocked", [(1e3 * a, 1e3 * b) for a, b in trace["blocked"]]))
        panels.append(timeline.Panel(f"{NAMES[mode]} (measured)", width, rows))
    return timeline.draw(panels, path, title=f"pipeline PP={cfg.pp}, m={cfg.microbatches}: one step per stage",
                         columns=1)


def add_pp_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    from .bench_cluster import add_emulate_args

    defaults = PPBench()
    for f in fields(PPBench):
        if f.name == "seed":
            continue
        parser.add_argument(_flag(f.name), dest=f.name, type=type(getattr(defaults, f.name)), default=None,
                            help=f"default {getattr(defaults, f.name)} (with --emulate: the cluster's own)")
    parser.add_argument("--timeline", default="", metavar="PNG", help="draw one step per stage to PNG")
    parser.add_argument("--json", action="store_true", help="print one JSON line after the table")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--write-durations", default="", metavar="FILE",
                        help="write this run's measured F/B/W per stage, parameters and link to FILE, for "
                        "`bench pp --emulate --durations FILE`")
    add_emulate_args(parser)
    from ..args import add_alias

    add_alias(parser, "--microbatches", "--micro-batches")
    return parser


def _flag(name: str) -> str:
    """A ``PPBench`` field's flag (``microbatches``: ``--micro-batches``, as in plan and floor)."""
    return "--micro-batches" if name == "microbatches" else "--" + name.replace("_", "-")


def pp_main(args) -> int:
    if getattr(args, "emulate", False):
        from .bench_cluster import emulate_main

        return emulate_main(args)
    from .bench_cluster import EMULATE_ONLY

    given = [n for n in EMULATE_ONLY if getattr(args, n, None) is not None] + (["no_exposed"] if getattr(
        args, "no_exposed", False) else [])
    if given:
        names = ", ".join("--" + n.replace("_", "-") for n in given)
        print(f"bench pp: {names} only apply with --emulate (the emulated cluster)", file=sys.stderr)
        return 2
    defaults = PPBench()
    values = {f.name: (getattr(args, f.name) if getattr(args, f.name, None) is not None else getattr(defaults, f.name))
              for f in fields(PPBench) if hasattr(args, f.name)}
    cfg = PPBench(**values)
    from .arg_checks import amounts, counts  # every value checked before the ranks start

    counts("bench pp", **{_flag(f.name)[2:].replace("-", "_"): (getattr(cfg, f.name), 0 if f.name == "warmup" else 1)
                          for f in fields(PPBench) if f.type in ("int", int) and f.name != "seed"})
    amounts("bench pp", comm_ratio=cfg.comm_ratio, latency_us=cfg.latency_us)
    if cfg.pp < 2 or cfg.microbatches < cfg.pp:
        print(f"bench pp: needs --pp >= 2 and --micro-batches >= --pp, got {cfg.pp} and {cfg.microbatches}",
              file=sys.stderr)
        return 2
    if cfg.layers % cfg.pp:
        print(f"bench pp: --layers {cfg.layers} does not split over {cfg.pp} stages", file=sys.stderr)
        return 2
    result = run(cfg, progress=not args.no_progress, timeline_png=args.timeline)
    print(format_table(result))
    if args.write_durations:
        write_durations(args.write_durations, cfg, result)
        print(f"durations: {args.write_durations} (run them with `bench pp --emulate --pp {cfg.pp} --durations "
              f"{args.write_durations}`)")
    if args.timeline:
        print(f"timeline: {result['timeline_png']}")
    if args.json:
        for r in result["modes"].values():
            r.pop("simulation", None)
        print(json.dumps(result))
    return 0
