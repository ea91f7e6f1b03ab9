"""``megatron-overlap plan``: which overlap strategy to use, before booking the cluster."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace

from ..tune.hardware import HARDWARE, get_hardware
from ..tune.models import MODELS, ModelSpec, RunSpec, get_model

_DIMS = ("hidden", "ffn", "heads", "kv_heads", "layers", "vocab")


def add_plan_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--model", choices=sorted(MODELS), help="a known architecture (dims below override it)")
    for dim in _DIMS:
        parser.add_argument(f"--{dim.replace('_', '-')}", dest=dim, type=int, help=f"model {dim.replace('_', ' ')}")
    parser.add_argument("--gelu", action="store_true", help="custom model: GeLU MLP instead of SwiGLU")
    parser.add_argument("--hardware", choices=sorted(HARDWARE), default="h100-sxm")
    parser.add_argument("--tp", type=int, default=8)
    parser.add_argument("--cp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--dp", type=int, default=1)
    parser.add_argument("--no-sequence-parallel", dest="sequence_parallel", action="store_false",
                        help="tensor parallelism without sequence parallelism: stock all-reduces the Row outputs and "
                        "the Column input gradients (exposed or beside a wgrad); the plugin's all-reduce path, "
                        "sub-batches and all-reduce fusion are priced against it")
    parser.add_argument("--seq", type=int, help="sequence length (decode: cached tokens); default: the model's")
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--micro-batches", type=int,
                        help="micro-batches per step (training); default 1, or 2 x PP with pipelining")
    parser.add_argument("--inference", action="store_true",
                        help="inference: one decode step (1 new token per sequence), unless --prefill")
    parser.add_argument("--prefill", action="store_true", help="with --inference: the prompt pass over --seq tokens")
    parser.add_argument("--json", action="store_true", help="print JSON instead of the table")
    parser.add_argument("--timeline", metavar="PNG", default="", help="draw one layer, stock vs best, here")
    parser.add_argument("--published", action="store_true",
                        help="print the published-vs-predicted table (other options ignored)")
    return parser


def model_from_args(args) -> ModelSpec:
    if args.model:
        base = get_model(args.model)
        overrides = {d: getattr(args, d) for d in _DIMS if getattr(args, d) is not None}
        if args.gelu:
            overrides["gated"] = False
        return replace(base, name=base.name + (" (modified)" if overrides else ""), **overrides)
    missing = [f"--{d.replace('_', '-')}" for d in _DIMS if getattr(args, d) is None and d != "kv_heads"]
    if missing:
        raise SystemExit(f"plan: give --model or all of {', '.join(missing)}")
    return ModelSpec("custom", args.hidden, args.ffn, args.heads, args.kv_heads or args.heads, args.layers,
                     args.vocab, args.seq or 4096, gated=not args.gelu)


def run_from_args(args, model: ModelSpec) -> RunSpec:
    if args.prefill and not args.inference:
        raise SystemExit("plan: --prefill needs --inference")
    phase = ("prefill" if args.prefill else "decode") if args.inference else "train"
    micro_batches = args.micro_batches or (2 * args.pp if args.pp > 1 else 1)
    return RunSpec(tp=args.tp, cp=args.cp, pp=args.pp, dp=args.dp, seq=args.seq or model.seq,
                   micro_batch=args.micro_batch, micro_batches=micro_batches if phase == "train" else 1, phase=phase,
                   sequence_parallel=getattr(args, "sequence_parallel", True))


def plan_main(args) -> int:
    from ..tune.strategy_ranking import draw_plan_timeline, format_plan, make_plan, plan_json

    if args.published:
        from ..tune.published import published_table

        print(published_table())
        return 0
    from .arg_checks import counts

    counts("plan", tp=(args.tp, 1), cp=(args.cp, 1), pp=(args.pp, 1), dp=(args.dp, 1),
           micro_batch=(args.micro_batch, 1), **{d: (getattr(args, d), 1) for d in _DIMS + ("seq", "micro_batches")
                                                 if getattr(args, d) is not None})
    try:
        model = model_from_args(args)
        run = run_from_args(args, model)
    except ValueError as exc:
        raise SystemExit(f"plan: {exc}") from None
    from ..tune.strategy_ranking import UnbuildableError

    try:
        plan = make_plan(model, run, get_hardware(args.hardware))
    except UnbuildableError as exc:  # before anything is simulated: name the flag to change
        flag = {"megatron.tensor_model_parallel_size": "--tp", "megatron.seq_length": "--seq"}.get(exc.field, "--tp")
        raise SystemExit(f"plan: {flag}: {exc.reason}") from None
    if args.timeline:
        draw_plan_timeline(plan, args.timeline)
    if args.json:
        out = plan_json(plan)
        if args.timeline:
            out["timeline_png"] = args.timeline
        print(json.dumps(out))
    else:
        print(format_plan(plan))
        if args.timeline:
            print(f"timeline: {args.timeline}")
    return 0


def main(argv=None) -> int:
    parser = add_plan_args(argparse.ArgumentParser(prog="megatron-overlap plan", description=__doc__))
    return plan_main(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
