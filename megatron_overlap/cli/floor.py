"""``megatron-overlap floor``: the shortest pipeline step any schedule can reach for given F, B,
W times per stage, link and memory (``pp/optimal.py``, proved by CP-SAT), beside what our
schedules and Megatron's 1F1B reach in the simulator. Simulated: the model's assumptions are in
``pp/optimal.py``."""

from __future__ import annotations

import argparse
import json
import sys


def _times(text: str):
    from ..pp.schedule_sim import StageTimes

    try:
        f, b, w = (float(x) for x in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: a stage's times are F/B/W in ms, e.g. 118.6/120.4/102.9")
    if min(f, b, w) <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: F, B and W must be positive")
    return StageTimes(f, b, w)


def _piece(text: str):
    try:
        ms, share = (float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: a piece of W is MS,SHARE, e.g. 15,0.07")
    return ms, share


def add_floor_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--times", type=_times, nargs="+", required=True, metavar="F/B/W",
                        help="ms per micro-batch, one F/B/W per stage (or one for every stage, with --stages)")
    parser.add_argument("--stages", type=int, default=0, help="stages, when one --times serves them all")
    parser.add_argument("--micro-batches", dest="microbatches", type=int, default=8, metavar="M",
                        help="micro-batches per step")
    parser.add_argument("--transfer-ms", type=float, default=0.0, help="one activation (or gradient) on the wire")
    parser.add_argument("--latency-ms", type=float, default=0.0)
    parser.add_argument("--memory", type=float, default=1.0,
                        help="activations a stage may hold, as a multiple of 1F1B's peak (p on stage 0)")
    parser.add_argument("--w-share", type=float, default=0.5, help="the part of an activation a pending W holds")
    parser.add_argument("--piece", type=_piece, default=None, metavar="MS,SHARE",
                        help="let a piece of W of MS ms, holding SHARE of an activation, run apart from the rest")
    parser.add_argument("--time-limit", type=float, default=60.0, help="solver seconds")
    parser.add_argument("--json", action="store_true")
    from ..args import add_alias

    add_alias(parser, "--microbatches", "--micro-batches")
    return parser


def compare(times, microbatches: int, transfer_ms: float, latency_ms: float, memory: float, w_share: float,
            piece=None, time_limit_s: float = 60.0) -> dict:
    """The floors, split (zero-bubble family) and not, at ``memory`` x 1F1B's peak, and the
    simulated steps of Megatron's 1F1B and of ours for the same times."""
    from ..pp import build
    from ..pp.optimal import floor
    from ..pp.schedule_sim import LinkCost, simulate

    p, m = len(times), microbatches
    link = LinkCost(transfer_ms=transfer_ms, latency_ms=latency_ms)
    cap = memory * p
    out = {"stages": p, "microbatches": m, "memory_activations": cap, "schedules": {}}
    for name, kw in (("floor, B/W split", {"split": True, "piece": piece}), ("floor, B and W together", {"split": False})):
        f = floor(times, m, transfer_ms, latency_ms, memory=cap, w_share=w_share, time_limit_s=time_limit_s, **kw)
        out["schedules"][name] = {"step_ms": f.step_ms, "bound_ms": f.bound_ms, "optimal": f.optimal,
                                  "bubble": f.bubble_floor, "orders": f.orders}
    for name, kind in (("stock Megatron 1F1B", "megatron"), ("1f1b (async P2P)", "1f1b"), ("zb (ZB-H1)", "zb")):
        sim = simulate(build(kind, p, m), times, link)
        out["schedules"][name] = {"step_ms": sim.step_ms, "bubble": sim.bubble}
    stock = out["schedules"]["stock Megatron 1F1B"]["bubble"]
    for r in out["schedules"].values():
        r["bubble_vs_stock"] = r["bubble"] / stock if stock else None
    return out


def format_floor(result: dict) -> str:
    lines = [f"PP={result['stages']}, m={result['microbatches']}, at most {result['memory_activations']:g} "
             "activations per stage (simulated; pp/optimal.py's model)", "",
             f"{'':28}{'step ms':>10}{'bubble':>8}{'x stock':>9}"]
    for name, r in result["schedules"].items():
        mark = "" if r.get("optimal", True) else f"  (best found; proved >= {r['bound_ms']:.1f} ms)"
        lines.append(f"{name:28}{r['step_ms']:>10.1f}{100 * r['bubble']:>7.1f}%{r['bubble_vs_stock']:>8.2f}x{mark}")
    lines.append("floor: no schedule of the model is shorter (CP-SAT, proved unless marked); stock and ours: "
                 "their schedules simulated (pp/schedule_sim.py)")
    return "\n".join(lines)


def floor_main(args) -> int:
    from .arg_checks import amounts, counts

    counts("floor", stages=(args.stages, 0), micro_batches=(args.microbatches, 1))
    amounts("floor", ("memory", "time_limit"), transfer_ms=args.transfer_ms, latency_ms=args.latency_ms,
            memory=args.memory, w_share=args.w_share, time_limit=args.time_limit)
    if args.w_share > 1:
        raise SystemExit(f"floor: --w-share is the part of an activation a pending W holds, in 0 .. 1; got "
                         f"{args.w_share:g}")
    times = list(args.times)
    if args.stages:
        if len(times) != 1:
            print("floor: --stages takes one --times for every stage", file=sys.stderr)
            return 2
        times = times * args.stages
    if len(times) < 2:
        print("floor: a pipeline has >= 2 stages: give one --times per stage, or --stages", file=sys.stderr)
        return 2
    if args.memory < 1:
        print(f"floor: --memory {args.memory:g} is below 1F1B's own peak (1.0)", file=sys.stderr)
        return 2
    try:
        result = compare(times, args.microbatches, args.transfer_ms, args.latency_ms, args.memory, args.w_share,
                         args.piece, args.time_limit)
    except (ImportError, ValueError) as exc:
        print(f"floor: {exc}", file=sys.stderr)
        return 2
    print(format_floor(result))
    if args.json:
        print(json.dumps(result))
    return 0
