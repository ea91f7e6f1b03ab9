"""Entry point of the ``megatron-overlap`` command."""

from __future__ import annotations

import argparse
import os
import sys


# The commands of the plugin itself: their arguments are built without importing the lab, the
# benches or the demo (tests/test_layout.py checks what ``run`` loads).
PLUGIN_COMMANDS = ("run", "check", "report")


def _parser(only: str | None = None) -> argparse.ArgumentParser:
    """The command line; with ``only`` one of ``PLUGIN_COMMANDS``, the other commands are named
    (for ``--help``) without their arguments, whose modules are left unimported."""
    parser = argparse.ArgumentParser(
        prog="megatron-overlap",
        description="Hide the communication of Megatron-LM's 4D parallelism behind its compute, switched on by "
        "flags on pretrain_gpt.py: tensor parallelism (--overlap-tp: the sequence-parallel all-gathers and "
        "reduce-scatters behind the GEMMs they feed, chunked rings or fused kernels, --overlap-tp-sub-batches); "
        "context parallelism on Megatron's local attention (--overlap-cp ring, a2a, hybrid; packed documents); "
        "hybrid data parallelism (--overlap-hdp: each long sequence on a ring of the fewest ranks that hold it, work "
        "balanced across the data-parallel ranks); pipeline schedules (--overlap-pp 1f1b, zb, zbv: transfers "
        "posted early, zero bubble, the data-parallel sync in the bubbles). Stock Megatron's numerics: bit for bit, or "
        "within fp32 rounding where docs/ says so.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser(
        "run",
        help="run a Megatron-LM training script (e.g. pretrain_gpt.py) with the plugin's flags",
        description="Run SCRIPT with ARGS; the --overlap-* flags join Megatron's parser and the "
        "patches are installed right after parsing. Under torchrun: "
        "torchrun ... -m megatron_overlap run pretrain_gpt.py ...",
    )
    run.add_argument("script")
    run.add_argument("args", nargs=argparse.REMAINDER)

    if only in PLUGIN_COMMANDS:
        for name, text in _OTHER_COMMANDS:
            sub.add_parser(name, help=text)
    else:
        _add_other_commands(sub)

    report = sub.add_parser("report", help="summarize and draw the traces of --overlap-trace / demo --trace")
    report.add_argument("directory")
    report.add_argument("--timeline", default="", metavar="PNG", help="draw the timeline here (default: "
                        "DIR/timeline.png)")
    from ..args import add_alias

    add_alias(report, "--png", "--timeline")

    check = sub.add_parser("check", help="print versions and which backends are usable here")
    check.add_argument("--json", action="store_true", help="one JSON object instead of text")
    return parser


_OTHER_COMMANDS = (
    ("demo", "the CPU demo: stock vs overlapped training on an emulated link"),
    ("bench", "benchmarks"),
    ("floor", "the shortest pipeline step any schedule can reach for given F/B/W times, link and memory "
              "(CP-SAT; simulated)"),
    ("plan", "rank the strategies (TP overlap, sub-batches, pipeline schedules) for a model on a machine (cost model)"),
)


def _add_other_commands(sub) -> None:
    """The lab's commands: the demo, the benches, the floor and the planner."""
    texts = dict(_OTHER_COMMANDS)
    from .demo import add_demo_args

    add_demo_args(sub.add_parser("demo", help=texts["demo"]))

    bench = sub.add_parser("bench", help=texts["bench"])
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    from .bench import add_mlp_args

    add_mlp_args(bench_sub.add_parser("mlp", help="MLP block fwd+bwd, stock vs overlap, emulated link"))
    add_mlp_args(bench_sub.add_parser("layer", help="one whole transformer layer (attention included) fwd+bwd, "
                                      "stock vs overlap (vs sub-batches), emulated link"), layer=True)
    from .bench import add_attention_args

    add_attention_args(bench_sub.add_parser(
        "attention", help="ring attention fwd+bwd (context parallelism), overlapped vs waited, emulated link"))
    from .bench_pp import add_pp_args

    add_pp_args(bench_sub.add_parser(
        "pp", help="pipeline schedules (PP stages, one rank each): stock 1F1B vs ours, emulated link"))
    from .bench_cp import add_cp_args

    add_cp_args(bench_sub.add_parser(
        "cp", help="context parallelism (ring, all-to-all, hybrid, the waited ring) on a long sequence: simulated, "
        "or measured on the emulated cluster (--emulate)"))
    from .bench_hdp import add_hdp_args

    add_hdp_args(bench_sub.add_parser(
        "hdp", help="hybrid data parallelism: static CP vs megatron-core's balanced scheduler vs HDP (cost model)"))

    from .floor import add_floor_args

    add_floor_args(sub.add_parser("floor", help=texts["floor"]))

    from .plan_command import add_plan_args

    add_plan_args(sub.add_parser("plan", help=texts["plan"]))


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = _parser(only=next((a for a in argv if not a.startswith("-")), None)).parse_args(argv)
    if args.command not in PLUGIN_COMMANDS:  # the lab's rank pools fork only without tqdm's monitor thread
        from ..lab.rank_pool import no_bar_thread

        no_bar_thread()
    if args.command == "run":
        from ..integration.launch import LaunchError, run_script

        try:
            run_script(args.script, args.args)
        except LaunchError as exc:
            print(exc, file=sys.stderr)
            return 2
        return 0
    if args.command == "check":
        from .env_report import main as check_main

        return check_main(args.json)
    if args.command == "floor":
        from .floor import floor_main

        return floor_main(args)
    if args.command == "plan":
        from .plan_command import plan_main

        return plan_main(args)
    if args.command == "report":
        from ..trace.report import report

        try:
            table, png = report(args.directory, args.timeline or os.path.join(args.directory, "timeline.png"))
        except FileNotFoundError as exc:
            print(exc, file=sys.stderr)
            return 2
        print(table)
        print(f"timeline: {png}")
        return 0
    if args.command == "demo":
        from .demo import main as demo_main

        return demo_main(args)
    if args.command == "bench" and args.bench == "pp":
        from .bench_pp import pp_main

        return pp_main(args)
    if args.command == "bench" and args.bench == "cp":
        from .bench_cp import cp_main

        return cp_main(args)
    if args.command == "bench" and args.bench == "hdp":
        return _bench_hdp(args)
    if args.command == "bench" and args.bench == "attention":
        from .bench import attention_main

        return attention_main(args)
    if args.command == "bench" and args.bench in ("mlp", "layer"):
        from .bench import mlp_main

        return mlp_main(args)
    raise AssertionError(args)


def _bench_hdp(args) -> int:
    """``bench hdp``: the emulated cluster (``--emulate``), the sweep (``--sweep``) or one batch set."""
    if args.pp != 1 and not args.emulate:
        raise SystemExit("megatron-overlap bench hdp: --pp runs HDP's pipeline mode on the emulated cluster: add --emulate")
    if args.emulate and args.pp != 1:
        from .bench_hdp_pipeline import pipeline_main

        return pipeline_main(args)
    if args.emulate:
        from .bench_hdp_emulate import emulate_main

        return emulate_main(args)
    args.ranks = args.ranks or 64
    if args.sweep:
        from .bench_hdp_sweep import sweep_main

        return sweep_main(args)
    from .bench_hdp import hdp_main

    return hdp_main(args)


if __name__ == "__main__":
    sys.exit(main())

