"""The tiny GPT as a virtual pipeline (Megatron's interleaved placement): ``v`` model chunks per
stage, each a ``GPTModel`` built with its ``vp_stage`` (Megatron numbers its layers from the
layer offset), each in its own Megatron DDP (bucketing on the first chunk only, as Megatron-LM's
``get_model``), trained through Megatron's pipeline schedule as ``pipeline_gpt`` does: its
interleaved one unless ``--overlap-pp`` takes it over. The parity tests use it."""

from __future__ import annotations

import contextlib
from typing import Callable, Optional

import torch
import torch.distributed as dist

from . import tiny_gpt
from .pipeline_gpt import PipelineGPT


@contextlib.contextmanager
def virtual_pipeline(v: int):
    """Megatron's parallel state with a virtual pipeline of ``v`` chunks, restored after."""
    from megatron.core import parallel_state

    before = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    parallel_state.set_virtual_pipeline_model_parallel_world_size(v)
    try:
        yield
    finally:
        parallel_state.set_virtual_pipeline_model_parallel_world_size(before)


def build_chunk(spec: tiny_gpt.TinyGPT, tp: int, pp: int, v: int, vp_stage: int, **overrides):
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    config = tiny_gpt.transformer_config(spec, tp, True, pipeline_model_parallel_size=pp,
                                         virtual_pipeline_model_parallel_size=v, pipeline_dtype=torch.float32,
                                         **overrides)
    layer = get_gpt_layer_local_spec(normalization=spec.normalization)
    layer.submodules.input_layernorm = tiny_gpt._SPNorm
    layer.submodules.pre_mlp_layernorm = tiny_gpt._SPNorm
    block = TransformerBlockSubmodules(layer_specs=[layer] * (spec.num_layers // (pp * v)), layer_norm=tiny_gpt._SPNorm)
    return GPTModel(
        config=config, transformer_layer_spec=block, vocab_size=spec.vocab, max_sequence_length=spec.seq,
        position_embedding_type="rope", share_embeddings_and_output_weights=False,
        pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
        post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
        vp_stage=vp_stage)


class VirtualPipelineTrainer:
    """This rank's ``v`` chunks of the tiny GPT in Megatron DDP, a reusable start. With
    ``overlap_grad_reduce`` the chunks' ``start_grad_sync`` are the ``grad_sync_func`` (Megatron-LM's
    ``align_grad_reduce``)."""

    def __init__(self, setup: PipelineGPT, v: int, overlap_grad_reduce: bool, distributed_optimizer: bool = False):
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.distributed import finalize_model_grads

        self.setup, self.v = setup, v
        tiny_gpt.init_parallel(setup.tp, pp=setup.pp)
        with virtual_pipeline(v):
            # Megatron-LM's P2P settings with a virtual pipeline: overlapped, not batched (batched, at PP=2 the
            # previous and the next stage are one rank and its batch pairs an activation with a gradient).
            # Not Megatron-LM's deallocate_pipeline_outputs: on gloo, Megatron's interleaved schedule then frees
            # an output its isend may still be reading, and its own losses move (docs/pipelines.md, virtual pipelines)
            chunks = [build_chunk(setup.spec, setup.tp, setup.pp, v, c, gradient_accumulation_fusion=True,
                                  overlap_p2p_comm=True, batch_p2p_comm=False) for c in range(v)]
        gather = distributed_optimizer and overlap_grad_reduce
        ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=overlap_grad_reduce,
                                                   bucket_size=4096, use_distributed_optimizer=distributed_optimizer,
                                                   overlap_param_gather=gather, align_param_gather=gather)
        self.ddps = [DistributedDataParallel(chunk.config, ddp_config, chunk, disable_bucketing=c > 0)
                     for c, chunk in enumerate(chunks)]
        config = chunks[0].config
        config.no_sync_func = [d.no_sync for d in self.ddps]
        config.finalize_model_grads_func = finalize_model_grads
        if overlap_grad_reduce:
            config.grad_sync_func = [d.start_grad_sync for d in self.ddps]
        if gather:  # Megatron-LM with align_param_gather: the schedule launches each chunk's gather
            config.param_sync_func = [d.start_param_sync for d in self.ddps]
        self.optimizer = self._optimizer() if distributed_optimizer else None
        if self.optimizer is not None:
            config.grad_scale_func = self.optimizer.scale_loss
        self.start = self.state()

    def _optimizer(self):
        """Megatron's distributed optimizer (Adam, clipping) over the chunks; made for one run."""
        import os

        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        from .cpu_shims import CPUDevices, optimizer_shims

        optimizer_shims()
        opt = OptimizerConfig(optimizer="adam", lr=1e-3, weight_decay=0.0, params_dtype=torch.float32,
                              use_distributed_optimizer=True, clip_grad=1.0)
        with open(os.devnull, "w") as sink, contextlib.redirect_stdout(sink), CPUDevices():
            return get_megatron_optimizer(opt, self.ddps)

    def params(self) -> list:
        return [p for d in self.ddps for p in d.module.parameters()]

    def state(self) -> list:
        return [p.detach().clone() for p in self.params()]

    def reset(self) -> None:
        with torch.no_grad():
            for p, x in zip(self.params(), self.start):
                p.copy_(x)

    def step(self, step: int, lr: float = 1e-2, on_grads: Optional[Callable[[list], None]] = None) -> float:
        from megatron.core import parallel_state
        from megatron.core.pipeline_parallel import get_forward_backward_func

        spec, m = self.setup.spec, self.setup.microbatches
        tiny_gpt.init_parallel(self.setup.tp, pp=self.setup.pp)
        for d in self.ddps:
            d.zero_grad_buffer()
        if self.optimizer is not None:
            self.optimizer.zero_grad()

        def forward_step(data_iterator, model):
            tokens, labels, position_ids, mask = next(data_iterator)
            output = model(tokens, position_ids, mask, labels=labels)
            return output, lambda losses: (losses.float().mean(), {"loss": losses.float().mean().detach()})

        with virtual_pipeline(self.v):
            iterators = [iter([tiny_gpt.batch(spec, step * m + i) for i in range(m)]) for _ in range(self.v)]
            data = get_forward_backward_func()(
                forward_step_func=forward_step, data_iterator=iterators, model=self.ddps, num_microbatches=m,
                seq_length=spec.seq, micro_batch_size=spec.micro_batch)
        self.last_data = data
        if on_grads is not None:
            on_grads([p.main_grad.detach().clone() for p in self.params()])
        if self.optimizer is not None:
            self.optimizer.step()
        else:
            with torch.no_grad():
                for p in self.params():
                    p.add_(p.main_grad, alpha=-lr)
        loss = torch.zeros(())
        with virtual_pipeline(self.v):  # the stage with the loss (ZB-V's: stage 0)
            last = parallel_state.is_pipeline_last_stage()
        if last:
            loss = torch.stack([d["loss"] for d in data]).mean()
        dist.all_reduce(loss, group=parallel_state.get_pipeline_model_parallel_group())
        dp = parallel_state.get_data_parallel_group()
        dist.all_reduce(loss, group=dp)
        return loss.item() / dist.get_world_size(dp)
