"""MLP block (Column fc1 -> GeLU -> Row fc2, SP) forward+backward: stock Megatron vs the plugin,
on the same emulated link, in one run.

Each rank runs with one intra-op thread, as many ranks as cores, so a rank that sleeps on an
emulated transfer never lends its core to another. The link is calibrated so that a step's
transfer time equals its compute time (``--comm-ratio 1``): compute is timed by replaying
this rank's GEMMs and activation on local tensors with no communication at all, and the bytes
are counted from one stock step. Every round runs the replay, a stock step and an overlapped
step back to back, so drifts of the machine hit all three alike; the summary takes medians.

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
    steps: int = 12
    warmup: int = 3
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


class _ComputeReplay:
    """This rank's compute of one fwd+bwd step with no communication at all: the same GEMM
    shapes and activation on local tensors (the full sequence, this rank's weight shards)."""

    def __init__(self, mlp, cfg: MLPBench):
        fc1, fc2 = mlp.linear_fc1, mlp.linear_fc2
        self.x = torch.randn(cfg.seq, cfg.micro_batch, cfg.hidden, requires_grad=True)
        self.dy = torch.randn(cfg.seq, cfg.micro_batch, cfg.hidden)
        self.w1 = fc1.weight.detach().clone().requires_grad_()
        self.b1 = fc1.bias.detach().clone().requires_grad_()
        self.w2 = fc2.weight.detach().clone().requires_grad_()

    def __call__(self) -> float:
        import torch.nn.functional as F

        t0 = time.perf_counter()
        h = F.gelu(torch.matmul(self.x, self.w1.t()) + self.b1)
        torch.matmul(h, self.w2.t()).backward(self.dy)
        elapsed = time.perf_counter() - t0
        self.x.grad = self.w1.grad = self.b1.grad = self.w2.grad = None
        return elapsed


class _Session:
    """Per-rank state of one benchmark run."""

    def __init__(self, cfg: MLPBench):
        import megatron_overlap
        from megatron_overlap.comm.emulated_link import EmulatedLink, LinkSpec

        torch.set_num_threads(1)
        logging.getLogger("megatron_overlap").setLevel(logging.ERROR)  # installs once per step
        megatron_overlap.uninstall()
        self.cfg = cfg
        self.mlp = _build(cfg)
        torch.manual_seed(cfg.seed + 10 + dist.get_rank())
        self.x = torch.randn(cfg.seq // cfg.tp, cfg.micro_batch, cfg.hidden, requires_grad=True)
        self.dy = torch.randn(cfg.seq // cfg.tp, cfg.micro_batch, cfg.hidden)
        self.replay = _ComputeReplay(self.mlp, cfg)
        flags = ["--overlap-tp", "p2p", "--overlap-tp-chunks", str(cfg.chunks), "--overlap-tp-rs", cfg.rs]
        if cfg.bidirectional:
            flags.append("--overlap-tp-bidirectional")
        self.overlap_args = megatron_overlap.overlap_parser().parse_args(flags)

        # Bytes per step, counted on a free link; compute from a few replays. Same link for all.
        with EmulatedLink(LinkSpec(bandwidth_GBps=1e6, latency_us=0.0)) as probe:
            self._step()
            nbytes = probe.reset().total_bytes
        self.nbytes = nbytes
        self.spec = self._spec([self.replay() for _ in range(3)])
        self.link = EmulatedLink(self.spec).install()
        self.grads = {}
        self.warm_compute: list = []

    def _spec(self, compute_samples):
        """The link on which this step's bytes take ``comm_ratio`` x its compute time (the
        largest over ranks, so every rank gets the same link)."""
        from megatron_overlap.comm.emulated_link import LinkSpec

        volume = torch.tensor([float(self.nbytes), statistics.median(compute_samples)])
        dist.all_reduce(volume, op=dist.ReduceOp.MAX)
        bandwidth = volume[0].item() / (volume[1].item() * self.cfg.comm_ratio) / 1e9
        return LinkSpec(bandwidth_GBps=bandwidth, latency_us=self.cfg.latency_us)

    def _step(self):
        self.mlp.zero_grad(set_to_none=True)
        self.x.grad = None
        out, bias = self.mlp(self.x)
        (out + bias).backward(self.dy)

    def round(self, index: int, record_spans: bool = False) -> dict:
        """Back to back: the compute-only replay, then stock and overlapped steps on a free link
        (what each costs when communication costs nothing), then both on the emulated link."""
        import megatron_overlap
        from megatron_overlap.comm.emulated_link import LinkSpec

        if index == self.cfg.warmup and self.warm_compute:
            # recalibrate on the warm-up rounds' compute: the first replays run on a colder machine
            self.spec = self.link.spec = self._spec(self.warm_compute)
        record = {"compute_s": self.replay()}
        if index < self.cfg.warmup:
            self.warm_compute.append(record["compute_s"])
        free = LinkSpec(bandwidth_GBps=1e6, latency_us=0.0)
        for mode, spec in (("stock_free", free), ("overlap_free", free), ("stock", self.spec), ("overlap", self.spec)):
            if mode.startswith("overlap"):
                megatron_overlap.install(self.overlap_args)
            self.link.spec = spec
            self.link.record_spans = record_spans and spec is self.spec
            dist.barrier()
            self.link.reset()
            t0 = time.perf_counter()
            self._step()
            t1 = time.perf_counter()
            stats = self.link.reset()
            megatron_overlap.uninstall()
            if index == 0 and mode in ("stock", "overlap"):
                self.grads[mode] = (self.x.grad.clone(), self.mlp.linear_fc1.weight.grad.clone(),
                                    self.mlp.linear_fc2.weight.grad.clone())
            record[mode] = {"wall_s": t1 - t0, "blocked_s": stats.blocked_s, "busy_s": stats.busy_s,
                            "bytes": stats.total_bytes}
            if self.link.record_spans:
                record[mode]["trace"] = {"step": (t0, t1), "link": [(x.start, x.done) for x in stats.spans],
                                         "blocked": list(stats.waits)}
        return record

    def close(self) -> dict:
        self.link.uninstall()
        parity = max(((a - b).norm() / b.norm()).item()
                     for a, b in zip(self.grads["overlap"], self.grads["stock"]))
        return {"link": self.spec.as_dict(), "parity": parity}


_session = None  # rank-side state of the benchmark process


def _setup(cfg_dict: dict):
    global _session
    _session = _Session(MLPBench(**cfg_dict))


def _round(index: int, record_spans: bool = False) -> dict:
    return _session.round(index, record_spans)


def _close() -> dict:
    global _session
    result, _session = _session.close(), None
    return result


def run(cfg: MLPBench, progress: bool = True, timeline_png: str = "") -> dict:
    """Run the benchmark on ``cfg.tp`` fresh gloo ranks (one thread each); return the summary.
    With ``timeline_png``, the last round is traced and drawn there."""
    from tqdm import tqdm

    from ..testing.rank_pool import RankPool

    rounds = []
    with RankPool(cfg.tp, timeout=1800, threads_per_rank=1) as pool:
        bar = tqdm(total=cfg.warmup + cfg.steps, desc="MLP bench (replay, free link, emulated link)", unit="round",
                   disable=not progress)
        pool.run(_setup, asdict(cfg))
        total = cfg.warmup + cfg.steps
        for index in range(total):
            per_rank = pool.run(_round, index, bool(timeline_png) and index == total - 1)
            if index >= cfg.warmup:
                rounds.append(per_rank)
            bar.update(1)
        bar.close()
        closing = pool.run(_close)
    result = summarize(cfg, rounds, closing)
    if timeline_png:
        result["timeline_png"] = draw_timeline(rounds[-1], timeline_png)
    return result


def draw_timeline(per_rank: list, path: str) -> str:
    """Both modes of one round, the whole step, per rank: compute, blocked, link."""
    from .. import timeline

    panels = []
    width = 1e3 * max(r[m]["trace"]["step"][1] - r[m]["trace"]["step"][0] for r in per_rank for m in ("stock", "overlap"))
    for mode, label in (("stock", "stock Megatron"), ("overlap", "megatron-overlap")):
        rows = []
        for rank, r in enumerate(per_rank):
            trace = r[mode]["trace"]
            start, end = trace["step"]
            rows.append((f"rank {rank} compute", "compute",
                         timeline.clip(timeline.subtract((start, end), trace["blocked"]), start, end)))
            rows.append((f"rank {rank} blocked", "blocked", timeline.clip(trace["blocked"], start, end)))
            rows.append((f"rank {rank} link", "link", timeline.clip(trace["link"], start, end)))
        panels.append(timeline.Panel(f"{label}: MLP fwd+bwd", width, rows))
    return timeline.draw(panels, path, title="MLP block (fc1 -> GeLU -> fc2), TP + SP, emulated link", columns=1)


def summarize(cfg: MLPBench, rounds: list, closing: list) -> dict:
    """Medians over rounds; per round, the slowest rank's wall time (a step ends when the last
    rank is done) and the mean over ranks of link time and blocked time."""
    compute_ms = statistics.median(1e3 * max(r["compute_s"] for r in per_rank) for per_rank in rounds)
    result = {"config": asdict(cfg), "link": closing[0]["link"], "compute_ms": compute_ms}
    for mode in ("stock", "overlap"):
        wall = [1e3 * max(r[mode]["wall_s"] for r in per_rank) for per_rank in rounds]
        blocked = [1e3 * statistics.mean(r[mode]["blocked_s"] for r in per_rank) for per_rank in rounds]
        busy = [1e3 * statistics.mean(r[mode]["busy_s"] for r in per_rank) for per_rank in rounds]
        nbytes = [max(r[mode]["bytes"] for r in per_rank) for per_rank in rounds]
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
    for mode in ("stock", "overlap"):
        result[mode]["free_link_step_ms"] = statistics.median(
            1e3 * max(r[f"{mode}_free"]["wall_s"] for r in per_rank) for per_rank in rounds
        )
    limit = max(compute_ms, result["stock"]["comm_ms"])
    result["limit_ms"] = limit
    # The same bound with the program's own compute (stock Megatron on a free link: GEMMs plus
    # framework overhead and the real, un-emulated cost of moving the bytes on this CPU).
    result["program_limit_ms"] = max(result["stock"]["free_link_step_ms"], result["stock"]["comm_ms"])

    # Ratios per round, then the median: each round measures its limit and both steps within
    # seconds of each other, so a machine that speeds up or slows down between rounds (a shared
    # VM does) does not bias them.
    def per_round(numerator, bound):
        ratios = []
        for per_rank in rounds:
            compute = max(r["compute_s"] for r in per_rank)
            transfer = statistics.mean(r["stock"]["busy_s"] for r in per_rank)
            free = max(r["stock_free"]["wall_s"] for r in per_rank)
            step = max(r[numerator]["wall_s"] for r in per_rank)
            ratios.append(step / max(compute if bound == "strict" else free, transfer))
        return statistics.median(ratios)

    result["overlap_vs_limit"] = per_round("overlap", "strict")
    result["stock_vs_limit"] = per_round("stock", "strict")
    result["overlap_vs_program_limit"] = per_round("overlap", "program")
    result["speedup"] = statistics.median(
        max(r["stock"]["wall_s"] for r in per_rank) / max(r["overlap"]["wall_s"] for r in per_rank)
        for per_rank in rounds
    )
    result["max_rel_diff_vs_stock"] = max(c["parity"] for c in closing)
    return result


def format_table(result: dict) -> str:
    link, cfg = result["link"], result["config"]
    lines = [
        f"MLP block fwd+bwd, hidden {cfg['hidden']}, ffn {cfg['ffn']}, seq {cfg['seq']}, "
        f"TP={cfg['tp']} + SP, fp32, 1 thread/rank, {cfg['steps']} rounds (medians)",
        f"link: {link['bandwidth_GBps']:.4f} GB/s egress per rank, {link['latency_us']:.0f} us/message "
        f"(transfers = {cfg['comm_ratio']:g} x compute)",
        f"compute only {result['compute_ms']:.1f} ms | transfer {result['stock']['comm_ms']:.1f} ms | "
        f"limit = max(compute, transfer) {result['limit_ms']:.1f} ms",
        "",
        f"{'':18}{'free link':>10}{'emulated':>10}{'x limit':>9}{'exposed comm':>14}{'hidden':>8}{'MB/step':>9}",
    ]
    for mode, label in (("stock", "stock Megatron"), ("overlap", "megatron-overlap")):
        r = result[mode]
        lines.append(
            f"{label:18}{r['free_link_step_ms']:>10.1f}{r['step_ms']:>10.1f}"
            f"{result[mode + '_vs_limit']:>9.2f}{r['exposed_comm_ms']:>14.1f}"
            f"{100 * (1 - r['exposed_fraction']):>7.0f}%{r['bytes_per_step'] / 1e6:>9.1f}"
        )
    lines += [
        "",
        "(x limit, speedup: medians of per-round ratios)",
        f"speedup {result['speedup']:.2f}x over stock on the emulated link; "
        f"{result['overlap_vs_limit']:.2f}x the limit "
        f"({result['overlap_vs_program_limit']:.2f}x when compute is stock's own free-link step); "
        f"max rel. diff of grads vs stock {result['max_rel_diff_vs_stock']:.1e}",
    ]
    if result.get("timeline_png"):
        lines.append(f"timeline: {result['timeline_png']}")
    return "\n".join(lines)
