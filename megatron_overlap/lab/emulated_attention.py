"""Attention whose compute is a wait, for the emulated cluster's long-context runs
(``lab/cp_cluster.py``, ``lab/hdp_cluster.py``): the product's context-parallel code runs
(``cp_attention``: its rings, pieces, all-to-alls, the HDP runtime's rings and packed layouts), but
each block kernel it calls sleeps on the rank's ``ComputeClock`` for the modelled time of the
block and returns zeros of the block's shapes.

    block time   pairs x ms per pair x the block's share of the heads (q's heads / ``heads``)
    pairs        full block: rows x cols; causal (diagonal, square) block: R (R + 1) / 2; a packed
                 (masked) block: the causal same-document pairs of its rows, counted per document
                 (``CountedPackedLayout``), never as a rows x cols mask
    backward     ``bwd_factor`` x the forward's time

Rows may stand for ``row_unit`` modelled tokens each (an unpacked sequence of S tokens emulated
by S / row_unit rows: a zigzag block's rows and columns are slices, so its modelled pairs follow
exactly), and head tensors hold one element per head (head dim 1): the bytes on the link are the
modelled bytes times ``d / (head_dim x row_unit)`` and the link is scaled to match
(``LinkSpec.two_tier``). Times, not numerics: outputs and gradients are zeros.

The lab patches the world, as it may: ``installed`` swaps the block kernels ``cp.ring`` calls, and,
for packed batches, the ``PackedLayout`` and ``PackedSpec`` ``cp_attention`` builds for counting,
caching ones (each micro-batch's masks counted once, not per layer group and pass);
``local_exchanges`` replaces every exchange of ``cp.ring`` and ``cp.a2a`` by a local copy (the
compute replayed with no communication: the limit).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from ..cp.block import CAUSAL, FULL, MASK, NONE, BlockPlan
from ..cp.packed import PackedLayout, PackedSpec, TokenInfo


@dataclass(frozen=True)
class PairCount:
    """A packed block's mask, as a count: the block's causal same-document pairs."""

    pairs: float


class TimedBlocks:
    """The block kernels of one rank: a wait per block (module docstring). ``ms_per_pair``: the
    clock's milliseconds per pair of all ``heads`` in one layer (the modelled rate times the lab's
    time factor); ``layers``: the layers one call stands for (set per call by the caller);
    ``heads``: the query heads a rank holds."""

    def __init__(self, clock, ms_per_pair: float, bwd_factor: float, heads: int, row_unit: int = 1):
        self.clock, self.ms_per_pair, self.bwd_factor = clock, ms_per_pair, bwd_factor
        self.heads, self.row_unit = heads, row_unit
        self.layers = 1

    def pairs(self, q: torch.Tensor, k: torch.Tensor, kind: str, mask) -> float:
        u = self.row_unit
        if kind == NONE:
            return 0.0
        if kind == CAUSAL:
            rows = q.shape[0] * u
            return rows * (rows + 1) / 2
        if kind == FULL:
            return float(q.shape[0] * u) * (k.shape[0] * u)
        if kind == MASK and isinstance(mask, PairCount):
            return mask.pairs
        raise ValueError(f"an emulated block of kind {kind!r} needs a PairCount mask (CountedPackedLayout)")

    def _ms(self, q, k, kind, mask) -> float:
        return self.pairs(q, k, kind, mask) * self.ms_per_pair * self.layers * q.shape[2] / self.heads

    def attention(self, q, k, v, kind, scale, mask=None, kernel="auto"):
        self.clock.run(self._ms(q, k, kind, mask) * 1e-3, "attention")
        sq, b, hq, d = q.shape
        return q.new_zeros(sq, b, hq, d, dtype=torch.float32), q.new_zeros(b, hq, sq, dtype=torch.float32)

    def backward(self, q, k, v, out, lse, dout, kind, scale, mask=None, delta=None, kernel="auto"):
        self.clock.run(self._ms(q, k, kind, mask) * self.bwd_factor * 1e-3, "attention backward")
        return (torch.zeros(q.shape, dtype=torch.float32), torch.zeros(k.shape, dtype=torch.float32),
                torch.zeros(v.shape, dtype=torch.float32))

    @contextlib.contextmanager
    def installed(self, packed: bool = False):
        """``cp.ring``'s block kernels replaced by these waits (and, with ``packed``, the packed
        layout ``cp_attention`` builds by ``CountedPackedLayout``) inside the block."""
        from ..cp import a2a, attention, ring

        saved = [(ring, "block_attention", ring.block_attention), (ring, "block_backward", ring.block_backward)]
        ring.block_attention, ring.block_backward = self.attention, self.backward
        if packed:
            saved += [(attention, "PackedLayout", attention.PackedLayout), (a2a, "PackedLayout", a2a.PackedLayout),
                      (attention, "PackedSpec", attention.PackedSpec)]
            attention.PackedLayout = a2a.PackedLayout = CountedPackedLayout
            attention.PackedSpec = CountedPackedSpec
        try:
            yield self
        finally:
            for module, name, value in reversed(saved):
                setattr(module, name, value)


def causal_doc_pairs(q: TokenInfo, k: TokenInfo) -> float:
    """Pairs (query row, key row) of one document, both real tokens, key position <= query
    position: what ``PackedLayout``'s causal mask keeps, counted per document by sorting."""
    qv, kv = q.valid, k.valid
    if not bool(qv.any()) or not bool(kv.any()):
        return 0.0
    span = int(torch.maximum(q.pos.max(), k.pos.max())) + 2
    qkey = q.doc[qv].long() * span + q.pos[qv].long()
    kkey, _ = (k.doc[kv].long() * span + k.pos[kv].long()).sort()
    upto = torch.searchsorted(kkey, qkey, right=True)
    start = torch.searchsorted(kkey, q.doc[qv].long() * span)
    return float((upto - start).sum())


_CACHE_LIMIT = 4096  # layouts kept (and 16 x as many infos); the cache is emptied when it holds more


def clear_counts() -> None:
    """Forget every kept spec and layout (``CountedPackedSpec``, ``CountedPackedLayout``)."""
    CountedPackedSpec._infos.clear()
    CountedPackedLayout._states.clear()


class CountedPackedSpec(PackedSpec):
    """``PackedSpec`` whose ``info`` is computed once per (documents, CP size, position) and kept:
    every layer group and pass of a micro-batch builds the same spec, and the lab's host must not
    spend its budget recomputing it (the device it emulates would not wait for it either; the
    values are ``PackedSpec``'s own)."""

    _infos: dict = {}

    def info(self, cp_rank: int) -> TokenInfo:
        key = (self.cu.numpy().tobytes(), self.cu_padded.numpy().tobytes(), self.cp_size, cp_rank)
        cache = CountedPackedSpec._infos
        if key not in cache:
            if len(cache) > _CACHE_LIMIT * 16:
                cache.clear()
                CountedPackedLayout._states.clear()  # its keys are the ids of these infos
            cache[key] = super().info(cp_rank)
        return cache[key]


class CountedPackedLayout(PackedLayout):
    """``PackedLayout`` with each block's mask replaced by its pair count (``PairCount``):
    which blocks run and which pieces travel are ``PackedLayout``'s own (``needs``, ``travels``);
    a block is the whole of the rows and columns it is given (the merge then touches every row,
    which costs the host a little and the modelled device nothing). A layout over the same
    ``CountedPackedSpec`` infos (the same objects) shares its state and its blocks' counts with the
    first one built (the host's budget, as ``CountedPackedSpec``)."""

    _states: dict = {}

    def __init__(self, infos: list, causal: bool, docs: int, device, pieces: int = 2):
        key = (tuple(id(info) for info in infos), causal, docs, str(device), pieces)
        cached = CountedPackedLayout._states.get(key)
        if cached is not None and all(a is b for a, b in zip(cached["_infos_src"], infos)):
            self.__dict__.update(cached)
            return
        super().__init__(infos, causal, docs, device, pieces)
        self._pairs = {}
        self._infos_src = list(infos)
        if len(CountedPackedLayout._states) > _CACHE_LIMIT:
            CountedPackedLayout._states.clear()
        CountedPackedLayout._states[key] = dict(self.__dict__)

    def own(self, x: int):
        if ("own", x) not in self._pairs:
            self._pairs[("own", x)] = super().own(x)
        return self._pairs[("own", x)]

    def plan(self, x: int, j: int, i: int):
        if (x, j, i) not in self._pairs:
            self._pairs[(x, j, i)] = super().plan(x, j, i)
        return self._pairs[(x, j, i)]

    def _block(self, q: TokenInfo, k: TokenInfo):
        if not self.causal:
            raise ValueError("the emulated packed layout counts causal attention only")
        pairs = causal_doc_pairs(q, k)
        if pairs == 0:
            return None
        return BlockPlan(slice(None), slice(None), MASK, PairCount(pairs))


class _Done:
    def wait(self, timeout=None):
        return True

    def is_completed(self):
        return True


def local_exchange(group, *, send=None, dst=None, recv=None, src=None, tag=0):
    """``comm.p2p.exchange`` without communication: what arrives is this rank's own send (same
    shape), or zeros (the dK/dV sums: their values change no wait)."""
    if recv is not None:
        recv.copy_(send) if send is not None and send.shape == recv.shape else recv.zero_()
    return (_Done() if send is not None else None), (_Done() if recv is not None else None)


@contextlib.contextmanager
def local_exchanges():
    """Every exchange of ``cp.ring`` and ``cp.a2a`` a local copy inside the block (the replay)."""
    from ..cp import a2a, ring

    saved = (ring.exchange, a2a.exchange)
    ring.exchange = a2a.exchange = local_exchange
    try:
        yield
    finally:
        ring.exchange, a2a.exchange = saved
