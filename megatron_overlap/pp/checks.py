"""Model settings ``--overlap-pp`` cannot honour, and ``auto`` resolved, from a
``config.ModelContext`` (unknown settings pass; the executor checks what it meets)."""

from __future__ import annotations

from ..errors import OverlapConfigError


def pp_schedule_applies(pp, ctx) -> bool:
    """True when the pipeline schedule is replaced (PP > 1, or PP unknown)."""
    return pp.enabled and (ctx.pp_size is None or ctx.pp_size > 1)


def check_pp_model(pp, tp, ctx) -> None:
    """``pp``, ``tp``: the config's sections; ``ctx``: a ``config.ModelContext``."""
    if not pp_schedule_applies(pp, ctx):
        return
    if pp.mode == "zbv":
        check_zbv_model(ctx)
    for name in ctx.megatron_pp_flags:
        raise OverlapConfigError(
            f"megatron.{name}", f"changes Megatron's pipeline schedule, which `pp.mode` {pp.mode} replaces: "
            "choose one of the two")
    if pp.mode in ("zb", "zbv", "auto"):
        reason = split_unavailable(tp, ctx)
        if reason and pp.mode != "auto":
            raise OverlapConfigError("pp.mode", f"{pp.mode} splits each backward into B and W, which needs {reason}; "
                                     "use `pp.mode` 1f1b (no split) instead")
    if pp.max_inflight is not None and ctx.pp_size is not None and pp.max_inflight < ctx.pp_size:
        raise OverlapConfigError(
            "pp.max_inflight", f"is {pp.max_inflight}, below the {ctx.pp_size} pipeline stages: the first stage "
            f"holds at least {ctx.pp_size} micro-batches (as in 1F1B)")


def split_unavailable(tp, ctx):
    """Why the weight gradients cannot be deferred to W here (None: they can)."""
    if ctx.transformer_impl == "transformer_engine":
        return ("weight gradients computed apart from the backward; Transformer Engine's linears would give "
                "them (`delay_wgrad_compute`, `backward_dw`) but that path has not been tested, so it is refused: "
                "use `megatron.transformer_impl` local")
    if ctx.tp_size is not None and ctx.tp_size > 1 and not tp.enabled:
        return (f"megatron-overlap's linears at TP={ctx.tp_size} (they defer the weight gradient): add "
                "`tp.mode` p2p (with `megatron.sequence_parallel`)")
    return None


def resolve_auto(pp, tp, ctx, notice, predicted=None):
    """``auto``: the faster of ``1f1b`` and ``zb`` by the cost model (``predicted``:
    ``tune.auto.predicted_pp_choice``, its DP sync priced as the emulated cluster measures it),
    ``zb`` only where W can be deferred; without a prediction ``zb`` where it can, else
    ``1f1b``."""
    if pp.mode != "auto":
        return pp
    reason = split_unavailable(tp, ctx)
    if getattr(ctx, "virtual_pp_size", None) is not None:
        return _resolve_virtual(pp, ctx, notice, predicted, reason)
    if predicted is not None:
        steps = predicted["steps_ms"]
        mode = "1f1b" if reason or steps["1f1b"] <= steps["zb"] else "zb"
        stock = steps["off"]
        notice(f"`pp.mode` auto: {mode}, predicted {stock / steps[mode]:.2f}x over stock 1F1B (simulated on "
               f"{predicted['hardware']}, DP={predicted['dp']}, {predicted['microbatches']} micro-batches, "
               f"{predicted['options']}; zb {stock / steps['zb']:.2f}x, 1f1b {stock / steps['1f1b']:.2f}x)"
               + (f"; no B/W split: it needs {reason.split(':')[0]}" if reason else ""))
        return pp.replace(mode=mode)
    mode = "1f1b" if reason else "zb"
    notice(f"`pp.mode` auto: {mode}" + (f" (no B/W split: it needs {reason.split(':')[0]})" if reason else
                                         " (B/W split, ZB-H1: 1F1B's peak activation memory)"))
    return pp.replace(mode=mode)


def check_zbv_model(ctx) -> None:
    """ZB-V needs a virtual pipeline of exactly 2 chunks per stage, untied embeddings."""
    if ctx.virtual_pp_size is None and ctx.pp_size is not None:  # known from Megatron's arguments
        raise OverlapConfigError("pp.mode", "zbv places 2 model chunks on each stage (a V); this run has no virtual "
                                 "pipeline: set `megatron.virtual_pipeline_model_parallel_size` 2, or use `pp.mode` zb")
    if isinstance(ctx.virtual_pp_size, int) and ctx.virtual_pp_size != 2:
        from .chunk_build import check_chunks

        check_chunks("zbv", ctx.virtual_pp_size)
    if ctx.tied_embeddings:
        raise OverlapConfigError("pp.mode", "zbv puts the embedding and the output layer in two chunks of stage 0; "
                                 "tied ones would have to be one parameter there, which is not built: add "
                                 "`megatron.untie_embeddings_and_output_weights`, or use `pp.mode` zb")
    if ctx.legacy_checkpoint:
        raise OverlapConfigError("pp.mode", "zbv keeps Megatron's whole-model layer numbers in distributed checkpoints "
                                 "only: `megatron.ckpt_format` torch saves each chunk under its local layer names, "
                                 "which the V gives to other layers than Megatron's placement does (such a checkpoint "
                                 "loads into no other layout): use `megatron.ckpt_format` torch_dist, or `pp.mode` zb")


def _resolve_virtual(pp, ctx, notice, predicted, reason):
    """``auto`` on a virtual pipeline: the fastest of stock interleaved, interleaved ``zb`` and
    (2 chunks, untied embeddings) ``zbv`` by the cost model; stock interleaved where none of ours
    is predicted to win (said so); without a prediction ``zb`` where W can be deferred, else
    ``1f1b`` (Megatron's interleaved order)."""
    virtual = (predicted or {}).get("virtual")
    if not virtual:
        mode = "1f1b" if reason else "zb"
        notice(f"`pp.mode` auto on a virtual pipeline: {mode} (no cost-model prediction for this run)")
        return pp.replace(mode=mode)
    steps = dict(virtual["steps_ms"])
    if reason:
        steps = {k: t for k, t in steps.items() if k == "off"}
    if virtual["chunks"] != 2 or ctx.tied_embeddings or ctx.legacy_checkpoint:
        steps.pop("zbv", None)
    mode = min(steps, key=lambda k: (steps[k], k != "off"))
    stock = virtual["steps_ms"]["off"]
    if mode == "off":
        notice(f"`pp.mode` auto: Megatron's interleaved schedule runs (v={virtual['chunks']}): none of ours is "
               f"predicted faster on {predicted['hardware']} ("
               + ", ".join(f"{k} {stock / t:.2f}x" for k, t in sorted(virtual["steps_ms"].items()) if k != "off")
               + (f"; no B/W split: it needs {reason.split(':')[0]}" if reason else "") + ")")
        return pp.replace(mode="off", explicit=frozenset())
    notice(f"`pp.mode` auto: {mode}, predicted {stock / steps[mode]:.2f}x over stock interleaved (v="
           f"{virtual['chunks']}, simulated on {predicted['hardware']})")
    return pp.replace(mode=mode)
