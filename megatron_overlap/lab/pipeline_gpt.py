"""The tiny GPT split over pipeline stages and trained through Megatron's pipeline schedule
(``get_forward_backward_func``, looked up at every step so an installed ``--overlap-pp`` takes
it over): the parity tests, ``bench pp`` and ``demo --pp`` share it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist

from . import tiny_gpt


@dataclass(frozen=True)
class PipelineGPT:
    spec: tiny_gpt.TinyGPT = tiny_gpt.TinyGPT(num_layers=4, hidden=64, ffn=160, heads=4, kv_heads=2, vocab=256,
                                               seq=32, micro_batch=2)
    tp: int = 1
    pp: int = 2
    microbatches: int = 4


class PipelineTrainer:
    """One model per process (this rank's stage), Megatron DDP around it, a reusable start.
    ``distributed_optimizer``: Megatron's distributed optimizer (Adam, gradient clipping; with
    ``overlap_grad_reduce`` its parameter all-gather overlapped with the next forward) instead
    of plain SGD on ``main_grad``, and ``grad_sync_func`` set as Megatron-LM sets it; a trainer
    made for one run (its optimizer state is not reset)."""

    def __init__(self, setup: PipelineGPT, overlap_grad_reduce: bool, distributed_optimizer: bool = False,
                 **config_overrides):
        from megatron.core.distributed import finalize_model_grads

        self.setup = setup
        tiny_gpt.init_parallel(setup.tp, pp=setup.pp)
        config_overrides.setdefault("gradient_accumulation_fusion", True)
        model = tiny_gpt.build(setup.spec, setup.tp, pipeline_model_parallel_size=setup.pp,
                               pipeline_dtype=torch.float32, **config_overrides)
        self.ddp = tiny_gpt.wrap_ddp(model, overlap_grad_reduce, distributed_optimizer=distributed_optimizer)
        config = model.config
        config.no_sync_func = self.ddp.no_sync
        config.finalize_model_grads_func = finalize_model_grads
        self.optimizer = None
        if distributed_optimizer:
            import contextlib
            import os

            from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

            from .cpu_shims import CPUDevices, optimizer_shims

            optimizer_shims()
            opt = OptimizerConfig(optimizer="adam", lr=1e-3, weight_decay=0.0, params_dtype=torch.float32,
                                  use_distributed_optimizer=True, clip_grad=1.0)
            with open(os.devnull, "w") as sink, contextlib.redirect_stdout(sink), CPUDevices():
                self.optimizer = get_megatron_optimizer(opt, [self.ddp])
            if overlap_grad_reduce:
                config.grad_sync_func = self.ddp.start_grad_sync  # Megatron-LM's align_grad_reduce
            config.grad_scale_func = self.optimizer.scale_loss
        self.start = [p.detach().clone() for p in self.ddp.module.parameters()]

    def reset(self) -> None:
        self.load(self.start)

    def state(self) -> list:
        return [p.detach().clone() for p in self.ddp.module.parameters()]

    def load(self, state: list) -> None:
        with torch.no_grad():
            for p, x in zip(self.ddp.module.parameters(), state):
                p.copy_(x)

    def microbatches(self, step: int):
        spec, m = self.setup.spec, self.setup.microbatches
        return iter([tiny_gpt.batch(spec, step * m + i) for i in range(m)])

    def step(self, step: int, lr: float = 1e-2, forward_only: bool = False,
             on_grads: Optional[Callable[[list], None]] = None, around=None) -> float:
        """One step: the pipeline schedule over the micro-batches, SGD on ``main_grad``; the
        global mean loss (the same on every rank). ``around``: a context manager entered for
        the schedule call only (the benchmark's timers and memory hooks)."""
        import contextlib

        from megatron.core import parallel_state
        from megatron.core.pipeline_parallel import get_forward_backward_func

        spec = self.setup.spec
        self.ddp.zero_grad_buffer()
        if self.optimizer is not None:
            self.optimizer.zero_grad()

        def forward_step(data_iterator, model):
            tokens, labels, position_ids, mask = next(data_iterator)
            output = model(tokens, position_ids, mask, labels=labels)

            def loss_func(losses):
                loss = losses.float().mean()
                return loss, {"loss": loss.detach()}

            return output, loss_func

        with around if around is not None else contextlib.nullcontext():
            data = get_forward_backward_func()(
                forward_step_func=forward_step, data_iterator=self.microbatches(step), model=[self.ddp],
                num_microbatches=self.setup.microbatches, seq_length=spec.seq, micro_batch_size=spec.micro_batch,
                forward_only=forward_only)
        if not forward_only:
            if on_grads is not None:
                on_grads([p.main_grad.detach().clone() for p in self.ddp.module.parameters()])
            if self.optimizer is not None:
                self.optimizer.step()
            else:
                with torch.no_grad():
                    for param in self.ddp.module.parameters():
                        param.add_(param.main_grad, alpha=-lr)
        loss = torch.zeros(())
        if parallel_state.is_pipeline_last_stage():
            loss = torch.stack([d["loss"] for d in data]).mean()
        # the last stage's loss, averaged over data-parallel replicas, on every rank
        dist.all_reduce(loss, group=parallel_state.get_pipeline_model_parallel_group())
        dp = parallel_state.get_data_parallel_group()
        dist.all_reduce(loss, group=dp)
        return loss.item() / dist.get_world_size(dp)
