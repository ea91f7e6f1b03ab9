"""The rank side of ``megatron-overlap bench attention`` (driver: ``cli/bench_attention.py``):
ring attention forward + backward on random q, k, v, overlapped and with every transfer waited,
on the emulated link; and the compute replay the limit is made of: the same block kernels on
the same shapes and masks, every exchange replaced by a local copy (no communication at all)."""

from __future__ import annotations

import logging
import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class AttentionBench:
    cp: int = 4
    seq: int = 4096
    heads: int = 8
    kv_heads: int = 2
    head_dim: int = 64
    micro_batch: int = 1
    causal: bool = True
    steps: int = 8
    warmup: int = 2
    comm_ratio: float = 1.0
    latency_us: float = 20.0
    seed: int = 0

    def __post_init__(self):
        if self.cp < 2:
            raise ValueError(f"--cp must be >= 2 (a ring needs two ranks), got {self.cp}")
        if self.seq % (2 * self.cp):
            raise ValueError(f"--seq {self.seq} must be a multiple of 2 x CP = {2 * self.cp}")
        if self.heads % self.kv_heads:
            raise ValueError(f"--heads {self.heads} must be a multiple of --kv-heads {self.kv_heads}")


class AttentionBenchRanks:
    """Per-rank state of one run (through ``lab.session``)."""

    def __init__(self, cfg):
        cfg = AttentionBench(**cfg) if isinstance(cfg, dict) else cfg
        from .emulated_link import EmulatedLink, LinkSpec
        from ..cp import BlockWork

        torch.set_num_threads(1)
        logging.getLogger("megatron_overlap").setLevel(logging.ERROR)
        self.cfg = cfg
        self.group = dist.group.WORLD
        rows = cfg.seq // cfg.cp
        gen = torch.Generator().manual_seed(cfg.seed + 100 + dist.get_rank())
        shape_q = (rows, cfg.micro_batch, cfg.heads, cfg.head_dim)
        shape_kv = (rows, cfg.micro_batch, cfg.kv_heads, cfg.head_dim)
        self.q = torch.randn(shape_q, generator=gen).requires_grad_()
        self.k = torch.randn(shape_kv, generator=gen).requires_grad_()
        self.v = torch.randn(shape_kv, generator=gen).requires_grad_()
        self.dout = torch.randn(rows, cfg.micro_batch, cfg.heads * cfg.head_dim, generator=gen)
        self.block_bytes = 2 * self.k.numel() * self.k.element_size()  # one K and V block
        self.work = BlockWork()
        self.free = LinkSpec(bandwidth_GBps=1e6, latency_us=0.0)
        self.link = EmulatedLink(self.free).install()
        self._step(True)  # warm the kernels
        self.work = BlockWork()
        self._step(True, count=True)
        self.spec = self._spec([self._timed_free() for _ in range(3)])
        self.grads = {}

    def _spec(self, free_samples):
        """One block's transfer = ``comm_ratio`` x one block's forward compute (the slowest rank's,
        so every rank gets the same link)."""
        from .emulated_link import LinkSpec

        units = 3 * self.cfg.cp  # n blocks forward + their backward (~2x)
        volume = torch.tensor([float(self.block_bytes), statistics.median(free_samples) / units])
        dist.all_reduce(volume, op=dist.ReduceOp.MAX)
        bandwidth = volume[0].item() / (volume[1].item() * self.cfg.comm_ratio) / 1e9
        return LinkSpec(bandwidth_GBps=bandwidth, latency_us=self.cfg.latency_us)

    def _step(self, overlap: bool, count: bool = False):
        from ..cp import cp_attention

        for t in (self.q, self.k, self.v):
            t.grad = None
        out = cp_attention(self.q, self.k, self.v, mode="ring", causal=self.cfg.causal, group=self.group,
                           overlap=overlap, work=self.work if count else None)
        out.backward(self.dout)

    def _timed_replay(self) -> float:
        """The ring's compute alone: every block and merge of this rank, forward and backward, with
        the exchanges made local copies (the blocks' positions, hence their masks, unchanged)."""
        from ..cp import ring
        from .emulated_attention import local_exchange as local_copy

        real = ring.exchange
        ring.exchange = local_copy
        try:
            dist.barrier()
            t0 = time.perf_counter()
            self._step(True)
            return time.perf_counter() - t0
        finally:
            ring.exchange = real

    def _timed_free(self) -> float:
        self.link.spec = self.free
        dist.barrier()
        t0 = time.perf_counter()
        self._step(True)
        return time.perf_counter() - t0

    def round(self, index: int) -> dict:
        if index == self.cfg.warmup:  # recalibrate once the machine is warm
            self.spec = self._spec([self._timed_free() for _ in range(2)])
        record = {"free_s": self._timed_free(), "replay_s": self._timed_replay()}
        # which mode runs first alternates per round, so a drift of the machine hits both alike
        for mode in ("serial", "overlap") if index % 2 == 0 else ("overlap", "serial"):
            self.link.spec = self.spec
            dist.barrier()
            self.link.reset()
            t0 = time.perf_counter()
            self._step(mode == "overlap")
            t1 = time.perf_counter()
            stats = self.link.reset()
            if index == 0:
                self.grads[mode] = [t.grad.clone() for t in (self.q, self.k, self.v)]
            record[mode] = {"wall_s": t1 - t0, "blocked_s": stats.blocked_s, "busy_s": stats.busy_s,
                            "bytes": stats.total_bytes}
        return record

    def close(self) -> dict:
        self.link.uninstall()
        parity = max(((a - b).norm() / b.norm()).item() for a, b in zip(self.grads["overlap"], self.grads["serial"]))
        return {"link": self.spec.as_dict(), "parity": parity, "block_bytes": self.block_bytes,
                "work": {"forward": self.work.forward_elements, "backward": self.work.backward_elements}}
