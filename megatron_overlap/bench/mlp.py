"""MLP block (Column fc1 -> GeLU -> Row fc2, SP) forward+backward: stock Megatron vs the plugin,
on the same emulated link, in one run.

Each rank runs with one intra-op thread, as many ranks as cores, so a rank that sleeps on an
emulated transfer never lends its core to another. The link is calibrated so that a step's
transfer time equals its compute time (``--comm-ratio 1``): compute is timed by replaying
this rank's GEMMs and activations on local tensors with no communication at all, and the
bytes are counted from one stock step.

Physical limit = max(compute, transfer) per step; stock hides part of its backward
communication already, so about 1.5x over stock is the ceiling at ratio 1.
"""

from __future__ import annotations

import logging
import statistics
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class MLPBench:
    hidden: int = 1024
    ffn: int = 4096
    seq: int = 2048
    micro_batch: int = 1
    tp: int = 2
    steps: int = 10
    warmup: int = 2
    comm_ratio: float = 1.0
    latency_us: float = 20.0
    chunks: int = 0
    rs: str = "ring"
    bidirectional: bool = False
    seed: int = 0


def _build(cfg: MLPBench):
    import torch.nn.functional as F
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLP, MLPSubmodules
    from megatron.core.transformer.transformer_config import TransformerConfig

    from ..testing import tiny_gpt

    tiny_gpt.init_parallel(cfg.tp, seed=cfg.seed + 1)
    config = TransformerConfig(
        num_layers=1,
        hidden_size=cfg.hidden,
        ffn_hidden_size=cfg.ffn,
        num_attention_heads=8,
        tensor_model_parallel_size=cfg.tp,
        sequence_parallel=True,
        use_cpu_initialization=True,
        add_bias_linear=True,
        gated_linear_unit=False,
        activation_func=F.gelu,
        bias_activation_fusion=False,
    )
    return MLP(config, MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear))


def _compute_only_s(mlp, cfg: MLPBench, repeats: int = 3) -> float:
    """This rank's compute of one fwd+bwd step, with no communication: the same GEMM shapes
    on local tensors (the full sequence, this rank's weight shards)."""
    import torch.nn.functional as F

    fc1, fc2 = mlp.linear_fc1, mlp.linear_fc2
    x = torch.randn(cfg.seq, cfg.micro_batch, cfg.hidden, requires_grad=True)
    dy = torch.randn(cfg.seq, cfg.micro_batch, cfg.hidden)
    w1 = fc1.weight.detach().clone().requires_grad_()
    b1 = fc1.bias.detach().clone().requires_grad_()
    w2 = fc2.weight.detach().clone().requires_grad_()
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        h = F.gelu(torch.matmul(x, w1.t()) + b1)
        torch.matmul(h, w2.t()).backward(dy)
        times.append(time.perf_counter() - t0)
        x.grad = w1.grad = b1.grad = w2.grad = None
    return statistics.median(times[1:])


def _rank_main(cfg_dict: dict) -> dict:
    import megatron_overlap
    from megatron_overlap.comm.emulated_link import EmulatedLink, LinkSpec

    cfg = MLPBench(**cfg_dict)
    torch.set_num_threads(1)
    logging.getLogger("megatron_overlap").setLevel(logging.ERROR)  # installs once per step
    megatron_overlap.uninstall()
    mlp = _build(cfg)
    tp = cfg.tp
    torch.manual_seed(cfg.seed + 10 + dist.get_rank())
    x = torch.randn(cfg.seq // tp, cfg.micro_batch, cfg.hidden, requires_grad=True)
    dy = torch.randn(cfg.seq // tp, cfg.micro_batch, cfg.hidden)

    def step():
        mlp.zero_grad(set_to_none=True)
        x.grad = None
        out, bias = mlp(x)
        (out + bias).backward(dy)

    compute_s = _compute_only_s(mlp, cfg)
    parser = megatron_overlap.overlap_parser()
    flags = ["--overlap-tp", "p2p", "--overlap-tp-chunks", str(cfg.chunks), "--overlap-tp-rs", cfg.rs]
    if cfg.bidirectional:
        flags.append("--overlap-tp-bidirectional")
    overlap_args = parser.parse_args(flags)

    # Bytes per step, counted on a free link.
    with EmulatedLink(LinkSpec(bandwidth_GBps=1e6, latency_us=0.0)) as probe:
        step()
        stock_bytes = probe.reset().total_bytes
    # Same link for everyone: take the largest per-rank volume.
    volume = torch.tensor([float(stock_bytes), compute_s])
    dist.all_reduce(volume, op=dist.ReduceOp.MAX)
    bandwidth = volume[0].item() / (volume[1].item() * cfg.comm_ratio) / 1e9
    spec = LinkSpec(bandwidth_GBps=bandwidth, latency_us=cfg.latency_us)

    records = {"stock": [], "overlap": []}
    outputs = {}
    with EmulatedLink(spec) as link:
        for i in range(cfg.warmup + cfg.steps):
            for mode in ("stock", "overlap"):
                if mode == "overlap":
                    megatron_overlap.install(overlap_args)
                dist.barrier()
                link.reset()
                t0 = time.perf_counter()
                step()
                wall = time.perf_counter() - t0
                stats = link.reset()
                if i == 0:
                    outputs[mode] = (x.grad.clone(), mlp.linear_fc1.weight.grad.clone())
                megatron_overlap.uninstall()
                if i >= cfg.warmup:
                    records[mode].append(
                        {"wall_s": wall, "blocked_s": stats.blocked_s, "busy_s": stats.busy_s,
                         "bytes": stats.total_bytes}
                    )
    parity = max(
        ((a - b).norm() / b.norm()).item() for a, b in zip(outputs["overlap"], outputs["stock"])
    )
    return {"compute_s": compute_s, "link": spec.as_dict(), "records": records, "parity": parity}


def run(cfg: MLPBench, progress: bool = True) -> dict:
    """Run the benchmark on ``cfg.tp`` fresh gloo ranks; return the summary dict."""
    from ..testing.rank_pool import RankPool

    with RankPool(cfg.tp, timeout=1800, threads_per_rank=1) as pool:
        per_rank = pool.run(_rank_main, asdict(cfg))
    return summarize(cfg, per_rank)


def summarize(cfg: MLPBench, per_rank: list) -> dict:
    compute_ms = 1e3 * max(r["compute_s"] for r in per_rank)
    result = {"config": asdict(cfg), "link": per_rank[0]["link"], "compute_ms": compute_ms}
    for mode in ("stock", "overlap"):
        steps = len(per_rank[0]["records"][mode])
        wall = [1e3 * max(r["records"][mode][i]["wall_s"] for r in per_rank) for i in range(steps)]
        blocked = [1e3 * statistics.mean(r["records"][mode][i]["blocked_s"] for r in per_rank) for i in range(steps)]
        busy = [1e3 * statistics.mean(r["records"][mode][i]["busy_s"] for r in per_rank) for i in range(steps)]
        nbytes = [max(r["records"][mode][i]["bytes"] for r in per_rank) for i in range(steps)]
        step_ms, comm_ms, exposed_ms = statistics.median(wall), statistics.median(busy), statistics.median(blocked)
        result[mode] = {
            "step_ms": step_ms,
            "step_ms_min": min(wall),
            "step_ms_max": max(wall),
            "comm_ms": comm_ms,
            "exposed_comm_ms": exposed_ms,
            "exposed_fraction": exposed_ms / comm_ms if comm_ms else 0.0,
            "bytes_per_step": int(statistics.median(nbytes)),
        }
    limit = max(compute_ms, result["stock"]["comm_ms"])
    result["limit_ms"] = limit
    result["overlap_vs_limit"] = result["overlap"]["step_ms"] / limit
    result["stock_vs_limit"] = result["stock"]["step_ms"] / limit
    result["speedup"] = result["stock"]["step_ms"] / result["overlap"]["step_ms"]
    result["max_rel_diff_vs_stock"] = max(r["parity"] for r in per_rank)
    return result


def format_table(result: dict) -> str:
    link = result["link"]
    lines = [
        f"MLP block fwd+bwd, hidden {result['config']['hidden']}, ffn {result['config']['ffn']}, "
        f"seq {result['config']['seq']}, TP={result['config']['tp']} + SP, fp32, 1 thread/rank",
        f"link: {link['bandwidth_GBps']:.3f} GB/s egress per rank, {link['latency_us']:.0f} us/message",
        f"compute only {result['compute_ms']:.1f} ms | transfer {result['stock']['comm_ms']:.1f} ms | "
        f"limit max(compute, transfer) {result['limit_ms']:.1f} ms",
        "",
        f"{'':10}{'step ms':>10}{'x limit':>9}{'exposed comm ms':>17}{'hidden':>8}{'MB/step':>9}",
    ]
    for mode in ("stock", "overlap"):
        r = result[mode]
        lines.append(
            f"{mode:10}{r['step_ms']:>10.1f}{r['step_ms'] / result['limit_ms']:>9.2f}"
            f"{r['exposed_comm_ms']:>17.1f}{100 * (1 - r['exposed_fraction']):>7.0f}%"
            f"{r['bytes_per_step'] / 1e6:>9.1f}"
        )
    lines.append(
        f"speedup {result['speedup']:.2f}x over stock; max rel. diff of grads vs stock "
        f"{result['max_rel_diff_vs_stock']:.1e}"
    )
    return "\n".join(lines)
