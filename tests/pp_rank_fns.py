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


def _install(mode: str, inflight, tp: int, sub_batches: int = 1, buckets: str = "megatron"):
    import megatron_overlap
    from megatron_overlap.config import OverlapConfig, PPConfig, TPConfig

    megatron_overlap.uninstall()
    if mode == "off":  # stock Megatron: its 1F1B and its linears
        return None
    explicit = frozenset({"max_inflight"}) if inflight else frozenset()
    config = OverlapConfig(tp=TPConfig(mode="p2p" if tp > 1 else "off", sub_batches=sub_batches),
                           pp=PPConfig(mode=mode, max_inflight=inflight, buckets=buckets,
                                       explicit=explicit | ({"buckets"} if buckets != "megatron" else set())))
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
    """Virtual pipelines: for each (mode, microbatches) in ``runs`` on the tiny GPT
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

    from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBucketGroup

    import traceback

    spec = TinyGPT(num_layers=2 * pp * v, hidden=64, ffn=160, heads=4, kv_heads=2, vocab=256, seq=32, micro_batch=2)
    out, dispatched, reduced, where = {}, [], [], {}
    original, original_reduce = _ParamAndGradBucketGroup.start_param_sync, _ParamAndGradBucketGroup.start_grad_sync

    def start_param_sync(self, *args, **kwargs):  # which chunk's which bucket group, in dispatch order
        dispatched.append(where.get(id(self)))
        return original(self, *args, **kwargs)

    def start_grad_sync(self, *args, **kwargs):  # which chunk's which bucket group, and whether a DDP hook sent it
        hook = any(f.name == "register_grad_ready" for f in traceback.extract_stack())
        reduced.append(where.get(id(self)) + (hook,))
        return original_reduce(self, *args, **kwargs)

    _ParamAndGradBucketGroup.start_param_sync = start_param_sync
    _ParamAndGradBucketGroup.start_grad_sync = start_grad_sync
    try:
        for mode, m, buckets in runs:
            inst = _install(mode, None, 1, buckets=buckets)  # before the model is wrapped, as pretrain_gpt.py's flags
            trainer = VirtualPipelineTrainer(PipelineGPT(spec=spec, pp=pp, microbatches=m), v, True,
                                             distributed_optimizer=True)
            where.clear()
            where.update({id(g): (c, k) for c, d in enumerate(trainer.ddps) for k, g in enumerate(d.bucket_groups)})
            grads, losses = [], []
            for step in range(steps):
                dispatched.clear()
                reduced.clear()
                losses.append(trainer.step(step, on_grads=(lambda _: grads.append(_reduced_grads(trainer)))
                                           if step == 0 else None))
                order = list(dispatched) if step == 0 else order
            for d in trainer.ddps:  # the last step's updates are gathered by the next step's forward: now
                d.start_param_sync(force_sync=True)
            out[f"{mode}/{m}/{buckets}"] = {"losses": losses, "grads": grads[0], "params": trainer.state(),
                                  "calls": dict(inst.calls) if inst is not None else {}, "gathers": order,
                                  "reduces": list(reduced)}  # the last step's
            megatron_overlap.uninstall()
    finally:
        _ParamAndGradBucketGroup.start_param_sync = original
        _ParamAndGradBucketGroup.start_grad_sync = original_reduce
        megatron_overlap.uninstall()
    return out


def _reduced_grads(trainer) -> list:
    """Every parameter's data-parallel gradient after the reduce-scatter, whichever rank holds
    its shard: each bucket's shards gathered over the data-parallel group (what the optimizer
    steps with), so buffers cut into other buckets compare alike."""
    import torch.distributed as dist

    full = {}
    for ddp in trainer.ddps:
        for buf in ddp.buffers:
            data = buf.grad_data.clone()
            group = buf.data_parallel_group
            n = dist.get_world_size(group)
            for bucket in buf.buckets:
                shards = bucket.grad_data.view(n, -1)
                gathered = [torch.empty_like(shards[0]) for _ in range(n)]
                dist.all_gather(gathered, shards[dist.get_rank(group)].contiguous(), group=group)
                start = bucket.offset
                data[start:start + bucket.grad_data.numel()] = torch.cat(gathered)
            for param, (a, b, _bucket) in buf.param_index_map.items():
                full[param] = data[a:b].view(param.shape).clone()
    return [full[p] for p in trainer.params()]


def _v_names(trainer) -> list:
    """Every parameter of the chunks named as in the whole model (global layer numbers)."""
    names = []
    for ddp in trainer.ddps:
        layers = ddp.module.decoder.layers
        for name, _ in ddp.module.named_parameters():
            if name.startswith("decoder.layers."):
                _d, _l, i, rest = name.split(".", 3)
                name = f"decoder.layers.{layers[int(i)].layer_number - 1}.{rest}"
            names.append(name)
    return names


def _layer_offsets(trainer) -> dict:
    """Distributed checkpointing's view of each chunk: the layer each decoder tensor is saved at
    (its global offset on the stacked layer axis) and the keys."""
    from megatron_overlap.lab.virtual_gpt import virtual_pipeline

    out = {"layers": [], "keys": set()}
    with virtual_pipeline(trainer.v):
        for ddp in trainer.ddps:
            layers = set()
            for key, sh in ddp.module.sharded_state_dict().items():
                if key.startswith("decoder.layers.") and hasattr(sh, "global_offset"):
                    layers.add(sh.global_offset[0])
                    out["keys"].add(sh.key)
            out["layers"].append(sorted(layers))
    out["keys"] = sorted(out["keys"])
    return out


def zbv_vs_one_stage(m: int) -> dict:
    """``--overlap-pp zbv`` on the tiny GPT at PP=2 x VPP=2 (the V) against the same model run as
    one stage (same layers, same initial weights, the same micro-batches of every replica):
    step 0's loss, and every gradient (this rank's chunks) against the one-stage model's
    averaged over the replicas as DDP averages them."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    import megatron_overlap
    from megatron_overlap.lab import tiny_gpt
    from megatron_overlap.lab.pipeline_gpt import PipelineGPT
    from megatron_overlap.lab.virtual_gpt import VirtualPipelineTrainer

    spec = tiny_gpt.TinyGPT(num_layers=8, hidden=64, ffn=160, heads=4, kv_heads=2, vocab=256, seq=32, micro_batch=2)
    try:
        inst = _install("zbv", None, 1)
        tiny_gpt.init_parallel(1, pp=2)
        trainer = VirtualPipelineTrainer(PipelineGPT(spec=spec, pp=2, microbatches=m), 2, False)  # built in the V
        grads = []
        loss = trainer.step(0, on_grads=grads.append)
        mine = dict(zip(_v_names(trainer), zip(trainer.start, grads[0])))
        ckpt = _layer_offsets(trainer)
        dp = parallel_state.get_data_parallel_world_size()
        real = parallel_state.get_data_parallel_rank
        data = {}
        for r in range(dp):  # every replica's micro-batches, as batch() draws them for its data-parallel rank
            parallel_state.get_data_parallel_rank = lambda *a, r=r, **k: r
            data[r] = [tiny_gpt.batch(spec, i) for i in range(m)]
        parallel_state.get_data_parallel_rank = real
        stages = [None] * parallel_state.get_pipeline_model_parallel_world_size()
        dist.all_gather_object(stages, {n: w for n, (w, _g) in mine.items()},
                               group=parallel_state.get_pipeline_model_parallel_group())
        calls = dict(inst.calls)
        megatron_overlap.uninstall()
        full = {n: w for part in stages for n, w in part.items()}
        tiny_gpt.init_parallel(1, pp=1)
        ref = tiny_gpt.build(spec, 1)
        with torch.no_grad():
            for n, p in ref.named_parameters():
                p.copy_(full[n])
        losses = []
        for r in range(dp):
            for tokens, labels, position_ids, mask in data[r]:
                out = ref(tokens, position_ids, mask, labels=labels).float().mean()
                (out / (m * dp)).backward()
                losses.append(out.item())
        ref_grads = dict(ref.named_parameters())
        worst = max(rel(g, ref_grads[n].grad) for n, (_w, g) in mine.items())
        tiny_gpt.init_parallel(1, pp=2)
        stock = _layer_offsets(VirtualPipelineTrainer(PipelineGPT(spec=spec, pp=2, microbatches=m), 2, False))
        return {"loss": loss, "ref_loss": sum(losses) / len(losses), "worst": worst, "calls": calls,
                "names": sorted(mine), "checkpoint": ckpt, "stock_checkpoint": stock}
    finally:
        megatron_overlap.uninstall()
        tiny_gpt.init_parallel(1, pp=2)


def _global_values(trainer, salt: int) -> dict:
    """A value for every parameter of this rank's chunks drawn from its whole-model name (global
    layer number) and ``salt``: what any layout must hold for that name."""
    import zlib

    out = {}
    for name, p in zip(_v_names(trainer), trainer.params()):
        gen = torch.Generator().manual_seed(zlib.crc32(f"{salt}/{name}".encode()))
        out[name] = torch.randn(p.shape, generator=gen, dtype=p.dtype)
    return out


def _fill(trainer, salt: int) -> None:
    with torch.no_grad():
        for p, value in zip(trainer.params(), _global_values(trainer, salt).values()):
            p.copy_(value)


def _mismatches(trainer, salt: int) -> list:
    """The parameters (whole-model names) not holding their global values."""
    return [n for (n, v), p in zip(_global_values(trainer, salt).items(), trainer.params()) if not torch.equal(p, v)]


def _all_keys(trainer) -> list:
    """Every key this rank's chunks put in a distributed checkpoint."""
    from megatron_overlap.lab.virtual_gpt import virtual_pipeline

    with virtual_pipeline(trainer.v):
        return sorted({sh.key for d in trainer.ddps for sh in d.module.sharded_state_dict().values()})


def _ckpt_io(trainer, path: str, save: bool) -> None:
    """Megatron-LM's checkpoint of a virtual pipeline: ``model{c}`` the chunks' sharded state
    dicts, through ``dist_checkpointing`` (``torch_dist``; the save fully parallel over DP, as
    Megatron-LM's ``--ckpt-fully-parallel-save`` default), loaded back with ``load_state_dict``."""
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    from megatron_overlap.lab.dist_ckpt import in_process_writes
    from megatron_overlap.lab.virtual_gpt import virtual_pipeline

    with virtual_pipeline(trainer.v):
        state = {f"model{c}": d.module.sharded_state_dict() for c, d in enumerate(trainer.ddps)}
        if save:
            strategy = FullyParallelSaveStrategyWrapper(TorchDistSaveShardedStrategy("torch_dist", 1),
                                                        parallel_state.get_data_parallel_group())
            with in_process_writes():
                dist_checkpointing.save(state, path, strategy)
            return
        loaded = dist_checkpointing.load(state, path)
    for c, d in enumerate(trainer.ddps):
        d.module.load_state_dict(loaded[f"model{c}"])


def zbv_checkpoint_round_trip(root: str) -> dict:
    """The tiny GPT (8 layers) at PP=2 x VPP=2 (x DP=2): a checkpoint saved under ``zbv`` (the V)
    loaded into Megatron's interleaved layout, and one saved there loaded back into the V; every
    parameter set from its whole-model name first, so each must arrive under the same name."""
    import megatron_overlap
    from megatron_overlap.lab import tiny_gpt
    from megatron_overlap.lab.pipeline_gpt import PipelineGPT
    from megatron_overlap.lab.virtual_gpt import VirtualPipelineTrainer

    spec = tiny_gpt.TinyGPT(num_layers=8, hidden=64, ffn=160, heads=4, kv_heads=2, vocab=256, seq=32, micro_batch=2)
    setup = PipelineGPT(spec=spec, pp=2, microbatches=2)
    out = {}
    try:
        inst = _install("zbv", None, 1)
        zbv = VirtualPipelineTrainer(setup, 2, False)
        out["zbv"] = dict(_layer_offsets(zbv), all_keys=_all_keys(zbv))
        out["offset_calls"] = inst.calls.get("pp.zbv.offset", 0)
        _fill(zbv, 1)
        _ckpt_io(zbv, f"{root}/zbv", save=True)
        megatron_overlap.uninstall()
        stock = VirtualPipelineTrainer(setup, 2, False)
        out["stock"] = dict(_layer_offsets(stock), all_keys=_all_keys(stock))
        out["stock_before"], out["stock_checked"] = len(_mismatches(stock, 1)), len(stock.params())
        _ckpt_io(stock, f"{root}/zbv", save=False)
        out["stock_from_zbv"] = _mismatches(stock, 1)
        _fill(stock, 2)
        _ckpt_io(stock, f"{root}/stock", save=True)
        _install("zbv", None, 1)
        out["zbv_before"] = len(_mismatches(zbv, 2))
        _ckpt_io(zbv, f"{root}/stock", save=False)
        out["zbv_from_stock"] = _mismatches(zbv, 2)
        out["zbv_checked"] = len(zbv.params())
        return out
    finally:
        megatron_overlap.uninstall()
        tiny_gpt.init_parallel(1, pp=2)
