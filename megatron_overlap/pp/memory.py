"""Activation memory of one micro-batch on one pipeline stage, estimated from the model shape,
and the micro-batches in flight a memory budget allows.

Per transformer layer, the activations kept for the backward of a micro-batch of ``b``
sequences of ``s`` tokens (hidden ``h``, ``a`` heads, tensor parallel ``t`` with sequence
parallelism, no recomputation; Korthikanti et al. 2022, "Reducing Activation Recomputation",
16-bit activations)::

    s * b * h * (34 + 5 * a * s / h) / t   bytes

scaled by the activation dtype (x2 for fp32) and divided by the context-parallel size (its
``s`` is the rows a rank holds); with flash attention the score term ``5 a s / h`` is not
kept. An estimate: ``bench pp`` prints it beside what saved-tensor
hooks measure.
"""

from __future__ import annotations

from ..errors import OverlapConfigError


def layer_activation_bytes(seq: int, micro_batch: int, hidden: int, heads: int, tp: int = 1, cp: int = 1,
                           dtype_bytes: int = 2, flash: bool = False) -> float:
    """``flash``: the attention keeps no score matrix (flash / fused attention, as Transformer
    Engine runs it), so the ``5 a s / h`` term goes; Megatron's local attention keeps it."""
    s = seq / cp
    scores = 0.0 if flash else 5 * heads * s / hidden
    return s * micro_batch * hidden * (34 + scores) / tp * dtype_bytes / 2


def stage_activation_bytes(config, seq: int, micro_batch: int, stages: int) -> float:
    """One micro-batch's activations on one stage of a Megatron ``TransformerConfig``."""
    dtype_bytes = 4 if getattr(config, "params_dtype", None) is not None and str(config.params_dtype).endswith(
        "float32") else 2
    layers = config.num_layers / stages
    return layers * layer_activation_bytes(seq, micro_batch, config.hidden_size, config.num_attention_heads,
                                           config.tensor_model_parallel_size, config.context_parallel_size,
                                           dtype_bytes)


def inflight_for_budget(budget_gb: float, stages: int, microbatches: int, per_microbatch_bytes: float) -> int:
    """The most micro-batches stage 0 may hold within ``budget_gb``, clipped to the
    micro-batches there are; refused below what 1F1B itself holds (``stages``)."""
    fits = int(budget_gb * 1e9 // per_microbatch_bytes) if per_microbatch_bytes > 0 else microbatches
    per_gb = per_microbatch_bytes / 1e9
    if fits < 1:
        raise OverlapConfigError(
            "pp.memory_budget_gb", f"is {budget_gb:g} GB, below one micro-batch's activations on a stage "
            f"(~{per_gb:.3g} GB estimated): raise it, recompute activations, or use more stages")
    if fits < stages:
        raise OverlapConfigError(
            "pp.memory_budget_gb", f"is {budget_gb:g} GB: {fits} micro-batch(es) fit (~{per_gb:.3g} GB each), but "
            f"a {stages}-stage pipeline holds {stages} on its first stage even in 1F1B: raise it to at least "
            f"{stages * per_gb:.3g} GB, or recompute activations")
    return min(fits, max(stages, microbatches))
