"""Megatron's Column/Row parallel linears -> ``tp`` (patch table in ``install.py``).

With sequence parallelism the layers run ``tp.linear`` (all-gather / reduce-scatter overlapped);
without it ``tp.linear_ar`` (the Row forward's and the Column dgrad's all-reduces overlapped).
Everything that is not a layer with TP > 1 and a trainable weight (frozen weights, MoE experts
with explicit communication, 0.19's GTP-sharded weights) goes to Megatron's original code
untouched.
"""

from __future__ import annotations

import functools

from ..comm import waits
from ..tp.linear import ColumnParallelSP, DeferredWgradLinear, RowParallelSP, WgradOptions
from ..tp.linear_ar import ColumnParallelAR, RowParallelAR, ServedColumn
from ..tp.linear_plan import TPPlanner
from . import compat, sites
from .linear_comm import linear_comm

_LINEAR_FN = "linear_with_grad_accumulation_and_async_allreduce"


def _cuda_device_name():
    """The GPU the cost model is asked about (None: no CUDA device)."""
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else None


def _symm_mem_usable() -> bool:
    from ..tp.backends import symm_mem

    return symm_mem.availability()[0]


def resolve_auto(tp, args, notice):
    """``--overlap-tp auto`` and ``--overlap-tp-sub-batches auto``, resolved once, at install,
    into a concrete TP section.

    With Megatron's full ``args`` on a GPU the cost model knows: the strategy it predicts
    fastest (stock included); elsewhere ``symm-mem`` where it runs, else ``p2p``. An explicit
    decomposition (``--overlap-tp-chunks`` / ``-rs`` / ``-bidirectional``) is honoured: ``auto``
    then chooses only between stock and the backend that takes it, ``p2p``, with the user's
    values. ``--overlap-tp-autotune`` / ``--overlap-tp-plan-file`` leave the choice to their measurements
    (``p2p``, or ``symm-mem`` where it runs). Sub-batches ``auto`` adds each candidate cut into 2
    and 3 (with a concrete mode, only the count is chosen); without the cost model's answer the
    blocks run whole (1), said in a notice: the cut changes the weight gradients' last bits."""
    from ..tp.backends import resolve_backend
    from ..tp.linear_plan import EXPLICIT_SHAPE
    from ..tune.auto import predicted_choice

    sub = tp.sub_batches
    if tp.mode != "auto" and sub != "auto":
        return tp
    explicit = tp.given(*EXPLICIT_SHAPE)
    size = args.tensor_model_parallel_size if args is not None else 1
    fixed = (tp.chunks // size, tp.rs) if explicit else None
    picked = None
    if args is not None and not (tp.autotune or tp.plan_file):
        backend = None if tp.mode == "auto" else tp.mode
        blocks = tp.sub_batch_blocks if "sub_batch_blocks" in tp.explicit else None
        picked = predicted_choice(args, _cuda_device_name(), _symm_mem_usable() and not explicit, fixed, sub, backend,
                                  blocks)
    if picked is None:
        if sub == "auto":
            why = "`tp.autotune` / `tp.plan_file` measure the decompositions, not the cut" if (
                tp.autotune or tp.plan_file) else ("the cost model has no answer here (no GPU it knows, the model's "
                                                   "dimensions missing, or no cut that runs this configuration)")
            notice(f"`tp.sub_batches` auto: {why}; the blocks run whole (pass a count to cut them)")
            tp = tp.replace(sub_batches=1, sub_batch_blocks="all")
        return tp.replace(mode=resolve_backend(tp)) if tp.mode == "auto" else tp
    best, stock = picked
    n = best.strategy.sub_batches if sub == "auto" else sub
    cut = best.strategy.cut if sub == "auto" else tp.sub_batch_blocks
    if n == 1:
        cut = "all"
    if tp.mode != "auto":
        ratio = stock.step_ms / best.step_ms
        what = f"{n}" + ("" if cut == "all" else f" ({cut} blocks)")
        notice(f"`tp.sub_batches` auto: the cost model picks {what} for {tp.mode} (predicted {ratio:.2f}x over stock"
               + ("; it expects stock faster here: `tp.mode` auto would run stock)" if ratio < 1 else ")"))
        return tp.replace(sub_batches=n, sub_batch_blocks=cut)
    given = f" ({', '.join(f'`{g}`' for g in explicit)} kept)" if explicit else ""
    if best.strategy.name == "megatron":
        unused = [f"`{g}`" for g in explicit] + (["`tp.sub_batches`"] if sub not in (1, "auto") else [])
        notice("`tp.mode` auto: the cost model predicts stock Megatron fastest here; running stock"
               + (f" ({', '.join(unused)} unused)" if unused else ""))
        return tp.replace(mode="off", sub_batches=1, sub_batch_blocks="all", explicit=frozenset())
    notice(f"`tp.mode` auto: the cost model picks {best.name} ({best.flags}; predicted "
           f"{stock.step_ms / best.step_ms:.2f}x over stock){given}")
    if best.strategy.name == "symm-mem":
        return tp.replace(mode="symm-mem", sub_batches=n, sub_batch_blocks=cut, explicit=frozenset())
    if explicit:
        return tp.replace(mode="p2p", sub_batches=n, sub_batch_blocks=cut)
    return tp.replace(mode="p2p", chunks=best.strategy.chunks * size, rs=best.strategy.rs, sub_batches=n,
                      sub_batch_blocks=cut)


def patch(inst) -> None:
    """Patch both linears for ``inst``: TP overlap when its TP section is on (concrete by now),
    and, under a split pipeline schedule, the weight gradients of TP = 1 linears deferred to W."""
    from megatron.core import tensor_parallel
    from megatron.core.tensor_parallel import layers

    from ..tp.backends import make_backend
    from ..tp.wgrad_store import WgradStore
    from . import ddp

    inst.wgrad = WgradStore()
    ddp.patch(inst)
    original = layers.__dict__[_LINEAR_FN]
    column = _column_linear(inst, original)
    inst.set_attr(layers, _LINEAR_FN, column)
    if getattr(tensor_parallel, _LINEAR_FN, None) is original:
        inst.set_attr(tensor_parallel, _LINEAR_FN, column)
    if not inst.tp_overlap:
        return
    if compat.transformer_engine_version() is not None:
        inst.notice_once("te-linears", "Transformer Engine is installed: megatron-overlap patches Megatron's local "
                         "ColumnParallelLinear/RowParallelLinear only (`megatron.transformer_impl` local); TE's linears are "
                         "left as they are")
    tuner = None
    if inst.config.tp.autotune or inst.config.tp.plan_file:
        from ..tp.autotune import PlanTuner, load_plan_file

        path = inst.config.tp.plan_file
        rows = None if inst.config.hdp.enabled else inst.context.rows_per_rank()  # else: at the first step
        plans = load_plan_file(path, rows) if path else None
        tuner = PlanTuner(inst.config.tp.autotune, plans, plan_file=path or "the plan file")
    inst.tp = TPPlanner(inst.config.tp, make_backend(inst.config.tp.mode, inst.config.comm.timeout_s), tuner)
    inst.set_attr(layers.RowParallelLinear, "forward", _row_forward(inst, layers.RowParallelLinear.__dict__["forward"]))
    if inst.config.tp.sub_batches > 1:
        from . import sub_batches

        sub_batches.patch(inst)
    from . import embedding_grad

    embedding_grad.patch(inst)
    if inst.config.tp.allreduce_fusion:
        from . import allreduce_fusion

        allreduce_fusion.patch(inst)
    inst.notice_once("tp-on", f"TP overlap on ({inst.tp.backend.name}): {' '.join(inst.config.as_flags())}")


def _column_linear(inst, original):
    signature = compat.linear_signature(original)

    @functools.wraps(original)  # also copies the `.warned` attribute Megatron reads back
    def linear(*args, **kwargs):
        call = compat.LinearCall(signature, args, kwargs)
        group = compat.default_tp_group(call.tp_group)
        if inst.config.pp.split and (group is None or group.size() == 1) and call.grad_output_buffer is None:
            wgrad = WgradOptions(call.gradient_accumulation_fusion)
            inst.calls["pp.deferred_linear"] += 1
            return DeferredWgradLinear.apply(call.input, call.weight, call.bias, wgrad, inst.wgrad)
        if call.allreduce_dgrad and inst.tp_overlap and group is not None and group.size() > 1 and \
                call.gtp_remat_size <= 1:
            # Only a Column layer with TP > 1 and sequence parallelism off asks for this.
            return _column_ar(inst, call, group)
        if not call.sequence_parallel or not inst.tp_overlap:
            return original(*args, **kwargs)
        if group is None or group.size() == 1:
            inst.notice_once("tp1", "tensor-parallel size 1: nothing to overlap, stock path")
            return original(*args, **kwargs)
        if call.gtp_remat_size > 1:
            inst.notice_once("gtp", "GTP-sharded weights (gtp_remat_size > 1) run Megatron's stock path")
            return original(*args, **kwargs)
        x = call.input
        wgrad = WgradOptions(call.gradient_accumulation_fusion, call.grad_output_buffer, call.wgrad_deferral_limit)
        inst.calls["tp.column"] += 1
        sub = inst.sub_batch
        part = (sub, sub.index) if sub is not None and sub.parts and x is sub.parts[sub.index] else None
        comm = linear_comm(inst, "column", group, x, call.weight, x.shape[0], part)
        with waits.at(sites.label_for_weight(inst, call.weight, "column") + " forward",
                      timeout_s=inst.config.comm.timeout_s):
            return ColumnParallelSP.apply(x, call.weight, call.bias, wgrad, comm)

    return linear


def _column_ar(inst, call, group):
    """A Column linear without sequence parallelism (``tp.linear_ar``); its GEMM already computed
    when the all-reduce fusion's gather fed it (``allreduce_fusion.py``)."""
    x = call.input
    wgrad = WgradOptions(call.gradient_accumulation_fusion, call.grad_output_buffer, call.wgrad_deferral_limit)
    sub = inst.sub_batch
    part = (sub, sub.index) if sub is not None and sub.parts and x is sub.parts[sub.index] else None
    comm = linear_comm(inst, "column_ar", group, x, call.weight, x.shape[0], part)
    inst.calls["tp.column_ar"] += 1
    with waits.at(sites.label_for_weight(inst, call.weight, "column") + " forward",
                  timeout_s=inst.config.comm.timeout_s):
        served = inst.served.pop(id(x), None) if inst.served else None
        if served is not None and served[0] is x and served[1] is call.weight:
            inst.calls["tp.fusion.served"] += 1
            return ServedColumn.apply(x, call.weight, call.bias, wgrad, comm, served[2])
        return ColumnParallelAR.apply(x, call.weight, call.bias, wgrad, comm)


def _row_forward(inst, original):
    @functools.wraps(original)
    def forward(self, input_):
        group = self.tp_group
        if group is None or group.size() == 1 or self.explicit_expert_comm or not self.weight.requires_grad:
            return original(self, input_)
        if getattr(self, "gtp_remat_size", 1) > 1:
            inst.notice_once("gtp", "GTP-sharded weights (gtp_remat_size > 1) run Megatron's stock path")
            return original(self, input_)
        _check_cpu_offloading(self, input_)
        if inst.projected is not None:
            from .sub_batches import projected

            done = projected(inst, input_)
            if done is not None:  # computed per sub-batch by the core attention (sub_batches.py)
                return done
        sp = self.sequence_parallel
        rows = input_.shape[0] // group.size() if sp else input_.shape[0]
        sub = inst.sub_batch
        part = (sub, sub.index) if sub is not None and self is sub.row and self.skip_bias_add else None
        comm = linear_comm(inst, "row" if sp else "row_ar", group, input_, self.weight, rows, part)
        inst.calls["tp.row" if sp else "tp.row_ar"] += 1
        with waits.at(sites.label_for_weight(inst, self.weight, "row", self) + " forward",
                      timeout_s=inst.config.comm.timeout_s):
            options = WgradOptions(self.gradient_accumulation_fusion)
            if not sp:
                fused = _fusion(inst, self, input_, options, comm)
                if fused is not None:
                    return fused
            output_ = (RowParallelSP if sp else RowParallelAR).apply(input_, self.weight, options, comm)
        if not self.skip_bias_add:
            output = (output_ + self.bias) if self.bias is not None else output_
            return output, None
        return output_, self.bias

    return forward


def _fusion(inst, row, input_, options, comm):
    """The all-reduce fusion's output for ``row`` when the attention block it projects asked for
    it (``allreduce_fusion.py``), else None."""
    if inst.fusion is None:
        return None
    from . import allreduce_fusion

    return allreduce_fusion.row_forward(inst, row, input_, options, comm)


def _check_cpu_offloading(layer, input_):
    """Megatron's own check in RowParallelLinear.forward, kept on the patched path."""
    context = getattr(layer.config, "_cpu_offloading_context", None)
    if context is None or context.inside_context is not True:
        return
    from megatron.core.tensor_parallel import layers

    if not layers.HAVE_TE:
        assert layer.config.cpu_offloading is False, "CPU Offloading cannot be enabled while TE is not present"
    else:
        input_.activation_offloading = layer.config.cpu_offloading_activations
