"""The rank side of ``megatron-overlap bench mlp`` (driver: ``cli/bench_mlp.py``): Megatron's MLP
block (Column fc1 -> GeLU -> Row fc2, SP or, with ``sequence_parallel=False``, all-reduces), the
compute replay that is the limit's compute, and one round (replay, stock and plugin on a free
link, both on the emulated link) per call."""

from __future__ import annotations

import logging
import statistics
import time
from dataclasses import dataclass

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
    sub_batches: int = 1  # > 1: also per-op overlap with the block cut into this many sub-batches
    block: str = "mlp"  # or "layer": a whole transformer layer (lab/layer_bench.py)
    heads: int = 8
    seed: int = 0
    sequence_parallel: bool = True  # False: TP with all-reduces (the plugin's all-reduce path)
    allreduce_fusion: bool = False  # without SP: also per-op overlap with --overlap-tp-allreduce-fusion
    # Megatron's gradient_accumulation_fusion (its default where apex exists): weight gradients
    # accumulated into main_grad, which lets the plugin hold a wgrad GEMM back while a transfer travels
    grad_accum_fusion: bool = False

    @property
    def modes(self) -> tuple:
        return ("stock", "overlap") + (("sub",) if self.sub_batches > 1 else ()) + (
            ("fusion",) if self.allreduce_fusion else ())

    @property
    def rows(self) -> int:
        """Sequence rows each rank's block takes: its shard with SP, else the whole sequence."""
        return self.seq // self.tp if self.sequence_parallel else self.seq


def _build(cfg: MLPBench):
    import torch.nn.functional as F
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLP, MLPSubmodules
    from megatron.core.transformer.transformer_config import TransformerConfig

    from . import tiny_gpt

    tiny_gpt.init_parallel(cfg.tp, seed=cfg.seed + 1)
    config = TransformerConfig(
        num_layers=1,
        hidden_size=cfg.hidden,
        ffn_hidden_size=cfg.ffn,
        num_attention_heads=8,
        tensor_model_parallel_size=cfg.tp,
        sequence_parallel=cfg.sequence_parallel,
        use_cpu_initialization=True,
        add_bias_linear=True,
        gated_linear_unit=False,
        activation_func=F.gelu,
        bias_activation_fusion=False,
        gradient_accumulation_fusion=cfg.grad_accum_fusion,
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
        y = torch.matmul(h, self.w2.t())
        self.forward_s = time.perf_counter() - t0
        y.backward(self.dy)
        elapsed = time.perf_counter() - t0
        self.x.grad = self.w1.grad = self.b1.grad = self.w2.grad = None
        return elapsed


class MLPBenchRanks:
    """Per-rank state of one benchmark run (through ``lab.session``)."""

    def __init__(self, cfg):
        cfg = MLPBench(**cfg) if isinstance(cfg, dict) else cfg
        import megatron_overlap
        from .emulated_link import EmulatedLink, LinkSpec

        torch.set_num_threads(1)
        logging.getLogger("megatron_overlap").setLevel(logging.ERROR)  # installs once per step
        megatron_overlap.uninstall()
        self.cfg = cfg
        from . import layer_bench

        self.mlp = _build(cfg) if cfg.block == "mlp" else layer_bench.build_layer(cfg)
        # with SP each rank holds its own rows; without it the block's input (and its gradient) is
        # replicated over the TP group, as Megatron's layers assume
        torch.manual_seed(cfg.seed + 10 + (dist.get_rank() if cfg.sequence_parallel else 0))
        self.x = torch.randn(cfg.rows, cfg.micro_batch, cfg.hidden, requires_grad=True)
        self.dy = torch.randn(cfg.rows, cfg.micro_batch, cfg.hidden)
        self.replay = _ComputeReplay(self.mlp, cfg) if cfg.block == "mlp" else layer_bench.LayerReplay(self.mlp, cfg)
        self.mask = layer_bench.causal_mask(cfg.seq)
        flags = ["--overlap-tp", "p2p", "--overlap-tp-chunks", str(cfg.chunks)]
        if cfg.sequence_parallel:  # without SP there is no reduce-scatter to choose (but the fusion's)
            flags += ["--overlap-tp-rs", cfg.rs]
        if cfg.bidirectional:
            flags.append("--overlap-tp-bidirectional")
        parse = megatron_overlap.overlap_parser().parse_args
        self.args = {"overlap": parse(flags), "sub": parse(flags + ["--overlap-tp-sub-batches", str(cfg.sub_batches)]),
                     "fusion": parse(flags + ["--overlap-tp-rs", cfg.rs, "--overlap-tp-allreduce-fusion"])}

        # Bytes per step, counted on a free link; compute from a few replays. Same link for all.
        with EmulatedLink(LinkSpec(bandwidth_GBps=1e6, latency_us=0.0)) as probe:
            self._step(after_forward=lambda: self.__dict__.update(forward_bytes=probe.reset().total_bytes))
            nbytes = self.forward_bytes + probe.reset().total_bytes
        self.nbytes = nbytes
        self.spec = self._spec([self.replay() for _ in range(3)])
        self.link = EmulatedLink(self.spec).install()
        self.grads = {}
        self.warm_compute: list = []

    def _spec(self, compute_samples):
        """The link on which this step's bytes take ``comm_ratio`` x its compute time (the
        largest over ranks, so every rank gets the same link)."""
        from .emulated_link import LinkSpec

        volume = torch.tensor([float(self.nbytes), statistics.median(compute_samples)])
        dist.all_reduce(volume, op=dist.ReduceOp.MAX)
        bandwidth = volume[0].item() / (volume[1].item() * self.cfg.comm_ratio) / 1e9
        return LinkSpec(bandwidth_GBps=bandwidth, latency_us=self.cfg.latency_us)

    def _step(self, after_forward=None):
        self.mlp.zero_grad(set_to_none=True)
        self.x.grad = None
        if self.cfg.grad_accum_fusion:  # as Megatron's DDP hands them to the linears: fp32, zeroed each step
            for p in self.mlp.parameters():
                p.main_grad = torch.zeros_like(p, dtype=torch.float32)
                p.grad_added_to_main_grad = False
        if self.cfg.block == "mlp":
            out, bias = self.mlp(self.x)
            y = out + bias
        else:
            y, _context = self.mlp(self.x, attention_mask=self.mask)
        if after_forward is not None:
            after_forward()
        y.backward(self.dy)

    def round(self, index: int, record_spans: bool = False) -> dict:
        """Back to back: the compute-only replay, then stock and overlapped steps on a free link
        (what each costs when communication costs nothing), then both on the emulated link."""
        import megatron_overlap
        from .emulated_link import LinkSpec

        if index == self.cfg.warmup and self.warm_compute:
            # recalibrate on the warm-up rounds' compute: the first replays run on a colder machine
            self.spec = self.link.spec = self._spec(self.warm_compute)
        record = {"compute_s": self.replay(), "compute_forward_s": self.replay.forward_s,
                  "compute_attention_s": getattr(self.replay, "attention_s", 0.0),
                  "compute_pre_attention_s": getattr(self.replay, "pre_attention_s", 0.0),
                  "forward_bytes_share": self.forward_bytes / self.nbytes}
        if index < self.cfg.warmup:
            self.warm_compute.append(record["compute_s"])
        free = LinkSpec(bandwidth_GBps=1e6, latency_us=0.0)
        # which mode runs first rotates per round (a drifting VM hits all alike; two modes alternate)
        modes = self.cfg.modes
        turn = [modes[(index + k) % len(modes)] for k in range(len(modes))]
        order = [(f"{m}_free", free) for m in turn] + [(m, self.spec) for m in turn]
        for mode, spec in order:
            if not mode.startswith("stock"):
                megatron_overlap.install(self.args[mode.removesuffix("_free")])
            self.link.spec = spec
            self.link.record_spans = record_spans and spec is self.spec
            dist.barrier()
            self.link.reset()
            t0 = time.perf_counter()
            marks = []
            self._step(after_forward=lambda: marks.append((time.perf_counter(), self.link.stats.blocked_s)))
            t1 = time.perf_counter()
            stats = self.link.reset()
            megatron_overlap.uninstall()
            if index == 0 and mode in modes:
                self.grads[mode] = [self.x.grad.clone()] + [
                    (p.main_grad if getattr(p, "grad_added_to_main_grad", False) else p.grad).clone()
                    for p in self.mlp.parameters() if p.grad is not None]
            record[mode] = {"wall_s": t1 - t0, "forward_s": marks[0][0] - t0, "forward_blocked_s": marks[0][1],
                            "blocked_s": stats.blocked_s,
                            "busy_s": stats.busy_s, "bytes": stats.total_bytes}
            if self.link.record_spans:
                record[mode]["trace"] = {"step": (t0, t1), "link": [(x.start, x.done) for x in stats.spans],
                                         "blocked": list(stats.waits)}
        return record

    def close(self) -> dict:
        self.link.uninstall()
        parity = {mode: max(((a - b).norm() / b.norm()).item() for a, b in zip(self.grads[mode], self.grads["stock"]))
                  for mode in self.cfg.modes[1:]}
        return {"link": self.spec.as_dict(), "parity": parity["overlap"], "parity_by_mode": parity}
