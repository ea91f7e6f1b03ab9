"""Model settings the ``--overlap-hdp`` runtime cannot honour, checked at install from the model's
arguments. Unknown settings pass."""

from __future__ import annotations

from ..errors import OverlapConfigError


def check_hdp_model(hdp, ctx, pp=None) -> None:
    """``hdp``: the config's HDP section; ``ctx``: a ``config.ModelContext``; ``pp``: its pipeline
    section (our schedules), if any."""
    if not hdp.enabled:
        return
    if pp is not None and pp.enabled and pp.mode == "zbv":
        raise OverlapConfigError(
            "pp.mode", "zbv runs two model chunks per stage (a virtual pipeline), and `hdp.enabled` runs under "
            "non-interleaved pipelines only (its loop reads one data iterator per stage; a virtual pipeline has one "
            "per chunk): with `hdp.enabled` use `pp.mode` zb or 1f1b")
    if ctx.pp_size is not None and ctx.pp_size > 1 and ctx.virtual_pp_size:
        raise OverlapConfigError(
            "hdp.enabled", "runs under non-interleaved pipelines only; drop `megatron.virtual_pipeline_model_parallel_size`")
    if ctx.cp_size is not None and ctx.cp_size > 1:
        raise OverlapConfigError(
            "megatron.context_parallel_size",
            "`hdp.enabled` merges data and context parallelism into one group and picks each sequence's ring "
            f"itself; set `megatron.context_parallel_size` 1 (got {ctx.cp_size})")
    if ctx.hybrid_context_parallel:
        raise OverlapConfigError(
            "hdp.enabled", "and Megatron's `megatron.hybrid_context_parallel` both regroup the data-parallel ranks into "
            "rings per sequence, and they cannot share a step; pass one of them")
    if ctx.transformer_impl == "transformer_engine":
        raise OverlapConfigError(
            "hdp.enabled", "runs its rings through Megatron's local attention; pass `megatron.transformer_impl` local")
    tp, world = ctx.tp_size or 1, ctx.world_size
    if world is not None and world % (tp * (ctx.pp_size or 1)):
        raise OverlapConfigError(
            "megatron.tensor_model_parallel_size", f"`hdp.enabled` groups the data-parallel ranks of each TP rank; "
            f"the world of {world} ranks does not split into TP groups of {tp} x pipeline stages of "
            f"{ctx.pp_size or 1}: choose sizes whose product divides the world size")
