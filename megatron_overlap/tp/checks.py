"""Model settings the overlapped linears cannot honour (with sequence parallelism, and without it:
the all-reduce path). Unknown settings (``None`` in the
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
    if tp.chunks and tp.chunks % ctx.tp_size:
        raise OverlapConfigError(
            "tp.chunks", f"{tp.chunks} is not a multiple of the tensor-parallel size {ctx.tp_size}; "
            f"use {ctx.tp_size}, {2 * ctx.tp_size}, {4 * ctx.tp_size}, ... or 0 to let the plugin choose")
    if ctx.sequence_parallel is False:
        _check_without_sp(tp, ctx)
        return
    if tp.allreduce_fusion and ctx.sequence_parallel:
        raise OverlapConfigError(
            "tp.allreduce_fusion", "splits the all-reduces of tensor parallelism without sequence parallelism, and "
            "`megatron.sequence_parallel` is on: its linears reduce-scatter and all-gather already (the same "
            "transformation, with the activations kept sharded); drop `tp.allreduce_fusion`")
    if ctx.seq_length is not None:
        if ctx.seq_length % ctx.tp_size:
            raise OverlapConfigError(
                "megatron.seq_length", f"{ctx.seq_length} is not divisible by the tensor-parallel size "
                f"{ctx.tp_size}, which sequence parallelism needs")
        if tp.chunks:
            from . import check_chunks_fit

            check_chunks_fit(tp.chunks // ctx.tp_size, ctx.seq_length // ctx.tp_size, "tp.chunks",
                             f"{tp.chunks} (over TP {ctx.tp_size})", scale=ctx.tp_size)


def _check_without_sp(tp, ctx) -> None:
    """What cannot run on the all-reduce path (``tp/linear_ar.py``): TP > 1, SP off."""
    from ..errors import OverlapConfigError

    if tp.mode == "fused":
        raise OverlapConfigError(
            "tp.mode", "fused: without `megatron.sequence_parallel` the linears all-reduce, and the fused backend's "
            "GEMM-reduce-scatter sends its slots only once the whole GEMM kernel has run, so an all-reduce built "
            "from it would hide nothing; use `tp.mode` p2p (or symm-mem), or add `megatron.sequence_parallel`")
    if "bidirectional" in tp.explicit:
        raise OverlapConfigError(
            "tp.bidirectional", "splits the chunks of a ring in two directions; without `megatron.sequence_parallel` "
            "each chunk is all-reduced by the backend's collective, with no ring to split; drop it")
    if "rs" in tp.explicit and not tp.allreduce_fusion:
        raise OverlapConfigError(
            "tp.rs", "picks the reduce-scatter after a GEMM; without `megatron.sequence_parallel` the linears "
            "all-reduce (the backend's collective) and reduce-scatter nothing unless `tp.allreduce_fusion` splits "
            "the attention output's all-reduce; drop `tp.rs`, or add `tp.allreduce_fusion`")
    if ctx.seq_length is not None:
        if tp.allreduce_fusion and ctx.seq_length % ctx.tp_size:
            raise OverlapConfigError(
                "megatron.seq_length", f"{ctx.seq_length} is not divisible by the tensor-parallel size {ctx.tp_size}, "
                "which `tp.allreduce_fusion` needs (its reduce-scatter gives each rank 1/TP of the rows); drop "
                "`tp.allreduce_fusion`, or pick a sequence length that splits")
        if tp.chunks:
            from . import check_chunks_fit

            check_chunks_fit(tp.chunks, ctx.seq_length, "tp.chunks", f"{tp.chunks}")


def tp_overlap_applies(tp, ctx) -> bool:
    """True when the patched path will run; False when stock Megatron runs (TP=1 or off)."""
    return tp.enabled and (ctx.tp_size is None or ctx.tp_size > 1)
