"""``megatron-overlap demo``: the main job on a CPU.

gloo ranks, one per core (2 cores: TP=2 with sequence parallelism; 4 or more: TP=2 x DP=2),
train a tiny GPT on Megatron's local spec twice, side by side: stock Megatron and the plugin,
step for step on the same emulated link (one egress port per rank, bandwidth calibrated so a
step's transfers take as long as its GEMMs). Prints the per-step losses of both (they agree),
step time, exposed communication and the fraction of communication hidden; writes a PNG
timeline of one transformer layer per rank. More ranks than cores can be asked for
(``--world``), and the demo says what that does to the timing before it runs.

``--cp N --overlap-cp MODE``: context parallelism on Megatron's local attention (which has none
without the plugin). World = TP x CP (DP 1) unless ``--world`` says otherwise. Both models run
CP=N; the baseline is the ring with every transfer waited for before its block is computed,
the other the chosen mode overlapped (plus ``--overlap-tp p2p`` when TP > 1). The link is
calibrated so that a step's transfers take ``--comm-ratio`` x its attention-block compute (and
GEMMs, with TP > 1). That CP training equals training without CP is shown by the tests
(tests/test_cp_training.py), not here: one process cannot hold two parallel layouts at once.

``--pp N``: the tiny GPT over an N-stage pipeline, stock 1F1B against ``--overlap-pp zb``
(``cli/demo_pp.py``).

Then, unless ``--cluster off``: pipelines with data parallelism at scale on the emulated
cluster (``cli/demo_cluster.py``), PP=8 x DP=2 = 16 ranks on this machine, stock 1F1B against
ours (``--cluster PPxDPxM``, ``--cluster-model``).
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
    # the limit, measured apart from the overlapped run: max(compute, transfer) per step, compute
    # being stock's busiest rank's CPU time (its waits sleep), transfer the link's busy time
    compute = statistics.median(1e3 * max(r["baseline"]["cpu_s"] for r in rows) for rows in timed)
    result["limit_ms"] = max(compute, result["baseline"]["comm_ms"])
    result["compute_ms"] = compute
    result["ceiling"] = result["baseline"]["step_ms"] / result["limit_ms"] if result["limit_ms"] else None
    a, b = result["baseline"]["losses"], result["overlap"]["losses"]
    result["max_loss_rel_diff"] = max(abs(x - y) / abs(x) for x, y in zip(a, b))
    # per step (both modes within seconds of each other, first one alternating), then the median:
    # a VM that speeds up or slows down between steps does not bias it
    result["speedup"] = statistics.median(max(r["baseline"]["wall_s"] for r in rows)
                                          / max(r["overlap"]["wall_s"] for r in rows) for rows in timed)
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
        f"limit max(compute {result['compute_ms']:.1f} ms, transfer {result['baseline']['comm_ms']:.1f} ms) = "
        f"{result['limit_ms']:.1f} ms per step: ceiling stock / limit {result['ceiling']:.2f}x, ours at "
        f"{result['overlap']['step_ms'] / result['limit_ms']:.2f}x the limit",
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


def configure(args, cores: int) -> tuple[DemoConfig, str]:
    """The demo's config from the flags given and the machine, and the header that says which
    layout runs and why (and what it does to the timing when there are more ranks than cores)."""
    names = {f.name for f in fields(DemoConfig)}
    values = {k: v for k, v in vars(args).items() if k in names and v is not None}
    cp = values.get("cp", 1)
    if cp > 1:  # --cp alone: pure context parallelism, TP x CP ranks
        values.setdefault("tp", 1)
        values.setdefault("world", values["tp"] * cp)
        why = f"TP={values['tp']} x CP={cp} on {values['world']} ranks, as asked"
    elif "world" in values or "tp" in values:
        values.setdefault("tp", DemoConfig().tp)
        values.setdefault("world", max(values["tp"], DemoConfig().world))
        why = f"{values['world']} ranks, TP={values['tp']}, as asked"
    else:
        values["world"], values["tp"], why = default_layout(cores)
    cfg = DemoConfig(**values)
    header = f"megatron-overlap demo: {why}"
    if cfg.world > cores:
        header += (f"\nnote: {cfg.world} ranks on {cores} cores: ranks take turns on a core, so compute, not the "
                   "link, bounds the step and the step times understate what overlap hides (the exposed-"
                   "communication column still shows it); for timing, one rank per core")
    return cfg, header


def check_config(cfg: DemoConfig) -> None:
    """Every value the demo's ranks will use, checked here, before any rank starts: counts,
    the layout, and the model's shape by the rules install applies (``rules``), each refusal
    naming the flag."""
    from ..rules import model_shape_problems
    from .checks import amounts, counts

    counts("demo", world=(cfg.world, 1), tp=(cfg.tp, 1), cp=(cfg.cp, 1), steps=(cfg.steps, 1),
           warmup=(cfg.warmup, 0), seq=(cfg.seq, 1), hidden=(cfg.hidden, 1), layers=(cfg.layers, 1),
           overlap_tp_chunks=(cfg.chunks, 0), overlap_cp_a2a_size=(cfg.cp_a2a_size, 0))
    amounts("demo", ("comm_ratio",), bandwidth_GBps=cfg.bandwidth_GBps, comm_ratio=cfg.comm_ratio,
            latency_us=cfg.latency_us)
    if cfg.world % (cfg.tp * cfg.cp):
        raise SystemExit(f"demo: --tp {cfg.tp} x --cp {cfg.cp} must divide --world {cfg.world}")
    if cfg.hidden % cfg.heads:
        raise SystemExit(f"demo: --hidden {cfg.hidden} must be a multiple of the demo model's {cfg.heads} heads")
    for field, reason in model_shape_problems(cfg.tp, cfg.heads, cfg.kv_heads, cfg.seq, cfg.cp, cfg.tp > 1):
        flag = "--tp" if field.endswith("tensor_model_parallel_size") else "--seq"
        raise SystemExit(f"demo: {flag}: the tiny GPT ({cfg.heads} heads, {cfg.kv_heads} key/value heads, seq "
                         f"{cfg.seq}) cannot be built: {reason}")
    if cfg.tp > 1:
        from .checks import tp_chunks

        tp_chunks("demo", cfg.chunks, cfg.tp, cfg.seq // (cfg.tp * cfg.cp))
    if cfg.cp > 1 and cfg.overlap_cp in ("a2a", "hybrid"):
        size = cfg.cp if cfg.overlap_cp == "a2a" else cfg.cp_a2a_size
        if size < 1 or cfg.cp % size or (cfg.kv_heads // cfg.tp) % size:
            raise SystemExit(f"demo: --overlap-cp {cfg.overlap_cp} splits the {cfg.kv_heads // cfg.tp} key/value heads "
                             f"per TP rank over {size} ranks, which must divide them and --cp {cfg.cp}; use "
                             "--overlap-cp ring")


def _table_only(line: str) -> None:
    """--no-progress: the HDP demo's table without its progress lines."""
    if not line.startswith(("[", "HDP demo:")):
        print(line)


def default_layout(cores: int) -> tuple[int, int, str]:
    """(world, TP, why) of the demo on a machine with ``cores`` cores: one rank per core, so a
    rank waiting on the link never lends its core to another and the link, not the CPU, is
    what overlap can hide."""
    if cores >= 4:
        return 4, 2, f"TP=2 x DP=2 on 4 ranks, one per core ({cores} cores here)"
    return 2, 2, (f"TP=2 with SP on 2 ranks, one per core ({cores} cores here; with 4 or more the demo runs "
                  "TP=2 x DP=2)")


def cpu_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


# Flags that only the TP / CP demo reads (dest names), and those that only TP overlap reads.
_TRAINING_FLAGS = ("steps", "warmup", "world", "tp", "seq", "hidden", "layers", "bandwidth_GBps", "comm_ratio",
                   "cluster", "cluster_model",
                   "latency_us", "chunks", "rs", "bidirectional", "cp", "overlap_cp", "cp_a2a_size", "out",
                   "trace_dir")
_TP_FLAGS = {"chunks": "--overlap-tp-chunks", "rs": "--overlap-tp-rs", "bidirectional": "--overlap-tp-bidirectional"}


def _given(args, names) -> list:
    return [n for n in names if getattr(args, n, None) not in (None, False)]


def _refuse_unused(args) -> None:
    """Each demo mode refuses the flags it would ignore, naming them."""
    if getattr(args, "hdp", False):
        given = [n for n in _given(args, _TRAINING_FLAGS) if n != "tp"]
        if args.tp not in (None, 1, 2):
            raise SystemExit(f"demo --hdp runs 4 ranks as TP 1 x HDP 4 or TP 2 x HDP 2; --tp {args.tp} is neither")
        if given:
            names = ", ".join("--" + n.replace("_", "-").replace("-gbps", "-GBps") for n in given)
            raise SystemExit(f"demo --hdp runs its own batch on 4 ranks and does not read {names}; drop "
                             f"{'them' if len(given) > 1 else 'it'} (it takes --hdp-max-tokens-per-rank, --json, "
                             "--tp, --no-progress)")
        return
    if args.hdp_capacity is not None:
        raise SystemExit("demo: --hdp-max-tokens-per-rank only applies with --hdp")
    cp = args.cp or 1
    tp = args.tp if args.tp is not None else (1 if cp > 1 else 2)
    if cp > 1 and tp == 1:
        given = [_TP_FLAGS[n] for n in _given(args, _TP_FLAGS)]
        if given:
            raise SystemExit(f"demo --cp {cp} runs with TP=1 (no TP overlap), so {', '.join(given)} would do "
                             "nothing; drop it or add --tp 2")


def _pp_main(args) -> int:
    """``demo --pp N``: its own model, link and ranks; it reads only --steps, --hidden (the FFN
    4x it), --out, --json, --no-progress."""
    import json as _json

    from .demo_pp import PP_HEADS, PP_HIDDEN, format_pp_demo, run_pp_demo

    given = [n for n in _given(args, _TRAINING_FLAGS + ("hdp", "hdp_capacity")) if n not in ("steps", "hidden", "out")]
    if given:
        names = ", ".join("--" + n.replace("_", "-").replace("-gbps", "-GBps") for n in given)
        raise SystemExit(f"demo --pp runs its own pipeline (one rank per stage) and does not read {names}; drop "
                         f"{'them' if len(given) > 1 else 'it'} (it takes --steps, --hidden, --out, --json, "
                         "--no-progress)")
    from .checks import counts

    hidden = args.hidden if args.hidden is not None else PP_HIDDEN
    counts("demo --pp", pp=(args.pp, 2), steps=(args.steps if args.steps is not None else 8, 1), hidden=(hidden, 1))
    if hidden % PP_HEADS:
        raise SystemExit(f"demo --pp: --hidden {hidden} must be a multiple of the pipeline model's {PP_HEADS} heads")
    result = run_pp_demo(args.pp, steps=args.steps or 8, out_dir=args.out or "runs/demo",
                         progress=not args.no_progress, hidden=hidden)
    print(format_pp_demo(result))
    if args.json:
        print(_json.dumps(result))
    return 0


def add_demo_args(parser: argparse.ArgumentParser):
    d = DemoConfig()
    # None defaults: a mode can tell a flag the user gave from one it did not (and refuse it)
    parser.add_argument("--steps", type=int, default=None, help=f"training steps (default {d.steps})")
    parser.add_argument("--warmup", type=int, default=None, help=f"steps left out of the timing (default {d.warmup})")
    parser.add_argument("--world", type=int, default=None,
                        help="gloo ranks (default: one per core, 2 or 4; TP x CP with --cp)")
    parser.add_argument("--tp", type=int, default=None,
                        help=f"tensor-parallel size (divides --world; default {d.tp}, 1 with --cp)")
    parser.add_argument("--seq", type=int, default=None, help=f"default {d.seq}")
    parser.add_argument("--hidden", type=int, default=None, help=f"default {d.hidden} (demo --pp: 768, FFN 4x)")
    parser.add_argument("--layers", type=int, default=None, help=f"default {d.layers}")
    parser.add_argument("--bandwidth-GBps", dest="bandwidth_GBps", type=float, default=None,
                        help="emulated link bandwidth; 0 (default) sets it so the transfers of a "
                        "step take --comm-ratio x the time of its GEMMs")
    parser.add_argument("--comm-ratio", type=float, default=None, help=f"default {d.comm_ratio:g}")
    parser.add_argument("--latency-us", type=float, default=None, help=f"default {d.latency_us:g}")
    parser.add_argument("--overlap-tp-chunks", dest="chunks", type=int, default=None)
    parser.add_argument("--overlap-tp-rs", dest="rs", choices=("ring", "a2a"), default=None)
    parser.add_argument("--overlap-tp-bidirectional", dest="bidirectional", action="store_true", default=None)
    parser.add_argument("--cp", type=int, default=None,
                        help="context-parallel size: CP on Megatron's local attention through --overlap-cp")
    parser.add_argument("--overlap-cp", dest="overlap_cp", choices=("ring", "a2a", "hybrid"), default=None)
    parser.add_argument("--overlap-cp-a2a-size", dest="cp_a2a_size", type=int, default=None)
    parser.add_argument("--hdp", action="store_true",
                        help="instead: hybrid data parallelism on 4 ranks, a mixed-length batch, per-rank busy "
                        "time of a static CP layout vs the HDP plan (same loss and gradients)")
    parser.add_argument("--hdp-max-tokens-per-rank", dest="hdp_capacity", type=int, default=None, metavar="C",
                        help="with --hdp: tokens per rank per micro-batch (default: the demo's)")
    parser.add_argument("--pp", type=int, default=None, metavar="STAGES",
                        help="pipeline demo: the tiny GPT over STAGES ranks, stock 1F1B vs --overlap-pp zb")
    parser.add_argument("--out", default=None, help="directory for timeline.png and result.json (default runs/demo)")
    parser.add_argument("--trace", dest="trace_dir", default=None, metavar="DIR",
                        help="also write per-rank Chrome traces of the last step (both modes) to DIR; "
                        "`megatron-overlap report DIR` draws them")
    from .demo_cluster import DEFAULT

    parser.add_argument("--cluster", default=None, metavar="PPxDPxM",
                        help=f"then pipelines at scale on the emulated cluster (default {DEFAULT}: 16 ranks); off: skip")
    parser.add_argument("--cluster-model", default=None, help="the emulated cluster's model (default llama3-70b)")
    parser.add_argument("--json", action="store_true", help="print one JSON line after the table")
    parser.add_argument("--no-progress", action="store_true")


def main(args) -> int:
    if getattr(args, "pp", None) is not None:  # --pp 0 too: refused there, not run as the TP demo
        return _pp_main(args)
    _refuse_unused(args)
    if getattr(args, "hdp", False):
        from .demo_hdp import DEFAULT_CAPACITY, run_hdp_demo

        tp = args.tp or 1
        result = run_hdp_demo(out=print if not args.no_progress else _table_only, tp=tp,
                              capacity=args.hdp_capacity or DEFAULT_CAPACITY * tp,
                              planning_steps=5 if tp == 1 else 0)  # steps planned inline vs one step ahead
        if args.json:
            print(json.dumps(result))
        return 0
    from .demo_cluster import DEFAULT, cluster_config, format_cluster_part, parse_cluster, run_cluster_part

    cluster = parse_cluster(args.cluster if args.cluster is not None else (DEFAULT if args.cp in (None, 1) else "off"))
    if cluster is not None:  # refused now, not after the first part
        cluster = cluster_config(cluster, model=args.cluster_model or "llama3-70b", steps=args.steps or 4)
    cfg, header = configure(args, cpu_cores())
    check_config(cfg)
    print(header, flush=True)
    result = run(cfg, out_dir=args.out or "runs/demo", progress=not args.no_progress)
    print(format_table(result))
    out = {k: result[k] for k in ("config", "link", "baseline", "overlap", "limit_ms", "ceiling")}
    if cluster is not None:
        print("", flush=True)
        part = run_cluster_part(cluster, progress=not args.no_progress)
        print(format_cluster_part(part))
        out["cluster"] = {k: v for k, v in part.items() if k not in ("timeline_png",)}
        for r in out["cluster"]["modes"].values():
            r.pop("simulation", None)
    if args.json:
        print(json.dumps(out, default=str))
    return 0
