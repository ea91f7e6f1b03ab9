"""``megatron-overlap demo``: the main job on a CPU.

gloo ranks, one per core (2 cores: TP=2 with sequence parallelism; 4 or more: TP=2 x DP=2),
train a tiny GPT on Megatron's local spec twice, side by side: stock Megatron and the plugin,
step for step on the same emulated link (one egress port per rank, bandwidth calibrated so a
step's transfers take ``--comm-ratio`` x its GEMMs). The plugin runs what the cost model, fitted
to a calibration step on this CPU and link, predicts fastest (``--overlap-tp-sub-batches auto``,
``lab/demo_plan.py``: per-op overlap, or its blocks cut into 2 or 3 sub-batches, or stock), and
the demo says which and why; ``--overlap-tp-sub-batches 1`` runs per-op overlap, which keeps
stock's bits. Prints the per-step losses of both, step time, exposed communication and the
fraction of communication hidden, the limit; writes a PNG timeline of one transformer layer per
rank. More ranks than cores can be asked for
(``--ranks``), and the demo says what that does to the timing before it runs.

``--cp N --overlap-cp MODE``: context parallelism on Megatron's local attention (which has none
without the plugin). Ranks = TP x CP (DP 1) unless ``--ranks`` says otherwise. Both models run
CP=N; the baseline is the ring with every transfer waited for before its block is computed,
the other the chosen mode overlapped (plus ``--overlap-tp p2p`` when TP > 1). The link is
calibrated so that a step's transfers take ``--comm-ratio`` x its attention-block compute (and
GEMMs, with TP > 1). That CP training equals training without CP is shown by the tests
(tests/test_cp_training.py), not here: one process cannot hold two parallel layouts at once.

``--pp N``: the tiny GPT over an N-stage pipeline, stock 1F1B against ``--overlap-pp zb``
(``cli/demo_pp.py``).

Then, unless ``--cluster off``: pipelines with data parallelism at scale on the emulated
cluster (``cli/demo_cluster.py``), PP=8 x DP=2 = 16 ranks on this machine, stock 1F1B against
ours (``--cluster PPxDP``, ``--micro-batches``, ``--cluster-model``).
"""


from __future__ import annotations

import json
import os
import statistics
from dataclasses import asdict

from ..lab.demo import DemoConfig
from .demo_args import add_demo_args  # noqa: F401  (the command's entry point, with main)
from .demo_args import (TRAINING_FLAGS, check_config, configure, cpu_cores, flag_name, given_flags, refuse_unused,
                        timeline_path)


# --------------------------------------------------------------------------- driver side
def run(cfg: DemoConfig, timeline_png: str = "runs/demo/timeline.png", progress: bool = True) -> dict:
    """Both models, ``cfg.steps`` steps each; the timeline drawn to ``timeline_png`` and the
    result written beside it (``result.json``)."""
    from tqdm import tqdm

    from ..lab.demo import DemoRanks
    from ..lab.rank_pool import RankPool
    from ..lab.session import RemoteSession

    if cfg.world % (cfg.tp * cfg.cp):
        raise SystemExit(f"demo: --tp {cfg.tp} x --cp {cfg.cp} must divide --ranks {cfg.world}")
    out_dir = os.path.dirname(timeline_png) or "."
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
    result["timeline_png"] = write_timeline(cfg, per_step[-1], timeline_png)
    with open(os.path.join(out_dir, "result.json"), "w") as f:
        json.dump(result, f, indent=1)
    return result


def summarize(cfg: DemoConfig, link: dict, per_step: list) -> dict:
    link = dict(link)
    choice = link.pop("choice", None) or {"sub_batches": cfg.sub_batches, "blocks": cfg.sub_batch_blocks or "all",
                                           "why": "as asked"}
    ran, blocks = choice["sub_batches"], choice.get("blocks", "all")
    result = {"config": asdict(cfg), "link": link, "cpu_cores": len(os.sched_getaffinity(0)),
              "choice": dict(choice, flags=" ".join(cfg.overlap_flags("stock" if ran is None else ran, blocks)),
                             mode=_mode_name(cfg, ran, blocks))}
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


def _mode_name(cfg: DemoConfig, sub_batches, blocks: str = "all") -> str:
    if cfg.cp > 1:
        return f"--overlap-cp {cfg.overlap_cp}"
    if sub_batches is None:
        return "stock (the cost model predicts nothing of ours faster)"
    if sub_batches in (1, "auto"):
        return "per-op overlap"
    where = {"attention": " of the attention blocks", "mlp": " of the MLP blocks"}.get(blocks, "")
    return f"per-op overlap + {sub_batches} sub-batches{where}"


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
        *_choice_lines(result),
        "",
        f"{'step':>4}  {'loss stock':>11}  {'loss overlap':>12}",
    ]
    for i, (a, b) in enumerate(zip(result["baseline"]["losses"], result["overlap"]["losses"])):
        lines.append(f"{i:>4}  {a:>11.6f}  {b:>12.6f}")
    labels = (("baseline", "stock Megatron"), ("overlap", "megatron-overlap"))
    if cfg["cp"] > 1:
        lines[lines.index(f"{'step':>4}  {'loss stock':>11}  {'loss overlap':>12}")] = \
            f"{'step':>4}  {'loss waited':>11}  {'loss overlap':>12}"
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
        f"speedup {result['speedup']:.2f}x (median of {len(result['baseline']['losses']) - cfg['warmup']} per-step "
        f"ratios); {_losses(result)}",
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


def _choice_lines(result: dict) -> list:
    """What ours ran and why (the CP demo: the mode asked for)."""
    choice = result.get("choice")
    if not choice or result["config"]["cp"] > 1:
        return []
    return [f"ours ran: {choice['mode']} ({choice['flags'] or 'no plugin flags'}): {choice['why']}"]


def _losses(result: dict) -> str:
    diff = result["max_loss_rel_diff"]
    if diff == 0:
        return "losses identical at every step"
    cut = result.get("choice", {}).get("sub_batches") not in (None, 1, "auto")
    return (f"losses differ by at most {diff:.1e} (relative)" + (
        ": with linear biases, fc1's bias gradient is summed per sub-batch, a few ulp from stock's (per-op "
        "overlap, --overlap-tp-sub-batches 1, keeps stock's bits)" if cut else ""))


def _table_only(line: str) -> None:
    """--no-progress: the HDP demo's table without its progress lines."""
    if not line.startswith(("[", "HDP demo:")):
        print(line)


def _pp_main(args) -> int:
    """``demo --pp N``: its own model, link and ranks; it reads only --steps, --hidden (the FFN
    4x it), --timeline, --json, --no-progress."""
    import json as _json

    from .demo_pp import PP_HEADS, PP_HIDDEN, format_pp_demo, run_pp_demo

    given = [n for n in given_flags(args, TRAINING_FLAGS + ("hdp", "hdp_capacity"))
             if n not in ("steps", "hidden", "timeline", "out")]
    if given:
        names = ", ".join(flag_name(n) for n in given)
        raise SystemExit(f"demo --pp runs its own pipeline (one rank per stage) and does not read {names}; drop "
                         f"{'them' if len(given) > 1 else 'it'} (it takes --steps, --hidden, --timeline, --json, "
                         "--no-progress)")
    from .arg_checks import counts

    hidden = args.hidden if args.hidden is not None else PP_HIDDEN
    counts("demo --pp", pp=(args.pp, 2), steps=(args.steps if args.steps is not None else 8, 1), hidden=(hidden, 1))
    if hidden % PP_HEADS:
        raise SystemExit(f"demo --pp: --hidden {hidden} must be a multiple of the pipeline model's {PP_HEADS} heads")
    result = run_pp_demo(args.pp, steps=args.steps or 8, timeline_png=timeline_path(args, "pp_timeline.png"),
                         progress=not args.no_progress, hidden=hidden)
    print(format_pp_demo(result))
    if args.json:
        print(_json.dumps(result))
    return 0


def main(args) -> int:
    if getattr(args, "pp", None) is not None:  # --pp 0 too: refused there, not run as the TP demo
        return _pp_main(args)
    refuse_unused(args)
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

    default = "x".join(map(str, DEFAULT[:2])) if args.cp in (None, 1) else "off"
    cluster = parse_cluster(args.cluster if args.cluster is not None else default, args.cluster_microbatches)
    if cluster is not None:  # refused now, not after the first part
        cluster = cluster_config(cluster, model=args.cluster_model or "llama3-70b", steps=args.steps or 4)
    cfg, header = configure(args, cpu_cores())
    check_config(cfg)
    print(header, flush=True)
    result = run(cfg, timeline_png=timeline_path(args), progress=not args.no_progress)
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
