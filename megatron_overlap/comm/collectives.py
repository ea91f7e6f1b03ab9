"""Stock collectives by their current names (torch 2.13 renamed the single-tensor ones).

Looked up on ``torch.distributed`` at call time so the emulated link sees them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def all_gather_into(out: torch.Tensor, x: torch.Tensor, group, async_op: bool = False):
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(out, x, group=group, async_op=async_op)


def reduce_scatter_into(out: torch.Tensor, x: torch.Tensor, group, async_op: bool = False):
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(out, x, group=group, async_op=async_op)


def all_reduce_into(x: torch.Tensor, group, async_op: bool = False):
    """Sum ``x`` over ``group`` in place (``torch.distributed.all_reduce``, looked up at call time)."""
    return dist.all_reduce(x, group=group, async_op=async_op)
