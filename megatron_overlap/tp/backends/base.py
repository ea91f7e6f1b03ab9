"""The two primitives every TP-overlap backend provides.

    gather_matmul(x_shard [s, ..., k], weight_t [k, n])  -> (AG(x_shard) @ weight_t  [R*s, ..., n],
                                                            AG(x_shard) [R*s, ..., k] if asked)
    matmul_reduce_scatter(x [R*s, ..., k], weight_t)     -> pending; .finish() -> RS(x @ weight_t) [s, ..., n]

The autograd functions in :mod:`..linear` compose them: Column forward and Row backward
gather-then-multiply, Row forward and Column backward multiply-then-reduce-scatter (the
pending form lets the Column backward run its wgrad GEMM before the last hop is waited for).
Backends differ only in how the data moves and which kernel multiplies:

- ``p2p``: chunked P2P rings and ``torch.matmul`` per chunk (any device, any backend);
- ``symm-mem``: PyTorch's symmetric-memory fused ops (:mod:`.symm_mem`);
- ``fused``: our Triton kernels fed by a transport (:mod:`.fused`).

``plan`` is a :class:`..plan.TPPlan` (pieces, reduce-scatter algorithm).
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


def refuse(backend: str, why: str, instead: str = "use `tp.mode` p2p (any device, any backend)"):
    raise OverlapConfigError("tp.mode", f"{backend}: {why}; {instead}")


def gathered_buffer(x_shard: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    size = dist.get_world_size(group)
    return torch.empty((x_shard.shape[0] * size, *x_shard.shape[1:]), dtype=x_shard.dtype, device=x_shard.device)
