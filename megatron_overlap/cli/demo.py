"""``megatron-overlap demo``: the main job on a CPU.

Four gloo ranks (TP=2 x DP=2, sequence parallel) train a tiny GPT on Megatron's local spec
twice, side by side: stock Megatron and the plugin, step for step on the same emulated link
(one egress port per rank, bandwidth calibrated so a step's transfers take as long as its
GEMMs). Prints the per-step losses of both (they agree), step time, exposed communication and
the fraction of communication hidden; writes a PNG timeline of one transformer layer per rank.

``--cp N --overlap-cp MODE``: context parallelism on Megatron's local attention (which has none
without the plugin). World = TP x CP (DP 1) unless ``--world`` says otherwise. Both models run
CP=N; the baseline is the ring with every transfer waited for before its block is computed,
the other the chosen mode overlapped (plus ``--overlap-tp p2p`` when TP > 1). The link is
calibrated so that a step's transfers take ``--comm-ratio`` x its attention-block compute (and
GEMMs, with TP > 1). That CP training equals training without CP is shown by the tests
(tests/test_cp_training.py), not here: one process cannot hold two parallel layouts at once.
"""


from __future__ import annotations

import argparse
import json
import os
import statistics
from dataclasses import asdict, fields

from ..lab.demo import DemoConfig


# --------------------------------------------------------------------------- driver side
def run(cfg: DemoConfig, out_dir: str = "runs/demo", progress: bool = True) -> dict:
    from tqdm import tqdm

    from ..lab.demo import DemoRanks
    from ..lab.rank_pool import RankPool
    from ..lab.session import RemoteSession

    if cfg.world % (cfg.tp * cfg.cp):
        raise SystemExit(f"demo: --tp {cfg.tp} x --cp {cfg.cp} must divide --world {cfg.world}")
    os.makedirs(out_dir, exist_ok=True)
    bar = tqdm(total=cfg.steps + 1, desc=f"starting {cfg.world} gloo ranks", disable=not progress, unit="step")
    per_step = []
    with RankPool(cfg.world, timeout=1800, threads_per_rank=1) as pool, \
            RemoteSession(pool, DemoRanks, cfg) as ranks:
        link = ranks.started[0]
        bar.set_description("baseline + overlap")
        bar.update(1)
        for index in range(cfg.steps):
            rows = ranks.call("step", index, index == cfg.steps - 1)
            per_step.append(rows)
            bar.set_postfix(loss=f"{rows[0]['baseline']['loss']:.4f}/{rows[0]['overlap']['loss']:.4f}")
            bar.update(1)
    bar.close()
    result = summarize(cfg, link, per_step)
    result["timeline_png"] = write_timeline(cfg, per_step[-1], os.path.join(out_dir, "timeline.png"))
    with open(os.path.join(out_dir, "result.json"), "w") as f:
        json.dump(result, f, indent=1)
    return result


def summarize(cfg: DemoConfig, link: dict, per_step: list) -> dict:
    result = {"config": asdict(cfg), "link": link, "cpu_cores": len(os.sched_getaffinity(0))}
    timed = per_step[cfg.warmup:] or per_step
    for mode in ("baseline", "overlap"):
        wall = [1e3 * max(r[mode]["wall_s"] for r in rows) for rows in timed]
        exposed = [1e3 * statistics.mean(r[mode]["blocked_s"] for r in rows) for rows in timed]
        comm = [1e3 * statistics.mean(r[mode]["busy_s"] for r in rows) for rows in timed]
        comm_ms = statistics.median(comm)
        exposed_ms = statistics.median(exposed)
        result[mode] = {
            "losses": [rows[0][mode]["loss"] for rows in per_step],
            "step_ms": statistics.median(wall),
            "exposed_comm_ms": exposed_ms,
            "comm_ms": comm_ms,
            "hidden_fraction": max(0.0, 1 - exposed_ms / comm_ms) if comm_ms else 0.0,
            "bytes_per_step": max(r[mode]["bytes"] for r in timed[-1]),
        }
    a, b = result["baseline"]["losses"], result["overlap"]["losses"]
    result["max_loss_rel_diff"] = max(abs(x - y) / abs(x) for x, y in zip(a, b))
    result["speedup"] = result["baseline"]["step_ms"] / result["overlap"]["step_ms"]
    return result


def write_timeline(cfg: DemoConfig, last_step: list, path: str) -> str:
    from ..trace import timeline

    panels = []
    for phase, (start_key, end_key) in (("forward", ("fwd_start", "fwd_end")), ("backward", ("bwd_start", "bwd_end"))):
        spans = {}
        for mode in ("baseline", "overlap"):
            rows, width = [], 0.0
            for rank, r in enumerate(last_step):
                trace = r[mode]["trace"]
                start, end = trace["layer"][start_key], trace["layer"][end_key]
                width = max(width, 1e3 * (end - start))
                rows.append((f"rank {rank} compute", "compute",
                             timeline.clip(timeline.subtract((start, end), trace["blocked"]), start, end)))
                rows.append((f"rank {rank} blocked", "blocked", timeline.clip(trace["blocked"], start, end)))
                rows.append((f"rank {rank} link", "link", timeline.clip(trace["link"], start, end)))
            spans[mode] = (rows, width)
        width = max(w for _, w in spans.values())
        for mode in ("baseline", "overlap"):
            label = "stock Megatron" if mode == "baseline" else "megatron-overlap"
            if cfg.cp > 1:
                label = "ring, transfers waited" if mode == "baseline" else f"--overlap-cp {cfg.overlap_cp}"
            panels.append(timeline.Panel(f"{label}: layer 0 {phase}", width, spans[mode][0]))
    return timeline.draw(panels, path, title=f"tiny GPT, {_layout(cfg)}, emulated link, one layer of the last step")


def _layout(cfg) -> str:
    cfg = cfg if isinstance(cfg, dict) else asdict(cfg)
    parts = [f"TP={cfg['tp']}"] + ([f"CP={cfg['cp']}"] if cfg["cp"] > 1 else [])
    return " x ".join(parts + [f"DP={cfg['world'] // (cfg['tp'] * cfg['cp'])}"])


def format_table(result: dict) -> str:
    cfg, link = result["config"], result["link"]
    lines = [
        f"tiny GPT ({cfg['layers']} layers, hidden {cfg['hidden']}, seq {cfg['seq']}), "
        f"{cfg['world']} gloo ranks: {_layout(cfg)}{', SP' if cfg['tp'] > 1 else ''}, 1 thread/rank",
        f"emulated link: {link['bandwidth_GBps']:.3f} GB/s egress per rank, {link['latency_us']:.0f} us/message",
        "",
        f"{'step':>4}  {'loss stock':>11}  {'loss overlap':>12}",
    ]
    for i, (a, b) in enumerate(zip(result["baseline"]["losses"], result["overlap"]["losses"])):
        lines.append(f"{i:>4}  {a:>11.6f}  {b:>12.6f}")
    labels = (("baseline", "stock Megatron"), ("overlap", "megatron-overlap"))
    if cfg["cp"] > 1:
        lines[3] = f"{'step':>4}  {'loss waited':>11}  {'loss overlap':>12}"
        labels = (("baseline", "ring, waited"), ("overlap", f"cp {cfg['overlap_cp']}"))
    lines += [
        "",
        f"{'':18}{'step ms':>9}{'comm ms':>9}{'exposed comm ms':>17}{'hidden':>8}",
    ]
    for mode, label in labels:
        r = result[mode]
        lines.append(f"{label:18}{r['step_ms']:>9.1f}{r['comm_ms']:>9.1f}{r['exposed_comm_ms']:>17.1f}"
                     f"{100 * r['hidden_fraction']:>7.0f}%")
    lines += [
        "",
        f"speedup {result['speedup']:.2f}x; losses differ by at most {result['max_loss_rel_diff']:.1e} (relative)",
        f"timeline: {result['timeline_png']}",
    ]
    cores = result.get("cpu_cores") or 0
    if cores and cfg["world"] > cores:
        lines += [
            "",
            f"note: {cfg['world']} ranks share {cores} CPU cores, so a rank that waits on the link lends its",
            "core to another and compute, not the link, bounds the step: the exposed-communication",
            "and hidden columns show the overlap; step times understate it. For timing with one",
            "rank per core: megatron-overlap bench " + ("attention" if cfg["cp"] > 1 else "mlp"),
        ]
    return "\n".join(lines)


def _table_only(line: str) -> None:
    """--no-progress: the HDP demo's table without its progress lines."""
    if not line.startswith(("[", "HDP demo:")):
        print(line)


def add_demo_args(parser: argparse.ArgumentParser):
    d = DemoConfig()
    parser.add_argument("--steps", type=int, default=d.steps)
    parser.add_argument("--warmup", type=int, default=d.warmup, help="steps left out of the timing")
    parser.add_argument("--world", type=int, default=None, help="gloo ranks (default 4; TP x CP with --cp)")
    parser.add_argument("--tp", type=int, default=None,
                        help=f"tensor-parallel size (divides --world; default {d.tp}, 1 with --cp)")
    parser.add_argument("--seq", type=int, default=d.seq)
    parser.add_argument("--hidden", type=int, default=d.hidden)
    parser.add_argument("--layers", type=int, default=d.layers)
    parser.add_argument("--bandwidth-GBps", dest="bandwidth_GBps", type=float, default=d.bandwidth_GBps,
                        help="emulated link bandwidth; 0 (default) sets it so the TP transfers of a "
                        "step take --comm-ratio x the time of its GEMMs")
    parser.add_argument("--comm-ratio", type=float, default=d.comm_ratio)
    parser.add_argument("--latency-us", type=float, default=d.latency_us)
    parser.add_argument("--overlap-tp-chunks", dest="chunks", type=int, default=d.chunks)
    parser.add_argument("--overlap-tp-rs", dest="rs", choices=("ring", "a2a"), default=d.rs)
    parser.add_argument("--overlap-tp-bidirectional", dest="bidirectional", action="store_true")
    parser.add_argument("--cp", type=int, default=d.cp,
                        help="context-parallel size: CP on Megatron's local attention through --overlap-cp")
    parser.add_argument("--overlap-cp", dest="overlap_cp", choices=("ring", "a2a", "hybrid"), default=d.overlap_cp)
    parser.add_argument("--overlap-cp-a2a-size", dest="cp_a2a_size", type=int, default=d.cp_a2a_size)
    parser.add_argument("--hdp", action="store_true",
                        help="instead: hybrid data parallelism on 4 ranks, a mixed-length batch, per-rank busy "
                        "time of a static CP layout vs the HDP plan (same loss and gradients)")
    parser.add_argument("--hdp-max-tokens-per-rank", dest="hdp_capacity", type=int, default=None, metavar="C",
                        help="with --hdp: tokens per rank per micro-batch (default: the demo's)")
    parser.add_argument("--out", default="runs/demo", help="directory for timeline.png and result.json")
    parser.add_argument("--trace", dest="trace_dir", default="", metavar="DIR",
                        help="also write per-rank Chrome traces of the last step (both modes) to DIR; "
                        "`megatron-overlap report DIR` draws them")
    parser.add_argument("--json", action="store_true", help="print one JSON line after the table")
    parser.add_argument("--no-progress", action="store_true")


def main(args) -> int:
    if getattr(args, "hdp", False):
        from .demo_hdp import DEFAULT_CAPACITY, run_hdp_demo

        result = run_hdp_demo(out=print if not args.no_progress else _table_only,
                              capacity=args.hdp_capacity or DEFAULT_CAPACITY)
        if args.json:
            print(json.dumps(result))
        return 0
    names = {f.name for f in fields(DemoConfig)}
    values = {k: v for k, v in vars(args).items() if k in names and v is not None}
    cp = values.get("cp", 1)
    values.setdefault("tp", 1 if cp > 1 else DemoConfig().tp)  # --cp alone: pure context parallelism
    values.setdefault("world", values["tp"] * cp if cp > 1 else DemoConfig().world)
    cfg = DemoConfig(**values)
    result = run(cfg, out_dir=args.out, progress=not args.no_progress)
    print(format_table(result))
    if args.json:
        keys = ("config", "link", "baseline", "overlap")
        print(json.dumps({k: result[k] for k in keys}))
    return 0
