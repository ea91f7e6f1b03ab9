"""The rank side of ``megatron-overlap bench pp`` (driver: ``cli/bench_pp.py``): the tiny GPT
split over PP stages, one rank per stage, trained through Megatron's pipeline schedule with
stock Megatron's 1F1B and each of ours on the same emulated link; per step the wall time, each
rank's busy (thread CPU) time, the link's exposed waits and the peak activation memory
(saved-tensor hooks, plus what waits for a W)."""

from __future__ import annotations

import contextlib
import logging
import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

MODES = ("stock", "1f1b", "1f1b-inflight", "zb")


@dataclass(frozen=True)
class PPBench:
    pp: int = 2
    microbatches: int = 8
    layers: int = 4
    hidden: int = 768
    ffn: int = 3072
    heads: int = 8
    kv_heads: int = 8
    seq: int = 256
    micro_batch: int = 1
    vocab: int = 1024
    steps: int = 8
    warmup: int = 2
    comm_ratio: float = 0.2  # stage-to-stage transfers = 0.2 x a stage's compute per step
    latency_us: float = 20.0
    seed: int = 0


class SavedBytes:
    """Bytes of the distinct storages autograd holds for backward, live; the peak, with what
    the weight-gradient store keeps for W added (``extra``)."""

    def __init__(self, extra=lambda: 0):
        self.live = 0
        self.peak = 0
        self._count: dict = {}
        self.extra = extra

    def _pack(self, t):
        if isinstance(t, torch.nn.Parameter) or (t.is_leaf and t.requires_grad):
            return t  # weights are not activations (and stay what autograd saved)
        storage = t.untyped_storage()
        key = storage.data_ptr()
        n = self._count.get(key, (0, storage.nbytes()))[0]
        if n == 0:
            self.live += storage.nbytes()
        self._count[key] = (n + 1, storage.nbytes())
        self.sample()
        return _Held(self, key, t)

    def release(self, key):
        n, nbytes = self._count[key]
        if n == 1:
            del self._count[key]
            self.live -= nbytes
        else:
            self._count[key] = (n - 1, nbytes)

    def sample(self):
        self.peak = max(self.peak, self.live + self.extra())

    @contextlib.contextmanager
    def hooks(self):
        with torch.autograd.graph.saved_tensors_hooks(
                self._pack, lambda held: held if isinstance(held, torch.Tensor) else held.tensor):
            yield


class _Held:
    __slots__ = ("owner", "key", "tensor")

    def __init__(self, owner, key, tensor):
        self.owner, self.key, self.tensor = owner, key, tensor

    def __del__(self):
        self.owner.release(self.key)


class PPBenchRanks:
    """Per-rank state of one benchmark run (through ``lab.session``)."""

    def __init__(self, cfg):
        cfg = PPBench(**cfg) if isinstance(cfg, dict) else cfg
        import megatron_overlap
        from .emulated_link import EmulatedLink, LinkSpec
        from .pipeline_gpt import PipelineGPT, PipelineTrainer
        from .tiny_gpt import TinyGPT

        torch.set_num_threads(1)
        logging.getLogger("megatron_overlap").setLevel(logging.ERROR)
        megatron_overlap.uninstall()
        self.cfg = cfg
        spec = TinyGPT(num_layers=cfg.layers, hidden=cfg.hidden, ffn=cfg.ffn, heads=cfg.heads, kv_heads=cfg.kv_heads,
                       vocab=cfg.vocab, seq=cfg.seq, micro_batch=cfg.micro_batch)
        # DP = 1, so no gradient traffic either way; overlap_grad_reduce off because Megatron's
        # own linears lose their DDP flags under saved-tensor hooks (they read them off the
        # unpacked weight, a new tensor object) and DDP then asserts on the missing grad
        self.trainer = PipelineTrainer(PipelineGPT(spec=spec, tp=1, pp=cfg.pp, microbatches=cfg.microbatches),
                                       overlap_grad_reduce=False)
        self.stage = _stage()
        self.act_bytes = cfg.seq * cfg.micro_batch * cfg.hidden * 4
        # compute per step and bytes, stock on a free link; the link then carries them in
        # comm_ratio x the compute (the largest over ranks, so every rank gets the same link)
        free = LinkSpec(bandwidth_GBps=1e6, latency_us=0.0)
        with EmulatedLink(free) as probe:
            busy = []
            for step in range(3):
                probe.reset()
                busy.append(self._step("stock", step)["busy_s"])
            self.p2p_bytes = sum(n for op, n in probe.reset().bytes_by_op.items() if op == "isend")
        volume = torch.tensor([float(self.p2p_bytes), statistics.median(busy[1:])])
        dist.all_reduce(volume, op=dist.ReduceOp.MAX)
        bandwidth = volume[0].item() / (volume[1].item() * cfg.comm_ratio) / 1e9
        self.spec = LinkSpec(bandwidth_GBps=bandwidth, latency_us=cfg.latency_us)
        self.free = free
        self.link = EmulatedLink(self.spec, record_spans=False).install()
        self.times = self._action_times()

    def _install(self, mode: str):
        import megatron_overlap
        from ..config import OverlapConfig, PPConfig

        megatron_overlap.uninstall()
        if mode == "stock":
            return None
        k = min(self.cfg.microbatches, 2 * self.cfg.pp - 1)  # each stage two ahead of the next
        pp = PPConfig(mode="zb" if mode == "zb" else "1f1b", max_inflight=k if mode == "1f1b-inflight" else None,
                      explicit=frozenset({"max_inflight"}) if mode == "1f1b-inflight" else frozenset())
        return megatron_overlap.install(OverlapConfig(pp=pp))

    def _step(self, mode: str, step: int, events: list | None = None, reset: bool = True) -> dict:
        inst = self._install(mode)
        memory = SavedBytes(extra=(inst.wgrad.held_bytes if inst is not None and inst.wgrad is not None
                                   else (lambda: 0)))
        if inst is not None:
            def observe(stage, action, t0, t1):
                memory.sample()
                if events is not None:
                    events.append((str(action)[0] if action.op in "FBW" else action.op, t0, t1))
            inst.pp_observer = observe
        timing = {}

        @contextlib.contextmanager
        def around():
            dist.barrier()
            c0, t0 = time.thread_time(), time.perf_counter()
            with memory.hooks():
                yield
            timing.update(wall_s=time.perf_counter() - t0, busy_s=time.thread_time() - c0, start=t0)

        if reset:
            self.trainer.reset()
        loss = self.trainer.step(step, around=around())
        import megatron_overlap

        megatron_overlap.uninstall()
        return {**timing, "peak_bytes": memory.peak, "loss": loss}

    def _action_times(self) -> dict:
        """Median F, B and W of this stage (zb on a free link): the simulator's inputs."""
        self.link.spec = self.free
        events: list = []
        for step in range(3):
            events.clear()
            self._step("zb", step, events)
        self.link.spec = self.spec
        out = {}
        for op in "FBW":
            out[op] = 1e3 * statistics.median(t1 - t0 for o, t0, t1 in events if o == op)
        return out

    def describe(self) -> dict:
        return {"stage": self.stage, "times_ms": self.times, "link": self.spec.as_dict(),
                "transfer_ms": 1e3 * self.spec.seconds(self.act_bytes, 0), "p2p_bytes": self.p2p_bytes,
                "act_bytes": self.act_bytes, "params": [p.numel() for p in self.trainer.ddp.module.parameters()]}

    def round(self, index: int, record: bool = False) -> dict:
        order = list(MODES) if index % 2 == 0 else list(reversed(MODES))
        out = {}
        for mode in order:
            # the same schedule on a free link first: what it costs without communication
            self.link.spec = self.free
            free = self._step(mode, index)
            self.link.spec = self.spec
            events: list = [] if record else None
            self.link.reset()
            self.link.record_spans = record
            r = self._step(mode, index, events)
            stats = self.link.reset()
            r.update(blocked_s=stats.blocked_s, link_bytes=stats.total_bytes, free_wall_s=free["wall_s"],
                     free_busy_s=free["busy_s"])
            if record:
                start = r["start"]
                r["trace"] = {"events": [(o, a - start, b - start) for o, a, b in events],
                              "link": [(x.start - start, x.done - start) for x in stats.spans],
                              "blocked": [(a - start, b - start) for a, b in stats.waits]}
            out[mode] = r
        return out

    def train(self, steps: int, modes=("stock", "zb")) -> dict:
        """``demo --pp``: train from the same start with each schedule, one step of each per
        round (order alternating), each from its own parameters; per mode the losses and wall
        times per step, and ours' trace of the last step."""
        states = {mode: self.trainer.state() for mode in modes}
        out = {mode: {"loss": [], "wall_s": [], "busy_s": []} for mode in modes}
        for step in range(steps):
            for mode in (modes if step % 2 == 0 else tuple(reversed(modes))):
                record = step == steps - 1 and mode != "stock"
                events: list = [] if record else None
                self.link.reset()
                self.link.record_spans = record
                self.trainer.load(states[mode])
                r = self._step(mode, step, events, reset=False)
                states[mode] = self.trainer.state()
                stats = self.link.reset()
                for key in ("loss", "wall_s", "busy_s"):
                    out[mode][key].append(r[key])
                if record:
                    start = r["start"]
                    out[mode]["trace"] = {"events": [(o, a - start, b - start) for o, a, b in events],
                                          "blocked": [(a - start, b - start) for a, b in stats.waits]}
        self.trainer.reset()
        return out

    def close(self) -> dict:
        self.link.uninstall()
        return {}


def _stage() -> int:
    from megatron.core import parallel_state

    return parallel_state.get_pipeline_model_parallel_rank()
