"""GEMM-RS: a persistent Triton GEMM whose epilogue delivers each tile to the owner of its rows,
and the reduction that follows.

    a       [M, K]          all rows, this rank's slice of the reduction dim; M = R * M_local
    b       [K, N]
    slots   [R, M_local, N] slot d receives this rank's partial for the rows of rank d
                            (a local staging buffer: the a2a + local-reduce variant; in the
                            one-process emulation, or with peers' buffers mapped, it is the
                            owners' receive buffer itself)
    counts  [R] int32       tiles finished per owner (zeroed before the launch)
    flags   [R] int32       raised to 1 once every tile of slot d is written (release)

Tiles are listed owner by owner in ``order`` (peers first, the own rows last), so the
transport can start moving slot d while the GEMM still works on the next owner. The last
tile of an owner raises its flag; the consumer never reads a slot early. ``reduce_slots``
then sums, per output tile, the R received partials in a fixed order, waiting on each one's
flag: ``out [M_local, N] = sum_src received[src]``.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import triton
import triton.language as tl

from .ag_gemm import CONFIGS, TileConfig, _tile_matmul, _wait_flag, check_error, num_programs, spin_limit


@triton.jit
def gemm_rs_kernel(
    a_ptr, b_ptr, slots_ptr, counts_ptr, flags_ptr, tiles_ptr, totals_ptr,
    N, K, M_LOCAL, num_tiles,
    stride_am, stride_ak, stride_bk, stride_bn, stride_sd, stride_sm, stride_sn,
    NUM_PROGRAMS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr,
):
    pid = tl.program_id(0)
    for first in range(0, num_tiles, NUM_PROGRAMS):
        t = first + pid
        if t < num_tiles:
            # tile table row: (owner, first local row, first column, unused)
            owner = tl.load(tiles_ptr + t * 4)
            lrow0 = tl.load(tiles_ptr + t * 4 + 1)
            col0 = tl.load(tiles_ptr + t * 4 + 2)
            lm = lrow0 + tl.arange(0, BLOCK_M)  # rows local to the owner's shard
            rm = owner * M_LOCAL + lm  # rows of a
            rn = col0 + tl.arange(0, BLOCK_N)
            acc = _tile_matmul(a_ptr, b_ptr, rm, lm < M_LOCAL, rn, N, K, stride_am, stride_ak, stride_bk,
                               stride_bn, BLOCK_M, BLOCK_N, BLOCK_K, IEEE)
            tl.store(
                slots_ptr + owner * stride_sd + lm[:, None] * stride_sm + rn[None, :] * stride_sn,
                acc.to(slots_ptr.dtype.element_ty),
                mask=(lm[:, None] < M_LOCAL) & (rn[None, :] < N),
            )
            # every thread's stores before the count; the last tile of the owner raises its flag
            tl.debug_barrier()
            done = tl.atomic_add(counts_ptr + owner, 1, sem="release", scope="sys")
            if done == tl.load(totals_ptr + owner) - 1:
                tl.atomic_xchg(flags_ptr + owner, 1, sem="release", scope="sys")


@triton.jit
def reduce_slots_kernel(
    recv_ptr, flags_ptr, out_ptr, order_ptr, error_ptr,
    M_LOCAL, N, R, max_spins,
    stride_rs, stride_rm, stride_rn, stride_om, stride_on,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WAIT: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rm[:, None] < M_LOCAL) & (rn[None, :] < N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for i in range(0, R):
        src = tl.load(order_ptr + i)
        ready = True
        if WAIT:
            ready = _wait_flag(flags_ptr + src, error_ptr, src, max_spins)
        if ready:
            acc += tl.load(
                recv_ptr + src * stride_rs + rm[:, None] * stride_rm + rn[None, :] * stride_rn, mask=mask, other=0.0
            ).to(tl.float32)
    tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :] * stride_on, acc.to(out_ptr.dtype.element_ty), mask=mask)


def rs_tile_table(m_local: int, n: int, order: Sequence[int], block_m: int, block_n: int, device):
    """int32 [T, 4] rows (owner, local row0, col0, 0) owner by owner; and tiles per owner."""
    rows = []
    per_owner = [0] * len(order)
    for owner in order:
        for row0 in range(0, m_local, block_m):
            for col0 in range(0, n, block_n):
                rows.append((owner, row0, col0, 0))
                per_owner[owner] += 1
    table = torch.tensor(rows, dtype=torch.int32, device=device).reshape(-1, 4)
    return table, torch.tensor(per_owner, dtype=torch.int32, device=device)


def gemm_rs(
    a: torch.Tensor,
    b: torch.Tensor,
    world: int,
    order: Sequence[int],
    slots: Optional[torch.Tensor] = None,
    flags: Optional[torch.Tensor] = None,
    config: TileConfig = CONFIGS[0],
    reserved_sms: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Partials of ``a @ b`` per owner into ``slots [world, M_local, N]``, owners in ``order``;
    returns ``(slots, flags)`` with every flag raised once the kernel is done."""
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"gemm_rs: shapes {tuple(a.shape)} @ {tuple(b.shape)} do not chain")
    if a.dtype != b.dtype or a.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"gemm_rs: dtypes {a.dtype}, {b.dtype}: need one of fp32/fp16/bf16, both alike")
    if a.shape[0] % world:
        raise ValueError(f"gemm_rs: {a.shape[0]} rows do not split over {world} ranks")
    if sorted(order) != list(range(world)):
        raise ValueError("gemm_rs: order must list every owner once")
    m_local, n, k = a.shape[0] // world, b.shape[1], a.shape[1]
    if slots is None:
        slots = torch.empty((world, m_local, n), dtype=a.dtype, device=a.device)
    if flags is None:
        flags = torch.zeros(world, dtype=torch.int32, device=a.device)
    counts = torch.zeros(world, dtype=torch.int32, device=a.device)
    tiles, totals = rs_tile_table(m_local, n, order, config.BLOCK_M, config.BLOCK_N, a.device)
    programs = num_programs(a.device, tiles.shape[0], reserved_sms)
    gemm_rs_kernel[(programs,)](
        a, b, slots, counts, flags, tiles, totals,
        n, k, m_local, tiles.shape[0],
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), slots.stride(0), slots.stride(1), slots.stride(2),
        NUM_PROGRAMS=programs,
        BLOCK_M=config.BLOCK_M, BLOCK_N=config.BLOCK_N, BLOCK_K=config.BLOCK_K,
        IEEE=a.dtype == torch.float32,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return slots, flags


def reduce_slots(
    received: torch.Tensor,
    flags: torch.Tensor,
    order: Sequence[int],
    out: Optional[torch.Tensor] = None,
    wait: bool = True,
    block: int = 64,
    max_spins: int = spin_limit(300.0),
    error: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``out [M_local, N]`` = sum over ``received [R, M_local, N]`` in ``order``, slot by slot
    as each one's flag is raised (fp32 accumulation). Waits are bounded as in ``ag_gemm``: a
    slot whose flag never rises raises :class:`~.ag_gemm.FlagWaitTimeout` (checked here
    unless the caller passes its own ``error`` word)."""
    r, m_local, n = received.shape
    if out is None:
        out = torch.empty((m_local, n), dtype=received.dtype, device=received.device)
    order_t = torch.tensor(list(order), dtype=torch.int32, device=received.device)
    grid = (triton.cdiv(m_local, block), triton.cdiv(n, block))
    own_error = error is None
    if own_error:
        error = torch.zeros(1, dtype=torch.int32, device=received.device)
    reduce_slots_kernel[grid](
        received, flags, out, order_t, error, m_local, n, r, max_spins,
        received.stride(0), received.stride(1), received.stride(2), out.stride(0), out.stride(1),
        BLOCK_M=block, BLOCK_N=block, WAIT=wait,
    )
    if own_error:
        check_error(error, "reduce_slots", max_spins)
    return out


def gemm_rs_reference(a: torch.Tensor, b: torch.Tensor, world: int) -> torch.Tensor:
    """Slots of the plain GEMM: ``(a @ b).view(world, M_local, N)``."""
    return torch.matmul(a, b).view(world, a.shape[0] // world, b.shape[1])


def reduce_slots_reference(received: torch.Tensor, order: Sequence[int]) -> torch.Tensor:
    out = received[order[0]].float().clone()
    for src in order[1:]:
        out += received[src].float()
    return out.to(received.dtype)
