"""CoCoNet's transformation of a RowParallelLinear's all-reduce and the bias-dropout-add after it,
without sequence parallelism (``--overlap-tp-allreduce-fusion``).

R ranks, S rows (every rank holds the whole sequence), s = S / R; Row weight ``w [n, k]``:

    stock    h [S, b, n] = AR(x [S, b, k] @ w^T)                  blocking all-reduce
             o [S, b, n] = residual + dropout(h + bias)            on every rank, all S rows
    fused    h_s [s, b, n] = RS(x @ w^T)                           the backend's GEMM-RS (overlapped)
             o_s [s, b, n] = residual_s + dropout_s(h_s + bias)    this rank's rows only
             o   [S, b, n] = AG(o_s)                               ring pieces, each handed to ``consume``
                                                                   as it lands (the next norm + GEMM)

Bytes moved: RS + AG = one all-reduce. Elementwise work in forward: 1/R of stock's.

Numerics, exactly:
- dropout: the mask is drawn for the whole [S, b, n] tensor from the same generator, in the same
  call stock makes (``F.dropout`` of a tensor of ones of that shape: the same draws, the same
  ``1 / (1 - p)`` scale, the generator left where stock leaves it), and this rank's rows of it are
  applied; ``h * noise`` is what the unfused CPU dropout computes. So every rank applies exactly
  stock's mask to its rows. (A compiled ``bias_dropout_add`` draws from the compiler's own
  generator; ``integration/allreduce_fusion.py`` runs stock there.)
- elementwise order: ``residual + ((h + bias) * noise)``, Megatron's ``_bias_dropout_add_func``;
- summation order: that of the backend's reduce-scatter. Over two ranks a + b == b + a: the same
  bits as stock's all-reduce. Over R > 2 ranks the ring sums partials in ring order, which
  differs from the all-reduce's in the last bits (fp32 rounding, bounded in the tests);
- backward is stock's, on the whole replicated gradient: ``d residual = d o``,
  ``d h = d o * noise``, ``d bias`` its sum over rows, then the Row linear's own dgrad and wgrad
  GEMMs. No communication, as in stock (an all-reduce's backward is the identity).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..comm.rings import RingAllGather
from .linear import TPComm, WgradOptions, _custom_bwd, _custom_fwd, _wgrad
from .wgrad import as_2d

# consume(rows of the gathered [S, ...] tensor, the tensor of those rows): called for this rank's
# rows first, then for each piece of the others' as it lands
Consumer = Callable[[slice, torch.Tensor], None]


def dropout_noise(shape, p: float, training: bool, like: torch.Tensor) -> Optional[torch.Tensor]:
    """The multiplier stock's ``F.dropout`` applies to a tensor of ``shape`` (None: none drawn)."""
    if not training or p == 0.0:
        return None  # F.dropout returns its input untouched and draws nothing
    return F.dropout(torch.ones(shape, dtype=like.dtype, device=like.device), p=p, training=True)


def gather_consuming(o_s: torch.Tensor, group: dist.ProcessGroup, pieces, consume: Optional[Consumer]) -> torch.Tensor:
    """``AG(o_s)`` over the ring in ``pieces``; ``consume`` sees each piece as soon as it is local."""
    size = dist.get_world_size(group)
    gathered = torch.empty((o_s.shape[0] * size, *o_s.shape[1:]), dtype=o_s.dtype, device=o_s.device)
    ring = RingAllGather(o_s, gathered, group, pieces, stream="tp.fusion_all_gather", copy_own=True)
    own_rows, own = ring.own()
    if consume is not None:
        consume(own_rows, own)
    for step in range(1, size):
        for k in range(len(ring.pieces)):
            _owner, rows, piece = ring.take(step, k)
            if consume is not None:
                consume(rows, piece)
    ring.finish()
    return gathered


class RowAllReduceBDA(torch.autograd.Function):
    """``residual + dropout(AR(x @ w^T) + bias)`` computed as reduce-scatter, shard-wise bias +
    dropout + residual, all-gather (module docstring). ``consume``: what to do with each gathered
    piece (None: nothing)."""

    @staticmethod
    @_custom_fwd
    def forward(ctx, input: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                residual: torch.Tensor, p: float, training: bool, wgrad: WgradOptions, comm: TPComm,
                consume: Optional[Consumer]) -> torch.Tensor:
        ctx.save_for_backward(input)
        ctx.weight = weight  # the parameter itself (see linear.ColumnParallelSP)
        ctx.main_grad = weight.main_grad if wgrad.accumulation_fusion and hasattr(weight, "main_grad") else None
        ctx.wgrad, ctx.comm = wgrad, comm
        ctx.bias_shape = None if bias is None else bias.shape
        ctx.residual_dtype = residual.dtype
        size, rank = dist.get_world_size(comm.group), dist.get_rank(comm.group)
        pending = comm.backend.matmul_reduce_scatter(input, weight.t(), comm.group, comm.plan)
        out_shape = (*input.shape[:-1], weight.shape[0])
        noise = dropout_noise(out_shape, p, training, input)  # drawn while the partials travel
        ctx.noise = noise
        h_s = pending.finish()
        rows = slice(rank * h_s.shape[0], (rank + 1) * h_s.shape[0])
        residual = residual if residual.dtype == h_s.dtype else residual.to(h_s.dtype)
        x = h_s + bias if bias is not None else h_s
        if noise is not None:
            x = x * noise[rows]
        o_s = residual[rows] + x
        assert size * h_s.shape[0] == input.shape[0]
        return gather_consuming(o_s, comm.group, comm.plan.pieces, consume)

    @staticmethod
    @_custom_bwd
    def backward(ctx, grad_output: torch.Tensor):
        (input,), weight, comm, wgrad = ctx.saved_tensors, ctx.weight, ctx.comm, ctx.wgrad
        if wgrad.accumulation_fusion:
            weight.main_grad = ctx.main_grad
        noise, ctx.noise = ctx.noise, None
        grad_residual = grad_output if ctx.residual_dtype == grad_output.dtype else grad_output.to(ctx.residual_dtype)
        grad_h = grad_output * noise if noise is not None else grad_output
        grad_bias = grad_h.sum_to_size(ctx.bias_shape) if ctx.bias_shape is not None else None
        grad_input = grad_h.matmul(weight)  # the Row linear's backward, as stock's (no communication)
        grad_2d, input_2d = as_2d(grad_h, input)
        grad_weight = _wgrad(weight, grad_2d, input_2d, wgrad, input, comm)
        return grad_input, grad_weight, grad_bias, grad_residual, None, None, None, None, None
