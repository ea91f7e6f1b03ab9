"""Context-parallel settings the local attention cannot honour, checked at install from the
model's arguments. Unknown settings pass; the same checks run again when a patched attention
layer is built (``integration.attention``)."""

from __future__ import annotations

import logging

from ..errors import OverlapConfigError
from .attention import check_cp_config, check_seq_length
from .hybrid import check_hybrid_size


def check_cp_model(cp, ctx) -> None:
    """``cp``: the config's CP section; ``ctx``: a ``config.ModelContext``."""
    size = ctx.cp_size
    if size is None or size <= 1:
        if cp.enabled and size == 1:
            logging.getLogger("megatron_overlap").info(
                "context-parallel attention %s with context-parallel size 1: nothing to do, stock attention", cp.mode)
        return
    if ctx.transformer_impl == "transformer_engine":
        if cp.enabled:
            raise OverlapConfigError(
                "cp.mode", "patches Megatron's local DotProductAttention, but `megatron.transformer_impl` "
                "transformer_engine runs TE's attention, which does context parallelism itself "
                "(`megatron.cp_comm_type`); pass `megatron.transformer_impl` local, or drop `cp.mode`")
        return
    if not cp.enabled:
        if ctx.transformer_impl == "local":
            raise OverlapConfigError(
                "cp.mode", f"`megatron.context_parallel_size` {size} with `megatron.transformer_impl` local: "
                "Megatron's local attention has no context parallelism (it asserts CP == 1). Add `cp.mode` ring "
                "(any head count), a2a or hybrid, or use Transformer Engine")
        return
    tp = ctx.tp_size or 1
    heads = ctx.heads // tp if ctx.heads is not None and ctx.heads % tp == 0 else None
    kv = ctx.kv_heads // tp if ctx.kv_heads is not None and ctx.kv_heads % tp == 0 else None
    seq = None if ctx.packed else ctx.seq_length
    if heads is None or kv is None:  # heads unknown: check the rest, heads at the layer
        if cp.mode == "hybrid":
            check_hybrid_size(size, cp.a2a_size)
        if seq is not None:
            check_seq_length(seq, size)
        return
    check_cp_config(cp.mode, size, heads, kv, cp.a2a_size, seq)
