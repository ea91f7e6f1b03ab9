"""The ``p2p`` backend: chunked P2P rings over ``torch.distributed`` (any device, any backend);
without sequence parallelism, row pieces all-reduced by the backend's collective."""

from __future__ import annotations

from ..ag_gemm import gather_matmul
from ..gemm_ar import start_matmul_all_reduce
from ..gemm_rs import start_matmul_reduce_scatter
from .base import TPBackend, gathered_buffer


class P2PBackend(TPBackend):
    """Chunked P2P rings over ``torch.distributed`` with ``torch.matmul`` on each chunk."""

    name = "p2p"

    def gather_matmul(self, x_shard, weight_t, group, plan, keep_gathered=False, after_own=None):
        gathered = gathered_buffer(x_shard, group) if keep_gathered else None
        return gather_matmul(x_shard, weight_t, group, plan.pieces, gathered, after_own=after_own), gathered

    def matmul_reduce_scatter(self, x, weight_t, group, plan):
        return start_matmul_reduce_scatter(x, weight_t, group, plan.pieces, plan.rs_algo)

    def matmul_all_reduce(self, x, weight_t, group, plan):
        return start_matmul_all_reduce(x, weight_t, group, plan.pieces)
