"""Figures measured on hardware that the cost model takes instead of assumptions.

Each comes with where it was measured. When a GPU check records a new figure (``docs/gpu/``),
it replaces the one here (tests/test_cost_models.py holds the two equal).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Measured:
    value: float
    what: str
    device: str
    date: str
    source: str


FUSED_AG_GEMM_VS_CUBLAS = Measured(
    value=0.2569070293591497,
    what="our Triton AG-GEMM with every flag preset, throughput / torch.matmul (cuBLAS), bf16, M=16384, N=K=8192, "
         "best of 3 tile configs",
    device="NVIDIA H200", date="2026-11-30",
    source="docs/gpu/2026-11-30-h200-gpu_check.json, run_1, ag_gemm_vs_matmul_throughput")


def fused_slowdown() -> float:
    """Extra time of the fused kernels over a plain GEMM of the same shape: 1 / efficiency - 1."""
    return 1.0 / FUSED_AG_GEMM_VS_CUBLAS.value - 1.0
