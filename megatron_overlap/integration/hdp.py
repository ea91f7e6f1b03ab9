"""Megatron's GPT model and groups -> the ``hdp`` runtime.

:class:`MegatronModel` is the runtime's model adapter (``hdp.runtime``): it refuses the models
the runtime cannot run exactly, gives every row its true RoPE position, checks the patched
attention is installed, and builds Megatron's ``PackedSeqParams`` for the ring context.
:func:`make_runtime` builds an ``HdpRuntime`` from the config of ``--overlap-hdp`` (explicitly passed:
nothing is read back from an installation).

RoPE. Megatron builds ``rotary_pos_emb`` for positions 0..S-1 and rotates row i by entry i; for
a shard, whose rows sit at positions x c .. and (2n-1-x) c .., that would be wrong. While
:meth:`MegatronModel.positions` is entered, a forward pre-hook asks the model's
``RotaryEmbedding`` for ``max(position) + 1`` positions and a forward hook gathers its output at
each row's true position, ``emb[pos[i]]``, so Megatron's unfused ``apply_rotary_pos_emb`` (sbhd:
row i gets ``emb[i]``) rotates every row exactly as the whole sequence would. YaRN and
multimodal RoPE (other output shapes) and multi-latent attention are refused.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Optional

import torch
import torch.distributed as dist

from ..errors import OverlapConfigError


def _unwrap(model):
    while hasattr(model, "module") and isinstance(getattr(model, "module"), torch.nn.Module):
        model = model.module
    return model


def _rotary_modules(model) -> list:
    from megatron.core.models.common.embeddings.rotary_pos_embedding import (
        MultimodalRotaryEmbedding,
        RotaryEmbedding,
    )

    found = []
    for m in model.modules():
        if isinstance(m, MultimodalRotaryEmbedding) or (isinstance(m, RotaryEmbedding) and type(m) is not RotaryEmbedding):
            raise OverlapConfigError(
                "megatron.position_embedding_type",
                f"`hdp.enabled` gives each row its true position for plain RoPE (rope) or learned absolute positions; "
                f"{type(m).__name__} is not supported. Use `megatron.position_embedding_type` rope or learned_absolute")
        if isinstance(m, RotaryEmbedding):
            found.append(m)
    return found


@contextlib.contextmanager
def true_positions(model, position_ids: torch.Tensor, positions: Optional[int] = None):
    """While entered, the model's ``RotaryEmbedding`` returns one entry per row, at the row's
    true position (``emb[position_ids[i]]``) instead of positions 0..S-1. ``positions``: how
    many positions to build (max + 1; read from ``position_ids`` when not given, a device sync)."""
    modules = _rotary_modules(model)
    if not modules:
        yield
        return
    pos = position_ids.reshape(-1).long()
    need = positions if positions is not None else (int(pos.max()) + 1 if pos.numel() else 1)

    def pre(module, args, kwargs):
        if "max_seq_len" in kwargs:
            kwargs = dict(kwargs, max_seq_len=need)
        else:
            args = (need,) + tuple(args[1:])
        offset = kwargs.get("offset", args[1] if len(args) > 1 else 0)
        if offset:
            raise OverlapConfigError("hdp.enabled", f"rotary embeddings with an offset ({offset}) are inference-only")
        return args, kwargs

    def post(module, args, kwargs, output):
        return output.index_select(0, pos.to(output.device))

    handles = []
    try:
        for m in modules:
            handles.append(m.register_forward_pre_hook(pre, with_kwargs=True))
            handles.append(m.register_forward_hook(post, with_kwargs=True))
        yield
    finally:
        for h in handles:
            h.remove()


class MegatronModel:
    """The HDP runtime's adapter for Megatron's GPT (module docstring). Models that passed the
    checks are remembered (weakly) on this object."""

    def __init__(self):
        self._checked: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> recompute_allowed

    def positions(self, model, position_ids, count):
        return true_positions(model, position_ids, count)

    def require_patched(self) -> None:
        from .install import active_config

        config = active_config()
        if config is None or not config.hdp.enabled:
            raise OverlapConfigError(
                "hdp.enabled", "the HDP runtime needs the patched attention: call megatron_overlap.install(args) with "
                "`hdp.enabled` first (without it Megatron's attention would treat a ring shard's rows as a whole "
                "sequence)")

    def packed_params(self, layout):
        from megatron.core.packed_seq_params import PackedSeqParams

        longest = max(layout.seq_lens)
        return PackedSeqParams(qkv_format="thd", cu_seqlens_q=layout.cu_seqlens, cu_seqlens_kv=layout.cu_seqlens,
                               cu_seqlens_q_padded=layout.cu_seqlens_padded,
                               cu_seqlens_kv_padded=layout.cu_seqlens_padded, max_seqlen_q=longest,
                               max_seqlen_kv=longest)

    def check(self, model, recompute_allowed: bool = True) -> None:
        """Refuse model settings the runtime cannot run exactly (clear errors naming the flag)."""
        passed = self._checked.get(model)  # False: passed the strict check, which covers the lenient one
        if passed is not None and (passed is False or passed == recompute_allowed):
            return
        check_model(model, recompute_allowed)
        self._checked[model] = recompute_allowed


def check_model(model, recompute_allowed: bool = True) -> None:
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    inner = _unwrap(model)
    config = getattr(inner, "config", None)
    if config is not None:
        _check_config(config, recompute_allowed)
    kind = getattr(inner, "position_embedding_type", None)
    if kind not in (None, "rope", "learned_absolute", "none"):
        raise OverlapConfigError(
            "megatron.position_embedding_type", f"`hdp.enabled` supports rope and learned_absolute positions, got {kind!r}")
    _rotary_modules(inner)
    if not any(isinstance(m, DotProductAttention) for m in inner.modules()):
        raise OverlapConfigError(
            "megatron.transformer_impl", "`hdp.enabled` runs its rings through Megatron's local DotProductAttention; "
            "the model has none (Transformer Engine?). Pass `megatron.transformer_impl` local")


def _check_config(config, recompute_allowed: bool) -> None:
    if getattr(config, "pipeline_model_parallel_size", 1) > 1 and not getattr(config, "variable_seq_lengths", False):
        raise OverlapConfigError(
            "hdp.enabled", "with pipeline parallelism the stages pass HDP's micro-batches on, and their lengths vary: "
            "set the model config's variable_seq_lengths = True (Megatron-LM's training loop gets it for each step)")
    if getattr(config, "context_parallel_size", 1) > 1:
        raise OverlapConfigError("megatron.context_parallel_size", "`hdp.enabled` picks each sequence's ring itself; "
                                 "set 1")
    if getattr(config, "multi_latent_attention", False):
        raise OverlapConfigError("hdp.enabled", "multi-latent attention applies RoPE its own way; not supported")
    if getattr(config, "attention_dropout", 0.0):
        raise OverlapConfigError("megatron.attention_dropout", "`hdp.enabled` ring attention runs without attention "
                                 f"dropout; got {config.attention_dropout}. Set `megatron.attention_dropout` 0")
    if getattr(config, "softmax_type", "vanilla") != "vanilla" or getattr(config, "window_size", None):
        raise OverlapConfigError("hdp.enabled", "ring attention supports the vanilla softmax without a sliding window")
    if not recompute_allowed and getattr(config, "recompute_granularity", None):
        raise OverlapConfigError(
            "megatron.recompute_granularity", "the HDP forward step enters the ring context for the forward only, "
            "and recomputation re-runs the forward in the backward: drop `megatron.recompute_granularity` (a loop of "
            "your own can use hdp.runtime.forward_backward, which keeps the context through the backward)")


def default_group() -> dist.ProcessGroup:
    """Megatron's data-parallel group when its parallel state is up (CP must be 1), else WORLD."""
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return dist.group.WORLD
    if parallel_state.get_context_parallel_world_size() > 1:
        raise OverlapConfigError("megatron.context_parallel_size", "`hdp.enabled` merges DP and CP into one group; "
                                 "set CP to 1")
    return parallel_state.get_data_parallel_group(with_context_parallel=True)


def make_runtime(hdp, group: Optional[dist.ProcessGroup] = None, **kwargs):
    """An ``HdpRuntime`` for the config's HDP section ``hdp`` (``OverlapConfig.hdp``) over ``group``
    (default: :func:`default_group`, the data-parallel ranks that share this rank's TP rank), with
    the Megatron model adapter and, with TP > 1, rows padded to a multiple of the TP size
    (sequence parallelism splits them; without it the padding is only wasted rows).
    The scheduler's mode follows the pipeline: ``pp`` (every rank the same number of micro-batch
    slots) with more than one stage, else ``dp`` (whole steps balanced).
    ``kwargs`` go to the runtime (``mode``, ``scheduler``, ``cost``, ``device``, ``row_multiple``, ``timeout_s``:
    default, the installed config's ``comm.timeout_s``); ``guard=True`` gives it megatron-core's
    ``BalancedCPScheduler`` as the peer ``hdp.guard`` checks every plan against."""
    from ..hdp.runtime import HdpRuntime

    if not hdp.enabled:
        raise OverlapConfigError("hdp.enabled", "no `hdp.enabled` in this config: the HDP runtime needs it (with "
                                 "`hdp.max_tokens`)")
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        kwargs.setdefault("row_multiple", parallel_state.get_tensor_model_parallel_world_size())
        kwargs.setdefault("mode", "pp" if parallel_state.get_pipeline_model_parallel_world_size() > 1 else "dp")
    if "timeout_s" not in kwargs:  # --overlap-timeout-s of the installation in force bounds the exchange too
        from .install import active_config

        config = active_config()
        kwargs["timeout_s"] = config.comm.timeout_s if config is not None else None
    if kwargs.pop("guard", False):  # hdp.guard: never more than 1% slower than megatron-core's own plan
        from .baselines import schedule_megatron_balanced

        kwargs["peer"] = schedule_megatron_balanced
    return HdpRuntime(hdp.max_tokens, group if group is not None else default_group(), MegatronModel(), **kwargs)
