"""PyTorch's two symmetric-memory fused ops computed with stock collectives and no overlap (any
device, gloo included), so the symm-mem backend's composition (tp/backends/symm_mem.py) is tested
on CPU, where the fused ops have no kernels. Test-only: the product never runs these."""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_overlap.comm.collectives import all_gather_into, reduce_scatter_into
from megatron_overlap.tp.backends.base import gathered_buffer


class ReferenceSymmMemOps:
    """The same two ops as ``symm_mem.TorchSymmMemOps``, with stock collectives."""

    def all_gather_matmul(self, x, weight_t, group, return_gathered):
        gathered = gathered_buffer(x, group)
        all_gather_into(gathered, x.contiguous(), group)
        return torch.matmul(gathered, weight_t), (gathered if return_gathered else None)

    def matmul_reduce_scatter(self, x, weight_t, group):
        full = torch.matmul(x, weight_t).contiguous()
        size = dist.get_world_size(group)
        out = torch.empty((full.shape[0] // size, *full.shape[1:]), dtype=full.dtype, device=full.device)
        reduce_scatter_into(out, full, group)
        return out
