"""Pipeline functions the tests run on every rank of the pool (importable by name)."""

from __future__ import annotations

import torch

_TRAINERS: dict = {}


def _trainer(tp: int, pp: int, overlap_grad_reduce: bool):
    """One model per layout and DDP setting per process, reset before each run."""
    from megatron_overlap.lab.pipeline_gpt import PipelineGPT, PipelineTrainer

    from megatron_overlap.lab import tiny_gpt

    key = (tp, pp, overlap_grad_reduce)
    if key not in _TRAINERS:
        _TRAINERS[key] = PipelineTrainer(PipelineGPT(tp=tp, pp=pp), overlap_grad_reduce)
    else:  # another test may have switched Megatron's parallel state to its layout since
        tiny_gpt.init_parallel(tp, pp=pp)
    return _TRAINERS[key]


def _install(mode: str, inflight, tp: int, sub_batches: int = 1):
    import megatron_overlap
    from megatron_overlap.config import OverlapConfig, PPConfig, TPConfig

    megatron_overlap.uninstall()
    if mode == "off":  # stock Megatron: its 1F1B and its linears
        return None
    explicit = frozenset({"max_inflight"}) if inflight else frozenset()
    config = OverlapConfig(tp=TPConfig(mode="p2p" if tp > 1 else "off", sub_batches=sub_batches),
                           pp=PPConfig(mode=mode, max_inflight=inflight, explicit=explicit))
    return megatron_overlap.install(config)


def pp_runs(tp: int, pp: int, overlap_grad_reduce: bool, runs: list, steps: int) -> dict:
    """For each (mode, microbatches, inflight) in ``runs``: ``steps`` losses from the same start
    and every parameter's gradient after the first step (this rank's stage)."""
    import dataclasses

    import megatron_overlap

    trainer = _trainer(tp, pp, overlap_grad_reduce)
    out = {}
    base = trainer.setup
    try:
        for run in runs:  # (mode, m, inflight[, sub-batches])
            mode, m, inflight = run[:3]
            trainer.setup = dataclasses.replace(base, microbatches=m)
            inst = _install(mode, inflight, tp, *run[3:])
            trainer.reset()
            grads, losses = [], []
            for step in range(steps):
                losses.append(trainer.step(step, on_grads=grads.append if step == 0 else None))
            out["/".join(str(x) for x in run)] = {
                "losses": losses, "grads": grads[0], "calls": dict(inst.calls) if inst is not None else {},
                "ran": inst.wgrad.ran if inst is not None and inst.wgrad is not None else 0}
    finally:
        trainer.setup = base
        megatron_overlap.uninstall()
    return out


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    denom = b.double().norm().item()
    diff = (a.double() - b.double()).norm().item()
    return diff / denom if denom else diff


def pp_eval(tp: int, pp: int, modes: list, m: int) -> dict:
    """``forward_only`` (Megatron's evaluation): per mode the loss of a forward-only pass over
    ``m`` micro-batches from the same start, and whether any gradient was accumulated."""
    import dataclasses

    import megatron_overlap

    trainer = _trainer(tp, pp, False)
    base = trainer.setup
    out = {}
    try:
        trainer.setup = dataclasses.replace(base, microbatches=m)
        for mode in modes:
            _install(mode, None, tp)
            trainer.reset()
            trainer.ddp.zero_grad_buffer()
            loss = trainer.step(0, forward_only=True)
            touched = any(p.main_grad.abs().sum().item() > 0 for p in trainer.ddp.module.parameters())
            out[mode] = {"loss": loss, "grads_touched": touched}
    finally:
        trainer.setup = base
        megatron_overlap.uninstall()
    return out


def pp_runs_distopt(runs: list, steps: int) -> dict:
    """PP=2 x DP=2 with Megatron's distributed optimizer (Adam, clipping), DDP
    ``overlap_grad_reduce`` and ``overlap_param_gather``: for each (mode, micro-batches), from a
    fresh trainer with the same start, the losses of ``steps`` steps, every gradient buffer
    after the first (``main_grad``: this rank's reduce-scattered shard and its own rest), every
    parameter after the last, and the plugin's counters."""
    import dataclasses

    import megatron_overlap
    from megatron_overlap.lab.pipeline_gpt import PipelineGPT, PipelineTrainer

    out = {}
    try:
        for mode, m in runs:
            trainer = PipelineTrainer(dataclasses.replace(PipelineGPT(tp=1, pp=2), microbatches=m), True,
                                      distributed_optimizer=True)
            inst = _install(mode, None, 1)
            grads, losses = [], []
            for step in range(steps):
                losses.append(trainer.step(step, on_grads=grads.append if step == 0 else None))
            out[f"{mode}/{m}"] = {"losses": losses, "grads": grads[0],
                                  "params": [p.detach().clone() for p in trainer.ddp.module.parameters()],
                                  "calls": dict(inst.calls) if inst is not None else {}}
            megatron_overlap.uninstall()
    finally:
        megatron_overlap.uninstall()
    return out


_VTRAINERS: dict = {}


def vpp_runs(pp: int, v: int, overlap_grad_reduce: bool, runs: list, steps: int) -> dict:
    """Virtual pipelines (issue 23): for each (mode, microbatches) in ``runs`` on the tiny GPT
    with ``v`` chunks per stage: ``steps`` losses from the same start and every parameter's
    gradient after the first step (this rank's chunks, in order)."""
    import dataclasses

    import megatron_overlap
    from megatron_overlap.lab.pipeline_gpt import PipelineGPT
    from megatron_overlap.lab.tiny_gpt import TinyGPT
    from megatron_overlap.lab.virtual_gpt import VirtualPipelineTrainer

    key = (pp, v, overlap_grad_reduce)
    if key not in _VTRAINERS:
        spec = TinyGPT(num_layers=2 * pp * v, hidden=64, ffn=160, heads=4, kv_heads=2, vocab=256, seq=32,
                       micro_batch=2)
        _VTRAINERS[key] = VirtualPipelineTrainer(PipelineGPT(spec=spec, pp=pp), v, overlap_grad_reduce)
    trainer = _VTRAINERS[key]
    base, out = trainer.setup, {}
    try:
        for mode, m in runs:
            trainer.setup = dataclasses.replace(base, microbatches=m)
            inst = _install(mode, None, 1)
            trainer.reset()
            grads, losses = [], []
            for step in range(steps):
                losses.append(trainer.step(step, on_grads=grads.append if step == 0 else None))
            out[f"{mode}/{m}"] = {"losses": losses, "grads": grads[0],
                                  "calls": dict(inst.calls) if inst is not None else {},
                                  "ran": inst.wgrad.ran if inst is not None and inst.wgrad is not None else 0}
    finally:
        trainer.setup = base
        megatron_overlap.uninstall()
    return out


def vpp_runs_distopt(pp: int, v: int, runs: list, steps: int) -> dict:
    """``vpp_runs`` with Megatron's distributed optimizer, DDP overlap_grad_reduce and
    overlap_param_gather (aligned: the schedule launches each chunk's gather); a fresh trainer
    per run, the same start; every parameter after the last step too."""
    import dataclasses

    import megatron_overlap
    from megatron_overlap.lab.pipeline_gpt import PipelineGPT
    from megatron_overlap.lab.tiny_gpt import TinyGPT
    from megatron_overlap.lab.virtual_gpt import VirtualPipelineTrainer

    spec = TinyGPT(num_layers=2 * pp * v, hidden=64, ffn=160, heads=4, kv_heads=2, vocab=256, seq=32, micro_batch=2)
    out = {}
    try:
        for mode, m in runs:
            trainer = VirtualPipelineTrainer(PipelineGPT(spec=spec, pp=pp, microbatches=m), v, True,
                                             distributed_optimizer=True)
            inst = _install(mode, None, 1)
            grads, losses = [], []
            for step in range(steps):
                losses.append(trainer.step(step, on_grads=grads.append if step == 0 else None))
            out[f"{mode}/{m}"] = {"losses": losses, "grads": grads[0], "params": trainer.state(),
                                  "calls": dict(inst.calls) if inst is not None else {}}
            megatron_overlap.uninstall()
    finally:
        megatron_overlap.uninstall()
    return out
