"""All-to-all (Ulysses) context parallelism, and the head-split half of the hybrid mode.

U ranks (an ordered list of group ranks, member m holds ``rows`` sequence rows); H heads of a
tensor split in U groups of H/U::

    seq -> head   x [rows, b, H, d]      ->  x' [U*rows, b, H/U, d]   member m's head group m
                                              for the rows of every member, in member order
    head -> seq   the inverse (also the backward of seq -> head, and vice versa)

Ulysses attention: seq -> head on q, k, v (one message per peer carries all three), attention of
the full sequence on this rank's heads, head -> seq on the output. Query head i reads key/value
head ``i // g``; with ``H_q / U`` query and ``H_kv / U`` key/value heads per member that pairing
survives the split, so GQA works whenever U divides the key/value heads.

Causal with the zigzag layout: the gathered rows are U zigzag blocks back to back;
``layout.group_to_natural`` reorders them to one zigzag block of the group (for a group of all
ranks: the natural order of the sequence), the attention runs there (a ring across groups in the
hybrid mode, the whole block on one rank for Ulysses), and the inverse order goes back before
head -> seq. Packed batches keep the gathered order: their masks are explicit per row.

The exchange is point-to-point over the parent group (no communicator per group): U-1 paired
send/receive batches, every rank in the same offset order.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist

from ..comm import tags, waits
from ..comm.p2p import exchange
from ..errors import OverlapConfigError
from .layout import RingLayout, ZigzagLayout, group_to_natural
from .packed import PackedLayout, PackedSpec, TokenInfo
from .ring import Ring, RingOptions, ring_attention


class Members:
    """The U ranks of one all-to-all, in order, inside ``group``."""

    def __init__(self, group: dist.ProcessGroup, ranks: Sequence[int]):
        self.ring = Ring(group, ranks)  # position bookkeeping only: no ring traffic
        self.group, self.size, self.pos = group, self.ring.size, self.ring.pos


def _swap(parts: list, members: Members, recv_shape, stream: str) -> list:
    """``parts[m]`` goes to member m; returns what each member sent us (our own part kept)."""
    got = [None] * members.size
    got[members.pos] = parts[members.pos]
    pending = []
    for off in range(1, members.size):
        dst, src = members.ring.at(off), members.ring.at(-off)
        buf = parts[dst].new_empty(recv_shape)
        s_work, r_work = exchange(members.group, send=parts[dst], dst=members.ring.peer(off), recv=buf,
                                  src=members.ring.peer(-off), tag=tags.tag(stream, off))
        pending.append((s_work, parts[dst], members.ring.peer(off), "send"))
        pending.append((r_work, buf, members.ring.peer(-off), "receive"))
        got[src] = buf
    for work, _tensor, peer, what in pending:
        waits.wait(work, f"context-parallel all-to-all ({stream}) {what}", members.group, peer)
    return got


def seq_to_head(tensors: Sequence[torch.Tensor], members: Members, stream: str = "cp.a2a") -> list:
    """``[rows, b, H_t, d]`` each -> ``[U*rows, b, H_t/U, d]`` each (module docstring)."""
    U = members.size
    heads = [t.shape[2] // U for t in tensors]
    parts = [torch.cat([t[:, :, m * h:(m + 1) * h] for t, h in zip(tensors, heads)], dim=2).contiguous()
             for m in range(U)]
    got = _swap(parts, members, parts[0].shape, stream)
    gathered = torch.cat(got, dim=0)
    return list(gathered.split(heads, dim=2))


def head_to_seq(tensors: Sequence[torch.Tensor], members: Members, stream: str = "cp.a2a") -> list:
    """``[U*rows, b, H_t/U, d]`` each -> ``[rows, b, H_t, d]`` each (the inverse of seq_to_head)."""
    U = members.size
    rows = tensors[0].shape[0] // U
    heads = [t.shape[2] for t in tensors]
    parts = [torch.cat([t[m * rows:(m + 1) * rows] for t in tensors], dim=2).contiguous() for m in range(U)]
    got = _swap(parts, members, parts[0].shape, stream)
    per_member = [g.split(heads, dim=2) for g in got]
    return [torch.cat([pm[n] for pm in per_member], dim=2) for n in range(len(tensors))]


class _SeqToHead(torch.autograd.Function):
    @staticmethod
    def forward(ctx, members, *tensors):
        ctx.members, ctx.where = members, waits.current()
        return tuple(seq_to_head(tensors, members))

    @staticmethod
    def backward(ctx, *grads):
        grads = [torch.zeros_like(g) if g is None else g for g in grads]
        with waits.restored(ctx.where, "backward"):
            return (None, *head_to_seq(grads, ctx.members, stream="cp.a2a_grad_out"))


class _HeadToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, members, *tensors):
        ctx.members, ctx.where = members, waits.current()
        return tuple(head_to_seq(tensors, members))

    @staticmethod
    def backward(ctx, *grads):
        grads = [torch.zeros_like(g) if g is None else g for g in grads]
        with waits.restored(ctx.where, "backward"):
            return (None, *seq_to_head(grads, ctx.members, stream="cp.a2a_grad_in"))


def check_a2a_heads(q_heads: int, kv_heads: int, size: int, flag: str, alternative: str):
    """Head-split all-to-all over ``size`` ranks needs both head counts divisible by it."""
    if q_heads % size or kv_heads % size:
        raise OverlapConfigError(
            flag,
            f"all-to-all over {size} ranks splits the heads of each rank ({q_heads} query, {kv_heads} "
            f"key/value heads per tensor-parallel rank) in {size} groups; both must be divisible by {size}. "
            f"{alternative}",
        )


def headsplit_attention(q, k, v, *, causal: bool, scale: float, group, a2a_ranks: Sequence[int],
                        ring_ranks: Sequence[int], spec: Optional[PackedSpec] = None,
                        cp_positions: Optional[Sequence[Sequence[int]]] = None,
                        opts: Optional[RingOptions] = None) -> torch.Tensor:
    """All-to-all inside ``a2a_ranks`` (U consecutive CP positions), attention of the gathered
    rows with a ring across ``ring_ranks`` (one member per group; a ring of one for Ulysses),
    all-to-all back. ``q [rows, b, hq, d]``, ``k, v [rows, b, hk, d]`` -> ``[rows, b, hq, d]``.

    ``cp_positions[g]``: the CP positions (zigzag chunk owners) whose rows group g gathers, in
    member order; needed for packed batches (``spec``) to rebuild the gathered rows' documents.
    """
    members = Members(group, a2a_ranks)
    U, G = members.size, len(ring_ranks)
    rows = q.shape[0]
    qh, kh, vh = _SeqToHead.apply(members, q, k, v) if U > 1 else (q, k, v)
    reorder = None
    if spec is not None:
        infos = [TokenInfo.cat([spec.info(p) for p in positions]) for positions in cp_positions]
        layout: RingLayout = PackedLayout(infos, causal, docs=len(spec.cu) - 1, device=q.device)
    else:
        layout = ZigzagLayout(G, U * rows, causal)
        if causal and U > 1:
            reorder = group_to_natural(U, rows, device=q.device)
            qh, kh, vh = (t.index_select(0, reorder) for t in (qh, kh, vh))
    out = ring_attention(qh, kh, vh, layout, Ring(group, ring_ranks), scale, opts)
    if reorder is not None:
        out = out.index_select(0, torch.argsort(reorder))
    return _HeadToSeq.apply(members, out)[0] if U > 1 else out


def ulysses_attention(q, k, v, *, causal: bool, scale: float, group, ranks: Sequence[int],
                      spec: Optional[PackedSpec] = None, opts: Optional[RingOptions] = None) -> torch.Tensor:
    """Ulysses over ``ranks`` (CP position = index in ``ranks``): see the module docstring."""
    check_a2a_heads(q.shape[2], k.shape[2], len(ranks), "cp.mode",
                    "Use `cp.mode` ring (any head count) or `cp.mode` hybrid with an "
                    "`cp.a2a_size` that divides the heads.")
    me = dist.get_rank(group)
    return headsplit_attention(q, k, v, causal=causal, scale=scale, group=group, a2a_ranks=ranks, ring_ranks=[me],
                               spec=spec, cp_positions=[list(range(len(ranks)))], opts=opts)
