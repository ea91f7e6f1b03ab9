"""AG-GEMM: a persistent Triton GEMM whose tiles wait on the chunk they read.

    a      [M, K]   the gathered input, M = R * M_local rows, filled chunk by chunk by a
                    transport while the kernel runs
    b      [K, N]   (any strides: pass ``weight.t()`` for Megatron's [N, K] weight)
    flags  [C]      int32, chunk c's rows may be read once ``flags[c] != 0``
    c      [M, N]   = a @ b

The launcher cuts every chunk into BLOCK_M x BLOCK_N tiles, never across a chunk boundary
(chunks may be uneven), and lists them in the order the chunks are expected to land: the
local chunk first, then the others in arrival order. The persistent programs take tiles from
that list round-robin; before its first load a tile spins on its chunk's flag (an acquire
load), so GEMM work starts on whatever has landed. Read as a diff from a plain tiled GEMM, the
only additions are the tile table and the spin.

Every spin is bounded (``max_spins``, from a time-out, see :func:`spin_limit`): a flag that
never comes up (its producer failed, its peer went silent) ends the wait, the tile is skipped
and the chunk is recorded in an ``error`` word; the launcher turns it into
:class:`FlagWaitTimeout` naming the chunk. The kernel never hangs the GPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import triton
import triton.language as tl


@dataclass(frozen=True)
class TileConfig:
    """Meta-parameters of one kernel launch (a point of the autotuning space)."""

    BLOCK_M: int = 64
    BLOCK_N: int = 64
    BLOCK_K: int = 32
    num_warps: int = 4
    num_stages: int = 3

    def key(self) -> str:
        return f"{self.BLOCK_M}x{self.BLOCK_N}x{self.BLOCK_K}w{self.num_warps}s{self.num_stages}"


# Candidates for the autotuner (kernels/tuning.py); the first is the default.
CONFIGS = (
    TileConfig(128, 128, 64, 8, 3),
    TileConfig(128, 256, 64, 8, 3),
    TileConfig(256, 128, 64, 8, 3),
    TileConfig(128, 128, 32, 4, 4),
    TileConfig(64, 128, 64, 4, 4),
    TileConfig(64, 64, 32, 4, 3),
)


# Spins of a flag wait per second on a GPU (a sys-scope acquire load of a flag in device memory
# takes roughly a microsecond): an iteration cap standing for a time-out on every backend,
# the CPU interpreter included (which has no clock inside a kernel).
SPINS_PER_SECOND = 1_000_000


def spin_limit(timeout_s: float) -> int:
    """The iteration cap of a flag wait that stands for ``timeout_s`` seconds (at least 1)."""
    return max(1, min(int(timeout_s * SPINS_PER_SECOND), 2**31 - 1))


class FlagWaitTimeout(RuntimeError):
    """A kernel's flag wait gave up: ``index`` is the chunk (AG-GEMM) or slot (reduce) whose
    ready flag was never raised."""

    def __init__(self, kernel: str, index: int, max_spins: int):
        self.kernel, self.index, self.max_spins = kernel, index, max_spins
        super().__init__(f"{kernel}: the ready flag of {'chunk' if kernel == 'ag_gemm' else 'slot'} {index} was not "
                         f"raised within {max_spins} spins (~{max_spins / SPINS_PER_SECOND:.0f} s on a GPU): its "
                         "producer failed or its peer is silent; the kernel skipped what depended on it")


def check_error(error: torch.Tensor, kernel: str, max_spins: int) -> None:
    """Raise :class:`FlagWaitTimeout` if a wait of the kernel that wrote ``error`` gave up
    (a device synchronisation on a GPU)."""
    code = int(error.item())
    if code:
        raise FlagWaitTimeout(kernel, code - 1, max_spins)


@triton.jit
def _wait_flag(flag_ptr, error_ptr, code, max_spins):
    """Spin (acquire) until ``*flag_ptr != 0``, at most ``max_spins`` times. On time-out record
    ``code + 1`` in ``*error_ptr`` and return False."""
    ready = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys")
    spins = 0
    while (ready == 0) & (spins < max_spins):
        ready = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys")
        spins += 1
    if ready == 0:
        tl.atomic_max(error_ptr, code + 1)
    return ready != 0


@triton.jit
def _tile_matmul(a_ptr, b_ptr, rm, row_ok, rn, N, K, stride_am, stride_ak, stride_bk, stride_bn,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
    """One output tile, fp32 accumulator: rows ``rm`` of ``a`` (``row_ok`` masks them) times
    columns ``rn`` of ``b``, over the whole K (shared by AG-GEMM and GEMM-RS)."""
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a = tl.load(
            a_ptr + rm[:, None] * stride_am + (k0 + rk)[None, :] * stride_ak,
            mask=row_ok[:, None] & ((k0 + rk)[None, :] < K), other=0.0,
        )
        b = tl.load(
            b_ptr + (k0 + rk)[:, None] * stride_bk + rn[None, :] * stride_bn,
            mask=((k0 + rk)[:, None] < K) & (rn[None, :] < N), other=0.0,
        )
        if IEEE:
            acc += tl.dot(a, b, input_precision="ieee")
        else:
            acc += tl.dot(a, b)
    return acc


@triton.jit
def ag_gemm_kernel(
    a_ptr, b_ptr, c_ptr, flags_ptr, tiles_ptr, error_ptr,
    N, K, num_tiles, max_spins,
    stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
    NUM_PROGRAMS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    WAIT: tl.constexpr, IEEE: tl.constexpr,
):
    pid = tl.program_id(0)
    for first in range(0, num_tiles, NUM_PROGRAMS):
        t = first + pid
        if t < num_tiles:
            # tile table row: (chunk, first row, end row of the chunk, first column)
            chunk = tl.load(tiles_ptr + t * 4)
            row0 = tl.load(tiles_ptr + t * 4 + 1)
            row_end = tl.load(tiles_ptr + t * 4 + 2)
            col0 = tl.load(tiles_ptr + t * 4 + 3)
            ready = True
            if WAIT:
                ready = _wait_flag(flags_ptr + chunk, error_ptr, chunk, max_spins)
            if ready:
                rm = row0 + tl.arange(0, BLOCK_M)
                rn = col0 + tl.arange(0, BLOCK_N)
                acc = _tile_matmul(a_ptr, b_ptr, rm, rm < row_end, rn, N, K, stride_am, stride_ak, stride_bk,
                                   stride_bn, BLOCK_M, BLOCK_N, BLOCK_K, IEEE)
                tl.store(
                    c_ptr + rm[:, None] * stride_cm + rn[None, :] * stride_cn,
                    acc.to(c_ptr.dtype.element_ty),
                    mask=(rm[:, None] < row_end) & (rn[None, :] < N),
                )


def tile_table(chunk_bounds: Sequence[int], order: Sequence[int], n: int, block_m: int, block_n: int,
               device) -> torch.Tensor:
    """int32 [T, 4] rows (chunk, row0, chunk end, col0), chunks in ``order``, m-major."""
    rows = []
    for chunk in order:
        start, end = chunk_bounds[chunk], chunk_bounds[chunk + 1]
        for row0 in range(start, end, block_m):
            for col0 in range(0, n, block_n):
                rows.append((chunk, row0, end, col0))
    return torch.tensor(rows, dtype=torch.int32, device=device).reshape(-1, 4)


def num_programs(device: torch.device, num_tiles: int, reserved_sms: int = 0) -> int:
    """Persistent grid: one program per SM left free (``reserved_sms`` stay for a transport
    that runs on SMs, e.g. NCCL); on the CPU interpreter a handful."""
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        return max(1, min(num_tiles, sms - reserved_sms))
    return max(1, min(num_tiles, 4))


def ag_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    flags: torch.Tensor,
    chunk_bounds: Sequence[int],
    order: Sequence[int],
    out: Optional[torch.Tensor] = None,
    config: TileConfig = CONFIGS[0],
    wait: bool = True,
    reserved_sms: int = 0,
    max_spins: int = spin_limit(300.0),
    error: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``a @ b`` with each tile gated on ``flags[chunk]``; chunk c is rows
    ``[chunk_bounds[c], chunk_bounds[c+1])`` of ``a``; tiles run in chunk ``order``. A wait
    gives up after ``max_spins``: with ``error`` (int32 [1], zeroed) given, the caller checks it
    (``check_error``) when it suits; without, the launcher checks it at once (a sync on a GPU)."""
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"ag_gemm: shapes {tuple(a.shape)} @ {tuple(b.shape)} do not chain")
    if a.dtype != b.dtype or a.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"ag_gemm: dtypes {a.dtype}, {b.dtype}: need one of fp32/fp16/bf16, both alike")
    if chunk_bounds[0] != 0 or chunk_bounds[-1] != a.shape[0] or sorted(order) != list(range(len(chunk_bounds) - 1)):
        raise ValueError("ag_gemm: chunk_bounds must cover the rows of a, order every chunk once")
    if flags.dtype != torch.int32 or flags.numel() < len(chunk_bounds) - 1:
        raise ValueError("ag_gemm: flags must be int32, one per chunk")
    m, k = a.shape
    n = b.shape[1]
    if out is None:
        out = torch.empty((m, n), dtype=a.dtype, device=a.device)
    tiles = tile_table(chunk_bounds, order, n, config.BLOCK_M, config.BLOCK_N, a.device)
    programs = num_programs(a.device, tiles.shape[0], reserved_sms)
    own_error = error is None
    if own_error:
        error = torch.zeros(1, dtype=torch.int32, device=a.device)
    ag_gemm_kernel[(programs,)](
        a, b, out, flags, tiles, error,
        n, k, tiles.shape[0], max_spins,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), out.stride(0), out.stride(1),
        NUM_PROGRAMS=programs,
        BLOCK_M=config.BLOCK_M, BLOCK_N=config.BLOCK_N, BLOCK_K=config.BLOCK_K,
        WAIT=wait, IEEE=a.dtype == torch.float32,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    if own_error:
        check_error(error, "ag_gemm", max_spins)
    return out


def ag_gemm_reference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """What the kernel computes once every flag is up: one plain GEMM."""
    return torch.matmul(a, b)
