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

The wgrad GEMMs stay whole, so they give the same bits as stock Megatron's (under sub-batches,
one GEMM over every part's rows at the last part: ``SubBatches.collect``). A Row linear's
backward also starts, once its own ring is done, the re-gather of the input of the Column
linear that ran just before it in forward (fc1 before fc2, qkv before proj): it travels during
the Row's wgrad and the ops between the two (attention's whole backward between proj and qkv)
instead of queueing with the Column's reduce-scatter (``GatherSlot``).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

from ..comm import waits
from ..comm.collectives import all_gather_into
from .backends.base import TPBackend
from .linear_plan import TPPlan
from .wgrad import as_2d, as_rows, deferrable, deferred_weight_gradient, weight_gradient
from .wgrad_store import WgradStore

_custom_fwd = torch.amp.custom_fwd(device_type="cuda")
_custom_bwd = torch.amp.custom_bwd(device_type="cuda")


class GatherSlot:
    """The all-gather of a Column linear's input shard ``x [s, ...]`` for its wgrad, one async
    collective started early by the Row linear whose backward runs just before (``start``), or,
    where none did (the output layer), by the Column backward itself: behind its own
    reduce-scatter's partials when its wgrad waits in the store (the held task takes the gather
    when it runs), else first. The partials are what the next op waits for; ahead of them on
    the egress port, the gather made the demo's backward start wait about its transfer time
    (traced 2026-12-05: 1.29x -> 1.31x over stock, BENCHMARKS.md, the CPU demo).

    The Row starts the whole gather once its own grad-output pieces are posted (after its dgrad
    ring, so they never queue behind it): on one egress port the same bytes then sit ahead of the
    Column's reduce-scatter, only issued earlier, and where attention sits between proj and qkv
    its backward (~95 ms of compute with an idle link on the demo's tiny GPT) carries it whole.
    Traced on the demo (2026-12-05): the QKV backward's exposed wait fell by about the gather's
    transfer time per layer (BENCHMARKS.md, the CPU demo). Sub-batches do the same per part (an
    MLP part's fc1 input), and the attention's first part to run starts the whole QKV input
    (``sub_batch.gather_whole_early``).
    """

    def __init__(self, x_shard: torch.Tensor, group: dist.ProcessGroup):
        self._x = x_shard
        self._group = group
        self._gather = None  # (buffer [R*s, ...], work) once started

    def start(self):
        if self._x is None or self._gather is not None:
            return
        x = self._x.contiguous()
        size = dist.get_world_size(self._group)
        buf = torch.empty((size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
        self._gather = (buf, all_gather_into(buf, x, self._group, async_op=True))

    @property
    def started(self) -> bool:
        return self._gather is not None

    @property
    def nbytes(self) -> int:
        """Bytes of the gathered input once started (what a held task keeps alive)."""
        return self._gather[0].untyped_storage().nbytes() if self._gather is not None else 0

    def take(self) -> torch.Tensor:
        """The gathered input ``[R*s, ...]`` in rank order, exactly as one all-gather gives it."""
        self.start()
        (buf, work), self._x, self._gather = self._gather, None, None
        waits.wait(work, "all-gather of the wgrad input", self._group)
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


@dataclass(frozen=True, eq=False)
class WgradOptions:
    """How a linear delivers its weight gradient, as Megatron's layer asks (``wgrad.py``):
    accumulate into ``weight.main_grad`` (``gradient_accumulation_fusion``), and, for the output
    layer under ``defer_embedding_wgrad_compute``, the buffer that takes grad-outputs instead of
    computing the wgrad, up to ``deferral_limit`` of them (0: all)."""

    accumulation_fusion: bool = False
    grad_output_buffer: Optional[list] = None
    deferral_limit: Optional[int] = None

    def defers(self, grad_output: torch.Tensor) -> bool:
        """Whether this backward leaves its wgrad to Megatron: the grad-output goes into the
        buffer while it has room (then the caller computes no wgrad)."""
        buffer = self.grad_output_buffer
        if buffer is None or not (self.deferral_limit == 0 or len(buffer) < self.deferral_limit):
            return False
        buffer.append(grad_output)
        return True


@dataclass(frozen=True, eq=False)
class TPComm:
    """Where and how a linear's collectives run: its TP ``group``, the ``plan`` (plain data), the
    ``backend`` that moves and multiplies, the installation's ``prefetch`` registry (None: no
    wgrad-input prefetch between Row and Column linears) and its ``wgrad`` store (None: every
    wgrad GEMM runs where it is computed)."""

    group: dist.ProcessGroup
    plan: TPPlan
    backend: TPBackend
    prefetch: Optional[PrefetchRegistry] = None
    wgrad: Optional[WgradStore] = None
    sub: Optional[tuple] = None  # (sub_batch.SubBatches, j): this call is sub-batch j of an MLP block





def _wgrad(weight, grad_2d, input_2d, wgrad: WgradOptions, like, comm: TPComm):
    """The weight's gradient as stock returns it; its GEMM kept back in the store where it may
    wait (``wgrad.deferrable``), else run now."""
    if comm.wgrad is not None and deferrable(weight, wgrad.accumulation_fusion):
        return deferred_weight_gradient(weight, grad_2d, input_2d, like, comm.wgrad)
    return weight_gradient(weight, grad_2d, input_2d, wgrad.accumulation_fusion, like)


def collected_wgrad(weight, key: str, tensors, wgrad: WgradOptions, like, comm: TPComm, use_bias: bool):
    """Sub-batch ``comm.sub``'s weight and bias gradients: None until the last part's backward,
    then stock's, from ``tensors`` = (grad-output, input) of every part put back in stock's row
    order (``SubBatches.collect``, key "column" or "row"). The rows go back to the pool once the
    GEMM ran (not when it waits in the wgrad store)."""
    sub, j = comm.sub
    rows = sub.collect(key, j, *tensors)
    if rows is None:
        return None, None
    grad_2d, input_2d = as_2d(*rows)
    grad_weight = _wgrad(weight, grad_2d, input_2d, wgrad, like, comm)
    grad_bias = grad_2d.sum(dim=0) if use_bias else None
    if comm.wgrad is None or not deferrable(weight, wgrad.accumulation_fusion):
        sub.pool.give(*rows)
    return grad_weight, grad_bias


class ColumnParallelSP(torch.autograd.Function):
    """ColumnParallelLinear + sequence parallelism, all communication overlapped."""

    @staticmethod
    @_custom_fwd
    def forward(ctx, input: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                wgrad: WgradOptions, comm: TPComm) -> torch.Tensor:
        ctx.save_for_backward(input)
        # The weight itself, not a copy: saved-tensor hooks (activation offloading, memory
        # probes) hand back a new tensor object without main_grad and Megatron's flags.
        ctx.weight = weight
        # Not in save_for_backward: one module may run in several places (Megatron's reason).
        ctx.main_grad = weight.main_grad if wgrad.accumulation_fusion and hasattr(weight, "main_grad") else None
        ctx.use_bias = bias is not None
        ctx.wgrad, ctx.comm = wgrad, comm
        ctx.where = waits.current()  # the backward's waits say which layer they belong to
        ctx.slot = GatherSlot(input, comm.group)
        if comm.prefetch is not None:
            comm.prefetch.offer(comm.group, ctx.slot)
        gathered = comm.sub[0].gathered("x", comm.sub[1]) if comm.sub is not None else None
        if gathered is not None:  # gathered while the sub-batch before computed
            output = torch.matmul(gathered, weight.t())
        else:
            output, _ = comm.backend.gather_matmul(input, weight.t(), comm.group, comm.plan)
        return output + bias if bias is not None else output

    @staticmethod
    @_custom_bwd
    def backward(ctx, grad_output: torch.Tensor):
        with waits.restored(ctx.where, "backward"):
            return ColumnParallelSP._backward(ctx, grad_output)

    @staticmethod
    def _backward(ctx, grad_output: torch.Tensor):
        (input,), weight = ctx.saved_tensors, ctx.weight
        comm, wgrad = ctx.comm, ctx.wgrad
        if wgrad.accumulation_fusion:
            weight.main_grad = ctx.main_grad

        wgrad_compute = not wgrad.defers(grad_output)
        slot = ctx.slot
        ctx.slot = None
        # No Row started our re-gather (the output layer) and the wgrad waits in the store: the
        # gather goes behind our partials, which the next op needs first, and the held task takes it
        late = wgrad_compute and comm.sub is None and not slot.started and comm.wgrad is not None and \
            deferrable(weight, wgrad.accumulation_fusion)
        if wgrad_compute and not late:
            slot.start()  # no-op when the Row linear after us already started it

        # dgrad = RS(dy @ w); its last hop travels while the wgrad GEMM runs
        mark = comm.wgrad.mark() if comm.wgrad is not None else None
        pending = comm.backend.matmul_reduce_scatter(grad_output, weight, comm.group, comm.plan)
        if late:
            slot.start()
        if comm.wgrad is not None:
            comm.wgrad.run(older_than=mark)  # while the partials and the input re-gather travel

        if late:
            grad_weight = deferred_weight_gradient(weight, grad_output, slot.take, input, comm.wgrad, slot.nbytes)
            grad_bias = as_rows(grad_output).sum(dim=0) if ctx.use_bias else None
        elif wgrad_compute and comm.sub is not None:  # one GEMM over every part's rows, at the last part
            # the input's re-gather is waited for only at the last part, where the GEMM runs
            grad_weight, grad_bias = collected_wgrad(weight, "column", (grad_output, slot.take), wgrad, input, comm,
                                                     ctx.use_bias)
        elif wgrad_compute:
            grad_output, total_input = as_2d(grad_output, slot.take())
            grad_weight = _wgrad(weight, grad_output, total_input, wgrad, input, comm)
            grad_bias = grad_output.sum(dim=0) if ctx.use_bias else None
        else:
            grad_weight = weight_gradient(weight, None, None, wgrad.accumulation_fusion, input)
            grad_bias = grad_output.sum(dim=0) if ctx.use_bias else None  # as stock (3-D here)
        if comm.sub is not None:  # waited once every chain has run (sub_batch.Split)
            comm.sub[0].defer("dx", comm.sub[1], pending)
            return torch.empty_like(input), grad_weight, grad_bias, None, None
        return pending.finish(), grad_weight, grad_bias, None, None


class RowParallelSP(torch.autograd.Function):
    """RowParallelLinear + sequence parallelism (GEMM and reduce-scatter fused and overlapped).

    The bias is not part of the op: Megatron adds it after the reduce-scatter.
    """

    @staticmethod
    @_custom_fwd
    def forward(ctx, input: torch.Tensor, weight: torch.Tensor, wgrad: WgradOptions, comm: TPComm) -> torch.Tensor:
        ctx.save_for_backward(input)
        ctx.weight = weight  # the parameter itself (see ColumnParallelSP)
        ctx.main_grad = weight.main_grad if wgrad.accumulation_fusion and hasattr(weight, "main_grad") else None
        ctx.wgrad, ctx.comm = wgrad, comm
        ctx.where = waits.current()
        ctx.prefetch_slot = comm.prefetch.claim(comm.group) if comm.prefetch is not None else None
        if comm.sub is None:
            return comm.backend.matmul_reduce_scatter(input, weight.t(), comm.group, comm.plan).finish()
        sub, j = comm.sub
        if sub.gather_whole_early and ctx.prefetch_slot is not None:
            sub.slot = ctx.prefetch_slot  # any part's backward may start it (the first to run does)
        sub.prefetch("x", j + 1)  # the next sub-batch's input travels while this one's GEMM runs
        sub.defer("out", j, comm.backend.matmul_reduce_scatter(input, weight.t(), comm.group, comm.plan))
        size = dist.get_world_size(comm.group)  # waited after the last sub-batch (sub_batch.Join)
        return input.new_empty((input.shape[0] // size, *input.shape[1:-1], weight.shape[0]))

    @staticmethod
    @_custom_bwd
    def backward(ctx, grad_output: torch.Tensor):
        with waits.restored(ctx.where, "backward"):
            return RowParallelSP._backward(ctx, grad_output)

    @staticmethod
    def _backward(ctx, grad_output: torch.Tensor):
        (input,), weight = ctx.saved_tensors, ctx.weight
        comm, wgrad = ctx.comm, ctx.wgrad
        if wgrad.accumulation_fusion:
            weight.main_grad = ctx.main_grad
        grad_output = grad_output.contiguous()
        slot, ctx.prefetch_slot = ctx.prefetch_slot, None
        # while the grad-output pieces travel, after the local dgrad GEMM: the held-back wgrads
        run_held = comm.wgrad.run if comm.wgrad is not None else None
        if comm.sub is not None and comm.sub[0].has_gather("dy", comm.sub[1]):
            if run_held is not None:
                run_held()  # while the prefetched grad-output finishes travelling
            gathered = comm.sub[0].gathered("dy", comm.sub[1])
            grad_input = torch.matmul(gathered, weight)
        else:
            grad_input, gathered = comm.backend.gather_matmul(grad_output, weight, comm.group, comm.plan,
                                                              keep_gathered=True, after_own=run_held)
        if comm.sub is not None:  # the grad-output of the chain autograd runs next travels from here
            comm.sub[0].prefetch("dy", comm.sub[1] - 1)
        if comm.sub is not None and comm.sub[0].gather_whole_early and comm.sub[0].slot is not None:
            comm.sub[0].slot.start()  # whole, at the first part: the parts' attention backwards move nothing
        elif slot is not None:
            # the Column's whole re-gather, now that this Row's own pieces have arrived: it travels
            # during this wgrad and whatever runs before the Column's backward (all of attention's
            # backward, between proj and qkv), and the Column's reduce-scatter finds less ahead
            slot.start()
        if comm.sub is not None:  # one GEMM over every part's rows, at the last part
            grad_weight, _ = collected_wgrad(weight, "row", (gathered, input), wgrad, input, comm, False)
        else:
            grad_weight = _wgrad(weight, *as_2d(gathered, input), wgrad, input, comm)
        return grad_input, grad_weight, None, None


class DeferredWgradLinear(torch.autograd.Function):
    """A linear with no tensor parallelism (TP = 1, Megatron's own math) whose weight-gradient
    GEMM can wait in ``store`` for a split pipeline schedule's W (``--overlap-pp zb``)."""

    @staticmethod
    @_custom_fwd
    def forward(ctx, input: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                wgrad: WgradOptions, store: WgradStore) -> torch.Tensor:
        ctx.save_for_backward(input)
        ctx.weight = weight  # the parameter itself (see ColumnParallelSP)
        ctx.main_grad = weight.main_grad if wgrad.accumulation_fusion and hasattr(weight, "main_grad") else None
        ctx.use_bias = bias is not None
        ctx.wgrad, ctx.store = wgrad, store
        output = torch.matmul(input, weight.t())
        return output + bias if bias is not None else output

    @staticmethod
    @_custom_bwd
    def backward(ctx, grad_output: torch.Tensor):
        (input,), weight = ctx.saved_tensors, ctx.weight
        wgrad = ctx.wgrad
        if wgrad.accumulation_fusion:
            weight.main_grad = ctx.main_grad
        grad_input = grad_output.matmul(weight)
        grad_2d, input_2d = as_2d(grad_output, input)
        if deferrable(weight, wgrad.accumulation_fusion):
            grad_weight = deferred_weight_gradient(weight, grad_2d, input_2d, input, ctx.store)
        else:
            grad_weight = weight_gradient(weight, grad_2d, input_2d, wgrad.accumulation_fusion, input)
        grad_bias = grad_2d.sum(dim=0) if ctx.use_bias else None
        return grad_input, grad_weight, grad_bias, None, None
