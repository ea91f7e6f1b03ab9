"""Virtual pipelines on the emulated cluster (``lab/cluster.py`` with ``vpp`` > 1): each rank
holds ``v`` model chunks of its stage, as Megatron-LM's ``get_model`` builds them with
``--num-layers-per-virtual-pipeline-stage``: one Megatron DDP per chunk (stock and ours: bucketing on
stage 0's first chunk only; ours is built under the install as the flags do, so ``*-ec``
buckets every stage and chunk, ``integration/ddp.py``; the bucket size Megatron's default for the modelled run times
``bucket_factor``, the same for every schedule), one optimizer over the list, ``no_sync_func`` / ``grad_sync_func`` /
``param_sync_func`` one per chunk (Megatron-LM's ``align_grad_reduce`` and, with the
distributed optimizer, ``align_param_gather``: its defaults), Megatron-LM's P2P settings
there (``overlap_p2p_comm`` on, ``batch_p2p_comm`` off).

What a chunk computes: each block of the stage with ``1 / v`` of its F, B and W and ``1 / v`` of
its parameter elements, so a stage's work and its data-parallel bytes are those of the
non-interleaved run, and each chunk holds ``1 / v`` of a micro-batch's activations: the
simulator's assumption for virtual pipelines (``tune/virtual.py``, ``pp/schedule_sim.py``). Which
chunk starts the model (the embedding's lookup) and which ends it (the loss) follows the
mode's placement: Megatron's interleaved one (chunk c of stage s is virtual stage c p + s) for
stock, ``1f1b`` and ``zb``; the V for ``zbv`` (stage s holds virtual stages s and 2p - 1 - s,
the loss on stage 0). Times, not numerics: ZB-V's blocks sit elsewhere in its model, so its
losses are its own.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import replace

import torch

VIRTUAL_MODES = ("stock", "1f1b", "zb", "zbv")  # stock: Megatron's interleaved 1F1B
EVERY_CHUNK = ("1f1b-ec", "zb-ec", "zbv-ec")  # ours with ``--overlap-pp-buckets every-chunk``: asked for by name


def base_mode(mode: str) -> str:
    """The schedule of a lab mode (``zb-ec`` -> ``zb``)."""
    return mode[:-3] if mode in EVERY_CHUNK else mode


def lab_pp(mode: str):
    """The ``PPConfig`` a lab schedule installs (``1f1b-inflight`` is the caller's)."""
    from ..config import PPConfig

    if mode in EVERY_CHUNK:
        return PPConfig(mode=base_mode(mode), buckets="every-chunk", explicit=frozenset({"buckets"}))
    return PPConfig(mode=mode)


def virtual_index(mode: str, stage: int, chunk: int, p: int, v: int) -> int:
    """The virtual stage (0 = the model's first) of ``chunk`` on ``stage`` in ``mode``'s placement."""
    if base_mode(mode) == "zbv":
        return stage if chunk == 0 else 2 * p - 1 - stage
    return chunk * p + stage


@contextlib.contextmanager
def _installed(mode: str):
    """``--overlap-pp mode`` installed for the block (nothing for stock)."""
    import megatron_overlap
    from ..config import OverlapConfig

    megatron_overlap.uninstall()
    if mode != "stock":
        megatron_overlap.install(OverlapConfig(pp=lab_pp(mode)))
    try:
        yield
    finally:
        megatron_overlap.uninstall()


def chunk_blocks(blocks, v: int) -> list:
    """One chunk's share of a stage's blocks (module docstring)."""
    return [replace(b, f_ms=b.f_ms / v, b_ms=b.b_ms / v, w_ms=b.w_ms / v,
                    params=tuple(max(1, n // v) for n in b.params)) for b in blocks]


class ChunkReplica:
    """One schedule's copy of this rank's ``v`` chunks: the modules, their DDPs, one optimizer."""

    def __init__(self, cfg, mode: str, blocks, shape, device, scale: float):
        from megatron.core import parallel_state
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        from ..pp.buckets import default_bucket_size
        from .cpu_shims import CPUDevices
        from .emulated_model import EmulatedStage, stage_config

        p, v = cfg.pp, cfg.vpp
        stage = parallel_state.get_pipeline_model_parallel_rank()
        work = chunk_blocks(blocks, v)
        config = stage_config(p, len(work) * v, virtual_pipeline_model_parallel_size=v, overlap_p2p_comm=True,
                              batch_p2p_comm=False)
        self.index = [virtual_index(mode, stage, c, p, v) for c in range(v)]
        self.modules = [EmulatedStage(config, work, shape, device, first=j == 0, last=j == p * v - 1,
                                      seed=cfg.seed * 100 + j, unit=1.0 / v) for j in self.index]
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=True, use_distributed_optimizer=cfg.distributed_optimizer,
            overlap_param_gather=cfg.distributed_optimizer, align_param_gather=cfg.distributed_optimizer,
            bucket_size=max(1, int(default_bucket_size(cfg.dp) * cfg.bucket_factor * scale)))
        with _installed(mode):  # as the flags are before get_model wraps the chunks (*-ec: buckets everywhere)
            self.ddps = [DistributedDataParallel(config, ddp_config, m, disable_bucketing=c > 0)
                         for c, m in enumerate(self.modules)]
        opt = OptimizerConfig(optimizer="adam", lr=1e-3, weight_decay=0.0, bf16=True, params_dtype=torch.bfloat16,
                              use_distributed_optimizer=cfg.distributed_optimizer, clip_grad=1.0)
        with open(os.devnull, "w") as sink, contextlib.redirect_stdout(sink), CPUDevices():
            self.optimizer = get_megatron_optimizer(opt, self.ddps)
        config.no_sync_func = [d.no_sync for d in self.ddps]
        config.grad_sync_func = [d.start_grad_sync for d in self.ddps]
        if cfg.distributed_optimizer:
            config.param_sync_func = [d.start_param_sync for d in self.ddps]
        config.finalize_model_grads_func = finalize_model_grads
        config.grad_scale_func = self.optimizer.scale_loss
        self.config = config
        self.v = v

    @property
    def models(self) -> list:
        return self.ddps

    def zero_grad(self) -> None:
        for d in self.ddps:
            d.zero_grad_buffer()
        self.optimizer.zero_grad()

    def bucket_numels(self) -> list:
        """Elements per DDP bucket, chunk by chunk, each chunk's in the order its backward fills them."""
        return [b.numel_unpadded for d in self.ddps for buf in d.buffers for b in buf.buckets]

    def bucket_chunks(self) -> list:
        """The chunk of each of ``bucket_numels``."""
        return [c for c, d in enumerate(self.ddps) for buf in d.buffers for _ in buf.buckets]

    def parameters(self):
        return [p for m in self.modules for p in m.parameters()]
