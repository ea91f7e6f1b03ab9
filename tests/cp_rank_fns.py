"""Context-parallel attention functions the tests run on every rank of the pool (module-level, so
the pool can import them by name). Every rank of a CP group draws the same full-sequence
inputs, computes single-rank full attention as the reference, and compares its own rows."""

from __future__ import annotations

import itertools

import torch
import torch.distributed as dist

from .rank_helpers import GROUPS, tp_group as _cp_group  # groups made once per process

HQ, HK, D, B = 8, 2, 24, 2
DOCS = (5, 17, 1, 23)  # packed document lengths, none a multiple of 2 x CP


def _megatron_slice(x: torch.Tensor, group) -> torch.Tensor:
    """This CP rank's rows of ``x [S, ...]`` exactly as Megatron slices a batch (sequence on
    dim 1 there, so transpose around it)."""
    from megatron.core.utils import get_batch_on_this_cp_rank

    batch = {"x": x.transpose(0, 1).contiguous()}
    return get_batch_on_this_cp_rank(batch, cp_group=group)["x"].transpose(0, 1)


def _sq(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    a, b = a.double(), b.double()
    return torch.stack([(a - b).pow(2).sum(), b.pow(2).sum()])


def _full_inputs(seed: int, rows: int, hq: int, hk: int, batch=B):
    gen = torch.Generator().manual_seed(seed)
    shape_q, shape_kv = (rows, batch, hq, D), (rows, batch, hk, D)
    return (torch.randn(shape_q, generator=gen), torch.randn(shape_kv, generator=gen),
            torch.randn(shape_kv, generator=gen), torch.randn(shape_q, generator=gen))


def _reference(q, k, v, dout, causal, cu_seqlens=None):
    from megatron_overlap.cp import reference_attention

    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = reference_attention(q, k, v, causal=causal, cu_seqlens=cu_seqlens)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def unpacked_case(group, seed, mode, causal, seq, hq=HQ, hk=HK, a2a_size=None, ranks=None, slicer=None, **kw):
    """One mode on one configuration: this rank's squared error and squared reference norms
    ``[4, 2]`` for out, dq, dk, dv (``_finish`` adds them over the group)."""
    from megatron_overlap.cp import cp_attention

    q, k, v, dout = _full_inputs(seed, seq, hq, hk)
    ref = _reference(q, k, v, dout, causal)
    cut = slicer or (lambda t: _megatron_slice(t, group))
    local = [cut(t).clone().requires_grad_() for t in (q, k, v)]
    out = cp_attention(*local, mode=mode, causal=causal, group=group, ranks=ranks, a2a_size=a2a_size, **kw)
    rows = local[0].shape[0]
    out.backward(cut(dout).reshape(rows, B, hq * D))
    parts = torch.stack([
        _sq(out.detach().reshape(rows, B, hq, D), cut(ref[0])),
        _sq(local[0].grad, cut(ref[1])),
        _sq(local[1].grad, cut(ref[2])),
        _sq(local[2].grad, cut(ref[3])),
    ])
    return parts


def _finish(rows, parts_list, group):
    """All-reduce every case's squared sums in one call and attach the relative errors."""
    parts = torch.stack(parts_list)
    dist.all_reduce(parts, group=group)
    rel = (parts[..., 0].sqrt() / parts[..., 1].sqrt()).tolist()
    for row, r in zip(rows, rel):
        row.update(out=r[0], dq=r[1], dk=r[2], dv=r[3])
    return rows


def parity_unpacked(seed: int) -> list[dict]:
    """Every mode, CP 2 and 4, causal and not, sequence 48 and 96, GQA; plus the ring with the
    SDPA (CPU flash) kernel, with traffic not overlapped, and with 2 pieces per half."""
    from megatron_overlap.cp import zigzag_slice

    rows_out = []
    for cp in (2, 4):
        group = _cp_group(cp)
        me = dist.get_rank(group)
        rows, parts = [], []
        probe = torch.randn(96, B, 3)
        assert torch.equal(zigzag_slice(probe, cp, me), _megatron_slice(probe, group)), "zigzag_slice != Megatron"
        cases = [("ring", HK, None), ("a2a", HK if cp == 2 else 4, None), ("hybrid", HK, 2)]
        for (mode, hk, u), causal, seq in itertools.product(cases, (True, False), (48, 96)):
            case_seed = seed * 1000 + len(rows) * 7 + cp
            rows.append(dict(cp=cp, mode=mode, hk=hk, a2a_size=u, causal=causal, seq=seq))
            parts.append(unpacked_case(group, case_seed, mode, causal, seq, hk=hk, a2a_size=u))
        for extra in (dict(kernel="sdpa"), dict(overlap=False)):
            for causal in (True, False):
                rows.append(dict(cp=cp, mode="ring", hk=HK, causal=causal, seq=96, **extra))
                parts.append(unpacked_case(group, seed + len(rows), "ring", causal, 96, **extra))
        rows_out += _finish(rows, parts, group)
    return rows_out


def ring_pieces_parity(seed: int) -> list[dict]:
    """The ring with key blocks travelling in 2 and 3 pieces per half (the layouts' piece logic)."""
    from megatron_overlap.cp.layout import ZigzagLayout
    from megatron_overlap.cp.ring import Ring, RingOptions, ring_attention

    group = _cp_group(4)
    rows, parts = [], []
    for pph, causal, overlap in itertools.product((2, 3), (True, False), (True, False)):
        q, k, v, dout = _full_inputs(seed + len(rows), 96, HQ, HK)
        ref = _reference(q, k, v, dout, causal)
        cut = lambda t: _megatron_slice(t, group)  # noqa: E731
        local = [cut(t).clone().requires_grad_() for t in (q, k, v)]
        layout = ZigzagLayout(4, local[0].shape[0], causal, pieces_per_half=pph)
        out = ring_attention(*local, layout, Ring(group, range(4)), D ** -0.5, RingOptions(overlap=overlap))
        out.backward(cut(dout))
        parts.append(torch.stack([_sq(out.detach(), cut(ref[0])), _sq(local[0].grad, cut(ref[1])),
                                  _sq(local[1].grad, cut(ref[2])), _sq(local[2].grad, cut(ref[3]))]))
        rows.append(dict(pieces_per_half=pph, causal=causal, overlap=overlap))
    return _finish(rows, parts, group)


def packed_case(group, seed, mode, causal, hq=HQ, hk=HK, a2a_size=None, ranks=None, three_d=True, docs=DOCS) -> tuple:
    """Packed THD batch: documents padded to multiples of 2 x CP, NaN in the padding of q, k, v
    (any read of it would poison the result), large values in the padding of dout."""
    from megatron.core.packed_seq_params import PackedSeqParams

    from megatron_overlap.cp import cp_attention, pad_cu_seqlens, pad_packed, partition_index, real_index

    n = len(ranks) if ranks is not None else dist.get_world_size(group)
    pos = (list(ranks).index(dist.get_rank(group)) if ranks is not None else dist.get_rank(group))
    total = sum(docs)
    cu = torch.tensor([0, *itertools.accumulate(docs)], dtype=torch.int32)
    gen = torch.Generator().manual_seed(seed)
    q, k, v, dout = (torch.randn(total, h, D, generator=gen) for h in (hq, hk, hk, hq))
    ref = _reference(q, k, v, dout, causal, cu_seqlens=cu)
    cu_pad = pad_cu_seqlens(cu, n)
    rows = partition_index(cu_pad, n, pos)
    padded = [pad_packed(t, cu, cu_pad, fill=float("nan")) for t in (q, k, v)]
    dout_pad = pad_packed(dout, cu, cu_pad, fill=1e3)
    local = [t.index_select(0, rows) for t in padded]
    if not three_d:
        local = [t.unsqueeze(1) for t in local]
    local = [t.clone().requires_grad_() for t in local]
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu_pad,
                             cu_seqlens_kv_padded=cu_pad, max_seqlen_q=int(max(docs)), max_seqlen_kv=int(max(docs)))
    out = cp_attention(*local, mode=mode, causal=causal, group=group, ranks=ranks, packed=params, a2a_size=a2a_size)
    t = rows.numel()
    out.backward(dout_pad.index_select(0, rows).reshape(out.shape))
    real_of = torch.full((int(cu_pad[-1]),), -1, dtype=torch.long)
    real_of[real_index(cu, cu_pad)] = torch.arange(total)
    mine = real_of[rows]
    valid = mine >= 0
    got = [out.detach().reshape(t, hq, D)] + [x.grad.reshape(t, -1, D) for x in local]
    want = list(ref)
    parts = torch.stack([_sq(g[valid], w[mine[valid]]) for g, w in zip(got, want)])
    pad_clean = all(bool(torch.isfinite(g).all()) and bool((g[~valid] == 0).all()) for g in got)
    return parts, pad_clean, tuple(out.shape)


def parity_packed(seed: int) -> list[dict]:
    """Packed documents of lengths DOCS, every mode, CP 2 and 4, causal and not."""
    result = []
    for cp in (2, 4):
        group = _cp_group(cp)
        rows, parts = [], []
        cases = [("ring", HK, None), ("a2a", HK if cp == 2 else 4, None), ("hybrid", HK, 2)]
        for (mode, hk, u), causal in itertools.product(cases, (True, False)):
            three_d = len(rows) % 2 == 0
            p, clean, shape = packed_case(group, seed * 100 + len(rows), mode, causal, hk=hk, a2a_size=u,
                                          three_d=three_d)
            rows.append(dict(cp=cp, mode=mode, hk=hk, causal=causal, pad_clean=clean, out_shape=shape,
                             three_d=three_d))
            parts.append(p)
        result += _finish(rows, parts, group)
    return result


def causal_work(seq: int) -> dict:
    """Score elements each rank computes in a causal ring at CP 4 (forward and backward)."""
    from megatron_overlap.cp import BlockWork, cp_attention

    group = _cp_group(4)
    rows = seq // 4
    work = BlockWork()
    q, k, v = (torch.randn(rows, B, h, D, requires_grad=True) for h in (HQ, HK, HK))
    out = cp_attention(q, k, v, mode="ring", causal=True, group=group, work=work)
    out.sum().backward()
    return dict(forward=work.forward_elements, backward=work.backward_elements, blocks=work.forward_blocks)


def explicit_peer_order(seed: int) -> dict:
    """A 3-rank ring over ranks [2, 0, 3] of the 4-rank parent group; rank 1 sits out."""
    from megatron_overlap.cp import cp_attention, zigzag_slice

    parent = _cp_group(4)
    ranks = [2, 0, 3]
    # only to add up the errors of the three ranks; every rank must create every group, in order
    if "ring[2,0,3]" not in GROUPS:
        GROUPS["ring[2,0,3]"] = dist.new_group(ranks)
    ring_group = GROUPS["ring[2,0,3]"]
    me = dist.get_rank(parent)
    if me not in ranks:
        q = torch.randn(16, B, HQ, D)
        try:
            cp_attention(q, q[:, :, :HK], q[:, :, :HK], mode="ring", causal=True, group=parent, ranks=ranks)
        except ValueError as err:
            return {"idle": True, "error": str(err)}
        return {"idle": True, "error": None}
    pos = ranks.index(me)
    cut = lambda t: zigzag_slice(t, 3, pos)  # noqa: E731
    rows, parts = [], []
    for causal in (True, False):
        rows.append(dict(mode="ring", causal=causal))
        parts.append(unpacked_case(parent, seed + len(rows), "ring", causal, 48, ranks=ranks, slicer=cut))
        rows.append(dict(mode="a2a", causal=causal, heads=(6, 3)))
        parts.append(unpacked_case(parent, seed + len(rows), "a2a", causal, 48, hq=6, hk=3, ranks=ranks, slicer=cut))
        p, clean, _ = packed_case(parent, seed + len(rows), "ring", causal, ranks=ranks)
        rows.append(dict(mode="ring-packed", causal=causal, pad_clean=clean))
        parts.append(p)
    return {"idle": False, "rows": _finish(rows, parts, ring_group)}


def config_errors() -> dict:
    """Each refused configuration on a live CP group of 4: (flag, message)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    from megatron_overlap.cp import cp_attention
    from megatron_overlap.errors import OverlapConfigError

    group = _cp_group(4)
    out = {}

    def attempt(name, q, k, **kw):
        try:
            cp_attention(q, k, k.clone(), group=group, **kw)
        except OverlapConfigError as err:
            out[name] = (err.flag, str(err))
        else:
            out[name] = None

    q, kv2, kv4 = torch.randn(24, B, HQ, D), torch.randn(24, B, 2, D), torch.randn(24, B, 4, D)
    attempt("a2a_gqa", q, kv2, mode="a2a", causal=True)
    attempt("hybrid_size", q, kv4, mode="hybrid", causal=True, a2a_size=3)
    attempt("hybrid_missing", q, kv4, mode="hybrid", causal=True)
    attempt("hybrid_heads", q, kv2, mode="hybrid", causal=True, a2a_size=4)
    # 25 rows per rank: S = 100, not a multiple of 2 x CP = 8
    attempt("seq_length", torch.randn(25, B, HQ, D), torch.randn(25, B, 2, D), mode="ring", causal=True)
    attempt("mode", q, kv2, mode="ulysses", causal=True)
    cu = torch.tensor([0, 5, 22], dtype=torch.int32)
    bad = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu)  # no padding to 2 x CP
    attempt("packed_unpadded", torch.randn(6, HQ, D), torch.randn(6, HK, D), mode="ring", causal=True, packed=bad)
    return out


# --------------------------------------------------------------------------- tiny GPT under CP
def _install(flags):
    import megatron_overlap

    megatron_overlap.uninstall()
    if flags:
        megatron_overlap.install(megatron_overlap.overlap_parser().parse_args(flags))


def gpt_losses_cp(tp: int, cp: int, steps: int, flags: list) -> list:
    """The tiny GPT (GQA 8/2, RoPE) trained with TP=tp, CP=cp, DP=4/(tp*cp); the batch of each
    CP rank cut by Megatron's own get_batch_on_this_cp_rank (tiny_gpt.batch)."""
    from megatron_overlap.lab import tiny_gpt

    _install(flags)
    try:
        return tiny_gpt.train(tiny_gpt.TinyGPT(), tp=tp, steps=steps, cp=cp)
    finally:
        _install([])


def cp_layer_errors() -> dict:
    """What building Megatron's local attention with CP=2 says: stock (Megatron's assertion),
    the plugin installed for TP only (our error naming --overlap-cp), and --overlap-cp a2a with
    heads that do not divide (8 query / 2 KV heads at CP=4: error naming ring)."""
    from megatron_overlap.errors import OverlapConfigError
    from megatron_overlap.lab import tiny_gpt

    out = {}
    for name, cp, flags in (("stock", 2, []), ("tp_only", 2, ["--overlap-tp", "p2p"]),
                            ("a2a_heads", 4, ["--overlap-cp", "a2a"])):
        tiny_gpt.init_parallel(1, cp=cp)
        _install(flags)
        try:
            tiny_gpt.build(tiny_gpt.TinyGPT(), 1, context_parallel_size=cp)
            out[name] = None
        except OverlapConfigError as err:
            out[name] = ("plugin", err.flag, str(err))
        except AssertionError as err:
            out[name] = ("megatron", None, str(err))
        finally:
            _install([])
    tiny_gpt.init_parallel(1)
    return out
