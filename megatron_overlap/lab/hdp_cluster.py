"""Hybrid data parallelism on the emulated cluster (``bench hdp --emulate``; driver
``cli/bench_hdp_emulate.py``): R ranks on this machine, each one GPU (TP = 1) with its share of a
full batch of real document lengths, the product's HDP runtime (its lengths all-gather, the plan,
the row exchange, micro-batches with their rings and packed layouts, ``cp_attention`` over each
ring on the one process group), compute as waits of the cost model's times
(``lab/long_context_model.py``: linears per row, attention per causal pair of each document,
``lab/emulated_attention.py``), the bytes on the emulated two-tier link.

Plans executed, each the way its runtime runs it:

    hdp                ours (``hdp.planahead.Planner``, what ``make_runtime`` plans with): one phase
    static             fixed CP from the longest sequence, greedy token packing: one phase
    megatron_balanced  megatron-core's ``BalancedCPScheduler`` (``integration.baselines``): its
                       groups one after the other, a barrier after each (its
                       ``hybrid_context_parallel_forward_backward`` calls ``torch.distributed.barrier``)

Per rank and micro-batch, forward then backward (``hdp.runtime.forward_backward``'s order), a
micro-batch of documents held whole in one layer group (no communication to interleave), a ring's
in ``layer_groups`` groups. Tensors are per token (rows = tokens, padding included) with one
element per head, one query and one key/value head: bytes on the wire are the modelled bytes x
``1 / (kv_heads x head_dim)``, the link scaled to match. The lengths all-gather and the row
exchange run before the clock starts, on a free link (the exchange moves 24 bytes per moved
token: the cost model leaves it out). A barrier is a barrier of the devices: every rank resumes
at the latest rank's device time (an all-reduce of the clocks). The hosts run ahead of their
devices, as on a GPU (``long_context_model.start_device``).

Each step is also run with every transfer free; exposed communication = step - that step.
Times, not numerics.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import time
from dataclasses import dataclass, replace
from types import SimpleNamespace
from typing import Sequence

import torch
import torch.distributed as dist

from ..hdp.collector_pause import collector_paused
from .long_context_model import EmulatedRanks, start_device

SCHEDULERS = ("hdp", "static", "megatron_balanced")
VARIANTS = ("link", "free")


@dataclass(frozen=True)
class HDPLabConfig:
    """One emulated HDP run over ``batches`` (lists of sequence lengths, the same on every rank;
    sequence i loaded by rank i mod R). ``time_factor``: clock seconds per modelled second (the
    driver sets it); ``node_size`` / ``*_GBps`` 0: the hardware's."""

    batches: tuple = ()
    ranks: int = 16
    capacity: int = 32768
    model: str = "llama3-8b"
    hardware: str = "h100-sxm"
    node_size: int = 0
    intra_GBps: float = 0.0
    inter_GBps: float = 0.0
    layer_groups: int = 2
    time_factor: float = 0.0
    schedulers: tuple = SCHEDULERS
    exposed: bool = True
    seed: int = 0


def cost_and_link(cfg: HDPLabConfig):
    """(the ``HdpCostModel`` on the run's fabric, its ``TwoTierLink``): what the lab, the planner
    and the simulator all use."""
    from ..hdp.cost import HdpCostModel
    from ..tune.hardware import get_hardware
    from ..tune.two_tier import TwoTierLink

    link = TwoTierLink.for_hardware(get_hardware(cfg.hardware), cfg.node_size, cfg.intra_GBps, cfg.inter_GBps)
    return link.apply_to(HdpCostModel.named(cfg.hardware, cfg.model)), link


def plan_batch(name: str, seq_lens: Sequence[int], ranks: int, capacity: int, cost, home=None):
    """The plan scheduler ``name`` makes of one batch, as its runtime plans it."""
    if name == "megatron_balanced":
        from ..integration.baselines import schedule_megatron_balanced

        return schedule_megatron_balanced(list(seq_lens), ranks, capacity, cost)
    from ..hdp.planahead import Planner

    return Planner(name, ranks, capacity, "dp", cost)(list(seq_lens), home)


class LabAdapter:
    """The HDP runtime's model adapter for the emulated model: nothing to check, no positions to
    rotate, the ring's THD view as a plain namespace (what ``cp_attention`` reads)."""

    def check(self, model) -> None:
        pass

    def positions(self, model, position_ids, count):
        return contextlib.nullcontext()

    def require_patched(self) -> None:
        pass

    def packed_params(self, layout):
        return SimpleNamespace(qkv_format="thd", cu_seqlens_q=layout.cu_seqlens, cu_seqlens_kv=layout.cu_seqlens,
                               cu_seqlens_q_padded=layout.cu_seqlens_padded,
                               cu_seqlens_kv_padded=layout.cu_seqlens_padded)


class HDPClusterRanks(EmulatedRanks):
    """Per-rank state of one run (through ``lab.session``)."""

    def __init__(self, cfg):
        cfg = HDPLabConfig(**cfg) if isinstance(cfg, dict) else cfg
        from ..cp.step_model import LayerCosts, groups_of
        from .emulated_attention import TimedBlocks
        from .long_context_model import EmulatedTransformer, emulated_two_tier, rank_samples

        torch.set_num_threads(1)
        logging.getLogger("megatron_overlap").setLevel(logging.ERROR)
        if dist.get_world_size() != cfg.ranks:
            raise ValueError(f"the emulated HDP run needs {cfg.ranks} ranks, got {dist.get_world_size()}")
        if not cfg.time_factor > 0:
            raise ValueError("the driver sets time_factor (cli/bench_hdp_emulate.py)")
        self.cfg = cfg
        self.rank = dist.get_rank()
        self.cost, link = cost_and_link(cfg)
        costs = LayerCosts.of(self.cost)
        self.ring_groups = groups_of(costs.layers, cfg.layer_groups)
        self.local_groups = [costs.layers]
        per_group = self.ring_groups[0]
        tf = cfg.time_factor
        self.byte_factor = 1.0 / (costs.kv_heads * costs.head_dim)
        self.spec, self.free_spec, self.clock, self.link = emulated_two_tier(link, self.byte_factor, per_group, tf,
                                                                             cfg.ranks)
        self.blocks = TimedBlocks(self.clock, costs.pair_ms * tf, costs.bwd_factor, heads=1)
        self.model = EmulatedTransformer(costs, self.clock, self.ring_groups, tf, heads=1, kv_heads=1)
        self.per_group = per_group
        self.samples = rank_samples(cfg.batches, cfg.seed, self.rank, cfg.ranks)  # sequence i loaded by rank i mod R
        from ..hdp.runtime import HdpRuntime

        self.runtime = HdpRuntime(cfg.capacity, dist.group.WORLD, LabAdapter(), cost=self.cost, device="cpu")
        gc.collect()
        gc.freeze()

    def describe(self) -> dict:
        return {"rank": self.rank, "link": self.spec.as_dict(), "byte_factor": self.byte_factor,
                "layers_per_group": self.per_group}

    # -- one step -------------------------------------------------------------------------------
    def load(self, batch: int, scheduler: str):
        """Plan ``batch`` with ``scheduler`` and load this rank's micro-batches (untimed, on a free
        link): (the plan, [(phase, micro-batch)] in order, the phases every rank passes)."""
        self.link.spec = self.free_spec
        try:
            samples = self.samples[batch]
            gathered = self.runtime.gather(samples)
            plan = plan_batch(scheduler, gathered.seq_lens, self.cfg.ranks, self.cfg.capacity, self.cost,
                              gathered.home)
            step = self.runtime.load(samples, gathered, replace(plan, phases=None))  # rows do not depend on phases
        finally:
            self.link.spec = self.spec
        phases = [plan.phases[self.rank][k] for k, mb in enumerate(plan.microbatches[self.rank]) if mb]
        return plan, list(zip(phases, step.microbatches)), sorted({p for ph in plan.phases for p in ph})

    def _barrier(self, t0: float) -> None:
        """Every rank resumes at the latest device time (module docstring; ``t0``: the step's
        start, for a rank that ran nothing yet)."""
        t = torch.tensor([max(self.clock.end, t0)], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        self.clock.resume_at(t.item())

    def _attend(self, q, k, v):
        from ..cp import ring_context
        from ..cp.attention import cp_attention

        ring = ring_context.current()
        return cp_attention(q, k, v, mode="ring", causal=True, group=ring.group, ranks=ring.ranks, packed=ring.packed)

    def _run(self, mbs, phases) -> dict:
        from .cluster import _common_start

        self.clock.reset()
        self.link.reset()
        gc.collect()
        with self.blocks.installed(packed=True):
            t0 = _common_start()
            self.link.reset()  # the start's all-reduce is not the step's traffic
            t0 = start_device(self.clock, t0)  # the device starts here, after the start's all-reduce
            c0 = time.thread_time()
            with collector_paused():
                for p in phases:
                    for phase, mb in mbs:
                        if phase != p:
                            continue
                        ring = len(mb.layout.ring) > 1
                        groups = self.ring_groups if ring else self.local_groups
                        self.blocks.layers = groups[0]
                        with mb.context():
                            self.model.step(mb.layout.rows, mb.layout.rows, self._attend, groups)
                    if p != phases[-1]:
                        self._barrier(t0)
            self.clock.sync()
            t1, c1 = self.clock.end, time.thread_time()  # the device's end, not the host's wake-up after it
        stats = self.link.reset()
        return {"wall_s": t1 - t0, "cpu_s": c1 - c0, "busy_s": self.clock.busy_s, "late_s": self.clock.late_s, "bytes": stats.total_bytes,
                "bytes_by_tier": dict(stats.bytes_by_tier), "microbatches": len(mbs)}

    def _count_masks(self, mbs) -> None:
        """Count every packed block's pairs of this rank's micro-batches before the clock starts
        (``CountedPackedSpec`` and ``CountedPackedLayout`` keep them): the host of the first timed
        run would otherwise spend its budget on them, and fall behind its device, where the runs
        after it would not."""
        from ..cp import attention, ring_context
        from .emulated_attention import CountedPackedLayout, clear_counts

        clear_counts()  # the last step's
        with self.blocks.installed(packed=True):
            for _phase, mb in mbs:
                with mb.context():
                    ring = ring_context.current()
                    if ring is None or ring.packed is None:
                        continue
                    n = len(ring.ranks)
                    spec = attention._packed_spec(ring.packed, mb.layout.rows, n)
                    layout = CountedPackedLayout([spec.info(p) for p in range(n)], True, docs=len(spec.cu) - 1,
                                                 device="cpu")
                    x = ring.ranks.index(self.rank)
                    layout.own(x)
                    for j in range(n):
                        for i in range(len(layout.pieces)):
                            if j != x:
                                layout.plan(x, j, i)

    def step(self, batch: int, scheduler: str) -> dict:
        """One batch with one scheduler: on the link, and (``exposed``) with every transfer free."""
        _plan, mbs, phases = self.load(batch, scheduler)
        self._count_masks(mbs)
        out = {"link": self._run(mbs, phases)}
        if self.cfg.exposed:
            self.link.spec = self.free_spec
            try:
                out["free"] = self._run(mbs, phases)
            finally:
                self.link.spec = self.spec
        return out

    def round(self, index: int) -> dict:
        """Batch ``index``: every scheduler once, the order rotating with the batch."""
        return {name: self.step(index, name) for name in self.rotated(self.cfg.schedulers, index)}
