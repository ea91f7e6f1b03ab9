"""Closed forms for one GEMM overlapped with one collective.

``T_g``: the GEMM alone (whole), ``T_c``: the collective alone, ``c``: chunks.

Pipeline of c chunks (chunk i's transfer, then its GEMM; or its GEMM, then its transfer)::

    T = c * max(T_c / c, T_g' / c) + min(T_c / c, T_g' / c)  =  max(T_c, T_g') + min(T_c, T_g') / c

the physical limit ``max`` plus one chunk of fill or drain. ``T_g'`` is the GEMM cut into c
pieces (``gemm.chunked_gemm_ms``: never shorter than ``T_g``), slowed where communication runs
on SMs: with a share ``sigma`` of the SMs taken by the communication kernels while they run,

    contended(T_g, T_c) = min(T_g / (1 - sigma),  T_g + sigma * T_c)

(the GEMM runs at 1 - sigma of its rate while the transfer lasts, at full rate after it).
``sigma`` is 0 for copy-engine and symmetric-memory transfers, ~ CTAs / SMs for NCCL.

The simulator (``strategy_sim``) schedules the same pieces as tasks; these forms are its
one-op summary, used by the tests and by quick estimates.
"""

from __future__ import annotations


def contended_gemm_ms(gemm_ms: float, comm_ms: float, sm_fraction: float) -> float:
    """GEMM time while a communication kernel holding ``sm_fraction`` of the SMs runs for up to
    ``comm_ms`` beside it."""
    if not 0.0 <= sm_fraction < 1.0:
        raise ValueError(f"sm_fraction must be in [0, 1), got {sm_fraction}")
    if sm_fraction == 0.0 or comm_ms <= 0.0:
        return gemm_ms
    return min(gemm_ms / (1.0 - sm_fraction), gemm_ms + sm_fraction * comm_ms)


def pipelined_ms(gemm_ms: float, comm_ms: float, chunks: int) -> float:
    """c-stage pipeline of a transfer and a GEMM (both already split into c equal chunks)."""
    if chunks < 1:
        raise ValueError("chunks must be >= 1")
    if comm_ms <= 0.0:
        return gemm_ms
    if gemm_ms <= 0.0:
        return comm_ms
    return max(gemm_ms, comm_ms) + min(gemm_ms, comm_ms) / chunks


def overlapped_op_ms(
    gemm_ms: float,
    comm_ms: float,
    chunks: int,
    chunked_gemm_ms: float = None,
    sm_fraction: float = 0.0,
) -> float:
    """An overlapped op: ``chunks`` pieces, ``chunked_gemm_ms`` the GEMM's time as c pieces
    (default: ``gemm_ms``, i.e. no chunking loss), SM contention ``sm_fraction``.

    With no communication it is the (chunked) GEMM alone: with one chunk, exactly ``gemm_ms``.
    """
    pieces_ms = gemm_ms if chunked_gemm_ms is None else chunked_gemm_ms
    if comm_ms <= 0.0:
        return pieces_ms
    # Only the (c-1)/c of the transfer that overlaps GEMM pieces slows them.
    slowed = contended_gemm_ms(pieces_ms, comm_ms * (chunks - 1) / chunks if chunks > 1 else comm_ms, sm_fraction)
    return pipelined_ms(slowed, comm_ms, chunks)


def sequential_ms(gemm_ms: float, comm_ms: float) -> float:
    """Nothing overlapped: stock Megatron's forward (all-gather, then GEMM; GEMM, then reduce-scatter)."""
    return gemm_ms + comm_ms


def fused_op_ms(gemm_ms: float, comm_ms: float, fill_ms: float, slowdown: float = 0.0) -> float:
    """One fused kernel whose tiles wait on chunk arrivals (Flux style): the GEMM (slowed by
    ``slowdown``, e.g. 0.05 for 5%) or the transfer, whichever is longer, plus the tiles that
    can only run after the last byte (``fill_ms``)."""
    return max(gemm_ms * (1.0 + slowdown), comm_ms + fill_ms)


def exposed_ms(op_ms: float, gemm_ms: float) -> float:
    """What an op costs beyond its GEMM: the communication it leaves exposed."""
    return max(0.0, op_ms - gemm_ms)
