"""Rank functions that train the lab's tiny GPT under flags: losses, gradients, held-back wgrads,
dropout with the autotuner's cache, and Megatron's own local spec."""

from __future__ import annotations

import torch
import torch.distributed as dist

from .rank_helpers import install


def gpt_losses(tp: int, steps: int, flags: list[str], overlap_grad_reduce: bool) -> list[float]:
    from megatron_overlap.lab import tiny_gpt

    install(flags)
    try:
        return tiny_gpt.train(tiny_gpt.TinyGPT(), tp=tp, steps=steps, overlap_grad_reduce=overlap_grad_reduce)
    finally:
        install([])


def gpt_losses_fused_wgrad(tp: int, steps: int, flags: list[str], overlap_grad_reduce: bool) -> dict:
    """The tiny GPT with gradient-accumulation fusion (Megatron's default where apex exists):
    the plugin keeps wgrad GEMMs back to fill its waits; losses and the store's counters."""
    from megatron_overlap.integration.install import find_installation
    from megatron_overlap.lab import tiny_gpt

    install(flags)
    try:
        inst = find_installation()
        losses = tiny_gpt.train(tiny_gpt.TinyGPT(), tp=tp, steps=steps, overlap_grad_reduce=overlap_grad_reduce,
                                gradient_accumulation_fusion=True)
        store = inst.wgrad if inst is not None else None
        if store is None:
            return {"losses": losses, "ran": 0, "left": 0, "embedding_overlaps": 0, "late": 0}
        return {"losses": losses, "ran": store.ran, "left": len(store), "late": store.late_inputs,
                "embedding_overlaps": inst.calls["tp.embedding_grad_overlap"]}
    finally:
        install([])


def gpt_losses_with_dropout(tp: int, steps: int, flags: list[str], cache_dir: str) -> dict:
    """The tiny GPT with dropout on (hidden and attention), from the same seed, under
    ``flags``; the autotune cache in ``cache_dir`` (fresh when it does not exist yet). The
    losses, and how many shapes the autotuner measured (0 without it)."""
    import os

    from megatron_overlap.lab import tiny_gpt

    os.environ["MEGATRON_OVERLAP_CACHE"] = f"{cache_dir}/rank{dist.get_rank()}"
    torch.manual_seed(1234)  # dropout draws from the default generator: same start for every run
    install(flags)
    try:
        losses = tiny_gpt.train(tiny_gpt.TinyGPT(), tp=tp, steps=steps, hidden_dropout=0.1, attention_dropout=0.1)
        import glob
        import json

        entries = 0
        for path in glob.glob(f"{cache_dir}/rank{dist.get_rank()}/tp_plans.json"):
            entries = len(json.load(open(path)))
        return {"losses": losses, "entries": entries}
    finally:
        install([])
        os.environ.pop("MEGATRON_OVERLAP_CACHE", None)


def stock_spec_losses(tp: int, flags: list[str], steps: int, lab_norm: bool = False) -> dict:
    """The tiny GPT built from Megatron's own local spec (its norms ``WrappedTorchNorm``, as
    without apex; ``lab_norm``: the lab's SP norm shim instead), sequence parallel at TP > 1,
    under ``flags``, trained with Megatron's ``finalize_model_grads`` (which sums the gradients
    of ``sequence_parallel`` parameters over TP); the losses, or the error the build raised,
    and whether every norm parameter is marked ``sequence_parallel``."""
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    from megatron_overlap.lab import tiny_gpt

    spec = tiny_gpt.TinyGPT()
    tiny_gpt.init_parallel(tp)
    install(flags)
    try:
        layer = get_gpt_layer_local_spec(normalization=spec.normalization)
        block = TransformerBlockSubmodules(layer_specs=[layer] * spec.num_layers, layer_norm=WrappedTorchNorm)
        try:
            if lab_norm:
                model = tiny_gpt.build(spec, tp)
            else:
                model = GPTModel(config=tiny_gpt.transformer_config(spec, tp, True), transformer_layer_spec=block,
                                 vocab_size=spec.vocab, max_sequence_length=spec.seq, position_embedding_type="rope",
                                 share_embeddings_and_output_weights=False)
        except AssertionError as exc:
            return {"error": str(exc)}
        norms = [p for n, p in model.named_parameters() if "norm" in n]
        marked = bool(norms) and all(getattr(p, "sequence_parallel", False) for p in norms)
        ddp = tiny_gpt.wrap_ddp(model, False)
        losses = []
        for step in range(steps):
            tokens, labels, position_ids, mask = tiny_gpt.batch(spec, step)
            ddp.zero_grad_buffer()
            loss = ddp(tokens, position_ids, mask, labels=labels).float().mean()
            loss.backward()
            finalize_model_grads([ddp])
            with torch.no_grad():
                for param in ddp.module.parameters():
                    param.add_(param.main_grad, alpha=-1e-1)
            reported = loss.detach().clone()
            dist.all_reduce(reported)
            losses.append(reported.item() / dist.get_world_size())
        return {"losses": losses, "marked": marked, "norms": len(norms)}
    finally:
        install([])


def gpt_losses_and_grads(tp: int, steps: int, flags: list[str], overlap_grad_reduce: bool,
                         **config_overrides) -> dict:
    """The tiny GPT trained ``steps`` steps: the losses, every parameter's gradient of the first
    step (``main_grad``, after Megatron's finalize) and how often each patched path ran."""
    from megatron_overlap.integration.install import find_installation
    from megatron_overlap.lab import tiny_gpt

    install(flags)
    grads = {}
    try:
        inst = find_installation()
        holder = {}

        def on_step(step, _loss):
            if step == 0:
                for name, p in holder["model"].named_parameters():
                    grads[name] = p.main_grad.detach().clone()

        original_wrap = tiny_gpt.wrap_ddp

        def wrap(model, *args, **kwargs):
            holder["model"] = wrapped = original_wrap(model, *args, **kwargs)
            return wrapped

        tiny_gpt.wrap_ddp = wrap
        try:
            losses = tiny_gpt.train(tiny_gpt.TinyGPT(), tp=tp, steps=steps, overlap_grad_reduce=overlap_grad_reduce,
                                    on_step=on_step, **config_overrides)
        finally:
            tiny_gpt.wrap_ddp = original_wrap
        calls = dict(inst.calls) if inst is not None else {}
        return {"losses": losses, "grads": grads, "calls": calls}
    finally:
        install([])


def gpt_grads_key_value_summed_per_part(tp: int, steps: int, flags: list[str]) -> dict:
    """``gpt_losses_and_grads`` with the cut attention's layout check answering "not as rebuilt"
    (another Megatron-core): each part then sums its own key and value gradients. Also the
    notice keys the installation gave."""
    from megatron_overlap.integration import attention_parts
    from megatron_overlap.integration.install import find_installation

    seen = []
    check = attention_parts.CutAttention._laid_out_as_rebuilt

    def other_layout(self, q, record):
        seen.append(find_installation())
        return False

    attention_parts.CutAttention._laid_out_as_rebuilt = other_layout
    try:
        out = gpt_losses_and_grads(tp, steps, flags, False)
    finally:
        attention_parts.CutAttention._laid_out_as_rebuilt = check
    return {**out, "checks": len(seen), "noticed": sorted(set().union(*(inst._noticed for inst in seen)))}
