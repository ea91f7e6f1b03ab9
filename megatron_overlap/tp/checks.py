"""Model settings the overlapped linears cannot honour. Unknown settings (``None`` in the
``ModelContext``) pass: a programmatic install learns them when a layer first runs, and the
same checks run then, so both entry points fail with the same message."""

from __future__ import annotations


def check_tp_model(tp, ctx) -> None:
    """``tp``: the config's TP section; ``ctx``: a ``config.ModelContext``."""
    from ..errors import OverlapConfigError

    if not tp.enabled:
        return
    if ctx.tp_size is not None and ctx.tp_size < 1:
        raise OverlapConfigError("megatron.tensor_model_parallel_size", f"must be positive, got {ctx.tp_size}")
    if ctx.transformer_impl == "transformer_engine":
        raise OverlapConfigError(
            "megatron.transformer_impl",
            "Transformer Engine's linears are not patched by megatron-overlap yet, so "
            f"`tp.mode` {tp.mode} would do nothing there. Pass `megatron.transformer_impl` local "
            "(Megatron's own ColumnParallelLinear/RowParallelLinear), or drop `tp.mode` and "
            "use TE's `megatron.tp_comm_overlap` instead",
        )
    if ctx.tp_comm_overlap:
        raise OverlapConfigError(
            "tp.mode", "conflicts with Megatron's `megatron.tp_comm_overlap` (Transformer Engine userbuffers); "
            "choose one of the two")
    if ctx.tp_size is None or ctx.tp_size == 1:
        return
    if ctx.sequence_parallel is False:
        raise OverlapConfigError(
            "tp.mode", "overlaps the all-gather / reduce-scatter of sequence parallelism, but "
            f"`megatron.sequence_parallel` is off with TP={ctx.tp_size}; add `megatron.sequence_parallel`")
    if tp.chunks and tp.chunks % ctx.tp_size:
        raise OverlapConfigError(
            "tp.chunks", f"{tp.chunks} is not a multiple of the tensor-parallel size {ctx.tp_size}; "
            f"use {ctx.tp_size}, {2 * ctx.tp_size}, {4 * ctx.tp_size}, ... or 0 to let the plugin choose")
    if ctx.seq_length is not None:
        if ctx.seq_length % ctx.tp_size:
            raise OverlapConfigError(
                "megatron.seq_length", f"{ctx.seq_length} is not divisible by the tensor-parallel size "
                f"{ctx.tp_size}, which sequence parallelism needs")
        if tp.chunks:
            from . import check_chunks_fit

            check_chunks_fit(tp.chunks // ctx.tp_size, ctx.seq_length // ctx.tp_size, "tp.chunks",
                             f"{tp.chunks} (over TP {ctx.tp_size})", scale=ctx.tp_size)


def tp_overlap_applies(tp, ctx) -> bool:
    """True when the patched path will run; False when stock Megatron runs (TP=1 or off)."""
    return tp.enabled and (ctx.tp_size is None or ctx.tp_size > 1)
