"""Attention of one block of queries against one block of keys/values, with the log-sum-exp of
every query row, so that partial results over disjoint key blocks merge exactly.

Layout is Megatron's local attention layout: ``q [sq, b, hq, d]``, ``k, v [sk, b, hk, d]``,
``hq = g * hk`` (GQA: query head i reads key/value head ``i // g``, as Megatron's
``repeat_interleave`` does). All math in fp32; dropout 0.

Forward of a block (masked entries of S are -inf)::

    S   [b, hq, sq, sk] = scale * q k^T
    lse [b, hq, sq]     = logsumexp_k S                  (-inf for a row that sees no key)
    out [sq, b, hq, d]  = exp(S - lse) v                 (0 for such a row)

Merge of two partials over disjoint key sets (online softmax)::

    lse = logaddexp(lse1, lse2);   out = out1 exp(lse1 - lse) + out2 exp(lse2 - lse)

Backward of a block, given the *final* ``out`` and ``lse`` of its rows (over all key blocks)::

    delta [b, hq, sq] = rowsum(dout * out)
    P  = exp(S - lse);  dv = P^T dout;  dP = dout v^T;  dS = P (dP - delta)
    dq = scale dS k;    dk = scale dS^T q                (dk, dv summed over the g heads of a group)

Summed over key blocks (dq) and query blocks (dk, dv) these are the gradients of full attention.

Kernels: ``plain`` is the formulas above in PyTorch (any device, any mask). ``sdpa`` runs
PyTorch's flash-attention kernels, which return the log-sum-exp too (CUDA:
``aten._scaled_dot_product_flash_attention``; CPU: its ``_for_cpu`` sibling, used by the tests
to check this path); it handles ``full`` and ``causal`` blocks, not explicit masks. ``auto``
picks ``sdpa`` for fp16/bf16 CUDA tensors with a head dim the kernel takes, else ``plain``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union

import torch

FULL, CAUSAL, NONE, MASK = "full", "causal", "none", "mask"
KINDS = (FULL, CAUSAL, NONE, MASK)
KERNELS = ("auto", "plain", "sdpa")

Index = Union[slice, torch.Tensor]


@dataclass(frozen=True)
class BlockPlan:
    """Which part of a (query block, key block) pair to compute, and how to mask it.

    ``rows`` index the query block and ``cols`` the key block (a slice, or a LongTensor of
    positions); ``kind`` is ``full`` or ``causal`` (diagonal block: row i sees cols <= i), or
    ``mask`` with ``mask [len(rows), len(cols)]`` (True = attend).
    """

    rows: Index
    cols: Index
    kind: str
    mask: Optional[torch.Tensor] = None


@dataclass
class BlockWork:
    """Score elements computed (b * hq * rows * cols per block), forward and backward."""

    forward_elements: int = 0
    backward_elements: int = 0
    forward_blocks: int = 0
    backward_blocks: int = 0
    per_block: list = field(default_factory=list)


def pick(x: torch.Tensor, index: Index, dim: int = 0) -> torch.Tensor:
    """``x`` restricted to ``index`` along ``dim`` (a view for a slice, a copy for indices)."""
    if isinstance(index, slice):
        return x[(slice(None),) * dim + (index,)]
    return x.index_select(dim, index)


def _use_sdpa(q: torch.Tensor, kind: str, kernel: str) -> bool:
    """The one availability check for the flash kernels."""
    if kernel not in KERNELS:
        raise ValueError(f"unknown attention kernel {kernel!r}; one of {KERNELS}")
    if kernel == "plain" or kind not in (FULL, CAUSAL):
        return False
    if kernel == "sdpa":
        return True
    d = q.shape[-1]
    return (
        q.is_cuda
        and q.dtype in (torch.float16, torch.bfloat16)
        and d % 8 == 0
        and d <= 256
        and hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention")
    )


def _check(q, k, v, kind):
    if kind not in KINDS:
        raise ValueError(f"unknown mask kind {kind!r}; one of {KINDS}")
    if q.dim() != 4 or k.shape != v.shape or k.dim() != 4:
        raise ValueError(f"q [sq, b, hq, d], k and v [sk, b, hk, d] expected, got {q.shape}, {k.shape}, {v.shape}")
    if q.shape[1] != k.shape[1] or q.shape[3] != k.shape[3] or q.shape[2] % k.shape[2]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)}: batch and head dim must match "
                         "and query heads be a multiple of key/value heads")
    if kind == CAUSAL and q.shape[0] != k.shape[0]:
        raise ValueError(f"a causal block is square, got {q.shape[0]} query and {k.shape[0]} key rows")


# ----------------------------------------------------------------------------------- plain
def _scores(q, k, scale, kind, mask):
    """S [b, hk, g, sq, sk] in fp32, masked entries -inf."""
    sq, b, hq, d = q.shape
    sk, hk = k.shape[0], k.shape[2]
    qg = q.float().reshape(sq, b, hk, hq // hk, d)
    s = torch.einsum("qbhgd,kbhd->bhgqk", qg, k.float()).mul_(scale)
    if kind == CAUSAL:
        s.masked_fill_(torch.ones(sq, sk, dtype=torch.bool, device=q.device).triu_(1), float("-inf"))
    elif kind == MASK:
        s.masked_fill_(~mask, float("-inf"))
    return s


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """lse with -inf (rows that see nothing) replaced by 0, so exp(S - lse) is 0 there, not nan."""
    return lse.masked_fill(torch.isneginf(lse), 0.0)


def _plain_forward(q, k, v, kind, scale, mask):
    sq, b, hq, d = q.shape
    s = _scores(q, k, scale, kind, mask)
    lse = torch.logsumexp(s, dim=-1)  # [b, hk, g, sq]
    p = torch.exp(s - _finite(lse).unsqueeze(-1))
    out = torch.einsum("bhgqk,kbhd->qbhgd", p, v.float()).reshape(sq, b, hq, d)
    return out, lse.reshape(b, hq, sq)


def _plain_backward(q, k, v, out, lse, dout, delta, kind, scale, mask):
    sq, b, hq, d = q.shape
    hk = k.shape[2]
    g = hq // hk
    s = _scores(q, k, scale, kind, mask)
    p = torch.exp(s - _finite(lse).reshape(b, hk, g, sq, 1))
    do = dout.float().reshape(sq, b, hk, g, d)
    dv = torch.einsum("bhgqk,qbhgd->kbhd", p, do)
    dp = torch.einsum("qbhgd,kbhd->bhgqk", do, v.float())
    ds = p.mul_(dp.sub_(delta.reshape(b, hk, g, sq, 1))).mul_(scale)
    dq = torch.einsum("bhgqk,kbhd->qbhgd", ds, k.float()).reshape(sq, b, hq, d)
    dk = torch.einsum("bhgqk,qbhgd->kbhd", ds, q.float().reshape(sq, b, hk, g, d))
    return dq, dk, dv


# ----------------------------------------------------------------------------------- sdpa
def _heads_first(q, k, v):
    """[s, b, h, d] -> [b, h, s, d] views; k, v repeated to the query heads (flash wants equal heads)."""
    g = q.shape[2] // k.shape[2]
    if g > 1:
        k, v = k.repeat_interleave(g, dim=2), v.repeat_interleave(g, dim=2)
    return q.permute(1, 2, 0, 3), k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3)


def _sdpa_forward(q, k, v, kind, scale):
    qt, kt, vt = _heads_first(q, k, v)
    causal = kind == CAUSAL
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(qt, kt, vt, 0.0, causal, scale=scale)
    else:
        res = torch.ops.aten._scaled_dot_product_flash_attention(qt, kt, vt, 0.0, causal, False, scale=scale)
        out, lse = res[0], res[1]
    return out.permute(2, 0, 1, 3).float(), lse.float()


def _sdpa_backward(q, k, v, out, lse, dout, kind, scale):
    sq, b, hq, d = q.shape
    sk, hk = k.shape[0], k.shape[2]
    qt, kt, vt = _heads_first(q, k, v)
    ot = out.to(q.dtype).permute(1, 2, 0, 3)
    dot = dout.to(q.dtype).permute(1, 2, 0, 3)
    lse = lse.float().contiguous()
    causal = kind == CAUSAL
    if q.device.type == "cpu":
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dot, qt, kt, vt, ot, lse, 0.0, causal, scale=scale)
    else:
        # Dense blocks: no cumulative lengths; the RNG state is only read when dropout_p > 0.
        rng = torch.zeros(2, dtype=torch.uint64, device=q.device)
        unused = torch.zeros((), dtype=torch.uint64, device=q.device)
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            dot, qt, kt, vt, ot, lse, None, None, sq, sk, 0.0, causal, rng, unused, scale=scale)
    g = hq // hk
    dk = dk.reshape(b, hk, g, sk, d).sum(2) if g > 1 else dk
    dv = dv.reshape(b, hk, g, sk, d).sum(2) if g > 1 else dv
    return dq.permute(2, 0, 1, 3).float(), dk.permute(2, 0, 1, 3).float(), dv.permute(2, 0, 1, 3).float()


# ----------------------------------------------------------------------------------- API
def block_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kind: str,
    scale: float,
    mask: Optional[torch.Tensor] = None,
    kernel: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [sq, b, hq, d] fp32, lse [b, hq, sq] fp32)`` of one block; see the module docstring."""
    _check(q, k, v, kind)
    sq, b, hq, d = q.shape
    if kind == NONE:
        return (q.new_zeros(sq, b, hq, d, dtype=torch.float32),
                q.new_full((b, hq, sq), float("-inf"), dtype=torch.float32))
    if _use_sdpa(q, kind, kernel):
        return _sdpa_forward(q, k, v, kind, scale)
    return _plain_forward(q, k, v, kind, scale, mask)


def attention_delta(out: torch.Tensor, dout: torch.Tensor) -> torch.Tensor:
    """``delta [b, hq, sq] = rowsum(dout * out)`` of the final output (fp32)."""
    return (dout.float() * out.float()).sum(-1).permute(1, 2, 0)


def block_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dout: torch.Tensor,
    kind: str,
    scale: float,
    mask: Optional[torch.Tensor] = None,
    delta: Optional[torch.Tensor] = None,
    kernel: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq [sq, b, hq, d], dk, dv [sk, b, hk, d])`` in fp32: this block's share of the
    gradients, given the final ``out``/``lse`` of its query rows (``delta`` is recomputed from
    them when not given)."""
    _check(q, k, v, kind)
    if kind == NONE:
        return (torch.zeros(q.shape, dtype=torch.float32, device=q.device),
                torch.zeros(k.shape, dtype=torch.float32, device=k.device),
                torch.zeros(v.shape, dtype=torch.float32, device=v.device))
    if _use_sdpa(q, kind, kernel):
        return _sdpa_backward(q, k, v, out, lse, dout, kind, scale)
    if delta is None:
        delta = attention_delta(out, dout)
    return _plain_backward(q, k, v, out, lse, dout, delta, kind, scale, mask)


def merge_partial(out: torch.Tensor, lse: torch.Tensor, out_blk: torch.Tensor, lse_blk: torch.Tensor):
    """In place: ``out [sq, b, hq, d]`` and ``lse [b, hq, sq]`` (fp32, views allowed) absorb a
    block's partial result over keys they have not seen yet."""
    new = torch.logaddexp(lse, lse_blk)
    finite = _finite(new)
    w_old = torch.exp(lse - finite).permute(2, 0, 1).unsqueeze(-1)
    w_new = torch.exp(lse_blk - finite).permute(2, 0, 1).unsqueeze(-1)
    out.mul_(w_old).add_(out_blk * w_new)
    lse.copy_(new)

