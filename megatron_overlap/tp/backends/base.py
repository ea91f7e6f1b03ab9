"""The two primitives every TP-overlap backend provides.

    gather_matmul(x_shard [s, ..., k], weight_t [k, n])  -> (AG(x_shard) @ weight_t  [R*s, ..., n],
                                                            AG(x_shard) [R*s, ..., k] if asked)
    matmul_reduce_scatter(x [R*s, ..., k], weight_t)     -> pending; .finish() -> RS(x @ weight_t) [s, ..., n]

Without sequence parallelism (``..linear_ar``) a third op, composed from the second by default:

    matmul_all_reduce(x [S, ..., k], weight_t)           -> pending; .finish() -> AR(x @ weight_t) [S, ..., n]
                                                            = AG(RS(x @ weight_t)): the backend's GEMM-RS,
                                                            then an all-gather of the shard

The autograd functions in :mod:`..linear` compose them: Column forward and Row backward
gather-then-multiply, Row forward and Column backward multiply-then-reduce-scatter (the
pending form lets the Column backward run its wgrad GEMM before the last hop is waited for).
Backends differ only in how the data moves and which kernel multiplies:

- ``p2p``: chunked P2P rings and ``torch.matmul`` per chunk (any device, any backend);
- ``symm-mem``: PyTorch's symmetric-memory fused ops (:mod:`.symm_mem`);
- ``fused``: our Triton kernels fed by a transport (:mod:`.fused`).

``p2p`` overrides ``matmul_all_reduce``: row pieces of the GEMM, each all-reduced by the
backend's collective while the next computes (``..gemm_ar``). ``fused`` does not offer it
(``ALL_REDUCE``): its GEMM-RS sends its slots only once the whole kernel has run, so an
all-reduce built from it would hide nothing.

``plan`` is a :class:`..linear_plan.TPPlan` (pieces, reduce-scatter algorithm).
"""

from __future__ import annotations

import abc

import torch
import torch.distributed as dist

from ...errors import OverlapConfigError


class Done:
    """A reduce-scatter that has already finished (backends whose op returns the result)."""

    def __init__(self, out: torch.Tensor):
        self._out = out

    def finish(self) -> torch.Tensor:
        return self._out


class TPBackend(abc.ABC):
    """Interface; see the module docstring."""

    name = "?"
    ALL_REDUCE = True  # whether the all-reduce path (no sequence parallelism) runs on this backend

    def check(self, x: torch.Tensor) -> None:
        """Refuse (an ``OverlapConfigError`` on ``tp.mode``) tensors this backend cannot run."""

    @abc.abstractmethod
    def gather_matmul(self, x_shard, weight_t, group, plan, keep_gathered: bool = False, after_own=None):
        """``(AG(x_shard) @ weight_t, AG(x_shard) or None)``: the gathered input too when
        ``keep_gathered`` (the Row backward's wgrad needs it). ``after_own()``: other work to
        run while the remote pieces travel (``tp.wgrad_store``), called once, after the local
        part is issued; a backend without such a point calls it once its op is issued."""

    @abc.abstractmethod
    def matmul_reduce_scatter(self, x, weight_t, group, plan):
        """``RS(x @ weight_t)`` as a pending object whose ``finish()`` returns the shard."""


    def matmul_all_reduce(self, x, weight_t, group, plan):
        """``AR(x @ weight_t)`` as a pending object whose ``finish()`` returns it whole. ``plan``'s
        pieces cut ``x``'s rows (the whole sequence). Default: this backend's GEMM-RS on the
        rows' R shards (the plan's chunk count over R per shard), then an all-gather."""
        from ..linear_plan import TPPlan
        from ...comm.rings import split_pieces

        size = dist.get_world_size(group)
        if x.shape[0] % size:
            refuse(self.name, f"its all-reduce is a reduce-scatter and an all-gather, and the {x.shape[0]} sequence "
                   f"rows do not split over the {size} tensor-parallel ranks")
        shard = TPPlan(pieces=split_pieces(x.shape[0] // size, max(1, len(plan.pieces) // size)), rs_algo=plan.rs_algo)
        return GatherAfter(self.matmul_reduce_scatter(x, weight_t, group, shard), group)


class GatherAfter:
    """A pending reduce-scatter whose shard is all-gathered at ``finish``: an all-reduce."""

    def __init__(self, pending, group: dist.ProcessGroup):
        self._pending, self._group = pending, group

    def finish(self) -> torch.Tensor:
        from ...comm.collectives import all_gather_into

        shard = self._pending.finish().contiguous()
        out = gathered_buffer(shard, self._group)
        all_gather_into(out, shard, self._group)
        return out


def refuse(backend: str, why: str, instead: str = "use `tp.mode` p2p (any device, any backend)"):
    raise OverlapConfigError("tp.mode", f"{backend}: {why}; {instead}")


def gathered_buffer(x_shard: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    size = dist.get_world_size(group)
    return torch.empty((x_shard.shape[0] * size, *x_shard.shape[1:]), dtype=x_shard.dtype, device=x_shard.device)
