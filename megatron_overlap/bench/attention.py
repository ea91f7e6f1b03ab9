"""Ring attention forward+backward under the emulated link: overlapped ring vs the same ring
with its transfers not overlapped (each step waits for its block before computing), in one run.

The link is calibrated so that one key/value block's transfer takes as long as one block's
forward attention (``--comm-ratio 1``): the block time is measured on a free link (the whole
overlapped step, with its transfers costing nothing, over its ``3 n`` forward-block units:
n blocks forward, their backward at about twice the cost), and the bandwidth follows from the
bytes of one key/value block. Every round runs the free-link step, the non-overlapped ring and
the overlapped ring back to back, so drifts of the machine hit all three alike; the summary
takes medians of per-round ratios.

    compute  = the overlapped step on a free link (what the ring costs when transfers are free)
    transfer = time this rank's link port is busy in the overlapped step (bytes / bandwidth)
    limit    = max(compute, transfer)

Causal attention in Megatron's zigzag layout: every position computes the same work, so no
rank waits for another; the work per rank is counted and printed (``BlockWork``).
"""

from __future__ import annotations

import logging
import statistics
import time
from dataclasses import asdict, dataclass

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


class _Session:
    """Per-rank state of one run."""

    def __init__(self, cfg: AttentionBench):
        from ..comm.emulated_link import EmulatedLink, LinkSpec
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
        from ..comm.emulated_link import LinkSpec

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

    def _timed_free(self) -> float:
        self.link.spec = self.free
        dist.barrier()
        t0 = time.perf_counter()
        self._step(True)
        return time.perf_counter() - t0

    def round(self, index: int) -> dict:
        if index == self.cfg.warmup:  # recalibrate once the machine is warm
            self.spec = self._spec([self._timed_free() for _ in range(2)])
        record = {"free_s": self._timed_free()}
        for mode in ("serial", "overlap"):
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


_session = None


def _setup(cfg_dict: dict):
    global _session
    _session = _Session(AttentionBench(**cfg_dict))


def _round(index: int) -> dict:
    return _session.round(index)


def _close() -> dict:
    global _session
    result, _session = _session.close(), None
    return result


def run(cfg: AttentionBench, progress: bool = True) -> dict:
    """Run on ``cfg.cp`` fresh gloo ranks (one thread each); return the summary."""
    from tqdm import tqdm

    from ..testing.rank_pool import RankPool

    rounds = []
    with RankPool(cfg.cp, timeout=1800, threads_per_rank=1) as pool:
        bar = tqdm(total=cfg.warmup + cfg.steps, desc="ring attention (free link, serial, overlapped)",
                   unit="round", disable=not progress)
        pool.run(_setup, asdict(cfg))
        for index in range(cfg.warmup + cfg.steps):
            per_rank = pool.run(_round, index)
            if index >= cfg.warmup:
                rounds.append(per_rank)
            bar.update(1)
        bar.close()
        closing = pool.run(_close)
    return summarize(cfg, rounds, closing)


def summarize(cfg: AttentionBench, rounds: list, closing: list) -> dict:
    """Per round: the slowest rank's wall time per mode, the mean port-busy time; medians."""
    def slowest(per_rank, key):
        return max(r[key]["wall_s"] if key != "free_s" else r["free_s"] for r in per_rank)

    result = {"config": asdict(cfg), "link": closing[0]["link"], "block_bytes": closing[0]["block_bytes"]}
    result["compute_ms"] = statistics.median(1e3 * slowest(p, "free_s") for p in rounds)
    for mode in ("serial", "overlap"):
        result[mode] = {
            "step_ms": statistics.median(1e3 * slowest(p, mode) for p in rounds),
            "comm_ms": statistics.median(1e3 * statistics.mean(r[mode]["busy_s"] for r in p) for p in rounds),
            "exposed_comm_ms": statistics.median(1e3 * statistics.mean(r[mode]["blocked_s"] for r in p) for p in rounds),
            "bytes_per_step": int(statistics.median(max(r[mode]["bytes"] for r in p) for p in rounds)),
        }
    ratios_limit, ratios_serial_limit, speedups = [], [], []
    for p in rounds:
        limit = max(slowest(p, "free_s"), statistics.mean(r["overlap"]["busy_s"] for r in p))
        ratios_limit.append(slowest(p, "overlap") / limit)
        ratios_serial_limit.append(slowest(p, "serial") / limit)
        speedups.append(slowest(p, "serial") / slowest(p, "overlap"))
    result["limit_ms"] = max(result["compute_ms"], result["overlap"]["comm_ms"])
    result["overlap_vs_limit"] = statistics.median(ratios_limit)
    result["serial_vs_limit"] = statistics.median(ratios_serial_limit)
    result["speedup_vs_serial"] = statistics.median(speedups)
    forward = [c["work"]["forward"] for c in closing]
    result["work_per_rank"] = forward
    result["work_max_over_mean"] = max(forward) / statistics.mean(forward)
    result["max_rel_diff_overlap_vs_serial"] = max(c["parity"] for c in closing)
    return result


def format_table(result: dict) -> str:
    cfg, link = result["config"], result["link"]
    lines = [
        f"ring attention fwd+bwd, CP={cfg['cp']}, seq {cfg['seq']} ({cfg['seq'] // cfg['cp']} rows/rank), "
        f"{cfg['heads']} q / {cfg['kv_heads']} kv heads x {cfg['head_dim']}, "
        f"{'causal (zigzag)' if cfg['causal'] else 'no mask'}, fp32, 1 thread/rank, {cfg['steps']} rounds (medians)",
        f"link: {link['bandwidth_GBps']:.4f} GB/s egress per rank, {link['latency_us']:.0f} us/message "
        f"(one {result['block_bytes'] / 1e6:.2f} MB K/V block = {cfg['comm_ratio']:g} x one block's forward)",
        f"compute (overlapped ring on a free link) {result['compute_ms']:.1f} ms | transfer "
        f"{result['overlap']['comm_ms']:.1f} ms | limit = max(compute, transfer) {result['limit_ms']:.1f} ms",
        "",
        f"{'':26}{'step ms':>9}{'x limit':>9}{'exposed comm ms':>17}{'MB/step':>9}",
    ]
    for mode, label in (("serial", "ring, transfers waited"), ("overlap", "ring, overlapped")):
        r = result[mode]
        lines.append(f"{label:26}{r['step_ms']:>9.1f}{result[mode + '_vs_limit']:>9.2f}"
                     f"{r['exposed_comm_ms']:>17.1f}{r['bytes_per_step'] / 1e6:>9.2f}")
    lines += [
        "",
        f"overlapped: {result['speedup_vs_serial']:.2f}x faster than waited, {result['overlap_vs_limit']:.2f}x the "
        f"limit (medians of per-round ratios); causal score elements per rank {result['work_per_rank']} "
        f"(max/mean {result['work_max_over_mean']:.3f}); grads overlapped vs waited: max rel. diff "
        f"{result['max_rel_diff_overlap_vs_serial']:.1e}",
    ]
    return "\n".join(lines)
