"""GEMM time: a roofline divided by an efficiency curve over the shape.

For ``C [M, N] = A [M, K] @ B [K, N]`` with ``d`` bytes per element::

    flops  = 2 M N K
    bytes  = d (M K + K N + M N)
    t_ms   = overhead + max(flops / (peak * eff(M, N, K)),  bytes / (hbm * hbm_fraction))
    eff    = max_fraction * g(M) g(N) g(K),    g(x) = x / (x + half_dim)

``g`` is the share of a tile grid a dimension of size x keeps busy (small M, N or K leave tiles
and waves part empty). Cutting a GEMM into c pieces along M runs c GEMMs of M/c rows: each has
a lower ``g(M/c)``, pays ``overhead`` again and re-reads B, so the pieces never take less time
than the whole (``chunked_gemm_ms``). ``fit_efficiency`` calibrates the curve on measured
``{(M, N, K): ms}`` tables (e.g. the chunked-GEMM efficiency of 1, 2, 4, 8, 16 chunks).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence


@dataclass(frozen=True)
class GemmEfficiency:
    """Parameters of the efficiency curve (defaults are assumptions for bf16 tensor-core GEMMs:
    large GEMMs at ~75% of dense peak, a 64-wide dimension at half of that; calibrate them)."""

    max_fraction: float = 0.75
    half_dim: float = 64.0
    overhead_us: float = 0.0
    hbm_fraction: float = 0.8  # of datasheet HBM bandwidth, for memory-bound GEMMs and element-wise ops

    def __post_init__(self):
        if not 0 < self.max_fraction <= 1.0 or self.half_dim < 0 or self.overhead_us < 0:
            raise ValueError(f"invalid GEMM efficiency {self}")

    def fraction(self, m: float, n: float, k: float) -> float:
        """Share of peak a GEMM of this shape reaches when compute-bound."""
        g = 1.0
        for x in (m, n, k):
            g *= x / (x + self.half_dim)
        return self.max_fraction * g


def gemm_flops(m: float, n: float, k: float) -> float:
    return 2.0 * m * n * k


def gemm_bytes(m: float, n: float, k: float, dtype_bytes: int) -> float:
    return dtype_bytes * (m * k + k * n + m * n)


def gemm_ms(m: float, n: float, k: float, hw, eff: GemmEfficiency = None) -> float:
    """Time of one ``[M, K] @ [K, N]`` GEMM on ``hw`` (a ``HardwareSpec``)."""
    if min(m, n, k) <= 0:
        return 0.0
    eff = eff or hw.gemm
    compute_ms = gemm_flops(m, n, k) / (hw.peak_tflops * 1e12 * eff.fraction(m, n, k)) * 1e3
    memory_ms = gemm_bytes(m, n, k, hw.dtype_bytes) / (hw.hbm_GBps * 1e9 * eff.hbm_fraction) * 1e3
    return eff.overhead_us * 1e-3 + max(compute_ms, memory_ms)


def pieces_gemm_ms(rows: Sequence[float], n: float, k: float, hw, eff: GemmEfficiency = None) -> float:
    """Total time of one GEMM per row piece (``rows`` along M)."""
    return sum(gemm_ms(r, n, k, hw, eff) for r in rows if r > 0)


def even_rows(m: float, chunks: int) -> list[float]:
    return [m / chunks] * chunks


def chunked_gemm_ms(m: float, n: float, k: float, chunks: int, hw, eff: GemmEfficiency = None) -> float:
    """``[M, K] @ [K, N]`` as ``chunks`` GEMMs of M / chunks rows each."""
    return pieces_gemm_ms(even_rows(m, chunks), n, k, hw, eff)


def elementwise_ms(nbytes: float, hw) -> float:
    """A memory-bound op moving ``nbytes`` through HBM (read + write counted by the caller)."""
    return nbytes / (hw.hbm_GBps * 1e9 * hw.gemm.hbm_fraction) * 1e3


def fit_efficiency(
    table: Mapping[tuple, float] | Iterable[tuple],
    peak_tflops: float,
    hbm_fraction: float = 1.0,
    half_dims: Sequence[float] = None,
    overheads_us: Sequence[float] = None,
) -> GemmEfficiency:
    """Least squares in log(time) over ``{(M, N, K): ms}`` (or ``(M, N, K, ms)`` rows).

    For each (half_dim, overhead) on a grid, ``max_fraction`` has a closed form (the geometric
    mean of the implied efficiencies); the pair with the smallest squared log error wins. The
    fit assumes compute-bound shapes (the calibration tables are large GEMMs and their chunks);
    ``max_fraction`` is capped at 1.
    """
    rows = list(table.items()) if isinstance(table, Mapping) else [((r[0], r[1], r[2]), r[3]) for r in table]
    if len(rows) < 2:
        raise ValueError("fit_efficiency needs at least two measurements")
    half_dims = half_dims if half_dims is not None else [0.0] + [2.0 ** (i / 2) for i in range(0, 25)]
    overheads_us = overheads_us if overheads_us is not None else [0.0, 1.0, 3.0, 10.0, 30.0, 100.0, 300.0]
    best = None
    for half in half_dims:
        for over in overheads_us:
            logs = []
            for (m, n, k), ms in rows:
                busy_ms = ms - over * 1e-3
                if busy_ms <= 0:
                    break
                g = (m / (m + half)) * (n / (n + half)) * (k / (k + half))
                implied = gemm_flops(m, n, k) / (peak_tflops * 1e12 * g * busy_ms * 1e-3)
                logs.append(math.log(implied))
            else:
                log_max = min(sum(logs) / len(logs), 0.0)
                error = sum((x - log_max) ** 2 for x in logs)
                if best is None or error < best[0] - 1e-12:
                    best = (error, GemmEfficiency(math.exp(log_max), half, over, hbm_fraction))
    if best is None:
        raise ValueError("no overhead on the grid is shorter than every measured time")
    return best[1]


def table_from_rows(rows: Iterable[Mapping]) -> dict:
    """``[{"M", "N", "K", "ms"}, ...]`` (as ``measure_cpu`` writes it) -> ``{(M, N, K): ms}``."""
    return {(r["M"], r["N"], r["K"]): r["ms"] for r in rows}
