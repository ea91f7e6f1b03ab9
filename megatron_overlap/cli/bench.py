"""Command-line front ends of the benchmarks."""

from __future__ import annotations

import argparse
import json

from .bench_mlp import MLPBench, format_table, run


def add_mlp_args(parser: argparse.ArgumentParser, layer: bool = False):
    d = MLPBench()
    parser.set_defaults(block="layer" if layer else "mlp")
    if layer:
        parser.add_argument("--heads", type=int, default=d.heads)
    parser.add_argument("--hidden", type=int, default=d.hidden)
    parser.add_argument("--ffn", type=int, default=d.ffn)
    parser.add_argument("--seq", type=int, default=d.seq)
    parser.add_argument("--micro-batch", type=int, default=d.micro_batch)
    parser.add_argument("--tp", type=int, default=d.tp, help="ranks (one per core is the fair setting)")
    parser.add_argument("--steps", type=int, default=d.steps, help="timed steps per mode")
    parser.add_argument("--warmup", type=int, default=d.warmup)
    parser.add_argument("--comm-ratio", type=float, default=d.comm_ratio,
                        help="link calibrated so transfer time = ratio x compute time")
    parser.add_argument("--latency-us", type=float, default=d.latency_us)
    parser.add_argument("--overlap-tp-chunks", dest="chunks", type=int, default=d.chunks)
    parser.add_argument("--overlap-tp-rs", dest="rs", choices=("ring", "a2a"), default=d.rs)
    parser.add_argument("--overlap-tp-bidirectional", dest="bidirectional", action="store_true")
    parser.add_argument("--overlap-tp-sub-batches", dest="sub_batches", type=int, default=d.sub_batches, metavar="N",
                        help="also run per-op overlap with each attention and MLP block cut into N sub-batches, in "
                        "the same rounds")
    parser.add_argument("--no-sequence-parallel", dest="sequence_parallel", action="store_false",
                        help="tensor parallelism without sequence parallelism: stock all-reduces the Row outputs "
                        "and the Column input gradients; the plugin runs its all-reduce path")
    parser.add_argument("--overlap-tp-allreduce-fusion", dest="allreduce_fusion", action="store_true",
                        help="with --no-sequence-parallel: also per-op overlap with --overlap-tp-allreduce-fusion "
                        "(the attention output's all-reduce, bias, dropout and residual as reduce-scatter, work on "
                        "the shard, all-gather feeding the next norm and GEMM), in the same rounds")
    parser.add_argument("--gradient-accumulation-fusion", dest="grad_accum_fusion", action="store_true",
                        help="Megatron's gradient_accumulation_fusion (its default where apex exists), for stock and "
                        "plugin alike: weight gradients accumulated into main_grad, which lets the plugin run a "
                        "weight-gradient GEMM while a later transfer travels (CPU: apex's kernel replaced by a "
                        "matmul and an add)")
    parser.add_argument("--json", action="store_true", help="print one JSON line after the table")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--timeline", default="", metavar="PNG", help="draw the last round's timeline here")
    from ..args import add_alias

    add_alias(parser, "--sub-batches", "--overlap-tp-sub-batches")
    parser.add_argument("--predict", action="store_true",
                        help="after the run, time this CPU's GEMM shapes (one thread) and print the cost "
                        "model's prediction of both step times beside the measurement")


def check_mlp(cfg, command: str) -> None:
    """The bench's arguments, before its ranks start (``cli/arg_checks.py``)."""
    from .arg_checks import amounts, counts, tp_chunks

    counts(command, tp=(cfg.tp, 2), seq=(cfg.seq, 1), hidden=(cfg.hidden, 1), ffn=(cfg.ffn, 1),
           micro_batch=(cfg.micro_batch, 1), steps=(cfg.steps, 1), warmup=(cfg.warmup, 0),
           overlap_tp_sub_batches=(cfg.sub_batches, 1), heads=(cfg.heads, 1), overlap_tp_chunks=(cfg.chunks, 0))
    amounts(command, ("comm_ratio",), comm_ratio=cfg.comm_ratio, latency_us=cfg.latency_us)
    if cfg.seq % cfg.tp and (cfg.sequence_parallel or cfg.allreduce_fusion):
        raise SystemExit(f"{command}: --seq {cfg.seq} does not split over --tp {cfg.tp} ("
                         + ("sequence parallelism)" if cfg.sequence_parallel else "the all-reduce fusion's shards)"))
    if cfg.allreduce_fusion and cfg.sequence_parallel:
        raise SystemExit(f"{command}: --overlap-tp-allreduce-fusion splits the all-reduces of TP without sequence parallelism; "
                         "add --no-sequence-parallel")
    if cfg.bidirectional and not cfg.sequence_parallel:
        raise SystemExit(f"{command}: --overlap-tp-bidirectional splits ring transfers; without sequence "
                         "parallelism the linears all-reduce: drop it")
    if cfg.block == "layer" and (cfg.hidden % cfg.heads or cfg.heads % cfg.tp):
        raise SystemExit(f"{command}: --hidden {cfg.hidden} must be a multiple of --heads {cfg.heads}, and the heads "
                         f"of --tp {cfg.tp}")
    tp_chunks(command, cfg.chunks, cfg.tp, cfg.rows)


def mlp_main(args) -> int:
    fields = MLPBench.__dataclass_fields__
    cfg = MLPBench(**{k: getattr(args, k) for k in fields if hasattr(args, k)})
    check_mlp(cfg, f"megatron-overlap bench {cfg.block}")
    if args.predict and cfg.block != "mlp":
        raise SystemExit("megatron-overlap bench layer: --predict models the MLP block only; drop it")
    if args.predict and not cfg.sequence_parallel:
        raise SystemExit(f"megatron-overlap bench {cfg.block}: --predict models sequence parallelism only; drop it "
                         "(`megatron-overlap plan --no-sequence-parallel` prices the all-reduce path)")
    result = run(cfg, progress=not args.no_progress, timeline_png=args.timeline)
    print(format_table(result))
    if args.predict:
        from ..tune.bench_predict import compare, predict_mlp_bench
        from ..tune.measure_cpu import measure

        rates = measure(cfg.hidden, cfg.ffn, cfg.seq, cfg.tp)
        print("\ncost model (tune/bench_predict.py) given this run's link and compute, and these GEMM rates:")
        print(compare(result, rates))
        predicted = predict_mlp_bench(result, rates)
        result["prediction"] = {k: v for k, v in predicted.items() if not k.endswith("_result")}
    if args.json:
        print(json.dumps(result))
    return 0


def add_attention_args(parser: argparse.ArgumentParser):
    from .bench_attention import AttentionBench

    d = AttentionBench()
    parser.add_argument("--cp", type=int, default=d.cp, help="ring size = ranks (one per core is the fair setting)")
    parser.add_argument("--seq", type=int, default=d.seq, help="whole sequence; each rank holds seq / cp rows")
    parser.add_argument("--heads", type=int, default=d.heads)
    parser.add_argument("--kv-heads", type=int, default=d.kv_heads)
    parser.add_argument("--head-dim", type=int, default=d.head_dim)
    parser.add_argument("--micro-batch", type=int, default=d.micro_batch)
    parser.add_argument("--no-causal", dest="causal", action="store_false", help="attention without a mask")
    parser.add_argument("--steps", type=int, default=d.steps, help="timed rounds")
    parser.add_argument("--warmup", type=int, default=d.warmup)
    parser.add_argument("--comm-ratio", type=float, default=d.comm_ratio,
                        help="link calibrated so one K/V block's transfer = ratio x one block's forward")
    parser.add_argument("--latency-us", type=float, default=d.latency_us)
    parser.add_argument("--json", action="store_true", help="print one JSON line after the table")
    parser.add_argument("--no-progress", action="store_true")


def attention_main(args) -> int:
    from .bench_attention import AttentionBench, format_table, run

    from .arg_checks import amounts, counts

    fields = AttentionBench.__dataclass_fields__
    command = "megatron-overlap bench attention"
    counts(command, cp=(args.cp, 2), seq=(args.seq, 1), heads=(args.heads, 1), kv_heads=(args.kv_heads, 1),
           head_dim=(args.head_dim, 1), micro_batch=(args.micro_batch, 1), steps=(args.steps, 1),
           warmup=(args.warmup, 0))
    amounts(command, ("comm_ratio",), comm_ratio=args.comm_ratio, latency_us=args.latency_us)
    try:
        cfg = AttentionBench(**{k: getattr(args, k) for k in fields if hasattr(args, k)})
    except ValueError as exc:
        print(f"megatron-overlap bench attention: {exc}", file=__import__("sys").stderr)
        return 2
    result = run(cfg, progress=not args.no_progress)
    print(format_table(result))
    if args.json:
        print(json.dumps(result))
    return 0
