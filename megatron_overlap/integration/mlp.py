"""Megatron's ``MLP.forward`` -> sub-batches (``--overlap-tp-sub-batches N``; ``tp/sub_batch.py``).

The block's own forward runs once per sub-batch of each rank's rows, so the activation is
Megatron's code, whatever it is (GeLU, SwiGLU, bias fusions); the patched linears see which
sub-batch they run and post or defer their transfers. Blocks the cut cannot apply to run
stock, with a notice saying why: Transformer Engine linears, expert MLPs, no sequence
parallelism or TP = 1.
"""

from __future__ import annotations

import functools

import torch

from ..errors import OverlapConfigError
from ..tp.sub_batch import Join, Split, SubBatches, split_sizes


def patch(inst) -> None:
    from megatron.core.transformer import mlp

    inst.set_attr(mlp.MLP, "forward", _forward(inst, mlp.MLP.__dict__["forward"]))
    inst.notice_once("sub-batches", f"MLP blocks cut into {inst.config.tp.sub_batches} sub-batches "
                     "(`tp.sub_batches`): one sub-batch's transfers travel while another computes")


def _forward(inst, original):
    n = inst.config.tp.sub_batches

    @functools.wraps(original)
    def forward(self, hidden_states, *args, **kwargs):
        why = _stock_reason(self, args, kwargs)
        if why is None:
            why = check_rows(hidden_states.shape[0], n, inst.config.tp.chunks, self.linear_fc2.tp_group.size())
            if why is not None and torch.is_grad_enabled():
                raise OverlapConfigError("tp.sub_batches", why)
        if why is not None:
            inst.notice_once(f"sub-batches-stock:{why}", f"`tp.sub_batches` {n}: this MLP block runs whole ({why})")
            return original(self, hidden_states, *args, **kwargs)
        sub = SubBatches(self.linear_fc2.tp_group, split_sizes(hidden_states.shape[0], n), owner=self)
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
    if group is None or group.size() == 1 or not fc2.sequence_parallel or fc2.explicit_expert_comm:
        return "no tensor-parallel communication with sequence parallelism to overlap"
    if not fc2.skip_bias_add:
        return "its fc2 adds its bias inside"
    return None
