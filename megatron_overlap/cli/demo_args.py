"""The flags of ``megatron-overlap demo`` and the layout they choose (the driver is
``cli/demo.py``): every value checked, and every flag a part of the demo would not read refused
by name, before any rank starts."""

from __future__ import annotations

import argparse
import os
from dataclasses import fields

from ..lab.demo import DemoConfig


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
    elif "world" in values or "tp" in values:  # --ranks, --tp
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
    from .arg_checks import amounts, counts

    counts("demo", ranks=(cfg.world, 1), tp=(cfg.tp, 1), cp=(cfg.cp, 1), steps=(cfg.steps, 1),
           warmup=(cfg.warmup, 0), seq=(cfg.seq, 1), hidden=(cfg.hidden, 1), layers=(cfg.layers, 1),
           overlap_tp_chunks=(cfg.chunks, 0), overlap_cp_a2a_size=(cfg.cp_a2a_size, 0),
           **({} if cfg.sub_batches == "auto" else {"overlap_tp_sub_batches": (cfg.sub_batches, 1)}))
    amounts("demo", ("comm_ratio",), bandwidth_GBps=cfg.bandwidth_GBps, comm_ratio=cfg.comm_ratio,
            latency_us=cfg.latency_us)
    if cfg.sub_batch_blocks not in ("", "all") and cfg.sub_batches == 1:
        raise SystemExit(f"demo: --overlap-tp-sub-batch-blocks {cfg.sub_batch_blocks} chooses the blocks sub-batches "
                         "cut, and --overlap-tp-sub-batches 1 cuts none; pass 2 or more (or auto), or drop it")
    if cfg.world % (cfg.tp * cfg.cp):
        raise SystemExit(f"demo: --tp {cfg.tp} x --cp {cfg.cp} must divide --ranks {cfg.world}")
    if cfg.hidden % cfg.heads:
        raise SystemExit(f"demo: --hidden {cfg.hidden} must be a multiple of the demo model's {cfg.heads} heads")
    for field, reason in model_shape_problems(cfg.tp, cfg.heads, cfg.kv_heads, cfg.seq, cfg.cp, cfg.tp > 1):
        flag = "--tp" if field.endswith("tensor_model_parallel_size") else "--seq"
        raise SystemExit(f"demo: {flag}: the tiny GPT ({cfg.heads} heads, {cfg.kv_heads} key/value heads, seq "
                         f"{cfg.seq}) cannot be built: {reason}")
    if cfg.tp > 1:
        from .arg_checks import tp_chunks

        tp_chunks("demo", cfg.chunks, cfg.tp, cfg.seq // (cfg.tp * cfg.cp))
    if cfg.cp > 1 and cfg.overlap_cp in ("a2a", "hybrid"):
        size = cfg.cp if cfg.overlap_cp == "a2a" else cfg.cp_a2a_size
        if size < 1 or cfg.cp % size or (cfg.kv_heads // cfg.tp) % size:
            raise SystemExit(f"demo: --overlap-cp {cfg.overlap_cp} splits the {cfg.kv_heads // cfg.tp} key/value heads "
                             f"per TP rank over {size} ranks, which must divide them and --cp {cfg.cp}; use "
                             "--overlap-cp ring")


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
TRAINING_FLAGS = ("steps", "warmup", "world", "tp", "seq", "hidden", "layers", "bandwidth_GBps", "comm_ratio",
                  "cluster", "cluster_microbatches", "cluster_model", "latency_us", "chunks", "rs", "bidirectional",
                  "sub_batches", "sub_batch_blocks", "cp", "overlap_cp", "cp_a2a_size", "timeline", "out", "trace_dir")
_TP_FLAGS = ("chunks", "rs", "bidirectional", "sub_batches", "sub_batch_blocks")
_FLAG_OF = {"world": "--ranks", "bandwidth_GBps": "--bandwidth-GBps", "cluster_microbatches": "--micro-batches",
            "chunks": "--overlap-tp-chunks", "rs": "--overlap-tp-rs", "bidirectional": "--overlap-tp-bidirectional",
            "sub_batches": "--overlap-tp-sub-batches", "sub_batch_blocks": "--overlap-tp-sub-batch-blocks",
            "cp_a2a_size": "--overlap-cp-a2a-size", "trace_dir": "--trace", "hdp": "--overlap-hdp",
            "hdp_capacity": "--overlap-hdp-max-tokens-per-rank"}


def flag_name(dest: str) -> str:
    return _FLAG_OF.get(dest, "--" + dest.replace("_", "-"))


def given_flags(args, names) -> list:
    return [n for n in names if getattr(args, n, None) not in (None, False)]


def refuse_unused(args) -> None:
    """Each demo mode refuses the flags it would ignore, naming them."""
    if getattr(args, "hdp", False):
        given = [n for n in given_flags(args, TRAINING_FLAGS) if n != "tp"]
        if args.tp not in (None, 1, 2):
            raise SystemExit(f"demo --overlap-hdp runs 4 ranks as TP 1 x HDP 4 or TP 2 x HDP 2; --tp {args.tp} is "
                             "neither")
        if given:
            names = ", ".join(flag_name(n) for n in given)
            raise SystemExit(f"demo --overlap-hdp runs its own batch on 4 ranks and does not read {names}; drop "
                             f"{'them' if len(given) > 1 else 'it'} (it takes --overlap-hdp-max-tokens-per-rank, "
                             "--json, --tp, --no-progress)")
        return
    if args.hdp_capacity is not None:
        raise SystemExit("demo: --overlap-hdp-max-tokens-per-rank only applies with --overlap-hdp")
    cp = args.cp or 1
    tp = args.tp if args.tp is not None else (1 if cp > 1 else 2)
    if cp > 1 and tp == 1:
        given = [flag_name(n) for n in given_flags(args, _TP_FLAGS)]
        if given:
            raise SystemExit(f"demo --cp {cp} runs with TP=1 (no TP overlap), so {', '.join(given)} would do "
                             "nothing; drop it or add --tp 2")


def _sub_batches(text: str):
    return text if text == "auto" else int(text)


def add_demo_args(parser: argparse.ArgumentParser):
    d = DemoConfig()
    # None defaults: a mode can tell a flag the user gave from one it did not (and refuse it)
    parser.add_argument("--steps", type=int, default=None, help=f"training steps (default {d.steps})")
    parser.add_argument("--warmup", type=int, default=None, help=f"steps left out of the timing (default {d.warmup})")
    parser.add_argument("--ranks", dest="world", type=int, default=None,
                        help="gloo ranks (default: one per core, 2 or 4; TP x CP with --cp)")
    parser.add_argument("--tp", type=int, default=None,
                        help=f"tensor-parallel size (divides --ranks; default {d.tp}, 1 with --cp)")
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
    parser.add_argument("--overlap-tp-sub-batches", dest="sub_batches", type=_sub_batches, default=None, metavar="N|auto",
                        help="ours: each attention and MLP block cut into N sub-batches; auto (default): the cost "
                        "model's pick for this CPU and link, N in 1-3 or stock; 1: per-op overlap (stock's bits)")
    parser.add_argument("--overlap-tp-sub-batch-blocks", dest="sub_batch_blocks", choices=("all", "attention", "mlp"),
                        default=None, help="ours: the blocks the sub-batches cut (default: all, or with "
                        "--overlap-tp-sub-batches auto the cost model's pick)")
    parser.add_argument("--cp", type=int, default=None,
                        help="context-parallel size: CP on Megatron's local attention through --overlap-cp")
    parser.add_argument("--overlap-cp", dest="overlap_cp", choices=("ring", "a2a", "hybrid"), default=None)
    parser.add_argument("--overlap-cp-a2a-size", dest="cp_a2a_size", type=int, default=None)
    parser.add_argument("--overlap-hdp", dest="hdp", action="store_true",
                        help="instead: hybrid data parallelism on 4 ranks, a mixed-length batch, per-rank busy "
                        "time of a static CP layout vs the HDP plan (same loss and gradients)")
    parser.add_argument("--overlap-hdp-max-tokens-per-rank", dest="hdp_capacity", type=int, default=None, metavar="C",
                        help="with --overlap-hdp: tokens per rank per micro-batch (default: the demo's)")
    parser.add_argument("--pp", type=int, default=None, metavar="STAGES",
                        help="pipeline demo: the tiny GPT over STAGES ranks, stock 1F1B vs --overlap-pp zb")
    parser.add_argument("--timeline", default=None, metavar="PNG",
                        help="draw one layer's timeline here, result.json beside it (default runs/demo/timeline.png; "
                        "demo --pp: runs/demo/pp_timeline.png)")
    parser.add_argument("--trace", dest="trace_dir", default=None, metavar="DIR",
                        help="also write per-rank Chrome traces of the last step (both modes) to DIR; "
                        "`megatron-overlap report DIR` draws them")
    from .demo_cluster import DEFAULT

    parser.add_argument("--cluster", default=None, metavar="PPxDP",
                        help=f"then pipelines at scale on the emulated cluster, PP stages x DP replicas (default "
                        f"{DEFAULT[0]}x{DEFAULT[1]}: 16 ranks); off: skip")
    parser.add_argument("--micro-batches", dest="cluster_microbatches", type=int, default=None, metavar="M",
                        help=f"micro-batches per step of the emulated cluster (default {DEFAULT[2]})")
    parser.add_argument("--cluster-model", default=None, help="the emulated cluster's model (default llama3-70b)")
    parser.add_argument("--json", action="store_true", help="print one JSON line after the table")
    parser.add_argument("--no-progress", action="store_true")
    from ..args import add_alias, deprecated_action

    for old, new in (("--world", "--ranks"), ("--hdp", "--overlap-hdp"),
                     ("--hdp-max-tokens-per-rank", "--overlap-hdp-max-tokens-per-rank")):
        add_alias(parser, old, new)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS,
                        action=deprecated_action(argparse._StoreAction, "--out DIR", "--timeline DIR/timeline.png"))


def timeline_path(args, name: str = "timeline.png") -> str:
    """Where the demo draws: --timeline, else the deprecated --out DIR's ``name``, else runs/demo's."""
    return args.timeline or os.path.join(args.out or "runs/demo", name)
