"""The rank side of ``megatron-overlap demo`` (the driver is ``cli/demo.py``): per rank, the
tiny GPT twice (stock and the plugin, identically initialised), the emulated link calibrated to
the step's GEMMs (or attention blocks under CP), and one training step of each per call."""

from __future__ import annotations

import logging
import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

CALIBRATION_STEPS = 3  # timed stock steps on a free link (after one warm-up); the link follows their median


@dataclass(frozen=True)
class DemoConfig:
    world: int = 2  # cli/demo.py picks the layout by the machine's cores (one rank per core)
    tp: int = 2
    steps: int = 20
    warmup: int = 2
    layers: int = 2
    hidden: int = 1024
    ffn: int = 2816
    heads: int = 8
    kv_heads: int = 2
    seq: int = 1024
    micro_batch: int = 1
    vocab: int = 4096
    lr: float = 0.05
    bandwidth_GBps: float = 0.0  # 0: calibrate (TP transfer time = comm_ratio x GEMM time)
    comm_ratio: float = 1.25  # transfers = 1.25 x the GEMMs: stock then waits ~40% of its step (BENCHMARKS.md)
    latency_us: float = 20.0
    chunks: int = 4  # 2 pieces of 256 rows per rank: stock's bits on every BLAS seen (docs/tp-overlap.md)
    rs: str = "ring"
    bidirectional: bool = False
    sub_batches: object = "auto"  # --overlap-tp-sub-batches of ours: a count, or auto (lab/demo_plan.py picks)
    sub_batch_blocks: str = ""  # --overlap-tp-sub-batch-blocks: all | attention | mlp; "": all, or the pick's
    seed: int = 1234
    trace_dir: str = ""  # --trace: Chrome traces of the last step (both modes), per rank
    cp: int = 1
    overlap_cp: str = "ring"
    cp_a2a_size: int = 0

    def model(self):
        from .tiny_gpt import TinyGPT

        return TinyGPT(num_layers=self.layers, hidden=self.hidden, ffn=self.ffn, heads=self.heads,
                       kv_heads=self.kv_heads, vocab=self.vocab, seq=self.seq, micro_batch=self.micro_batch)

    def overlap_flags(self, sub_batches=None, blocks: str = "") -> list[str]:
        """Ours: ``--overlap-tp p2p`` with the demo's decomposition, cut into ``sub_batches`` (the
        config's count by default; None: stock), the ``blocks`` cut (default: the config's)."""
        n = self.sub_batches if sub_batches is None else sub_batches
        blocks = blocks or self.sub_batch_blocks
        if (self.cp > 1 and self.tp == 1) or n == "stock":
            flags = []
        else:
            flags = ["--overlap-tp", "p2p", "--overlap-tp-chunks", str(self.chunks), "--overlap-tp-rs", self.rs]
            flags += ["--overlap-tp-bidirectional"] if self.bidirectional else []
            flags += ["--overlap-tp-sub-batches", str(n)] if n not in (1, "auto") else []
            flags += ["--overlap-tp-sub-batch-blocks", blocks] if n != 1 and blocks not in ("", "all") else []
        return flags + self.cp_flags(self.overlap_cp)

    @property
    def planned(self) -> bool:
        """Whether ours is the cost model's pick (``lab/demo_plan.py``): TP overlap, sub-batches auto."""
        return self.sub_batches == "auto" and self.tp > 1 and self.cp == 1

    def cp_flags(self, mode: str) -> list[str]:
        if self.cp <= 1:
            return []
        flags = ["--overlap-cp", mode]
        return flags + (["--overlap-cp-a2a-size", str(self.cp_a2a_size)] if mode == "hybrid" else [])

    def baseline_flags(self) -> list[str]:
        """Stock Megatron; under CP the ring with its transfers waited (stock has no CP here)."""
        return self.cp_flags("ring")


class DemoRanks:
    """Per-rank state of one demo run: two identically initialised models and the link
    (run through ``lab.session``)."""

    def __init__(self, cfg: DemoConfig):
        import megatron_overlap
        from megatron.core import parallel_state

        from .emulated_link import EmulatedLink, LinkSpec
        from . import tiny_gpt

        logging.getLogger("megatron_overlap").setLevel(logging.ERROR)
        self.cfg = cfg
        self.spec = cfg.model()
        self.choice = {"sub_batches": cfg.sub_batches, "blocks": cfg.sub_batch_blocks or "all", "why": "as asked"}
        self.overlap_args = megatron_overlap.overlap_parser().parse_args(cfg.overlap_flags(1 if cfg.planned else None))
        self.baseline_args = megatron_overlap.overlap_parser().parse_args(cfg.baseline_flags())
        tiny_gpt.init_parallel(cfg.tp, seed=cfg.seed, cp=cfg.cp)
        self.tp_group = parallel_state.get_tensor_model_parallel_group()
        self.models = {mode: self._build(mode) for mode in ("calibration", "baseline", "overlap")}
        megatron_overlap.uninstall()
        self.windows = {}
        self._hook_layer(self.models["baseline"], "baseline")
        self._hook_layer(self.models["overlap"], "overlap")

        spec, calibration = self._calibrate(LinkSpec(bandwidth_GBps=1e6, latency_us=cfg.latency_us))
        if cfg.bandwidth_GBps:
            spec = LinkSpec(bandwidth_GBps=cfg.bandwidth_GBps, latency_us=cfg.latency_us)
        del self.models["calibration"]
        if cfg.planned:  # every rank computes the same pick from the same all-reduced measurements
            from . import demo_plan

            self.choice = demo_plan.pick(cfg, demo_plan.Calibration(
                bandwidth_GBps=spec.bandwidth_GBps, latency_us=spec.latency_us, **calibration))
            n = self.choice["sub_batches"]
            flags = cfg.overlap_flags("stock" if n is None else n, self.choice["blocks"])
            self.overlap_args = megatron_overlap.overlap_parser().parse_args(flags)
        self.link = EmulatedLink(spec).install()

    def _build(self, mode):
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        from . import tiny_gpt

        torch.manual_seed(self.cfg.seed)
        model_parallel_cuda_manual_seed(self.cfg.seed)
        if self.cfg.cp == 1:
            # gradient-accumulation fusion: Megatron's default where apex is installed (the lab's CPU shim here)
            return tiny_gpt.wrap_ddp(tiny_gpt.build(self.spec, self.cfg.tp, gradient_accumulation_fusion=True),
                                     overlap_grad_reduce=True)
        # CP attention is set up when the layer is built: under the flags the model will run with
        self._install("overlap" if mode == "overlap" else "baseline")
        model = tiny_gpt.build(self.spec, self.cfg.tp, context_parallel_size=self.cfg.cp,
                               gradient_accumulation_fusion=True)
        return tiny_gpt.wrap_ddp(model, overlap_grad_reduce=True)

    def _install(self, mode: str) -> None:
        """The plugin as ``mode`` runs: ``overlap`` its flags; ``baseline`` stock Megatron, or under
        CP (which stock lacks on the local path) the ring with every transfer waited for."""
        import megatron_overlap

        from ..cp.ring import RingOptions

        if mode == "overlap":
            megatron_overlap.install(self.overlap_args)
        elif self.cfg.cp > 1:
            megatron_overlap.install(self.baseline_args, ring_options=RingOptions(overlap=False))
        else:
            megatron_overlap.uninstall()

    def _hook_layer(self, ddp_model, mode):
        """Record when layer 0's forward and backward start and end (the timeline's window).
        Backward is bracketed by tensor hooks: the grad of the layer's output arrives (start),
        the grad of its input is complete (end)."""
        layer = ddp_model.module.decoder.layers[0]
        window = self.windows.setdefault(mode, {})
        now = time.perf_counter

        def mark(key):
            def hook(*_):
                window[key] = now()

            return hook

        def pre(module, args, kwargs):
            mark("fwd_start")()
            hidden = kwargs.get("hidden_states", args[0] if args else None)
            if hidden is not None and hidden.requires_grad:
                hidden.register_hook(mark("bwd_end"))

        def post(module, args, output):
            mark("fwd_end")()
            out = output[0] if isinstance(output, tuple) else output
            if out.requires_grad:
                out.register_hook(mark("bwd_start"))

        layer.register_forward_pre_hook(pre, with_kwargs=True)
        layer.register_forward_hook(post)

    def _calibrate(self, free_spec):
        """Count the bytes of a step on a free link and time its GEMMs (the linears, around which
        the TP communication sits), the median of ``CALIBRATION_STEPS`` steps; the link is set so
        those bytes take ``comm_ratio`` x that GEMM time. Every rank gets the same link. Also
        returns the GEMM and compute milliseconds (slowest rank), what ``demo_plan`` fits the cost
        model to."""
        from .emulated_link import EmulatedLink, LinkSpec
        from . import tiny_gpt

        import megatron_overlap

        self._install("baseline")
        samples = []  # per step: seconds the transfers hide behind, GEMM seconds, compute seconds
        with EmulatedLink(free_spec) as probe:
            tiny_gpt.train_step(self.models["calibration"], self.spec, 0, lr=self.cfg.lr)  # warm
            for index in range(1, 1 + CALIBRATION_STEPS):
                probe.reset()
                dist.barrier()
                c0 = time.thread_time()
                with _timed_matmuls() as gemm, _timed_attention_blocks() as attention:
                    tiny_gpt.train_step(self.models["calibration"], self.spec, index, lr=self.cfg.lr)
                # TP transfers hide behind the GEMMs, ring transfers behind the attention blocks
                samples.append(((gemm.seconds if self.cfg.tp > 1 else 0.0) + (attention.seconds if self.cfg.cp > 1
                                                                                 else 0.0),
                                gemm.seconds, time.thread_time() - c0))
                nbytes = probe.reset().total_bytes
        megatron_overlap.uninstall()
        # the median step of a few: one step's GEMMs vary by 10% on a shared 2-core machine, and the link with them
        seconds, gemm_s, compute_s = (statistics.median(column) for column in zip(*samples))
        volume = torch.tensor([float(nbytes), seconds, gemm_s, compute_s], dtype=torch.float64)
        dist.all_reduce(volume, op=dist.ReduceOp.MAX)
        bandwidth = volume[0].item() / (volume[1].item() * self.cfg.comm_ratio) / 1e9
        return (LinkSpec(bandwidth_GBps=bandwidth, latency_us=self.cfg.latency_us),
                {"gemm_ms": 1e3 * volume[2].item(), "compute_ms": 1e3 * volume[3].item()})

    def step(self, index: int, record: bool) -> dict:
        import megatron_overlap

        from . import tiny_gpt

        from ..trace.tracer import StepTracer

        out = {}
        # which runs first alternates per step, so a drift of the machine hits both alike
        for mode in ("baseline", "overlap") if index % 2 == 0 else ("overlap", "baseline"):
            self._install(mode)
            tracer = StepTracer(self.cfg.trace_dir, {index} if record and self.cfg.trace_dir else (),
                                rank=dist.get_rank(), label=mode, link=self.link)
            self.link.record_spans = record
            dist.barrier()
            self.link.reset()
            t0, c0 = time.perf_counter(), time.thread_time()
            with tracer.step(index):
                loss = tiny_gpt.train_step(self.models[mode], self.spec, index, lr=self.cfg.lr)
            t1, c1 = time.perf_counter(), time.thread_time()
            stats = self.link.reset()
            megatron_overlap.uninstall()
            # cpu_s: this rank's compute (its waits sleep; gloo works on its own threads)
            out[mode] = {"loss": loss, "wall_s": t1 - t0, "blocked_s": stats.blocked_s,
                         "busy_s": stats.busy_s, "bytes": stats.total_bytes, "cpu_s": c1 - c0}
            if record:
                out[mode]["trace"] = {
                    "step": (t0, t1),
                    "layer": dict(self.windows[mode]),
                    "link": [(s.start, s.done) for s in stats.spans],
                    "blocked": list(stats.waits),
                }
        return out

    def describe(self) -> dict:
        return {**self.link.spec.as_dict(), "choice": self.choice}

    def close(self):
        self.link.uninstall()


class _timed:
    """Sum the time spent in the named functions while the block runs: ``(owner, name)`` pairs,
    replaced by timing wrappers and restored on exit."""

    def __init__(self, *targets):
        self._targets = targets

    def __enter__(self):
        self.seconds = 0.0
        self._saved = [getattr(owner, name) for owner, name in self._targets]

        def timed(fn):
            def wrapper(*args, **kwargs):
                t0 = time.perf_counter()
                try:
                    return fn(*args, **kwargs)
                finally:
                    self.seconds += time.perf_counter() - t0

            return wrapper

        for (owner, name), fn in zip(self._targets, self._saved):
            setattr(owner, name, timed(fn))
        return self

    def __exit__(self, *exc):
        for (owner, name), fn in zip(self._targets, self._saved):
            setattr(owner, name, fn)


def _timed_matmuls() -> _timed:
    """Every GEMM of Megatron's linears, forward and backward, and of ours."""
    return _timed((torch, "matmul"), (torch.Tensor, "matmul"))


def _timed_attention_blocks() -> _timed:
    """The ring's block attention, forward and backward (what a ring transfer hides behind)."""
    from ..cp import ring

    return _timed((ring, "block_attention"), (ring, "block_backward"))
