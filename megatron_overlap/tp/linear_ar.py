"""Autograd functions for ColumnParallelLinear and RowParallelLinear WITHOUT sequence
parallelism, with their all-reduces overlapped (``gemm_ar.py``).

R ranks in the TP group; every rank holds the whole sequence, S rows, b micro-batch:

Column (weight ``w [n, k]``, this rank's n = N / R output columns; input replicated)
    forward   y [S, b, n]  = x [S, b, k] @ w^T                    no communication (as stock)
    dgrad     dx [S, b, k] = AR(dy [S, b, n] @ w)                 GEMM per row piece -> its AR travels
                                                                   while the next piece computes
    wgrad     dw [n, k]    = dy^T @ x                              one GEMM while the last pieces travel
Row (weight ``w [n, k]``, this rank's k = K / R input columns; output replicated)
    forward   y [S, b, n]  = AR(x [S, b, k] @ w^T)                GEMM per row piece -> its AR travels
                                                                   while the next piece computes
    dgrad     dx [S, b, k] = dy @ w                                no communication (as stock)
    wgrad     dw [n, k]    = dy^T @ x                              one GEMM

Stock Megatron issues the Column dgrad's all-reduce once the whole dgrad GEMM is done and
hides it behind the wgrad GEMM only; the Row forward's all-reduce is blocking. Here the first
piece's all-reduce leaves after 1/P of the GEMM. The wgrad GEMMs stay whole, so the weight
gradients are stock's bits; the forward rows and input-gradient rows are the same GEMMs on the
same rows, summed by the same collective (``gemm_ar.py`` for R > 2).

``ServedColumn`` is the Column linear whose forward GEMM already ran, piece by piece, while its
input was being all-gathered (``allreduce_fusion.py``): the same backward as ``ColumnParallelAR``.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..comm import waits
from .linear import TPComm, WgradOptions, _custom_bwd, _custom_fwd, _wgrad, collected_wgrad
from .wgrad import as_2d, weight_gradient


def _column_backward(ctx, grad_output: torch.Tensor):
    (input,), weight = ctx.saved_tensors, ctx.weight
    comm, wgrad = ctx.comm, ctx.wgrad
    if wgrad.accumulation_fusion:
        weight.main_grad = ctx.main_grad
    wgrad_compute = not wgrad.defers(grad_output)
    # dgrad = AR(dy @ w), piece by piece; the held wgrads and this wgrad run while the last travel
    mark = comm.wgrad.mark() if comm.wgrad is not None else None
    pending = comm.backend.matmul_all_reduce(grad_output, weight, comm.group, comm.plan)
    if comm.wgrad is not None:
        comm.wgrad.run(older_than=mark)
    if wgrad_compute and comm.sub is not None:  # one GEMM over every part's rows, at the last part
        grad_weight, grad_bias = collected_wgrad(weight, "column", (grad_output, input), wgrad, input, comm,
                                                 ctx.use_bias)
    elif wgrad_compute:
        grad_output, total_input = as_2d(grad_output, input)
        grad_weight = _wgrad(weight, grad_output, total_input, wgrad, input, comm)
        grad_bias = grad_output.sum(dim=0) if ctx.use_bias else None
    else:
        grad_weight = weight_gradient(weight, None, None, wgrad.accumulation_fusion, input)
        grad_bias = grad_output.sum(dim=0) if ctx.use_bias else None  # as stock (3-D here)
    if comm.sub is not None:  # waited once every chain has run (sub_batch.Split)
        comm.sub[0].defer("dx", comm.sub[1], pending)
        return torch.empty_like(input), grad_weight, grad_bias
    return pending.finish(), grad_weight, grad_bias


def _save(ctx, input, weight, bias, wgrad: WgradOptions, comm: TPComm):
    ctx.save_for_backward(input)
    ctx.weight = weight  # the parameter itself (see linear.ColumnParallelSP)
    ctx.main_grad = weight.main_grad if wgrad.accumulation_fusion and hasattr(weight, "main_grad") else None
    ctx.use_bias = bias is not None
    ctx.wgrad, ctx.comm = wgrad, comm
    ctx.where = waits.current()


class ColumnParallelAR(torch.autograd.Function):
    """ColumnParallelLinear without sequence parallelism, its dgrad all-reduce overlapped."""

    @staticmethod
    @_custom_fwd
    def forward(ctx, input: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                wgrad: WgradOptions, comm: TPComm) -> torch.Tensor:
        _save(ctx, input, weight, bias, wgrad, comm)
        output = torch.matmul(input, weight.t())
        return output + bias if bias is not None else output

    @staticmethod
    @_custom_bwd
    def backward(ctx, grad_output: torch.Tensor):
        with waits.restored(ctx.where, "backward"):
            return (*_column_backward(ctx, grad_output), None, None)


class ServedColumn(torch.autograd.Function):
    """A Column linear whose forward GEMM ``output [S, b, n]`` (without bias) was computed
    earlier, piece by piece as its input arrived; ``ColumnParallelAR``'s backward."""

    @staticmethod
    @_custom_fwd
    def forward(ctx, input: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                wgrad: WgradOptions, comm: TPComm, output: torch.Tensor) -> torch.Tensor:
        _save(ctx, input, weight, bias, wgrad, comm)
        return output + bias if bias is not None else output

    @staticmethod
    @_custom_bwd
    def backward(ctx, grad_output: torch.Tensor):
        with waits.restored(ctx.where, "backward"):
            return (*_column_backward(ctx, grad_output), None, None, None)


class RowParallelAR(torch.autograd.Function):
    """RowParallelLinear without sequence parallelism, its forward all-reduce overlapped with
    its own GEMM's pieces. The bias is not part of the op: Megatron adds it after the all-reduce."""

    @staticmethod
    @_custom_fwd
    def forward(ctx, input: torch.Tensor, weight: torch.Tensor, wgrad: WgradOptions, comm: TPComm) -> torch.Tensor:
        _save(ctx, input, weight, None, wgrad, comm)
        pending = comm.backend.matmul_all_reduce(input, weight.t(), comm.group, comm.plan)
        if comm.sub is None:
            return pending.finish()
        sub, j = comm.sub
        sub.defer("out", j, pending)  # waited after the last sub-batch (sub_batch.Join)
        return input.new_empty((*input.shape[:-1], weight.shape[0]))

    @staticmethod
    @_custom_bwd
    def backward(ctx, grad_output: torch.Tensor):
        with waits.restored(ctx.where, "backward"):
            (input,), weight = ctx.saved_tensors, ctx.weight
            comm, wgrad = ctx.comm, ctx.wgrad
            if wgrad.accumulation_fusion:
                weight.main_grad = ctx.main_grad
            grad_input = grad_output.matmul(weight)
            if comm.sub is not None:  # one GEMM over every part's rows, at the last part
                grad_weight, _ = collected_wgrad(weight, "row", (grad_output, input), wgrad, input, comm, False)
                return grad_input, grad_weight, None, None
            grad_2d, input_2d = as_2d(grad_output, input)
            return grad_input, _wgrad(weight, grad_2d, input_2d, wgrad, input, comm), None, None

