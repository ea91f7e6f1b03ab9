"""Megatron-LM's training loop (``megatron.training``), for ``--overlap-trace`` (patch table in
``install.py``): ``training.train_step``, looked up by ``train()`` at call time, is wrapped so
the chosen iterations are profiled. Without Megatron-LM's training loop (megatron-core only),
the user's loop calls :class:`megatron_overlap.trace.tracer.StepTracer` itself."""

from __future__ import annotations

import functools
import itertools


def patch_train_step(inst) -> None:
    try:
        from megatron.training import training
    except ImportError:
        inst.notice_once("no-training", "`trace.dir`: no Megatron-LM training loop here (megatron.training); wrap "
                         "your iterations in megatron_overlap.trace.tracer.StepTracer(...).step(i) instead")
        return
    import torch.distributed as dist

    from ..trace.tracer import StepTracer

    tracer = StepTracer(inst.config.trace.dir, inst.config.trace.iterations)
    original = training.__dict__["train_step"]
    calls = itertools.count()

    @functools.wraps(original)
    def train_step(*args, **kwargs):
        tracer.rank = dist.get_rank() if dist.is_initialized() else 0
        with tracer.step(next(calls)):
            return original(*args, **kwargs)

    inst.set_attr(training, "train_step", train_step)
