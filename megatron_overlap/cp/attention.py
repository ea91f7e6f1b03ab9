"""One entry point for context-parallel core attention, shaped for a patched
``DotProductAttention.forward``.

n CP positions = the ordered rank list ``ranks`` inside ``group`` (default: all of ``group``'s
ranks in order, i.e. Megatron's CP group and CP rank = position). Position x holds

- unpacked (``sbhd``): rows ``[chunk x; chunk 2n-1-x]`` of the sequence cut in 2n chunks, as
  ``megatron.core.utils.get_batch_on_this_cp_rank`` slices it: ``q [s, b, hq, d]``,
  ``k, v [s, b, hk, d]`` with s = S / n;
- packed (``thd``, ``packed`` = Megatron's ``PackedSeqParams``): per document, chunks x and
  2n-1-x of the padded document (``packed.partition_index``): ``q [t, hq, d]`` (or
  ``[t, 1, hq, d]``) with t = T_padded / n; ``cu_seqlens_q`` gives the real lengths,
  ``cu_seqlens_q_padded`` the padded ones (defaults to ``cu_seqlens_q``).

Returns the attention output of this rank's rows, ``[s, b, hq*d]`` (``[t, hq*d]`` for 3-D packed
input, ``[t, 1, hq*d]`` for 4-D), in q's dtype, with autograd.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from ..errors import OverlapConfigError
from .a2a import check_a2a_heads, ulysses_attention
from .block import BlockWork
from .hybrid import check_hybrid_size, hybrid_attention
from .layout import ZigzagLayout
from .packed import PackedLayout, PackedSpec
from .ring import Ring, RingOptions, ring_attention

MODES = ("ring", "a2a", "hybrid")


def check_seq_length(seq_length: int, cp_size: int):
    """Unpacked sequences are cut in 2 x CP chunks (Megatron's load-balanced layout)."""
    if cp_size > 1 and seq_length % (2 * cp_size):
        raise OverlapConfigError(
            "megatron.seq_length",
            f"sequence length {seq_length} is not a multiple of 2 x context-parallel size = {2 * cp_size}: "
            "context parallelism cuts every sequence in 2 x CP equal chunks (2 per rank, for causal load "
            "balance); pad the sequence or change `megatron.context_parallel_size`",
        )


def check_cp_config(mode: str, cp_size: int, q_heads: int, kv_heads: int, a2a_size: Optional[int] = None,
                    seq_length: Optional[int] = None):
    """Every check that needs no tensor: the mode, head counts per tensor-parallel rank against
    the all-to-all size, the hybrid group size, the (unpacked) sequence length."""
    if mode not in MODES:
        raise OverlapConfigError("cp.mode", f"unknown mode {mode!r}; one of {', '.join(MODES)}")
    if mode == "a2a":
        check_a2a_heads(q_heads, kv_heads, cp_size, "cp.mode",
                        "Use `cp.mode` ring (any head count) or `cp.mode` hybrid with an "
                        "`cp.a2a_size` that divides the heads.")
    if mode == "hybrid":
        check_hybrid_size(cp_size, a2a_size)
        check_a2a_heads(q_heads, kv_heads, a2a_size, "cp.a2a_size",
                        "Pick an `cp.a2a_size` that divides both head counts, or use `cp.mode` ring.")
    if seq_length is not None:
        check_seq_length(seq_length, cp_size)


def _packed_spec(packed, rows: int, cp_size: int) -> PackedSpec:
    if getattr(packed, "qkv_format", "thd") not in (None, "thd"):
        raise ValueError(f"packed sequences in the 'thd' format expected, got {packed.qkv_format!r}")
    cu_q, cu_kv = packed.cu_seqlens_q, getattr(packed, "cu_seqlens_kv", None)
    pad_q, pad_kv = getattr(packed, "cu_seqlens_q_padded", None), getattr(packed, "cu_seqlens_kv_padded", None)
    if cu_kv is not None and not torch.equal(cu_kv.cpu(), cu_q.cpu()):
        raise ValueError("context-parallel packed attention is self-attention: cu_seqlens_kv must equal cu_seqlens_q")
    if pad_kv is not None and pad_q is not None and not torch.equal(pad_kv.cpu(), pad_q.cpu()):
        raise ValueError("cu_seqlens_kv_padded must equal cu_seqlens_q_padded")
    spec = PackedSpec(cu_q, pad_q if pad_q is not None else pad_kv, cp_size)
    if spec.local_rows != rows:
        raise ValueError(f"packed batch of {spec.total} padded tokens over {cp_size} CP ranks gives "
                         f"{spec.local_rows} rows per rank, got {rows}")
    return spec


def cp_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mode: str,
    causal: bool,
    group: dist.ProcessGroup,
    softmax_scale: Optional[float] = None,
    ranks: Optional[Sequence[int]] = None,
    packed=None,
    a2a_size: Optional[int] = None,
    kernel: str = "auto",
    overlap: bool = True,
    work: Optional[BlockWork] = None,
) -> torch.Tensor:
    """Context-parallel attention of this rank's rows; see the module docstring. ``mode``:
    ``ring``, ``a2a`` (Ulysses) or ``hybrid`` (a2a inside groups of ``a2a_size`` consecutive
    positions, ring across). ``overlap=False`` (ring traffic not overlapped) and ``work``
    (counts score elements) serve the benchmark and the tests."""
    if mode not in MODES:
        raise OverlapConfigError("cp.mode", f"unknown mode {mode!r}; one of {', '.join(MODES)}")
    ranks = list(range(dist.get_world_size(group))) if ranks is None else [int(r) for r in ranks]
    n = len(ranks)
    squeeze = packed is not None and q.dim() == 3
    if squeeze:
        q, k, v = q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1)
    if q.dim() != 4 or k.shape != v.shape or k.dim() != 4 or q.shape[:2] != k.shape[:2] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q [s, b, hq, d] and k, v [s, b, hk, d] expected, got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    rows, b, hq, d = q.shape
    if hq % k.shape[2]:
        raise ValueError(f"query heads {hq} must be a multiple of key/value heads {k.shape[2]}")
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else float(softmax_scale)
    spec = None
    if packed is not None:
        if b != 1:
            raise ValueError(f"packed (thd) attention has batch 1, got {b}")
        spec = _packed_spec(packed, rows, n)
    else:
        check_seq_length(rows * n, n)
    opts = RingOptions(overlap=overlap, kernel=kernel, work=work)
    if mode == "a2a":
        out = ulysses_attention(q, k, v, causal=causal, scale=scale, group=group, ranks=ranks, spec=spec, opts=opts)
    elif mode == "hybrid":
        out = hybrid_attention(q, k, v, causal=causal, scale=scale, group=group, ranks=ranks, a2a_size=a2a_size,
                               spec=spec, opts=opts)
    else:
        ring = Ring(group, ranks)
        if spec is not None:
            layout = PackedLayout([spec.info(p) for p in range(n)], causal, docs=len(spec.cu) - 1, device=q.device)
        else:
            layout = ZigzagLayout(n, rows, causal)
        out = ring_attention(q, k, v, layout, ring, scale, opts)
    out = out.reshape(rows, b, hq * d)
    return out.squeeze(1) if squeeze else out
