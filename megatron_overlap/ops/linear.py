"""Autograd functions for ColumnParallelLinear and RowParallelLinear under sequence parallelism,
with every TP collective overlapped with a GEMM.

R ranks in the TP group, s = S / R rows (sequence positions) per rank, b micro-batch:

Column (weight ``w [n, k]``, this rank's n = N / R output columns)
    forward   y [S, b, n]  = AG(x [s, b, k]) @ w^T                ring AG -> GEMM per piece
    dgrad     dx [s, b, k] = RS(dy [S, b, n] @ w)                 GEMM per piece -> ring/a2a RS
    wgrad     dw [n, k]    = dy^T @ AG(x)                          re-gather overlapped with dgrad;
                                                                   the RS tail with wgrad
Row (weight ``w [n, k]``, this rank's k = K / R input rows)
    forward   y [s, b, n]  = RS(x [S, b, k] @ w^T)                GEMM per piece -> ring/a2a RS
    dgrad     dx [S, b, k] = AG(dy [s, b, n]) @ w                 ring AG -> GEMM per piece
    wgrad     dw [n, k]    = AG(dy)^T @ x                          one GEMM after the gather

The wgrad GEMMs stay whole, so they give the same bits as stock Megatron's. A Row linear's
backward also starts, once its own ring has been issued, the re-gather of the input of the
Column linear that ran just before it in forward (fc1 before fc2, qkv before proj): that
gather then travels during the Row's wgrad and the ops between the two, instead of during the
Column's dgrad where the link is already busy with the reduce-scatter.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

from ..comm.collectives import all_gather_into
from ..comm.rings import Piece, RingAllGather, make_reduce_scatter
from .gemm_rs import gemm_rs, row_partial
from .ag_gemm import ag_gemm
from .wgrad import as_2d, weight_gradient

_custom_fwd = torch.amp.custom_fwd(device_type="cuda")
_custom_bwd = torch.amp.custom_bwd(device_type="cuda")


class GatherSlot:
    """The all-gather of a Column linear's input shard for its wgrad, startable early."""

    def __init__(self, x_shard: torch.Tensor, group: dist.ProcessGroup):
        self._x_shard = x_shard
        self._group = group
        self._buf: Optional[torch.Tensor] = None
        self._work = None
        self.started_early = False

    def start(self, early: bool = False):
        if self._buf is not None or self._x_shard is None:
            return
        size = dist.get_world_size(self._group)
        x = self._x_shard.contiguous()
        self._buf = torch.empty((x.shape[0] * size, *x.shape[1:]), dtype=x.dtype, device=x.device)
        self._work = all_gather_into(self._buf, x, self._group, async_op=True)
        self.started_early = early

    def take(self) -> torch.Tensor:
        self.start()
        self._work.wait()
        buf, self._buf, self._work, self._x_shard = self._buf, None, None, None
        return buf


@dataclass
class PrefetchRegistry:
    """Links each Row linear to the Column linear that ran just before it on the same group.

    One per installation (no module globals). Holds weak references only: a slot lives as long
    as the autograd graph that owns it.
    """

    _latest: dict = field(default_factory=dict)

    def offer(self, group: dist.ProcessGroup, slot: GatherSlot):
        self._latest[id(group)] = weakref.ref(slot)

    def claim(self, group: dist.ProcessGroup) -> Optional[GatherSlot]:
        ref = self._latest.pop(id(group), None)
        return ref() if ref is not None else None


@dataclass(frozen=True)
class TPPlan:
    """How one overlapped linear runs: its pieces, reduce-scatter algorithm and prefetching."""

    pieces: tuple[Piece, ...]
    rs_algo: str = "ring"
    prefetch: Optional[PrefetchRegistry] = None


class ColumnParallelSP(torch.autograd.Function):
    """ColumnParallelLinear + sequence parallelism, all communication overlapped."""

    @staticmethod
    @_custom_fwd
    def forward(
        ctx,
        input: torch.Tensor,
        weight: torch.Tensor,
        bias: Optional[torch.Tensor],
        gradient_accumulation_fusion: bool,
        grad_output_buffer: Optional[list],
        wgrad_deferral_limit: Optional[int],
        group: dist.ProcessGroup,
        plan: TPPlan,
    ) -> torch.Tensor:
        ctx.save_for_backward(input, weight)
        # Not in save_for_backward: one module may run in several places (Megatron's reason).
        ctx.main_grad = weight.main_grad if gradient_accumulation_fusion and hasattr(weight, "main_grad") else None
        ctx.use_bias = bias is not None
        ctx.gradient_accumulation_fusion = gradient_accumulation_fusion
        ctx.grad_output_buffer = grad_output_buffer
        ctx.wgrad_deferral_limit = wgrad_deferral_limit
        ctx.group = group
        ctx.plan = plan
        ctx.slot = GatherSlot(input, group)
        if plan.prefetch is not None:
            plan.prefetch.offer(group, ctx.slot)
        return ag_gemm(input, weight, group, plan.pieces, bias)

    @staticmethod
    @_custom_bwd
    def backward(ctx, grad_output: torch.Tensor):
        input, weight = ctx.saved_tensors
        group, plan = ctx.group, ctx.plan
        if ctx.gradient_accumulation_fusion:
            weight.main_grad = ctx.main_grad

        wgrad_compute = True
        buffer = ctx.grad_output_buffer
        if buffer is not None:
            limit = ctx.wgrad_deferral_limit
            if limit == 0 or len(buffer) < limit:
                buffer.append(grad_output)
                wgrad_compute = False
        slot = ctx.slot
        ctx.slot = None
        if wgrad_compute:
            slot.start()  # no-op when the Row linear after us already started it

        grad_input = torch.empty_like(input)
        shard_rows = input.shape[0]
        rs = make_reduce_scatter(
            plan.rs_algo, grad_input, group, plan.pieces, row_partial(grad_output, weight, shard_rows)
        )
        for step in range(dist.get_world_size(group)):
            for k in range(len(rs.pieces)):
                rs.run(step, k)

        if wgrad_compute:
            grad_output, total_input = as_2d(grad_output, slot.take())
            grad_weight = weight_gradient(
                weight, grad_output, total_input, ctx.gradient_accumulation_fusion, input
            )
        else:
            grad_weight = weight_gradient(weight, None, None, ctx.gradient_accumulation_fusion, input)
        grad_bias = grad_output.sum(dim=0) if ctx.use_bias else None
        rs.finish()
        return grad_input, grad_weight, grad_bias, None, None, None, None, None


class RowParallelSP(torch.autograd.Function):
    """RowParallelLinear + sequence parallelism (GEMM and reduce-scatter fused and overlapped).

    The bias is not part of the op: Megatron adds it after the reduce-scatter.
    """

    @staticmethod
    @_custom_fwd
    def forward(
        ctx,
        input: torch.Tensor,
        weight: torch.Tensor,
        gradient_accumulation_fusion: bool,
        group: dist.ProcessGroup,
        plan: TPPlan,
    ) -> torch.Tensor:
        ctx.save_for_backward(input, weight)
        ctx.main_grad = weight.main_grad if gradient_accumulation_fusion and hasattr(weight, "main_grad") else None
        ctx.gradient_accumulation_fusion = gradient_accumulation_fusion
        ctx.group = group
        ctx.plan = plan
        ctx.prefetch_slot = plan.prefetch.claim(group) if plan.prefetch is not None else None
        return gemm_rs(input, weight, group, plan.pieces, plan.rs_algo)

    @staticmethod
    @_custom_bwd
    def backward(ctx, grad_output: torch.Tensor):
        input, weight = ctx.saved_tensors
        group, plan = ctx.group, ctx.plan
        if ctx.gradient_accumulation_fusion:
            weight.main_grad = ctx.main_grad
        size = dist.get_world_size(group)
        grad_output = grad_output.contiguous()
        shard_rows = grad_output.shape[0]
        gathered = torch.empty(
            (shard_rows * size, *grad_output.shape[1:]), dtype=grad_output.dtype, device=grad_output.device
        )
        ring = RingAllGather(grad_output, gathered, group, plan.pieces, tag=4, copy_own=True)
        grad_input = torch.empty_like(input)
        for step in range(size):
            for k in range(len(ring.pieces)):
                _owner, rows, piece = ring.take(step, k)
                torch.matmul(piece, weight, out=grad_input[rows])
        slot, ctx.prefetch_slot = ctx.prefetch_slot, None
        if slot is not None:
            slot.start(early=True)
        grad_2d, input_2d = as_2d(gathered, input)
        grad_weight = weight_gradient(
            weight, grad_2d, input_2d, ctx.gradient_accumulation_fusion, input
        )
        ring.finish()
        return grad_input, grad_weight, None, None, None
