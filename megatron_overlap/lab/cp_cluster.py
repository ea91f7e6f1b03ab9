"""Context parallelism on the emulated cluster (``bench cp --emulate``; driver ``cli/bench_cp.py``):
16 ranks on this machine, each one GPU of a CP group holding its zigzag rows of one long sequence,
the product's ``cp_attention`` (ring, waited ring, all-to-all, hybrid) with every block a wait of
the cost model's time, the linears waits too (``lab/long_context_model.py``), the bytes on the
emulated two-tier link.

Scales, each a factor the simulator (``cp/step_model.py``) is given too:

    rows        the sequence of S tokens is ``rows`` emulated rows (``row_unit`` = S / rows
                tokens each); a rank holds rows / CP of them, heads one element wide
    bytes       modelled bytes x ``1 / (head_dim x row_unit)`` on the wire
    layers      ``layer_groups`` groups of layers / groups layers each (a message of a group
                stands for that many layers' messages)
    time        the clock runs ``time_factor`` x the modelled time (chosen so a step takes
                about ``step_s`` seconds); the link's bandwidth and latencies are scaled so every
                transfer takes ``time_factor`` x its modelled time

Each round runs every variant once (order alternating) and the replay: the same compute with
every exchange a local copy (no communication at all), the limit. Times, not numerics.

The hosts run ahead of their emulated devices, as on a GPU (``long_context_model.start_device``):
a wait holds the device, not the host; a step ends when the slowest device does.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..hdp.collector_pause import collector_paused
from .long_context_model import EmulatedRanks, start_device

REPLAY = "replay"


@dataclass(frozen=True)
class CPLabConfig:
    """One emulated CP run. ``variants``: ``(mode, a2a size, overlap)`` triples (``cli/bench_cp.py``
    fills every candidate and the waited ring); ``time_factor`` 0: the driver sets it from
    ``step_s``; ``node_size`` / ``intra_GBps`` / ``inter_GBps`` 0: the hardware's."""

    model: str = "llama3-8b"
    hardware: str = "h100-sxm"
    seq: int = 131072
    cp: int = 16
    ranks: int = 16
    node_size: int = 0
    intra_GBps: float = 0.0
    inter_GBps: float = 0.0
    layer_groups: int = 2
    rows: int = 1024
    step_s: float = 3.0
    time_factor: float = 0.0
    variants: tuple = ()
    steps: int = 3
    warmup: int = 1

    @property
    def row_unit(self) -> int:
        return self.seq // self.rows


def cost_and_link(cfg: CPLabConfig):
    """(the ``HdpCostModel`` on the run's fabric, the ``TwoTierLink``): what the lab and the
    simulator both price the run with."""
    from ..hdp.cost import HdpCostModel
    from ..tune.hardware import get_hardware
    from ..tune.two_tier import TwoTierLink

    link = TwoTierLink.for_hardware(get_hardware(cfg.hardware), cfg.node_size, cfg.intra_GBps, cfg.inter_GBps)
    return link.apply_to(HdpCostModel.named(cfg.hardware, cfg.model)), link


def variant_name(variant) -> str:
    mode, size, overlap = variant
    if mode == "ring":
        return "ring" if overlap else "ring, waited"
    return "a2a (Ulysses)" if mode == "a2a" else f"hybrid U={size}"


class CPClusterRanks(EmulatedRanks):
    """Per-rank state of one run (through ``lab.session``)."""

    def __init__(self, cfg):
        cfg = CPLabConfig(**cfg) if isinstance(cfg, dict) else cfg
        from ..cp.step_model import LayerCosts, groups_of
        from .emulated_attention import TimedBlocks
        from .long_context_model import EmulatedTransformer, emulated_two_tier

        torch.set_num_threads(1)
        logging.getLogger("megatron_overlap").setLevel(logging.ERROR)
        if dist.get_world_size() != cfg.ranks:
            raise ValueError(f"the emulated CP run needs {cfg.ranks} ranks, got {dist.get_world_size()}")
        if not cfg.time_factor > 0:
            raise ValueError("the driver sets time_factor (cli/bench_cp.py)")
        self.cfg = cfg
        cost, link = cost_and_link(cfg)
        self.costs = LayerCosts.of(cost)
        groups = groups_of(self.costs.layers, cfg.layer_groups)
        per_group = groups[0]
        tf = cfg.time_factor
        self.byte_factor = 1.0 / (self.costs.head_dim * cfg.row_unit)
        self.spec, self.free_spec, self.clock, self.link = emulated_two_tier(link, self.byte_factor, per_group, tf,
                                                                             cfg.ranks)
        self.blocks = TimedBlocks(self.clock, self.costs.pair_ms * tf, self.costs.bwd_factor, self.costs.heads,
                                  cfg.row_unit)
        self.blocks.layers = per_group
        self.model = EmulatedTransformer(self.costs, self.clock, groups, tf, self.costs.heads, self.costs.kv_heads)
        rank = dist.get_rank()
        base = rank - rank % cfg.cp
        self.cp_ranks = list(range(base, base + cfg.cp))
        self.per_group = per_group
        gc.collect()
        gc.freeze()

    def describe(self) -> dict:
        return {"rank": dist.get_rank(), "link": self.spec.as_dict(), "byte_factor": self.byte_factor,
                "layers_per_group": self.per_group}

    def _attend(self, variant):
        from ..cp.attention import cp_attention

        mode, size, overlap = variant
        return lambda q, k, v: cp_attention(q, k, v, mode=mode, causal=True, group=dist.group.WORLD,
                                            ranks=self.cp_ranks, a2a_size=size if mode == "hybrid" else None,
                                            overlap=overlap)

    def _step(self, variant) -> dict:
        from .cluster import _common_start
        from .emulated_attention import local_exchanges

        replay = variant == REPLAY
        attend = self._attend(("ring", 1, True) if replay else tuple(variant))
        rows = self.cfg.rows // self.cfg.cp
        self.clock.reset()
        self.link.reset()
        gc.collect()
        with self.blocks.installed(), local_exchanges() if replay else contextlib.nullcontext():
            t0 = _common_start()
            self.link.reset()  # the start's all-reduce is not the step's traffic
            t0 = start_device(self.clock, t0)  # the device starts here, after the start's all-reduce
            c0 = time.thread_time()
            with collector_paused():
                self.model.step(rows, rows * self.cfg.row_unit, attend)
            self.clock.sync()
            t1, c1 = self.clock.end, time.thread_time()  # the device's end, not the host's wake-up after it
        stats = self.link.reset()
        return {"wall_s": t1 - t0, "cpu_s": c1 - c0, "busy_s": self.clock.busy_s, "late_s": self.clock.late_s, "blocked_s": stats.blocked_s,
                "bytes": stats.total_bytes, "bytes_by_tier": dict(stats.bytes_by_tier)}

    def round(self, index: int) -> dict:
        order = [REPLAY] + [tuple(v) for v in self.cfg.variants]
        if index % 2:
            order.reverse()
        return {variant_name(v) if v != REPLAY else REPLAY: self._step(v) for v in order}
