"""``--overlap-tp-allreduce-fusion`` in Megatron's transformer layer (``tp/allreduce_fusion.py``).

Where it applies: the attention block of a ``TransformerLayer`` without sequence parallelism.
Megatron runs there

    out, bias = self_attention(...)                 linear_proj: GEMM, then a blocking all-reduce
    h = self_attn_bda(...)((out, bias), residual, p)
    n = pre_mlp_layernorm(h); y = mlp(n)            fc1's GEMM first

The fusion makes ``linear_proj`` compute ``h`` itself (reduce-scatter, bias + dropout + residual on
its rows, all-gather) and hands ``h`` through the bias-dropout-add untouched; as the all-gather's
pieces land, the pre-MLP norm and fc1's GEMM run on them (the look-ahead, no autograd). The layer
then runs its norm as stock does (its autograd graph, so its gradients are stock's whatever the
norm: a composite RMSNorm's backward sums its contributions in autograd's order), and where that
norm's output equals the look-ahead's bit for bit (checked each time: a row-wise norm gives the
same rows), fc1 takes the GEMM computed ahead instead of computing it again; fc1's backward is the
all-reduce path's. The norm's forward runs twice (on pieces, then whole): elementwise work, the
price of stock's exact graph.

Patches (``install.py``'s table): ``TransformerLayer._forward_attention`` (marks the block and
swaps the layer's ``self_attn_bda`` for the call), ``TransformerLayer._forward_pre_mlp_layernorm``
(checks the norm against the look-ahead and offers fc1 its GEMM). A block the fusion cannot honour runs the all-reduce path, with
a notice saying why: sequence parallelism, TP = 1, non-local modules, a compiled bias-dropout-add
with dropout (its masks come from the compiler's generator), recompute or offloading of the
norms, sub-batches (``tp.sub_batches`` > 1), an attention output gate, context parallelism. The
look-ahead is skipped (the gather is then waited whole) when the MLP is not Megatron's local one,
recomputes, or a forward pre-hook takes keyword arguments.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch

from ..tp.allreduce_fusion import RowAllReduceBDA
from .linear_comm import linear_comm


@dataclass
class Request:
    """One fused attention block in flight: its layer and, once ``linear_proj`` ran, its output."""

    layer: object
    residual: torch.Tensor
    output: Optional[torch.Tensor] = None
    norm: Optional[tuple] = None  # (o, the look-ahead that computed the norm and fc1 on its pieces)


def patch(inst) -> None:
    from megatron.core.transformer.transformer_layer import TransformerLayer

    inst.set_attr(TransformerLayer, "_forward_attention",
                  _forward_attention(inst, TransformerLayer.__dict__["_forward_attention"]))
    if "_forward_pre_mlp_layernorm" in TransformerLayer.__dict__:
        inst.set_attr(TransformerLayer, "_forward_pre_mlp_layernorm",
                      _pre_mlp_norm(inst, TransformerLayer.__dict__["_forward_pre_mlp_layernorm"]))
    else:  # another megatron-core layout: no look-ahead (the gather is waited whole)
        inst.notice_once("fusion-no-lookahead", "`tp.allreduce_fusion`: this megatron-core has no "
                         "TransformerLayer._forward_pre_mlp_layernorm; the all-gather is waited whole")
    inst.notice_once("fusion-on", "`tp.allreduce_fusion`: the attention output's all-reduce, bias, dropout and "
                     "residual add run as reduce-scatter, work on each rank's rows, all-gather into the pre-MLP norm "
                     "and fc1")


def _forward_attention(inst, original):
    @functools.wraps(original)
    def forward(self, hidden_states, *args, **kwargs):
        why = stock_reason(inst, self)
        if why is not None:
            inst.notice_once(f"fusion-whole:{why}", f"`tp.allreduce_fusion`: an attention block runs unfused ({why})")
            return original(self, hidden_states, *args, **kwargs)
        request = Request(self, hidden_states)
        bda = self.__dict__.get("self_attn_bda")
        outer, inst.fusion = inst.fusion, request
        self.self_attn_bda = _passing_bda(request, self.self_attn_bda)
        try:
            result = original(self, hidden_states, *args, **kwargs)
        finally:
            inst.fusion = outer
            if bda is None:
                del self.self_attn_bda
            else:
                self.self_attn_bda = bda
        if request.output is None:
            raise RuntimeError("megatron-overlap: the fused attention block's linear_proj did not run (a newer "
                               "megatron-core?); run without `tp.allreduce_fusion`")
        inst.calls["tp.fusion"] += 1
        return result

    return forward


def _passing_bda(request: Request, original):
    """The layer's ``self_attn_bda`` for one call: ``linear_proj``'s fused output passes through."""

    def make(training, fused):
        stock = original(training, fused)

        def bda(x_with_bias, residual, prob):
            x, bias = x_with_bias
            if request.output is not None and x is request.output:
                if bias is not None or residual is not request.residual:
                    raise RuntimeError("megatron-overlap: the fused attention output met another bias or residual "
                                       "than it was computed with; run without `tp.allreduce_fusion`")
                return x
            if request.output is not None:
                raise RuntimeError("megatron-overlap: the fused attention output did not reach the bias-dropout-add "
                                   "unchanged (a newer megatron-core?); run without `tp.allreduce_fusion`")
            return stock(x_with_bias, residual, prob)

        return bda

    return make


def stock_reason(inst, layer) -> Optional[str]:
    """Why this layer's attention block runs unfused, or None."""
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.tensor_parallel.layers import RowParallelLinear

    proj = getattr(getattr(layer, "self_attention", None), "linear_proj", None)
    if type(proj) is not RowParallelLinear:
        return "its linear_proj is not Megatron's local RowParallelLinear"
    group = proj.tp_group
    if group is None or group.size() == 1:
        return "tensor-parallel size 1: nothing to all-reduce"
    if proj.sequence_parallel:
        return "sequence parallelism reduce-scatters already"
    if not proj.skip_bias_add or not proj.weight.requires_grad or getattr(proj, "gtp_remat_size", 1) > 1 \
            or hasattr(proj.weight, "__fsdp_param__") or proj.explicit_expert_comm:
        return "its linear_proj adds its bias inside, is frozen, GTP-sharded or an FSDP parameter"
    if layer.__dict__.get("self_attn_bda") is not get_bias_dropout_add:
        return "its bias-dropout-add is not Megatron's get_bias_dropout_add"
    config = layer.config
    if layer.training and layer.hidden_dropout > 0 and config.bias_dropout_fusion:
        return ("the compiled bias-dropout-add draws its dropout masks from the compiler's generator; pass "
                "`megatron.no_bias_dropout_fusion` to fuse")
    if getattr(layer, "recompute_input_layernorm", False) or getattr(layer, "recompute_pre_mlp_layernorm", False) \
            or getattr(layer, "offload_attn_norm", False) or getattr(layer, "offload_mlp_norm", False) \
            or getattr(proj.config, "_cpu_offloading_context", None) is not None:
        return "recompute or offloading of its norms"
    if getattr(config, "attention_output_gate", False) or getattr(layer.self_attention, "offload_attn_proj", False):
        return "an output gate or offloading sits between linear_proj and the bias-dropout-add"
    if inst.config.tp.sub_batches > 1:
        return "its attention runs cut into sub-batches (`tp.sub_batches`)"
    if getattr(config, "inference_fuse_tp_communication", False) and not layer.training:
        return "Megatron's own fused inference communication"
    if getattr(config, "context_parallel_size", 1) > 1:
        return "context parallelism"
    return None


def row_forward(inst, row, input_, options, comm):
    """``linear_proj``'s forward under a fusion request: ``(h, None)`` with ``h`` the block's
    bias-dropout-add output; None when ``row`` is not the requested block's projection."""
    request = inst.fusion
    if request.output is not None or request.layer.self_attention.linear_proj is not row:
        return None
    layer, group = request.layer, row.tp_group
    size = group.size()
    if input_.shape[0] % size:
        from ..errors import OverlapConfigError

        raise OverlapConfigError(
            "tp.allreduce_fusion", f"the {input_.shape[0]} sequence rows here do not split over the {size} "
            "tensor-parallel ranks, which its reduce-scatter needs; drop `tp.allreduce_fusion`")
    plan_comm = linear_comm(inst, "row", group, input_, row.weight, input_.shape[0] // size, sequence_parallel=False)
    consume = _look_ahead(inst, request, input_.shape[0])
    inst.served.clear()
    inst.served_norm = None
    request.output = RowAllReduceBDA.apply(input_, row.weight, row.bias, request.residual, layer.hidden_dropout,
                                           layer.training, options, plan_comm, consume)
    if consume is not None and consume.norm_out is not None:
        request.norm = (request.output, consume)
        inst.served_norm = request
    return request.output, None


class _Ahead:
    """The look-ahead: the pre-MLP norm and fc1's GEMM on each gathered piece (``rows`` of the
    ``total`` rows), into the whole outputs the layer's own calls then take."""

    def __init__(self, norm, fc1, total: int):
        self.norm, self.fc1, self.total = norm, fc1, total
        self.norm_out = self.fc1_out = None

    def __call__(self, rows: slice, piece: torch.Tensor) -> None:
        n = self.norm(piece)  # the module itself (its hooks run), in the fused op's no-grad forward
        if self.norm_out is None:
            self.norm_out = n.new_empty((self.total, *n.shape[1:]))
            # fc1's forward pre-hooks (DDP's wait for its parameters' all-gather) before its weight is read
            for hook in list(self.fc1._forward_pre_hooks.values()):
                hook(self.fc1, (n,))
            self.fc1_out = n.new_empty((self.total, *n.shape[1:-1], self.fc1.weight.shape[0]))
        self.norm_out[rows] = n
        torch.matmul(n, self.fc1.weight.t(), out=self.fc1_out[rows])


def _look_ahead(inst, request: Request, total: int):
    """The consumer of the gathered pieces, or None when the MLP cannot take its results."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear
    from megatron.core.transformer.mlp import MLP

    layer = request.layer
    mlp, norm = getattr(layer, "mlp", None), getattr(layer, "pre_mlp_layernorm", None)
    if not hasattr(type(layer), "_forward_pre_mlp_layernorm"):
        return None
    if type(mlp) is not MLP or type(getattr(mlp, "linear_fc1", None)) is not ColumnParallelLinear:
        return None
    fc1 = mlp.linear_fc1
    if fc1.sequence_parallel or not fc1.weight.requires_grad or getattr(fc1, "gtp_remat_size", 1) > 1 or \
            getattr(layer, "recompute_mlp", False) or not isinstance(norm, torch.nn.Module):
        return None
    if fc1._forward_pre_hooks_with_kwargs or norm._forward_pre_hooks_with_kwargs or \
            torch.nn.modules.module._global_forward_pre_hooks:
        return None
    return _Ahead(norm, fc1, total)


def _pre_mlp_norm(inst, original):
    """The layer's own pre-MLP norm, as stock runs it (its autograd graph is stock's); where the
    look-ahead computed the same rows bit for bit, fc1 takes the GEMM computed ahead."""

    @functools.wraps(original)
    def forward(self, hidden_states):
        out = original(self, hidden_states)
        request = inst.served_norm
        if request is None or request.layer is not self or request.norm[0] is not hidden_states:
            return out
        inst.served_norm = None
        _o, ahead = request.norm
        if torch.equal(out, ahead.norm_out):  # a row-wise norm on pieces: the same bits (checked, not assumed)
            inst.served[id(out)] = (out, ahead.fc1.weight, ahead.fc1_out)
        else:
            inst.notice_once("fusion-norm-differs", "`tp.allreduce_fusion`: the pre-MLP norm on row pieces gave other "
                             "bits than on the whole sequence here; fc1 computes its GEMM again (correct, slower)")
        return out

    return forward
