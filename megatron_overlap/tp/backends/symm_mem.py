"""``--overlap-tp symm-mem``: PyTorch's symmetric-memory fused ops (Async TP).

    gather_matmul          torch.ops.symm_mem.fused_all_gather_matmul(x, [w_t], gather_dim=0, ...)
                           (copy-engine pulls, one chunk per rank, alternating streams)
    matmul_reduce_scatter  torch.ops.symm_mem.fused_matmul_reduce_scatter(x, w_t, "sum", 0, ...)

Backward composes them like the other backends: the Column dgrad is a matmul-reduce-scatter,
the Row dgrad an all-gather-matmul that also returns the gathered grad-output for the wgrad
(``return_A``). The Column wgrad input is **re-gathered** (started by the Row backward once its
own pieces are in, as for ``p2p``: ``tp/linear.py`` ``GatherSlot``), not kept from the forward: keeping it would hold one gathered
activation ``[S, b, h]`` per Column linear per micro-batch until its backward; re-gathering
costs one all-gather of the input per Column linear, as stock Megatron does.

CUDA only (NCCL groups, symmetric memory): on anything else the backend refuses at install
and at the first layer. The tests compute the same two ops with stock collectives
(tests/symm_mem_reference.py), so the composition above is tested on CPU with gloo.
"""

from __future__ import annotations

import importlib

import torch
import torch.distributed as dist

from .base import Done, TPBackend, refuse


def availability(device_type=None) -> tuple[bool, str]:
    cuda = torch.cuda.is_available() if device_type is None else device_type == "cuda"
    if not cuda:
        return False, "needs CUDA GPUs with symmetric memory (PyTorch Async TP); there is no CUDA device here"
    try:
        importlib.import_module("torch.distributed._symmetric_memory")
    except ImportError as exc:
        return False, f"this torch has no symmetric memory ({exc})"
    if not hasattr(torch.ops.symm_mem, "fused_all_gather_matmul"):
        return False, "this torch lacks torch.ops.symm_mem.fused_all_gather_matmul"
    return True, f"torch {torch.__version__} symmetric memory"


class TorchSymmMemOps:
    """The real ops (CUDA)."""

    def __init__(self):
        self._enabled: set = set()

    def _name(self, group: dist.ProcessGroup) -> str:
        name = group.group_name
        if name not in self._enabled:
            from torch.distributed._symmetric_memory import enable_symm_mem_for_group

            enable_symm_mem_for_group(name)
            self._enabled.add(name)
        return name

    def all_gather_matmul(self, x, weight_t, group, return_gathered):
        gathered, outs = torch.ops.symm_mem.fused_all_gather_matmul(
            x.contiguous(), [weight_t], 0, self._name(group), return_A=return_gathered
        )
        return outs[0], gathered

    def matmul_reduce_scatter(self, x, weight_t, group):
        return torch.ops.symm_mem.fused_matmul_reduce_scatter(x.contiguous(), weight_t, "sum", 0, self._name(group))


class SymmMemBackend(TPBackend):
    name = "symm-mem"

    def __init__(self, ops=None):
        self.ops = ops if ops is not None else TorchSymmMemOps()

    def check(self, x: torch.Tensor) -> None:
        ok, why = availability(x.device.type)
        if not ok:
            refuse("symm-mem", why)
        if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            refuse("symm-mem", f"dtype {x.dtype} is not supported (bf16, fp16, fp32)")

    def gather_matmul(self, x_shard, weight_t, group, plan, keep_gathered=False, after_own=None):
        result = self.ops.all_gather_matmul(x_shard, weight_t, group, keep_gathered)
        if after_own is not None:  # no point inside the fused op: after it is issued
            after_own()
        return result

    def matmul_reduce_scatter(self, x, weight_t, group, plan):
        return Done(self.ops.matmul_reduce_scatter(x, weight_t, group))


def one_rank_check(dtype) -> dict:
    """Run the two fused ops through :class:`TorchSymmMemOps` on a one-rank NCCL group (started
    here if none is): proves the calls, not the overlap. For the GPU check script."""
    import os

    def rel(a, b):
        return ((a.float() - b.float()).norm() / b.float().norm()).item()

    out = {}
    try:
        if not dist.is_initialized():
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", "29571")
            dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
        group = dist.group.WORLD
        ops = TorchSymmMemOps()
        x = torch.randn(1024, 512, dtype=dtype, device="cuda")
        w = torch.randn(512, 768, dtype=dtype, device="cuda")
        y, gathered = ops.all_gather_matmul(x, w, group, True)
        out["all_gather_matmul_rel_err"] = rel(y, x @ w)
        out["returned_gathered"] = gathered is not None
        z = ops.matmul_reduce_scatter(x, w, group)
        out["matmul_reduce_scatter_rel_err"] = rel(z, x @ w)
    except Exception as exc:  # record what this torch does at world size 1, do not stop the check
        out["error"] = f"{type(exc).__name__}: {exc}"[:400]
    return out
