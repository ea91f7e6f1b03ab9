"""Sub-batches (``--overlap-tp-sub-batches N``; ``tp/sub_batch.py``) in Megatron's transformer layer.

MLP: the block's own forward runs once per sub-batch of each rank's rows, so the activation is
Megatron's code, whatever it is (GeLU, SwiGLU, bias fusions); the patched linears see which
sub-batch they run and post or defer their transfers.

Attention: the core attention couples rows through its keys and values, not its queries. With
Q, K and V gathered whole (the QKV linear, as today), the core attention runs once per
sub-batch of query rows (the rows of each rank's part j, its mask rows with them) and the
output projection right after each, so the reduce-scatter of part j travels while part j + 1's
attention computes. ``Attention.forward`` then gets the parts' context rows put back together
(a tensor with no autograd history) and its ``linear_proj`` call returns the projection already
computed from them; anything between the two that would change that tensor (an output gate,
packed THD, recompute, offloading) makes the attention run whole instead, said once.

Numerics: stock's bits. Every forward row and input-gradient row is computed as stock computes
it; each weight gradient is one GEMM over every part's rows (``SubBatches.collect``), and the
keys' and values' gradients are stock's two GEMMs over all query rows
(``integration/attention_parts.py``; it keeps a second copy of the attention probabilities
until the backward). With ``add_bias_linear``, fc1's bias is added inside Megatron's activation,
per part, so its gradient is summed per sub-batch (a few ulp).

Without sequence parallelism every rank holds the whole sequence: the parts are row ranges of
it, the linears take the all-reduce path (``tp/linear_ar.py``), and part j's all-reduces (fc2's
and the projection's in forward, fc1's dgrad in backward) travel while part j + 1 computes,
waited after the last part (``Join`` / ``Split``).

``--overlap-tp-sub-batch-blocks`` attention (or mlp) cuts only those blocks; the others run
whole with per-op overlap.

Blocks the cut cannot apply to run whole, with a notice saying why: Transformer Engine
modules, expert MLPs, TP = 1, context parallelism (its attention), attention dropout (its RNG
stream would be drawn in another order).
"""

from __future__ import annotations

import functools
import inspect

import torch

from ..errors import OverlapConfigError
from ..tp.sub_batch import Join, Split, SubBatches, split_sizes
from .attention_parts import AttentionPart, CutAttention


def patch(inst) -> None:
    from megatron.core.transformer import attention, dot_product_attention, mlp

    inst.set_attr(mlp.MLP, "forward", _forward(inst, mlp.MLP.__dict__["forward"]))
    inst.set_attr(attention.Attention, "forward", _attention_forward(inst, attention.Attention.__dict__["forward"]))
    dpa = dot_product_attention.DotProductAttention
    inst.set_attr(dpa, "forward", _core_forward(inst, dpa.__dict__["forward"]))
    blocks = {"all": "attention and MLP blocks", "attention": "attention blocks (MLP blocks whole)",
              "mlp": "MLP blocks (attention blocks whole)"}[inst.config.tp.sub_batch_blocks]
    inst.notice_once("sub-batches", f"{blocks} cut into {inst.config.tp.sub_batches} sub-batches "
                     "(`tp.sub_batches`): one sub-batch's transfers travel while another computes")


def _forward(inst, original):
    n = inst.config.tp.sub_batches

    @functools.wraps(original)
    def forward(self, hidden_states, *args, **kwargs):
        if inst.config.tp.sub_batch_blocks == "attention" or \
                not _cut(inst, "this MLP block", _stock_reason(self, args, kwargs), hidden_states, self.linear_fc2):
            return original(self, hidden_states, *args, **kwargs)
        sub = SubBatches(self.linear_fc2.tp_group, split_sizes(hidden_states.shape[0], n), row=self.linear_fc2,
                         pool=inst.scratch)
        sub.parts = Split.apply(hidden_states, sub)
        outs, bias = [], None
        outer, inst.sub_batch = inst.sub_batch, sub
        try:
            for j, part in enumerate(sub.parts):
                sub.index = j
                out, bias = original(self, part, *args, **kwargs)
                outs.append(out)
        finally:
            inst.sub_batch = outer
        inst.calls["tp.sub_batches"] += 1
        return Join.apply(sub, *outs), bias

    return forward


def _cut(inst, what: str, why, hidden_states, row) -> bool:
    """Whether a block is cut: not when ``why`` (a reason it cannot be) or its rows are too few,
    which is an error when training and a notice (the block runs whole) without gradients."""
    n = inst.config.tp.sub_batches
    if why is None:
        chunks = inst.config.tp.chunks if row.sequence_parallel else 0  # an all-reduce's pieces fit any part
        why = check_rows(hidden_states.shape[0], n, chunks, row.tp_group.size())
        if why is not None and torch.is_grad_enabled():
            raise OverlapConfigError("tp.sub_batches", why)
    if why is not None:
        inst.notice_once(f"sub-batches-whole:{what}:{why}", f"`tp.sub_batches` {n}: {what} runs whole ({why})")
    return why is None


def check_rows(rows: int, n: int, chunks: int, tp_size: int):
    """Why ``rows`` rows per rank cannot be cut into ``n`` sub-batches, or None."""
    if rows < n:
        return f"each rank holds {rows} sequence rows here, fewer than the {n} sub-batches asked"
    per_rank = chunks // tp_size if chunks else 1
    smallest = rows // n
    if smallest < per_rank:
        return (f"{n} sub-batches of each rank's {rows} rows hold {smallest} rows, fewer than the {per_rank} chunks "
                f"per rank of `tp.chunks` {chunks}; lower `tp.sub_batches` or `tp.chunks`")
    return None


def _stock_reason(block, args, kwargs):
    """Why this block runs whole, or None."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    fc1, fc2 = block.linear_fc1, block.linear_fc2
    if type(fc1) is not ColumnParallelLinear or type(fc2) is not RowParallelLinear:
        return f"its linears are {type(fc1).__name__} / {type(fc2).__name__}, not Megatron's local ones"
    if any(a is not None for a in args) or kwargs.get("per_token_scale") is not None:
        return "an expert MLP with per-token scales"
    group = fc2.tp_group
    if group is None or group.size() == 1 or fc2.explicit_expert_comm:
        return "no tensor-parallel communication to overlap"
    if not fc2.skip_bias_add:
        return "its fc2 adds its bias inside"
    if any(hasattr(m.weight, "__fsdp_param__") for m in (fc1, fc2)):
        return "Megatron-FSDP writes each weight gradient once (the parts would overwrite each other)"
    return None


# -- attention ------------------------------------------------------------------------------------
def _attention_forward(inst, original):
    """``Attention.forward``: marks the block whose core attention and projection are cut."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def forward(self, hidden_states, *args, **kwargs):
        if inst.config.tp.sub_batch_blocks == "mlp":
            return original(self, hidden_states, *args, **kwargs)
        why = _attention_stock_reason(inst, self, signature.bind(self, hidden_states, *args, **kwargs).arguments)
        if not _cut(inst, "attention", why, hidden_states, self.linear_proj):
            return original(self, hidden_states, *args, **kwargs)
        outer, inst.attention_block = inst.attention_block, self
        try:
            result = original(self, hidden_states, *args, **kwargs)
        finally:
            inst.attention_block = outer
            left, inst.projected = inst.projected, None
        if left is not None:  # linear_proj ran on something else: its gradient would not reach attention
            raise RuntimeError("megatron-overlap: the sub-batched attention's output did not reach linear_proj "
                               "unchanged (a newer Megatron-core?); run without `tp.sub_batches`")
        return result

    return forward


def _core_forward(inst, original):
    """``DotProductAttention.forward`` of a marked block: attention and projection per part."""
    n = inst.config.tp.sub_batches

    @functools.wraps(original)
    def forward(self, query, key, value, attention_mask, *args, **kwargs):
        block = inst.attention_block
        if block is None or block.core_attention is not self:
            return original(self, query, key, value, attention_mask, *args, **kwargs)
        inst.attention_block = None
        proj, total = block.linear_proj, query.shape[0]
        size = proj.tp_group.size() if proj.sequence_parallel else 1  # without SP: row ranges of the sequence
        sub = SubBatches(proj.tp_group, split_sizes(total // size, n), row=proj, pool=inst.scratch)
        sub.gather_whole_early = True  # the parts' attention backwards run between the first projection's and QKV
        mask = attention_mask if attention_mask is not None else _causal_mask(self, total, key.shape[0], query.device)
        cut = CutAttention(n, query, key, value, inst.notice_once, inst.scratch) if torch.is_grad_enabled() else None
        outer, inst.sub_batch = inst.sub_batch, sub
        parts, outs, bias = [], [], None
        try:
            first = 0
            for j, rows in enumerate(sub.sizes):
                sub.index = j
                index = torch.cat([torch.arange(r * (total // size) + first, r * (total // size) + first + rows,
                                                device=query.device) for r in range(size)])
                first += rows
                rows_mask = mask.index_select(-2, index) if mask is not None and mask.shape[-2] == total else mask
                if cut is None:  # no backward: Megatron's forward on the part's query rows
                    context = original(self, query.index_select(0, index), key, value, rows_mask, *args, **kwargs)
                else:
                    run = functools.partial(_run_part, original, self, rows_mask, args, kwargs)
                    context = AttentionPart.apply(query, key, value, cut, j, index, run)
                out, bias = proj(context)
                parts.append((index, context))
                outs.append(out)
        finally:
            inst.sub_batch = outer
        with torch.no_grad():  # the context rows in order, for Attention.forward to hand on
            whole = parts[0][1].new_empty((total, *parts[0][1].shape[1:]))
            for index, context in parts:
                whole.index_copy_(0, index, context)
        inst.projected = (whole, Join.apply(sub, *outs), bias)
        inst.calls["tp.sub_batches.attention"] += 1
        return whole

    return forward


def _run_part(original, core, rows_mask, args, kwargs, query, key, value):
    return original(core, query, key, value, rows_mask, *args, **kwargs)


def _causal_mask(core, sq: int, sk: int, device):
    """The mask Megatron's softmax builds itself for a causal block without one (it assumes the
    whole square), given explicitly for the query rows of one part; None when there is none.
    The softmax's own mask type decides, as in Megatron (the forward's argument is unused)."""
    from megatron.core.transformer.enums import AttnMaskType

    kind = core.scale_mask_softmax.attn_mask_type
    if kind != AttnMaskType.causal:
        return None
    return torch.triu(torch.ones(1, 1, sq, sk, dtype=torch.bool, device=device), diagonal=1)  # True: masked


def projected(inst, input_):
    """The projection computed per part for ``input_`` (the context rows a sub-batched core
    attention returned), or None."""
    entry = inst.projected
    if entry is None or entry[0] is not input_:
        return None
    inst.projected = None
    return entry[1], entry[2]


def _attention_stock_reason(inst, block, bound):
    """Why this attention block runs whole, or None."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from .attention import ATTRIBUTE

    config = block.config
    core = getattr(block, "core_attention", None)
    if type(getattr(block, "linear_qkv", None)) is not ColumnParallelLinear or \
            type(getattr(block, "linear_proj", None)) is not RowParallelLinear or not isinstance(core, DotProductAttention):
        return "its modules are not Megatron's local ones"
    if getattr(core, ATTRIBUTE, None) is not None or getattr(config, "context_parallel_size", 1) > 1 or \
            inst.config.hdp.enabled:
        return "context parallelism (or HDP) runs its own attention"
    softmax = getattr(core, "scale_mask_softmax", None)
    if softmax is None or softmax.window_size is not None:
        return "sliding-window attention builds its mask for the last queries of the square"
    if softmax.scaled_masked_softmax_fusion and softmax.input_in_float16:
        return "the fused softmax kernels assume the whole square of queries and keys"
    group = block.linear_proj.tp_group
    if group is None or group.size() == 1:
        return "no tensor-parallel communication to overlap"
    if not block.linear_proj.skip_bias_add:
        return "its linear_proj adds its bias inside"
    if not block.linear_proj.weight.requires_grad or getattr(block.linear_proj, "gtp_remat_size", 1) > 1 or \
            hasattr(block.linear_proj.weight, "__fsdp_param__"):
        return "its linear_proj is frozen, GTP-sharded or an FSDP parameter"
    if block.training and config.attention_dropout > 0:
        return "attention dropout would draw its random numbers in another order"
    if getattr(block, "checkpoint_core_attention", False) or getattr(config, "attention_output_gate", False) or \
            getattr(block, "offload_core_attention", False) or getattr(block, "offload_attn_proj", False):
        return "recompute, an output gate or offloading sits between the core attention and linear_proj"
    if bound.get("key_value_states") is not None or bound.get("attention_bias") is not None:
        return "cross-attention or an attention bias"
    if bound.get("inference_context") is not None or bound.get("inference_params") is not None or \
            bound.get("packed_seq_params") is not None:
        return "inference or packed sequences"
    return None

