"""The emulated cluster: PP x DP ranks on a few CPU cores, the real schedule, DDP and
distributed optimizer around a model whose compute is a wait (``lab/emulated_model.py``).

Each rank builds its pipeline stage of the modelled run (``tune/pipeline.stage_work``: the
cost model's F, B, W per block for a named model and GPU, parameters and activations at
``scale`` of their modelled sizes), wraps it in Megatron's ``DistributedDataParallel``
(``overlap_grad_reduce``; the distributed optimizer with ``overlap_param_gather``, or plain
DDP) and Megatron's optimizer (Adam, gradient clipping), and trains it with Megatron-LM's
step: zero the grad buffers, the pipeline schedule (stock's or ours, through
``get_forward_backward_func``), ``optimizer.step()``. Every byte goes through the emulated link
(``lab/emulated_link.py``): one egress port per rank and process group (the pipeline's and
the data-parallel communicators side by side), the cost model's fabric for the modelled run
(InfiniBand between nodes, NVLink inside one: two tiers when nodes hold several emulated
ranks), bandwidth times ``scale`` so each transfer takes its modelled time.

Each schedule trains its own copy of the model from the same start (one DDP and optimizer per
schedule), one step each per round, order alternating; optionally each step is repeated with
the data-parallel traffic free (its collectives counted and not run: no real gloo op either)
and with every transfer free, so the exposed P2P and DP times are differences of steps, as
the simulator computes them. Those repeats compute on unreduced gradients and partly gathered
parameters and take no optimizer step: the model trains on the modelled link's steps alone.
Times, not numerics: the losses are those of the cheap math the emulated blocks compute (equal
across schedules when the schedules compute the same thing).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import math
import os
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

from ..hdp.collector_pause import collector_paused

MODES = ("stock", "1f1b", "zb")
ALL_MODES = MODES + ("1f1b-inflight", "zbv", "1f1b-ec", "zb-ec", "zbv-ec")  # K = 2p - 1; ZB-V; every-chunk: by name
TARGET_ELEMENTS = 500_000  # parameter elements of the largest stage after scaling: gloo moves real bytes with real CPU
VARIANTS = ("link", "dp free", "free")


@dataclass(frozen=True)
class ClusterConfig:
    """One emulated run. ``scale`` 0: chosen so the largest stage holds ``TARGET_ELEMENTS``
    parameter elements. ``node_size`` 0: the hardware's GPUs per node / TP (emulated ranks per
    node). ``exposed``: also run each step with DP free and with everything free."""

    pp: int = 4
    dp: int = 2
    microbatches: int = 16
    model: str = "llama3-70b"
    hardware: str = "h100-sxm"
    tp: int = 8
    seq: int = 8192
    micro_batch: int = 1
    scale: float = 0.0
    node_size: int = 0
    distributed_optimizer: bool = True
    tp_strategy: str = "megatron"  # the TP strategy inside each stage whose times the cost model gives
    durations: str = ""  # a file of durations measured on this CPU (lab/durations.py) instead of the cost model
    steps: int = 4
    warmup: int = 1
    exposed: bool = True
    modes: tuple = MODES
    seed: int = 0
    vpp: int = 1  # model chunks per stage (lab/cluster_chunks.py): stock is then Megatron's interleaved 1F1B
    bucket_factor: float = 1.0  # DDP's bucket size: Megatron's default for the modelled run times this, every schedule

    @property
    def world(self) -> int:
        return self.pp * self.dp


def modelled(cfg: ClusterConfig):
    """(the stages' costs, the cost model's run, hardware) of ``cfg``: the cost model's for the
    named model and GPU, or a durations file's (``lab/durations.py``)."""
    from ..tune.hardware import get_hardware
    from ..tune.models import RunSpec, get_model
    from ..tune.pipeline import stage_costs

    from ..tune.strategies import Strategy

    if cfg.durations:
        from .durations import modelled_costs

        return modelled_costs(cfg)
    model, hw = get_model(cfg.model), get_hardware(cfg.hardware)
    run = RunSpec(tp=cfg.tp, pp=cfg.pp, dp=cfg.dp, seq=cfg.seq, micro_batch=cfg.micro_batch,
                  micro_batches=cfg.microbatches)
    return stage_costs(model, run, hw, Strategy(cfg.tp_strategy)), run, hw


def placement(cfg: ClusterConfig, costs) -> tuple:
    """The (F, B, W) zb places its weight gradients for, as the install computes it on the
    modelled GPU (``pp.build.placement_times`` on the cost model's times and DP sync)."""
    from ..pp.build import placement_times
    from ..pp.schedule_sim import LinkCost

    return placement_times(costs.times, cfg.microbatches, LinkCost(transfer_ms=costs.transfer_ms), costs.dp_ours())


def choose_scale(costs, target: int = TARGET_ELEMENTS) -> float:
    biggest = max(sum(b.param_count for b in blocks) for blocks in costs.work)
    return min(1.0, target / biggest) if biggest else 1.0


def link_spec(cfg: ClusterConfig, hw, scale: float):
    """The emulated link of the modelled fabric, bandwidths times ``scale``."""
    from .link_spec import LinkSpec

    per_node = cfg.node_size or max(1, hw.gpus_per_node // cfg.tp)
    inter, intra = hw.inter, hw.intra
    if per_node >= cfg.world and not cfg.node_size:  # every rank in one node: one tier, the node's
        inter, per_node = intra, 1
    two_tier = per_node > 1
    return LinkSpec(bandwidth_GBps=inter.bandwidth_GBps * scale, latency_us=inter.latency_us,
                    launch_us=inter.launch_us, ports="group", node_size=per_node if two_tier else 0,
                    intra_GBps=intra.bandwidth_GBps * scale if two_tier else 0.0,
                    intra_latency_us=intra.latency_us if two_tier else 0.0,
                    intra_launch_us=intra.launch_us if two_tier else 0.0)


class _Replica:
    """One schedule's copy of this rank's stage: model, DDP, optimizer."""

    def __init__(self, cfg: ClusterConfig, blocks, shape, device, scale: float):
        from megatron.core import parallel_state
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        from ..pp.buckets import default_bucket_size
        from .emulated_model import EmulatedStage, stage_config

        stage = parallel_state.get_pipeline_model_parallel_rank()
        config = stage_config(cfg.pp, len(blocks))
        module = EmulatedStage(config, blocks, shape, device, first=stage == 0, last=stage == cfg.pp - 1,
                               seed=cfg.seed * 100 + stage)
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=True, use_distributed_optimizer=cfg.distributed_optimizer,
            overlap_param_gather=cfg.distributed_optimizer,
            bucket_size=max(1, int(default_bucket_size(cfg.dp) * cfg.bucket_factor * scale)))
        self.ddp = DistributedDataParallel(config, ddp_config, module)
        opt = OptimizerConfig(optimizer="adam", lr=1e-3, weight_decay=0.0, bf16=True, params_dtype=torch.bfloat16,
                              use_distributed_optimizer=cfg.distributed_optimizer, clip_grad=1.0)
        from .cpu_shims import CPUDevices

        with open(os.devnull, "w") as sink, contextlib.redirect_stdout(sink), CPUDevices():
            self.optimizer = get_megatron_optimizer(opt, [self.ddp])
        config.no_sync_func = self.ddp.no_sync
        config.grad_sync_func = self.ddp.start_grad_sync  # Megatron-LM's align_grad_reduce (its default)
        config.finalize_model_grads_func = finalize_model_grads
        config.grad_scale_func = self.optimizer.scale_loss
        self.config = config
        self.module = module
        self.models = [self.ddp]

    def zero_grad(self) -> None:
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()

    def bucket_numels(self) -> list:
        """Elements per DDP bucket (gradient buffers), in the order the backward fills them."""
        return [b.numel_unpadded for buf in self.ddp.buffers for b in buf.buckets]

    def bucket_chunks(self) -> list:
        return []

    def parameters(self):
        return list(self.module.parameters())


START_MARGIN_S = 0.03  # every rank idle before the step: no rank's wake-up delays another's first op


def _common_start() -> float:
    """Start the step on every rank at one instant (``perf_counter`` is the machine's monotonic
    clock, the same in every process): the latest rank's now plus a margin, agreed by an
    all-reduce; returns it."""
    when = torch.tensor([time.perf_counter() + START_MARGIN_S], dtype=torch.float64)
    dist.all_reduce(when, op=dist.ReduceOp.MAX)
    start = when.item()
    left = start - time.perf_counter()
    if left > 0:
        time.sleep(left)
    return start


def _dp_groups(ddp) -> list:
    """The process groups Megatron DDP's buckets reduce and gather over."""
    out = []
    for bg in list(ddp.bucket_groups) + list(getattr(ddp, "expert_parallel_bucket_groups", [])):
        for name in ("intra_distributed_optimizer_instance_group", "data_parallel_group"):
            group = getattr(bg, name, None)
            if group is not None:
                out.append(group)
    return out


def _virtual(v: int):
    from .virtual_gpt import virtual_pipeline

    return virtual_pipeline(v) if v > 1 else contextlib.nullcontext()


class ClusterRanks:
    """Per-rank state of one emulated run (through ``lab.session``)."""

    def __init__(self, cfg):
        cfg = ClusterConfig(**cfg) if isinstance(cfg, dict) else cfg
        import megatron_overlap
        from megatron.core import parallel_state

        from . import tiny_gpt
        from .compute_clock import ComputeClock
        from .emulated_link import EmulatedLink
        from .emulated_model import Device, EmulatedShape

        torch.set_num_threads(1)
        for name in ("megatron_overlap", "megatron", "megatron.core"):
            logging.getLogger(name).setLevel(logging.ERROR)
        megatron_overlap.uninstall()
        if dist.get_world_size() != cfg.world:
            raise ValueError(f"the emulated cluster needs {cfg.world} ranks (PP {cfg.pp} x DP {cfg.dp}), "
                             f"got {dist.get_world_size()}")
        self.cfg = cfg
        tiny_gpt.init_parallel(1, pp=cfg.pp)
        self.stage = parallel_state.get_pipeline_model_parallel_rank()
        self.dp_rank = parallel_state.get_data_parallel_rank()
        costs, _run, hw = modelled(cfg)
        self.costs = costs
        self.placement = placement(cfg, costs)
        self.scale = cfg.scale or choose_scale(costs)
        self.shape = EmulatedShape.for_bytes(costs.transfer_bytes, cfg.micro_batch, self.scale)
        self.blocks = costs.work[self.stage]
        self.clock = ComputeClock()
        from .cpu_shims import CPUDevices

        self.devices = CPUDevices()
        self.device = Device(self.clock)
        from .cluster_chunks import ChunkReplica

        self.replicas = {mode: ChunkReplica(cfg, mode, self.blocks, self.shape, self.device, self.scale)
                         if cfg.vpp > 1 else _Replica(cfg, self.blocks, self.shape, self.device, self.scale)
                         for mode in cfg.modes}
        self.spec = link_spec(cfg, hw, self.scale)
        self.spec.check_world(cfg.world)
        self.link = EmulatedLink(self.spec).install()
        self.link.clock = self.clock
        self._free = None
        from .link_spec import LinkSpec

        self.free_spec = LinkSpec(bandwidth_GBps=1e9, latency_us=0.0, ports="group")
        self.dp_channels = tuple({self.link._channel(g) for rep in self.replicas.values() for d in rep.models
                                  for g in _dp_groups(d)})
        gc.collect()
        gc.freeze()  # what lives now (Megatron's modules, the replicas) is never walked again

    def describe(self) -> dict:
        rep = next(iter(self.replicas.values()))
        return {"stage": self.stage, "dp_rank": self.dp_rank, "scale": self.scale, "rows": self.shape.rows,
                "buckets": rep.bucket_numels(), "bucket_chunks": rep.bucket_chunks(), "link": self.spec.as_dict(),
                "mode_buckets": {k: (r.bucket_numels(), r.bucket_chunks()) for k, r in self.replicas.items()},
                "params": sum(p.numel() for p in rep.parameters()),
                "act_bytes": self.shape.act_elements * 2}

    # -- one step -------------------------------------------------------------------------------
    def _install(self, mode: str):
        """Stock, or ours as ``install`` sets it up on the modelled GPU: zb's weight gradients
        placed for the cost model's times (``placement``, what the install computes from
        Megatron's arguments there)."""
        import megatron_overlap
        from ..config import OverlapConfig, PPConfig
        from .cluster_chunks import lab_pp

        megatron_overlap.uninstall()
        if mode == "stock":
            return None
        k = min(self.cfg.microbatches, 2 * self.cfg.pp - 1)
        pp = PPConfig(mode="1f1b", max_inflight=k, explicit=frozenset({"max_inflight"})) if mode == "1f1b-inflight" \
            else lab_pp(mode)
        inst = megatron_overlap.install(OverlapConfig(pp=pp))
        if pp.split:
            inst.pp_times = self.placement
        return inst

    def _step(self, mode: str, step: int, record: bool = False, train: bool = True) -> dict:
        """One step of ``mode``'s replica, and its optimizer step when ``train`` (a repeat with
        the DP traffic free computes on unreduced gradients: it does not train)."""
        from megatron.core import pipeline_parallel

        import megatron_overlap
        from .emulated_model import data

        rep = self.replicas[mode]
        inst = self._install(mode)
        self.device.store = inst.wgrad if inst is not None else None
        batches = data(self.shape, step, self.cfg.microbatches, self.dp_rank)

        def forward_step(data_iterator, model):
            tokens, labels = next(data_iterator)
            output = model(tokens, labels)

            def loss_func(losses):
                loss = losses.float().mean()
                return loss, {"loss": loss.detach().clone()}  # Megatron divides the loss in place

            return output, loss_func

        self.clock.reset()
        self.device.reset_memory()
        self.clock.record = record
        self.link.reset()
        self.link.record_spans = record
        # Megatron-LM's step zeroes the buffers first (a device memset on a GPU); here before the
        # clock starts, with the install and the data, so that no rank's CPU setup delays another's
        rep.zero_grad()
        v = self.cfg.vpp
        with _virtual(v):
            schedule = pipeline_parallel.get_forward_backward_func()  # looked up now: the install replaces it
        data_iterator = [iter(batches) for _ in range(v)] if v > 1 else iter(batches)
        gc.collect()  # between steps, the collector off in them (Megatron-LM's --manual-gc)
        t0 = _common_start()
        c0 = time.thread_time()
        with _virtual(v), collector_paused():
            out = schedule(
                forward_step_func=forward_step, data_iterator=data_iterator, model=rep.models,
                num_microbatches=self.cfg.microbatches, seq_length=self.shape.rows,
                micro_batch_size=self.shape.micro_batch, forward_only=False)
        self.clock.sync()
        t_sched = time.perf_counter()
        if train:
            with self.devices:  # Megatron's optimizer makes its scalars on "cuda"
                rep.optimizer.step()
        self.clock.sync()
        t1, c1 = time.perf_counter(), time.thread_time()
        stats = self.link.reset()
        megatron_overlap.uninstall()
        loss = torch.zeros(())
        has_loss = bool(out) and all("loss" in d for d in out)  # the stage with the model's last layer
        if has_loss:
            loss = torch.stack([d["loss"] for d in out]).mean()
        self.device.store = None
        r = {"wall_s": t1 - t0, "schedule_s": t_sched - t0, "optimizer_s": t1 - t_sched, "cpu_s": c1 - c0, "busy_s": self.clock.busy_s, "peak_microbatches": self.device.peak,
             "loss": loss.item(), "has_loss": has_loss, "blocked": dict(stats.blocked_by_op),
             "bytes": stats.total_bytes}
        if record:
            r["trace"] = {"compute": [(k, a - t0, b - t0) for k, a, b in self.clock.spans],
                          "link": [(x.op, x.start - t0, x.done - t0) for x in stats.spans],
                          "waits": [(op, a - t0, b - t0) for op, (a, b) in zip(stats.wait_ops, stats.waits)]}
        return r

    def _variant(self, variant: str):
        """The link for one variant of a step: as modelled, DP free, or everything free."""
        if variant == "link":
            self.link.spec = self.spec
            self.link.free_channels = ()
        elif variant == "dp free":
            self.link.spec = self.spec
            self.link.free_channels = self.dp_channels
        else:  # the DP collectives not run here either: the two variants differ by the P2P link alone
            self.link.spec = self.free_spec
            self.link.free_channels = self.dp_channels

    def round(self, index: int, record: bool = False) -> dict:
        modes = list(self.cfg.modes)
        order = modes if index % 2 == 0 else list(reversed(modes))
        variants = VARIANTS if self.cfg.exposed else ("link",)
        out = {"stage": self.stage, "dp_rank": self.dp_rank}
        for mode in order:
            out[mode] = {}
            for variant in variants:
                self._variant(variant)
                out[mode][variant] = self._step(mode, index, record=record and variant == "link",
                                                train=variant == "link")
        self._variant("link")
        return out

    def close(self) -> dict:
        import megatron_overlap

        megatron_overlap.uninstall()
        self.link.uninstall()
        gc.unfreeze()  # the rank process goes on (a test pool's): its collector as it was
        return {}
