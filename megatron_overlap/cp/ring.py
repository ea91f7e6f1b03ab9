"""Ring attention: key/value blocks travel round an ordered ring of ranks while each rank
attends to the block in hand; partial results merge by log-sum-exp.

n positions, this one x; ``kv_j`` is position j's key/value block ``[2, rows, b, hk, d]``, moving
in pieces (``layout.pieces``); ``+1`` is the next position in the ring's rank list.

Forward (kv moves +1)::

    step 0      send kv_x on, receive kv_{x-1}; attend to the own block meanwhile
    step s>=1   as each piece of kv_{x-s} lands: pass it on (s < n-1), attend to it, merge
    keeps kv_{x-(n-1)} = kv_{x+1}, the block in hand at the end, for the backward

Backward (the ring again, the other way; dK/dV sums travel with it, dQ stays)::

    step t=1..n-1   hold kv_{x+t} (t=1: the kept block); pass it to x-1 and receive kv_{x+t+1};
                    per piece: this rank's dK/dV share for kv_{x+t}, plus the running sum that
                    came from x+1, goes on to x-1 (at t = n-1 that is the block's home)
    own block last  its dK/dV add to the sums that came home; the last hop travels meanwhile

Every exchange posts its sends and receives together (``batch_isend_irecv``) and every rank posts
them in the same order towards each peer, as NCCL needs; every wait is ``comm.waits.wait``, bounded
by the process group's timeout (or ``comm.timeout_s``) and naming the step, piece and peer. With
``overlap=False`` the same messages are sent, but each step waits for its block (and each dK/dV
sum for its transfer) before computing: the baseline of the benchmark.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from ..comm import tags, waits
from ..comm.p2p import exchange
from .block import BlockPlan, BlockWork, attention_delta, block_attention, block_backward, merge_partial, pick
from .layout import RingLayout


class Ring:
    """An ordered ring of group ranks inside a parent process group (no communicator is created:
    peers talk point-to-point over ``group``). Position = index in ``ranks``."""

    def __init__(self, group: dist.ProcessGroup, ranks: Sequence[int]):
        ranks = tuple(int(r) for r in ranks)
        me = dist.get_rank(group)
        if len(set(ranks)) != len(ranks) or not ranks:
            raise ValueError(f"ring peers must be distinct group ranks, got {list(ranks)}")
        if me not in ranks:
            raise ValueError(f"group rank {me} is not among the ring's peers {list(ranks)}")
        self.group, self.ranks, self.size, self.pos = group, ranks, len(ranks), ranks.index(me)

    def peer(self, offset: int) -> int:
        """Group rank of position ``pos + offset``."""
        return self.ranks[(self.pos + offset) % self.size]

    def at(self, offset: int) -> int:
        """Position ``pos + offset``."""
        return (self.pos + offset) % self.size


@dataclass
class RingOptions:
    """``overlap``: compute while blocks travel (False: the benchmark's baseline). ``kernel``:
    the block kernel (``auto``, ``plain``, ``sdpa``). ``work``: counts computed score elements."""

    overlap: bool = True
    kernel: str = "auto"
    work: Optional[BlockWork] = None


def _tag(stream: str, step: int, piece: int, pieces: int) -> int:
    return tags.tag(stream, step * pieces + piece)


def _count(opts: RingOptions, q: torch.Tensor, k: torch.Tensor, backward: bool):
    if opts.work is not None:
        n = q.shape[0] * k.shape[0] * q.shape[1] * q.shape[2]
        if backward:
            opts.work.backward_elements += n
            opts.work.backward_blocks += 1
        else:
            opts.work.forward_elements += n
            opts.work.forward_blocks += 1
            opts.work.per_block.append(n)


def _attend(q, k, v, plan: BlockPlan, out, lse, scale, opts: RingOptions):
    """Forward of one block, merged into ``out``/``lse`` at ``plan.rows``."""
    qs, ks, vs = pick(q, plan.rows), pick(k, plan.cols), pick(v, plan.cols)
    _count(opts, qs, ks, backward=False)
    o, l = block_attention(qs, ks, vs, plan.kind, scale, plan.mask, opts.kernel)
    if isinstance(plan.rows, slice):
        merge_partial(out[plan.rows], lse[..., plan.rows], o, l)
    else:
        acc_o, acc_l = out.index_select(0, plan.rows), lse.index_select(2, plan.rows)
        merge_partial(acc_o, acc_l, o, l)
        out.index_copy_(0, plan.rows, acc_o)
        lse.index_copy_(2, plan.rows, acc_l)


def _add_at(acc: torch.Tensor, index, value: torch.Tensor):
    if isinstance(index, slice):
        acc[index] += value
    else:
        acc.index_add_(0, index, value)


def _grads(q, k, v, out, lse, dout, delta, plan: BlockPlan, scale, opts: RingOptions):
    """Backward of one block: (dq of plan.rows, dk and dv of plan.cols)."""
    qs, ks, vs = pick(q, plan.rows), pick(k, plan.cols), pick(v, plan.cols)
    _count(opts, qs, ks, backward=True)
    return block_backward(qs, ks, vs, pick(out, plan.rows), pick(lse, plan.rows, 2), pick(dout, plan.rows),
                          plan.kind, scale, plan.mask, pick(delta, plan.rows, 2), opts.kernel)


class _Sends:
    """Sends in flight with the tensors they read; all waited before the pass returns (gloo
    aborts unwaited sends)."""

    def __init__(self, ring: "Ring"):
        self._works = []
        self.ring = ring

    def add(self, work, tensor, wait_now: bool, offset: int, what: str):
        if work is None:
            return
        if wait_now:
            _wait(work, what, self.ring, offset)
        else:
            self._works.append((work, tensor, offset, what))

    def wait(self):
        for work, _tensor, offset, what in self._works:
            _wait(work, what, self.ring, offset)
        self._works.clear()


def _wait(work, what: str, ring: "Ring", offset: int):
    """A ring transfer's wait (``comm.waits``): ``what`` and the peer at ``offset`` in the ring."""
    waits.wait(work, f"ring attention {what} (ring position {ring.pos} of {ring.size})", ring.group, ring.peer(offset))


def ring_forward(q, k, v, layout: RingLayout, ring: Ring, scale: float, opts: RingOptions):
    """``(out [rows, b, hq, d] fp32, lse [b, hq, rows] fp32, kept kv pieces)``."""
    n, x = ring.size, ring.pos
    rows, b, hq, d = q.shape
    P = len(layout.pieces)
    out = q.new_zeros(rows, b, hq, d, dtype=torch.float32)
    lse = q.new_full((b, hq, rows), float("-inf"), dtype=torch.float32)
    sends, recvs = _Sends(ring), {}

    def piece_shape(i):
        start, stop = layout.pieces[i]
        return (2, stop - start, *k.shape[1:])

    def post(step: int, i: int, current):
        """Pass piece i of kv_{x-step} to x+1 and receive piece i of kv_{x-step-1} from x-1."""
        if step >= n - 1:
            return
        send = current if layout.travels(ring.at(-step), i) else None
        buf = k.new_empty(piece_shape(i)) if layout.travels(ring.at(-step - 1), i) else None
        s_work, r_work = exchange(ring.group, send=send, dst=ring.peer(1), recv=buf, src=ring.peer(-1),
                                  tag=_tag("cp.kv_forward", step, i, P))
        sends.add(s_work, send, not opts.overlap, 1, f"forward: K/V step {step} piece {i} send")
        if r_work is not None:
            if not opts.overlap:
                _wait(r_work, f"forward: K/V step {step + 1} piece {i} receive", ring, -1)
                r_work = None  # a gloo work waited twice blocks forever: hand on None
            recvs[i] = (r_work, buf)

    held = [None] * P
    if n > 1:
        held = [torch.stack((k[a:b_], v[a:b_])) if layout.travels(x, i) else None
                for i, (a, b_) in enumerate(layout.pieces)]
    if opts.overlap:
        for i in range(P):
            post(0, i, held[i])
    own = layout.own(x)
    if own is not None:
        _attend(q, k, v, own, out, lse, scale, opts)
    for step in range(1, n):
        if not opts.overlap:
            for i in range(P):
                post(step - 1, i, held[i])
        j = ring.at(-step)
        current = [None] * P
        for i in range(P):
            if i in recvs:
                work, buf = recvs.pop(i)
                if work is not None:
                    _wait(work, f"forward: K/V step {step} piece {i} receive", ring, -1)
                current[i] = buf
            if opts.overlap:
                post(step, i, current[i])
            plan = layout.plan(x, j, i)
            if plan is not None:
                _attend(q, current[i][0], current[i][1], plan, out, lse, scale, opts)
        held = current
    sends.wait()
    return out, lse, held


def ring_backward(dout, q, k, v, out, lse, kept, layout: RingLayout, ring: Ring, scale: float, opts: RingOptions):
    """``(dq, dk, dv)`` in fp32 for this position's q, k, v."""
    n, x = ring.size, ring.pos
    P = len(layout.pieces)
    dout = dout.float()
    delta = attention_delta(out, dout)
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
    dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
    sends, kv_in, dkv_in = _Sends(ring), {}, {}

    def piece_shape(i):
        start, stop = layout.pieces[i]
        return (2, stop - start, *k.shape[1:])

    def post_kv(t: int, i: int, current):
        """Pass piece i of kv_{x+t} to x-1, receive piece i of kv_{x+t+1} from x+1."""
        if t >= n - 1:
            return
        send = current if layout.travels(ring.at(t), i) else None
        buf = k.new_empty(piece_shape(i)) if layout.travels(ring.at(t + 1), i) else None
        s_work, r_work = exchange(ring.group, send=send, dst=ring.peer(-1), recv=buf, src=ring.peer(1),
                                  tag=_tag("cp.kv_backward", t, i, P))
        sends.add(s_work, send, not opts.overlap, -1, f"backward: K/V step {t} piece {i} send")
        if r_work is not None:
            if not opts.overlap:
                _wait(r_work, f"backward: K/V step {t + 1} piece {i} receive", ring, 1)
                r_work = None
            kv_in[i] = (r_work, buf)

    def post_dkv_recv(t: int, i: int):
        """Receive from x+1 the running dK/dV sum of piece i of kv_{x+t+1} that it sends at its
        step t (contributors x+1 .. x+t), for our step t+1 (t = n-1: our own block, home)."""
        contributors = [ring.at(c) for c in range(1, t + 1)]
        if layout.active(ring.at(t + 1), i, contributors):
            buf = torch.empty(piece_shape(i), dtype=torch.float32, device=k.device)
            _, r_work = exchange(ring.group, recv=buf, src=ring.peer(1), tag=_tag("cp.dkv", t, i, P))
            dkv_in[(t + 1, i)] = (r_work, buf)

    held = kept
    for t in range(1, n):
        j = ring.at(t)
        if not opts.overlap:
            if t > 1:
                for i in range(P):
                    post_kv(t - 1, i, held[i])
                held = [kv_in.pop(i)[1] if i in kv_in else None for i in range(P)]
            for i in range(P):
                post_dkv_recv(t, i)
        current = list(held) if t == 1 or not opts.overlap else [None] * P
        for i in range(P):
            if opts.overlap and i in kv_in:
                work, buf = kv_in.pop(i)
                _wait(work, f"backward: K/V step {t} piece {i} receive", ring, 1)
                current[i] = buf
            if opts.overlap:
                post_kv(t, i, current[i])
                post_dkv_recv(t, i)
            acc = _piece_grads(q, current[i], out, lse, dout, delta, layout.plan(x, j, i), scale, opts, dq,
                               piece_shape(i))
            if (t, i) in dkv_in:
                work, buf = dkv_in.pop((t, i))
                _wait(work, f"backward: dK/dV step {t} piece {i} receive", ring, 1)
                acc = buf if acc is None else buf.add_(acc)
            if acc is not None:
                s_work, _ = exchange(ring.group, send=acc, dst=ring.peer(-1), tag=_tag("cp.dkv", t, i, P))
                sends.add(s_work, acc, not opts.overlap, -1, f"backward: dK/dV step {t} piece {i} send")
        held = current
    _own_block_and_home(q, k, v, out, lse, dout, delta, layout, ring, scale, opts, dq, dk, dv, dkv_in)
    if kv_in or dkv_in:
        raise RuntimeError(f"ring backward finished with receives never used: {sorted(kv_in)}, {sorted(dkv_in)}")
    sends.wait()
    return dq, dk, dv


def _piece_grads(q, kv, out, lse, dout, delta, plan, scale, opts, dq, shape):
    """Adds the block's dQ into ``dq``; returns its dK/dV ``[2, piece rows, ...]`` (None: no work)."""
    if plan is None:
        return None
    g_q, g_k, g_v = _grads(q, kv[0], kv[1], out, lse, dout, delta, plan, scale, opts)
    _add_at(dq, plan.rows, g_q)
    if isinstance(plan.cols, slice) and plan.cols == slice(None):
        return torch.stack((g_k, g_v))
    acc = torch.zeros(shape, dtype=torch.float32, device=q.device)
    _add_at(acc[0], plan.cols, g_k)
    _add_at(acc[1], plan.cols, g_v)
    return acc


def _own_block_and_home(q, k, v, out, lse, dout, delta, layout, ring, scale, opts, dq, dk, dv, dkv_in):
    """The own block's gradients, and the dK/dV sums of our own K/V that came home (step n)."""
    x, n = ring.pos, ring.size
    own = layout.own(x)
    if own is not None:
        g_q, g_k, g_v = _grads(q, k, v, out, lse, dout, delta, own, scale, opts)
        _add_at(dq, own.rows, g_q)
        _add_at(dk, own.cols, g_k)
        _add_at(dv, own.cols, g_v)
    for i, (a, b_) in enumerate(layout.pieces):
        if (n, i) in dkv_in:
            work, buf = dkv_in.pop((n, i))
            _wait(work, f"backward: dK/dV of the own block piece {i} receive (home)", ring, 1)
            dk[a:b_] += buf[0]
            dv[a:b_] += buf[1]


class RingAttention(torch.autograd.Function):
    """``out [rows, b, hq, d]`` (q's dtype) of ring attention; see the module docstring."""

    @staticmethod
    def forward(ctx, q, k, v, layout: RingLayout, ring: Ring, scale: float, opts: RingOptions):
        out, lse, kept = ring_forward(q, k, v, layout, ring, scale, opts)
        ctx.where = waits.current()  # the layer (and HDP micro-batch) the backward's waits belong to
        ctx.save_for_backward(q, k, v, out, lse, *kept)
        ctx.layout, ctx.ring, ctx.scale, ctx.opts, ctx.pieces = layout, ring, scale, opts, len(kept)
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, *kept = ctx.saved_tensors
        with waits.restored(ctx.where, "backward"):
            dq, dk, dv = ring_backward(dout, q, k, v, out, lse, kept, ctx.layout, ctx.ring, ctx.scale, ctx.opts)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


def ring_attention(q, k, v, layout: RingLayout, ring: Ring, scale: float, opts: Optional[RingOptions] = None):
    """Autograd entry: ``q [rows, b, hq, d]``, ``k, v [rows, b, hk, d]`` of this ring position."""
    if layout.size != ring.size:
        raise ValueError(f"layout for {layout.size} positions on a ring of {ring.size}")
    if q.shape[0] != layout.rows or k.shape[0] != layout.rows:
        raise ValueError(f"layout for {layout.rows} rows per position, got q {tuple(q.shape)}, k {tuple(k.shape)}")
    return RingAttention.apply(q, k, v, layout, ring, scale, opts or RingOptions())
