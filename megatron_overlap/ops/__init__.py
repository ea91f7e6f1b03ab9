"""Overlapped tensor-parallel ops. Device-agnostic, explicit process groups, no Megatron imports.

Each op file holds the fast path and, beside it, a plain-PyTorch reference built from stock
collectives; the tests hold every fast path to its reference and to stock Megatron.
"""

from .ag_gemm import ag_gemm, ag_gemm_reference
from .gemm_rs import gemm_rs, gemm_rs_reference
from .linear import ColumnParallelSP, RowParallelSP, TPPlan

__all__ = [
    "ColumnParallelSP",
    "RowParallelSP",
    "TPPlan",
    "ag_gemm",
    "ag_gemm_reference",
    "gemm_rs",
    "gemm_rs_reference",
]
