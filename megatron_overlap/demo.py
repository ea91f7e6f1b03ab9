"""``megatron-overlap demo``: the main job on a CPU.

Four gloo ranks (TP=2 x DP=2, sequence parallel) train a tiny GPT on Megatron's local spec
twice, side by side: stock Megatron and the plugin, step for step on the same emulated link
(one egress port per rank, bandwidth calibrated so a step's transfers take as long as its
GEMMs). Prints the per-step losses of both (they agree), step time, exposed communication and
the fraction of communication hidden; writes a PNG timeline of one transformer layer per rank.

``--cp N --overlap-cp MODE``: context parallelism on Megatron's local attention (which has none
without the plugin). World = TP x CP (DP 1) unless ``--world`` says otherwise. Both models run
CP=N; the baseline is the ring with every transfer waited for before its block is computed,
the other the chosen mode overlapped (plus ``--overlap-tp p2p`` when TP > 1). The link is
calibrated so that a step's transfers take ``--comm-ratio`` x its attention-block compute (and
GEMMs, with TP > 1). That CP training equals training without CP is shown by the tests
(tests/test_cp_training.py), not here: one process cannot hold two parallel layouts at once.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import time
from dataclasses import asdict, dataclass, fields
from typing import Optional

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DemoConfig:
    world: int = 4
    tp: int = 2
    steps: int = 20
    warmup: int = 2
    layers: int = 2
    hidden: int = 512
    ffn: int = 1408
    heads: int = 8
    kv_heads: int = 2
    seq: int = 1024
    micro_batch: int = 1
    vocab: int = 512
    lr: float = 0.05
    bandwidth_GBps: float = 0.0  # 0: calibrate (TP transfer time = comm_ratio x GEMM time)
    comm_ratio: float = 1.0
    latency_us: float = 20.0
    chunks: int = 0
    rs: str = "ring"
    bidirectional: bool = False
    seed: int = 1234
    trace_dir: str = ""  # --trace: Chrome traces of the last step (both modes), per rank
    cp: int = 1
    overlap_cp: str = "ring"
    cp_a2a_size: int = 0

    def model(self):
        from .testing.tiny_gpt import TinyGPT

        return TinyGPT(num_layers=self.layers, hidden=self.hidden, ffn=self.ffn, heads=self.heads,
                       kv_heads=self.kv_heads, vocab=self.vocab, seq=self.seq, micro_batch=self.micro_batch)

    def overlap_flags(self) -> list[str]:
        if self.cp > 1 and self.tp == 1:
            flags = []
        else:
            flags = ["--overlap-tp", "p2p", "--overlap-tp-chunks", str(self.chunks), "--overlap-tp-rs", self.rs]
            flags += ["--overlap-tp-bidirectional"] if self.bidirectional else []
        return flags + self.cp_flags(self.overlap_cp)

    def cp_flags(self, mode: str) -> list[str]:
        if self.cp <= 1:
            return []
        flags = ["--overlap-cp", mode]
        return flags + (["--overlap-cp-a2a-size", str(self.cp_a2a_size)] if mode == "hybrid" else [])

    def baseline_flags(self) -> list[str]:
        """Stock Megatron; under CP the ring with its transfers waited (stock has no CP here)."""
        return self.cp_flags("ring")


# --------------------------------------------------------------------------- rank side
class _Session:
    """Per-rank state of one demo run: two identically initialised models and the link."""

    def __init__(self, cfg: DemoConfig):
        import megatron_overlap
        from megatron.core import parallel_state

        from .comm.emulated_link import EmulatedLink, LinkSpec
        from .testing import tiny_gpt

        logging.getLogger("megatron_overlap").setLevel(logging.ERROR)
        self.cfg = cfg
        self.spec = cfg.model()
        self.overlap_args = megatron_overlap.overlap_parser().parse_args(cfg.overlap_flags())
        self.baseline_args = megatron_overlap.overlap_parser().parse_args(cfg.baseline_flags())
        tiny_gpt.init_parallel(cfg.tp, seed=cfg.seed, cp=cfg.cp)
        self.tp_group = parallel_state.get_tensor_model_parallel_group()
        self.models = {mode: self._build(mode) for mode in ("calibration", "baseline", "overlap")}
        megatron_overlap.uninstall()
        self.windows = {}
        self._hook_layer(self.models["baseline"], "baseline")
        self._hook_layer(self.models["overlap"], "overlap")

        spec = LinkSpec(bandwidth_GBps=cfg.bandwidth_GBps or 1e6, latency_us=cfg.latency_us)
        if not cfg.bandwidth_GBps:
            spec = self._calibrate(spec)
        del self.models["calibration"]
        self.link = EmulatedLink(spec).install()

    def _build(self, mode):
        import megatron_overlap
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        from .testing import tiny_gpt

        torch.manual_seed(self.cfg.seed)
        model_parallel_cuda_manual_seed(self.cfg.seed)
        if self.cfg.cp == 1:
            return tiny_gpt.wrap_ddp(tiny_gpt.build(self.spec, self.cfg.tp), overlap_grad_reduce=True)
        # CP attention is set up when the layer is built: under the flags the model will run with
        megatron_overlap.install(self.overlap_args if mode == "overlap" else self.baseline_args)
        model = tiny_gpt.build(self.spec, self.cfg.tp, context_parallel_size=self.cfg.cp)
        if mode != "overlap":
            for layer in model.decoder.layers:
                layer.self_attention.core_attention._overlap_cp["overlap"] = False
        return tiny_gpt.wrap_ddp(model, overlap_grad_reduce=True)

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
        """Count the bytes of one step on a free link and time its GEMMs (the linears, around
        which the TP communication sits); the link is set so those bytes take ``comm_ratio`` x
        that GEMM time. Every rank gets the same link."""
        from .comm.emulated_link import EmulatedLink, LinkSpec
        from .testing import tiny_gpt

        import megatron_overlap

        if self.cfg.cp > 1:
            megatron_overlap.install(self.baseline_args)
        with EmulatedLink(free_spec) as probe:
            tiny_gpt.train_step(self.models["calibration"], self.spec, 0, lr=self.cfg.lr)  # warm
            probe.reset()
            dist.barrier()
            with _timed_matmuls() as gemm, _timed_attention_blocks() as attention:
                tiny_gpt.train_step(self.models["calibration"], self.spec, 1, lr=self.cfg.lr)
            nbytes = probe.reset().total_bytes
        megatron_overlap.uninstall()
        # TP transfers hide behind the GEMMs, ring transfers behind the attention blocks
        seconds = (gemm.seconds if self.cfg.tp > 1 else 0.0) + (attention.seconds if self.cfg.cp > 1 else 0.0)
        volume = torch.tensor([float(nbytes), seconds])
        dist.all_reduce(volume, op=dist.ReduceOp.MAX)
        bandwidth = volume[0].item() / (volume[1].item() * self.cfg.comm_ratio) / 1e9
        return LinkSpec(bandwidth_GBps=bandwidth, latency_us=self.cfg.latency_us)

    def step(self, index: int, record: bool) -> dict:
        import megatron_overlap

        from .testing import tiny_gpt

        from .trace import StepTracer

        out = {}
        for mode in ("baseline", "overlap"):
            if mode == "overlap":
                megatron_overlap.install(self.overlap_args)
            elif self.cfg.cp > 1:
                megatron_overlap.install(self.baseline_args)
            tracer = StepTracer(self.cfg.trace_dir, {index} if record and self.cfg.trace_dir else (),
                                rank=dist.get_rank(), label=mode, link=self.link)
            self.link.record_spans = record
            dist.barrier()
            self.link.reset()
            t0 = time.perf_counter()
            with tracer.step(index):
                loss = tiny_gpt.train_step(self.models[mode], self.spec, index, lr=self.cfg.lr)
            t1 = time.perf_counter()
            stats = self.link.reset()
            megatron_overlap.uninstall()
            out[mode] = {"loss": loss, "wall_s": t1 - t0, "blocked_s": stats.blocked_s,
                         "busy_s": stats.busy_s, "bytes": stats.total_bytes}
            if record:
                out[mode]["trace"] = {
                    "step": (t0, t1),
                    "layer": dict(self.windows[mode]),
                    "link": [(s.start, s.done) for s in stats.spans],
                    "blocked": list(stats.waits),
                }
        return out

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
    from .cp import ring

    return _timed((ring, "block_attention"), (ring, "block_backward"))


_session: Optional[_Session] = None  # rank-side state of the demo process, not of the plugin


def _setup(cfg_dict: dict) -> dict:
    global _session
    _session = _Session(DemoConfig(**cfg_dict))
    return _session.link.spec.as_dict()


def _step(index: int, record: bool) -> dict:
    return _session.step(index, record)


def _teardown() -> None:
    global _session
    if _session is not None:
        _session.close()
    _session = None


# --------------------------------------------------------------------------- driver side
def run(cfg: DemoConfig, out_dir: str = "runs/demo", progress: bool = True) -> dict:
    from tqdm import tqdm

    from .testing.rank_pool import RankPool

    if cfg.world % (cfg.tp * cfg.cp):
        raise SystemExit(f"demo: --tp {cfg.tp} x --cp {cfg.cp} must divide --world {cfg.world}")
    os.makedirs(out_dir, exist_ok=True)
    bar = tqdm(total=cfg.steps + 1, desc=f"starting {cfg.world} gloo ranks", disable=not progress, unit="step")
    per_step = []
    with RankPool(cfg.world, timeout=1800, threads_per_rank=1) as pool:
        link = pool.run(_setup, asdict(cfg))[0]
        bar.set_description("baseline + overlap")
        bar.update(1)
        for index in range(cfg.steps):
            rows = pool.run(_step, index, index == cfg.steps - 1)
            per_step.append(rows)
            bar.set_postfix(loss=f"{rows[0]['baseline']['loss']:.4f}/{rows[0]['overlap']['loss']:.4f}")
            bar.update(1)
        pool.run(_teardown)
    bar.close()
    result = summarize(cfg, link, per_step)
    result["timeline_png"] = write_timeline(cfg, per_step[-1], os.path.join(out_dir, "timeline.png"))
    with open(os.path.join(out_dir, "result.json"), "w") as f:
        json.dump(result, f, indent=1)
    return result


def summarize(cfg: DemoConfig, link: dict, per_step: list) -> dict:
    result = {"config": asdict(cfg), "link": link, "cpu_cores": len(os.sched_getaffinity(0))}
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
    a, b = result["baseline"]["losses"], result["overlap"]["losses"]
    result["max_loss_rel_diff"] = max(abs(x - y) / abs(x) for x, y in zip(a, b))
    result["speedup"] = result["baseline"]["step_ms"] / result["overlap"]["step_ms"]
    return result


def write_timeline(cfg: DemoConfig, last_step: list, path: str) -> str:
    from . import timeline

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
        "",
        f"{'step':>4}  {'loss stock':>11}  {'loss overlap':>12}",
    ]
    for i, (a, b) in enumerate(zip(result["baseline"]["losses"], result["overlap"]["losses"])):
        lines.append(f"{i:>4}  {a:>11.6f}  {b:>12.6f}")
    labels = (("baseline", "stock Megatron"), ("overlap", "megatron-overlap"))
    if cfg["cp"] > 1:
        lines[3] = f"{'step':>4}  {'loss waited':>11}  {'loss overlap':>12}"
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
        f"speedup {result['speedup']:.2f}x; losses differ by at most {result['max_loss_rel_diff']:.1e} (relative)",
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


def _table_only(line: str) -> None:
    """--no-progress: the HDP demo's table without its progress lines."""
    if not line.startswith(("[", "HDP demo:")):
        print(line)


def add_demo_args(parser: argparse.ArgumentParser):
    d = DemoConfig()
    parser.add_argument("--steps", type=int, default=d.steps)
    parser.add_argument("--warmup", type=int, default=d.warmup, help="steps left out of the timing")
    parser.add_argument("--world", type=int, default=None, help="gloo ranks (default 4; TP x CP with --cp)")
    parser.add_argument("--tp", type=int, default=None,
                        help=f"tensor-parallel size (divides --world; default {d.tp}, 1 with --cp)")
    parser.add_argument("--seq", type=int, default=d.seq)
    parser.add_argument("--hidden", type=int, default=d.hidden)
    parser.add_argument("--layers", type=int, default=d.layers)
    parser.add_argument("--bandwidth-GBps", dest="bandwidth_GBps", type=float, default=d.bandwidth_GBps,
                        help="emulated link bandwidth; 0 (default) sets it so the TP transfers of a "
                        "step take --comm-ratio x the time of its GEMMs")
    parser.add_argument("--comm-ratio", type=float, default=d.comm_ratio)
    parser.add_argument("--latency-us", type=float, default=d.latency_us)
    parser.add_argument("--overlap-tp-chunks", dest="chunks", type=int, default=d.chunks)
    parser.add_argument("--overlap-tp-rs", dest="rs", choices=("ring", "a2a"), default=d.rs)
    parser.add_argument("--overlap-tp-bidirectional", dest="bidirectional", action="store_true")
    parser.add_argument("--cp", type=int, default=d.cp,
                        help="context-parallel size: CP on Megatron's local attention through --overlap-cp")
    parser.add_argument("--overlap-cp", dest="overlap_cp", choices=("ring", "a2a", "hybrid"), default=d.overlap_cp)
    parser.add_argument("--overlap-cp-a2a-size", dest="cp_a2a_size", type=int, default=d.cp_a2a_size)
    parser.add_argument("--hdp", action="store_true",
                        help="instead: hybrid data parallelism on 4 ranks, a mixed-length batch, per-rank busy "
                        "time of a static CP layout vs the HDP plan (same loss and gradients)")
    parser.add_argument("--hdp-max-tokens-per-rank", dest="hdp_capacity", type=int, default=None, metavar="C",
                        help="with --hdp: tokens per rank per micro-batch (default: the demo's)")
    parser.add_argument("--out", default="runs/demo", help="directory for timeline.png and result.json")
    parser.add_argument("--trace", dest="trace_dir", default="", metavar="DIR",
                        help="also write per-rank Chrome traces of the last step (both modes) to DIR; "
                        "`megatron-overlap report DIR` draws them")
    parser.add_argument("--json", action="store_true", help="print one JSON line after the table")
    parser.add_argument("--no-progress", action="store_true")


def main(args) -> int:
    if getattr(args, "hdp", False):
        from .hdp.demo import DEFAULT_CAPACITY, run_hdp_demo

        result = run_hdp_demo(out=print if not args.no_progress else _table_only,
                              capacity=args.hdp_capacity or DEFAULT_CAPACITY)
        if args.json:
            print(json.dumps(result))
        return 0
    names = {f.name for f in fields(DemoConfig)}
    values = {k: v for k, v in vars(args).items() if k in names and v is not None}
    cp = values.get("cp", 1)
    values.setdefault("tp", 1 if cp > 1 else DemoConfig().tp)  # --cp alone: pure context parallelism
    values.setdefault("world", values["tp"] * cp if cp > 1 else DemoConfig().world)
    cfg = DemoConfig(**values)
    result = run(cfg, out_dir=args.out, progress=not args.no_progress)
    print(format_table(result))
    if args.json:
        keys = ("config", "link", "baseline", "overlap")
        print(json.dumps({k: result[k] for k in keys}))
    return 0
