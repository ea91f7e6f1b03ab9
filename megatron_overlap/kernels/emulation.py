"""One-process emulation of the fused kernels: the "ranks" are buffers on one device, and a
side stream plays the transport, so the kernels' flag logic can be checked and timed on a
single GPU (on CPU, under the interpreter, the producer runs before the kernel).

AG-GEMM: virtual rank 0 computes ``AG(shards) @ b``; its own chunk is in place, the others'
arrive from their source buffers chunk by chunk, each followed by its flag:
- ``copy_engine``: ``copy_`` on a side stream (DMA engines, no SMs: symmetric memory pulls);
- ``push_kernel``: a small Triton copy kernel per chunk that raises the flag itself (SMs, as
  peers pushing over NVLink would).

GEMM-RS: every virtual rank r runs the GEMM-RS kernel on its ``a_r``; owner d then reduces
slot d of every rank; the result must equal the plain ``sum_r a_r @ b`` split by owner.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .ag_gemm import CONFIGS, TileConfig, ag_gemm, check_error, spin_limit
from .gemm_rs import gemm_rs, reduce_slots


@triton.jit
def _push_chunk_kernel(src_ptr, dst_ptr, flag_ptr, numel, BLOCK: tl.constexpr, NUM_PROGRAMS: tl.constexpr,
                       counter_ptr):
    pid = tl.program_id(0)
    for first in range(0, numel, BLOCK * NUM_PROGRAMS):
        offs = first + pid * BLOCK + tl.arange(0, BLOCK)
        mask = offs < numel
        tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=mask), mask=mask)
    tl.debug_barrier()
    done = tl.atomic_add(counter_ptr, 1, sem="release", scope="sys")
    if done == NUM_PROGRAMS - 1:
        tl.atomic_xchg(flag_ptr, 1, sem="release", scope="sys")


def push_chunk(src: torch.Tensor, dst: torch.Tensor, flag: torch.Tensor, programs: int = 8, block: int = 1024):
    """Copy ``src`` into ``dst`` with a kernel whose last program raises ``flag``."""
    counter = torch.zeros(1, dtype=torch.int32, device=src.device)
    _push_chunk_kernel[(programs,)](src, dst, flag, src.numel(), BLOCK=block, NUM_PROGRAMS=programs,
                                    counter_ptr=counter)


def emulate_ag_gemm(
    world: int, m_local: int, n: int, k: int, dtype: torch.dtype, device: torch.device,
    producer: str = "copy_engine", config: TileConfig = CONFIGS[0], seed: int = 0,
    inputs: Optional[tuple] = None, reference: bool = True, warmed: Optional[set] = None,
    error: Optional[torch.Tensor] = None,
) -> dict:
    """Run AG-GEMM for virtual rank 0 with a live producer; return out, reference and buffers.
    ``warmed``: the caller's record of producer kernels already loaded (see below); without one
    they are loaded on every call. ``error``: the kernel's error word (int32 [1], zeroed), for a
    caller that checks it later (``ag_gemm.check_error``; a timing loop); without it, checked here.
    It is never checked between the GEMM's launch and the producer's: the host would wait for a
    kernel that waits for the producer."""
    if producer not in ("copy_engine", "push_kernel"):
        raise ValueError(f"producer must be copy_engine or push_kernel, got {producer!r}")
    gen = torch.Generator(device="cpu").manual_seed(seed)
    if inputs is None:
        shards = [torch.randn(m_local, k, generator=gen).to(device=device, dtype=dtype) for _ in range(world)]
        b = torch.randn(k, n, generator=gen).to(device=device, dtype=dtype)
    else:
        shards, b = inputs
    gathered = torch.empty(world * m_local, k, dtype=dtype, device=device)
    gathered[:m_local].copy_(shards[0])
    flags = torch.zeros(world, dtype=torch.int32, device=device)
    flags[0] = 1
    bounds = [r * m_local for r in range(world + 1)]
    order = list(range(world))

    def produce(into: torch.Tensor, raise_flags: torch.Tensor):
        for r in range(1, world):
            dst = into[r * m_local : (r + 1) * m_local]
            if producer == "copy_engine":
                dst.copy_(shards[r], non_blocking=True)
                raise_flags[r : r + 1].fill_(1)
            else:
                push_chunk(shards[r], dst, raise_flags[r : r + 1])

    if device.type == "cuda":
        # Load (and compile) every producer kernel before the GEMM starts spinning: with CUDA's
        # lazy module loading, the first launch of a kernel can wait for the running, spinning
        # GEMM, which waits for that kernel's flag: a deadlock (a hang seen on the H200 without
        # this; lazy loading is the likely cause). Triton compiles a kernel per specialization
        # of its integer arguments (e.g. numel divisible by 16), so warm per shape.
        key = (producer, str(device), dtype, world, m_local, k)
        if warmed is None or key not in warmed:
            produce(torch.empty_like(gathered), torch.zeros_like(flags))
            torch.cuda.synchronize(device)
            if warmed is not None:
                warmed.add(key)
        side = torch.cuda.Stream(device=device)
        side.wait_stream(torch.cuda.current_stream(device))
        # SMs left free so the producer's kernels (flag writes, push copies) can run beside it.
        word = error if error is not None else torch.zeros(1, dtype=torch.int32, device=device)
        out = ag_gemm(gathered, b, flags, bounds, order, config=config, reserved_sms=8, error=word)
        with torch.cuda.stream(side):
            produce(gathered, flags)
        torch.cuda.current_stream(device).wait_stream(side)
        if error is None:
            check_error(word, "ag_gemm", spin_limit(300.0))
    else:
        produce(gathered, flags)
        out = ag_gemm(gathered, b, flags, bounds, order, config=config, error=error)
    ref = torch.matmul(torch.cat(shards), b) if reference else None  # off when timing
    return {"out": out, "reference": ref, "shards": shards, "b": b}


def emulate_gemm_rs(world: int, m_local: int, n: int, k: int, dtype: torch.dtype, device: torch.device,
                    config: TileConfig = CONFIGS[0], seed: int = 0) -> dict:
    """Every virtual rank's GEMM-RS, then each owner's reduce; with the plain reference."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    a = [torch.randn(world * m_local, k, generator=gen).to(device=device, dtype=dtype) for _ in range(world)]
    b = torch.randn(k, n, generator=gen).to(device=device, dtype=dtype)
    slots = []
    for r in range(world):
        order = [(r + i) % world for i in range(1, world)] + [r]
        slots.append(gemm_rs(a[r], b, world, order, config=config)[0])
    outs, refs = [], []
    for owner in range(world):
        received = torch.stack([slots[src][owner] for src in range(world)])
        flags = torch.ones(world, dtype=torch.int32, device=device)
        outs.append(reduce_slots(received, flags, list(range(world))))
        full = sum(torch.matmul(a[src].float(), b.float()) for src in range(world))
        refs.append(full[owner * m_local : (owner + 1) * m_local].to(dtype))
    return {"outs": outs, "references": refs}
