"""Agreement across the ranks of one explicit process group: every rank gets the same answer.

Used by the autotuners (``tune.cache.choose``), which know nothing of process groups: they are
handed an agreement object. Its tensors live on the group's device: a NCCL group reduces CUDA
tensors only (a CPU tensor there is an error, or a hang on some versions); gloo reduces CPU ones.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist


def group_device(group) -> torch.device:
    """Where ``group``'s collectives take their tensors: the current CUDA device under NCCL, else CPU."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class GroupAgreement:
    """``max`` and ``any`` over the ranks of ``group`` (all ranks must call them in the same order)."""

    def __init__(self, group):
        self.group = group
        self.world = dist.get_world_size(group)

    def _reduce(self, values: Sequence[float], dtype) -> list:
        from .waits import wait

        t = torch.tensor(list(values), dtype=dtype, device=group_device(self.group))
        wait(dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group, async_op=True), "autotune agreement all-reduce",
             self.group)
        return t.cpu().tolist()

    def max(self, values: Sequence[float]) -> list:
        """Element-wise maximum over the ranks."""
        return self._reduce(values, torch.float64)

    def any(self, flag: bool) -> bool:
        """True on every rank if it is true on any."""
        return bool(self._reduce([1 if flag else 0], torch.int32)[0])
