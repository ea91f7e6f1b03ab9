"""Single-rank full attention in plain PyTorch: what every context-parallel mode must equal.

``q [S, b, hq, d]``, ``k, v [S, b, hk, d]``, the whole sequence in natural order; or packed
``q [T, hq, d]`` with ``cu_seqlens`` (documents back to back, no padding), attention within each
document only. GQA: query head i reads key/value head ``i // (hq / hk)`` (Megatron's
``repeat_interleave``). Scores and softmax in fp32; autograd gives the gradients::

    out = softmax(scale * q k^T + mask) v,    mask = -inf above the diagonal (causal) and
                                              across documents (packed)
"""

from __future__ import annotations

import math
from typing import Optional

import torch


def _mask(rows: int, causal: bool, cu_seqlens: Optional[torch.Tensor], device) -> torch.Tensor:
    """Bool [rows, rows], True = attend."""
    allowed = torch.ones(rows, rows, dtype=torch.bool, device=device)
    if causal:
        allowed = allowed.tril()
    if cu_seqlens is not None:
        bounds = cu_seqlens.long().to(device)
        doc = torch.searchsorted(bounds, torch.arange(rows, device=device), right=True) - 1
        allowed &= doc[:, None] == doc[None, :]
    return allowed


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool,
                        softmax_scale: Optional[float] = None, cu_seqlens: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Full attention of the whole sequence on one rank; output shaped like ``q``, in q's dtype."""
    packed = q.dim() == 3
    if packed:
        if cu_seqlens is None:
            raise ValueError("3-D (packed) input needs cu_seqlens")
        q, k, v = q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1)
    S, b, hq, d = q.shape
    g = hq // k.shape[2]
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else softmax_scale
    qf = q.float().permute(1, 2, 0, 3)                                   # [b, hq, S, d]
    kf = k.float().repeat_interleave(g, dim=2).permute(1, 2, 0, 3)       # [b, hq, S, d]
    vf = v.float().repeat_interleave(g, dim=2).permute(1, 2, 0, 3)
    scores = torch.matmul(qf, kf.transpose(-1, -2)) * scale
    allowed = _mask(S, causal, cu_seqlens, q.device)
    probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
    out = torch.matmul(probs, vf).permute(2, 0, 1, 3).to(q.dtype)       # [S, b, hq, d]
    return out.squeeze(1) if packed else out
