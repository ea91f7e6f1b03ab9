"""The ``--hdp`` runtime: one step's global batch, planned by the scheduler, run on real ranks.

Per step, on every rank of one process group G (Megatron's data-parallel group with CP = 1, or
WORLD), R = |G| ranks::

    1. lengths     each rank brings its own samples (what its data iterator loaded); the ranks
                   all-gather only their lengths (and each sample's loss-mask sum, for the global
                   token count): two small collectives. Global sample id = position in
                   (rank 0's samples, rank 1's, ...).
    2. plan        every rank runs the same deterministic scheduler (``schedule_hdp``, or the
                   ``static`` baseline) on the same lengths: the same ``Plan`` everywhere, with
                   no further agreement needed.
    3. exchange    the plan says which token rows each rank holds (whole short sequences, zigzag
                   shards of long ones, ``Shard.ranges``). Rows a rank needs from a sample another
                   rank loaded travel in ONE ``all_to_all_single`` of int64 triples (token, label,
                   loss-mask bits), in an order both sides derive from the plan, so no index
                   travels with them. Every rank knows the whole traffic matrix, so a step where
                   nothing moves skips the collective on all ranks. (Design choice: each rank
                   reads only its own samples, as Megatron's data iterators already do, instead of
                   every rank reading a shared dataset by global id; the sample exchange costs
                   3 x 8 bytes per moved token, negligible next to the activations.)
    4. micro-batches  per rank, its non-idle micro-batches in plan order (``MicroBatch``): token
                   rows, labels, loss mask, the TRUE position of every row in its sequence, and the
                   ring (ordered group ranks; a ring of one rank, ``(me,)``, for a micro-batch of
                   short sequences held whole) with its THD ``PackedSeqParams``.

Attention. ``MicroBatch.context(model)`` enters ``cp.context.ring(G, ring, packed)``: the
patched Megatron ``DotProductAttention.forward`` (``megatron_overlap.install`` with ``--hdp``)
then runs ``cp_attention(mode="ring")`` over that explicit rank list inside G; no process group
is ever created per ring or per step. A micro-batch's rows are, per document, chunks x and
2n-1-x of the document padded to a multiple of 2n (n = ring size, x = this rank's position;
n = 1: the document whole, unpadded): exactly ``Shard.ranges`` plus padding, which the runtime
checks. Ring peers must agree on the document order: documents are sorted by sequence id.

The model sees a plain ``[T, 1]`` sequence (``packed_seq_params=None``, no attention mask): the
document structure reaches attention only through the ring context, whose ``PackedSeqParams``
describe the documents as the ring holds them (``cu_seqlens_q`` real lengths,
``cu_seqlens_q_padded`` padded to 2n), which Megatron's own THD code could not be given here
(its RoPE would split the local rows by the ring-wide offsets).

Positions. ``position_ids`` are the true positions (learned absolute embeddings read them).
RoPE: Megatron builds ``rotary_pos_emb`` for positions 0..S-1 and rotates row i by entry i, so
for a shard, whose rows sit at positions x c .. and (2n-1-x) c .., that would be wrong.
``context(model)`` puts a forward pre-hook and hook on the model's ``RotaryEmbedding``: it is
asked for ``max(position) + 1`` positions and its output is then gathered at each row's true
position, ``emb[pos[i]]``, so Megatron's unfused ``apply_rotary_pos_emb`` (sbhd: row i gets
``emb[i]``) rotates every row exactly as the whole sequence would. Padding rows get position 0
(their outputs are never seen and their loss weight is 0). YaRN and multimodal RoPE (other
output shapes) and multi-latent attention are refused.

Loss. Each rank sums its tokens' losses, weighted by the loss mask, and divides by the GLOBAL
token count N = sum of every sample's loss mask (from step 1, no extra collective)::

    L_r = sum_{t on r} m_t l_t / N          sum_r L_r = (1/N) sum_t m_t l_t  (the global mean)

Gradients are then SUMMED over G (``reduce_gradients``; with Megatron's DDP:
``calculate_per_token_loss=True``, whose gradient scaling is 1, i.e. a sum), so they equal the
gradient of one process computing the mean over all tokens of the batch. Averaging instead of
summing, or dividing by each rank's own token count, would weight ranks by 1/R or 1/N_r: not DP's
gradient, since ranks hold different token counts. N = 0 (every token masked) divides by 1.

Micro-batch order. Peers of a ring hold it at the same slot and two ranks meet their shared
rings in the same order (``Plan.validate``); every rank runs forward then backward of slot k
before slot k+1 (``forward_backward``), so ring traffic pairs up and cannot deadlock. Idle
slots are skipped (a peer that reaches a ring early waits in its receive).

Megatron's training loop: ``HdpDataIterator`` gives a loop what it needs. ``start_step()``
plans the next step and returns this rank's micro-batch count (it differs between ranks; a
rank without work gets one fully masked one-token micro-batch, since Megatron's schedules
always run at least one); ``next()`` yields Megatron-style batch dicts; ``forward_step`` is a
``forward_step_func`` for ``calculate_per_token_loss=True`` (its loss function returns
``(loss sum, token count, report)``; Megatron divides the summed gradients by the all-reduced
count, which is N). Its context covers the forward only, so activation recomputation, which
re-runs the forward inside the backward, is refused there (``forward_backward`` keeps the
context entered through the backward and allows it).
"""

from __future__ import annotations

import contextlib
import time
import weakref
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ..errors import OverlapConfigError
from .plan import Plan
from .scheduler import CAPACITY_FLAG, MODES
from .shard import Shard

SCHEDULERS = ("hdp", "static")
_MASK_DTYPE = torch.float32


# ------------------------------------------------------------------------------------- samples
@dataclass(frozen=True)
class Sample:
    """One sequence as its rank loaded it: ``tokens``, ``labels`` (next tokens) and
    ``loss_mask`` (per-token loss weights, usually 0/1), all 1-D of the sequence's length."""

    tokens: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor

    def __post_init__(self):
        shapes = {tuple(t.shape) for t in (self.tokens, self.labels, self.loss_mask)}
        if len(shapes) != 1 or self.tokens.dim() != 1:
            raise ValueError(f"a sample's tokens, labels and loss_mask must be 1-D of one length, got shapes "
                             f"{[tuple(t.shape) for t in (self.tokens, self.labels, self.loss_mask)]}")

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def rows(self) -> torch.Tensor:
        """``[L, 3]`` int64: token, label, loss-mask bits (fp32 bit pattern, exact)."""
        bits = self.loss_mask.to(_MASK_DTYPE).contiguous().view(torch.int32).long()
        return torch.stack((self.tokens.long(), self.labels.long(), bits), dim=1)


def _sample(tokens, labels, loss_mask=None) -> Sample:
    tokens, labels = torch.as_tensor(tokens).reshape(-1), torch.as_tensor(labels).reshape(-1)
    mask = torch.ones(tokens.shape, dtype=_MASK_DTYPE) if loss_mask is None else torch.as_tensor(loss_mask).reshape(-1)
    return Sample(tokens.cpu(), labels.cpu(), mask.to(_MASK_DTYPE).cpu())


def as_samples(item) -> List[Sample]:
    """This rank's share of the global batch as ``Sample`` s. Accepted: a list of ``Sample``, of
    dicts (``tokens``, ``labels``, optional ``loss_mask``, 1-D) or of (tokens, labels[, mask])
    tuples; or a Megatron batch dict: ``tokens``/``labels``/``loss_mask`` ``[b, s]`` with each row
    one sample, or ``[1, T]`` / ``[T]`` packed documents with ``cu_seqlens`` (entries < 0, the
    padding of Megatron's fixed-size ``cu_seqlens``, are dropped)."""
    if isinstance(item, dict):
        tokens, labels, mask = item["tokens"], item["labels"], item.get("loss_mask")
        cu = item.get("cu_seqlens")
        if cu is not None:
            cu = torch.as_tensor(cu).reshape(-1).long().cpu()
            cu = cu[cu >= 0]
            flat = [t.reshape(-1) if t is not None else None for t in (tokens, labels, mask)]
            bounds = cu.tolist()
            if bounds[0] != 0 or bounds[-1] != flat[0].numel() or any(b <= a for a, b in zip(bounds, bounds[1:])):
                raise ValueError(f"cu_seqlens {bounds} do not cut the {flat[0].numel()} packed tokens into non-empty "
                                 f"documents")
            return [_sample(flat[0][a:b], flat[1][a:b], None if flat[2] is None else flat[2][a:b])
                    for a, b in zip(bounds, bounds[1:])]
        tokens = torch.as_tensor(tokens)
        if tokens.dim() == 1:
            return [_sample(tokens, labels, mask)]
        return [_sample(tokens[i], labels[i], None if mask is None else mask[i]) for i in range(tokens.shape[0])]
    out = []
    for s in item:
        if isinstance(s, Sample):
            out.append(s)
        elif isinstance(s, dict):
            out.append(_sample(s["tokens"], s["labels"], s.get("loss_mask")))
        else:
            out.append(_sample(*s))
    return out


# ----------------------------------------------------------------------------- micro-batches
def doc_order(mb: Sequence[Shard]) -> Tuple[Shard, ...]:
    """The documents of a micro-batch in the order its rows hold them: by sequence id, so every
    peer of a ring builds the same ``cu_seqlens``."""
    return tuple(sorted(mb, key=lambda s: s.seq_id))


@dataclass(frozen=True)
class RowLayout:
    """Which rows rank ``rank`` holds in one micro-batch (pure function of the plan).

    ``ring``: ordered group ranks of the attention ring, ``(rank,)`` for documents held whole;
    ``position`` = index of ``rank`` in it. ``cu_seqlens`` / ``cu_seqlens_padded``: the
    documents' real and padded offsets as the whole ring holds them (padded to 2n; unpadded at
    n = 1). Per local row: ``doc`` (index into ``seq_ids``), ``pos`` (position in the document,
    padding included) and ``valid`` (a real token)."""

    index: int
    ring: Tuple[int, ...]
    position: int
    seq_ids: Tuple[int, ...]
    seq_lens: Tuple[int, ...]
    cu_seqlens: torch.Tensor
    cu_seqlens_padded: torch.Tensor
    doc: torch.Tensor
    pos: torch.Tensor
    valid: torch.Tensor

    @property
    def rows(self) -> int:
        return self.doc.numel()


def _arange_ranges(ranges) -> torch.Tensor:
    """The positions of ``[start, stop)`` ranges, in order (empty: a shard of padding only, e.g. a
    3-token sequence on a static ring of 4)."""
    parts = [torch.arange(a, b) for a, b in ranges]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


def row_layout(mb: Sequence[Shard], index: int, rank: int) -> RowLayout:
    """The rows of micro-batch ``index`` of ``rank``, checked against the plan's ``Shard`` s
    (rows = ``Shard.rows``, real positions = ``Shard.ranges``)."""
    from ..cp.packed import pad_cu_seqlens, partition_index

    ring = Plan.ring_of(mb)
    if ring and any(not s.ring for s in mb):
        raise ValueError(f"rank {rank} micro-batch {index}: sequences held whole and shards of ring {ring} in one "
                         f"micro-batch; a micro-batch runs one attention ring")
    docs = doc_order(mb)
    if ring:
        positions = {s.position for s in docs}
        if len(positions) != 1 or ring[positions.pop()] != rank:
            raise ValueError(f"rank {rank} micro-batch {index}: not one position on ring {ring}")
    n = len(ring) or 1
    position = docs[0].position if ring else 0
    lens = [s.seq_len for s in docs]
    cu = torch.tensor([0] + lens, dtype=torch.int64).cumsum(0).to(torch.int32)
    cu_pad = pad_cu_seqlens(cu, n)
    rows = partition_index(cu_pad, n, position)
    cup = cu_pad.long()
    doc = torch.searchsorted(cup, rows, right=True) - 1
    pos = rows - cup[doc]
    valid = pos < torch.tensor(lens, dtype=torch.long)[doc]
    if rows.numel() != sum(s.rows for s in docs):
        raise RuntimeError(f"rank {rank} micro-batch {index}: {rows.numel()} rows laid out, the plan counts "
                           f"{sum(s.rows for s in docs)}")
    for i, s in enumerate(docs):
        want = _arange_ranges(s.ranges)
        got = pos[(doc == i) & valid]
        if not torch.equal(got, want):
            raise RuntimeError(f"rank {rank} micro-batch {index}: rows of sequence {s.seq_id} at positions "
                               f"{got.tolist()}, the plan's ranges are {list(s.ranges)}")
    return RowLayout(index, tuple(ring) if ring else (rank,), position, tuple(s.seq_id for s in docs),
                     tuple(lens), cu, cu_pad, doc, pos, valid)


@dataclass
class MicroBatch:
    """One micro-batch of this rank, ready for the model (``[T]`` tensors on the model's device;
    T = rows incl. padding). ``packed_seq_params`` is the ring's THD view for the attention
    context, not for the model (module docstring)."""

    layout: RowLayout
    group: dist.ProcessGroup
    tokens: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    position_ids: torch.Tensor
    packed_seq_params: object

    @property
    def index(self) -> int:
        return self.layout.index

    @property
    def ring(self) -> Tuple[int, ...]:
        return self.layout.ring

    @property
    def num_tokens(self) -> torch.Tensor:
        """Loss-weighted tokens of this micro-batch."""
        return self.loss_mask.sum()

    @contextlib.contextmanager
    def context(self, model=None):
        """Attention over this micro-batch's ring and, with ``model``, RoPE at the true positions
        (module docstring). Keep it entered through the forward (and the backward when
        activations are recomputed)."""
        from ..cp import context as ring_context

        _require_installed()
        with ring_context.ring(self.group, self.layout.ring, packed=self.packed_seq_params):
            if model is None:
                yield
            else:
                real = self.layout.pos[self.layout.valid]
                with true_positions(model, self.position_ids, int(real.max()) + 1 if real.numel() else 1):
                    yield

    def batch(self) -> dict:
        """Megatron-style batch dict (``[1, T]`` tensors) plus this micro-batch (``hdp``)."""
        return dict(tokens=self.tokens[None], labels=self.labels[None], loss_mask=self.loss_mask[None],
                    position_ids=self.position_ids[None], attention_mask=None,
                    packed_seq_params=self.packed_seq_params, hdp=self)


def _packed_params(layout: RowLayout):
    from megatron.core.packed_seq_params import PackedSeqParams

    longest = max(layout.seq_lens)
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=layout.cu_seqlens, cu_seqlens_kv=layout.cu_seqlens,
                           cu_seqlens_q_padded=layout.cu_seqlens_padded, cu_seqlens_kv_padded=layout.cu_seqlens_padded,
                           max_seqlen_q=longest, max_seqlen_kv=longest)


@dataclass
class HdpStep:
    """One planned step on this rank: the plan, this rank's micro-batches in order, and the
    global token count N (the loss divisor)."""

    plan: Plan
    rank: int
    group: dist.ProcessGroup
    microbatches: List[MicroBatch]
    seq_lens: Tuple[int, ...]
    token_weights: Tuple[float, ...]
    owners: Tuple[Tuple[int, int], ...]  # global id -> (rank that loaded it, its index there)
    moved_tokens: int  # tokens that crossed ranks in the exchange (all ranks together)

    @property
    def num_microbatches(self) -> int:
        return len(self.microbatches)

    @property
    def global_tokens(self) -> float:
        """N: loss-weighted tokens of the whole global batch."""
        return float(sum(self.token_weights))

    @property
    def loss_denominator(self) -> float:
        return self.global_tokens if self.global_tokens > 0 else 1.0


# ----------------------------------------------------------------------------------- RoPE
def _unwrap(model):
    while hasattr(model, "module") and isinstance(getattr(model, "module"), torch.nn.Module):
        model = model.module
    return model


def _rotary_modules(model) -> list:
    from megatron.core.models.common.embeddings.rotary_pos_embedding import (
        MultimodalRotaryEmbedding,
        RotaryEmbedding,
    )

    found = []
    for m in model.modules():
        if isinstance(m, MultimodalRotaryEmbedding) or (isinstance(m, RotaryEmbedding) and type(m) is not RotaryEmbedding):
            raise OverlapConfigError(
                "--position-embedding-type",
                f"--hdp gives each row its true position for plain RoPE (rope) or learned absolute positions; "
                f"{type(m).__name__} is not supported. Use --position-embedding-type rope or learned_absolute")
        if isinstance(m, RotaryEmbedding):
            found.append(m)
    return found


@contextlib.contextmanager
def true_positions(model, position_ids: torch.Tensor, positions: Optional[int] = None):
    """While entered, the model's ``RotaryEmbedding`` returns one entry per row, at the row's
    true position (``emb[position_ids[i]]``) instead of positions 0..S-1. ``positions``: how
    many positions to build (max + 1; read from ``position_ids`` when not given, a device sync)."""
    modules = _rotary_modules(model)
    if not modules:
        yield
        return
    pos = position_ids.reshape(-1).long()
    need = positions if positions is not None else (int(pos.max()) + 1 if pos.numel() else 1)

    def pre(module, args, kwargs):
        if "max_seq_len" in kwargs:
            kwargs = dict(kwargs, max_seq_len=need)
        else:
            args = (need,) + tuple(args[1:])
        offset = kwargs.get("offset", args[1] if len(args) > 1 else 0)
        if offset:
            raise OverlapConfigError("--hdp", f"rotary embeddings with an offset ({offset}) are inference-only")
        return args, kwargs

    def post(module, args, kwargs, output):
        return output.index_select(0, pos.to(output.device))

    handles = []
    try:
        for m in modules:
            handles.append(m.register_forward_pre_hook(pre, with_kwargs=True))
            handles.append(m.register_forward_hook(post, with_kwargs=True))
        yield
    finally:
        for h in handles:
            h.remove()


# ------------------------------------------------------------------------------- checks
def _require_installed():
    from ..patch import active_config

    config = active_config()
    if config is None or not config.hdp:
        raise OverlapConfigError(
            "--hdp", "the HDP runtime needs the patched attention: call megatron_overlap.install(args) with --hdp "
            "first (without it Megatron's attention would treat a ring shard's rows as a whole sequence)")


_checked: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> recompute_allowed it passed


def check_model(model, recompute_allowed: bool = True) -> None:
    """Refuse model settings the runtime cannot run exactly (clear errors naming the flag).
    Remembered per model object (the checks walk its modules)."""
    passed = _checked.get(model)  # False: passed the strict check, which covers the lenient one
    if passed is not None and (passed is False or passed == recompute_allowed):
        return
    _check_model(model, recompute_allowed)
    _checked[model] = recompute_allowed


def _check_model(model, recompute_allowed: bool) -> None:
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    inner = _unwrap(model)
    config = getattr(inner, "config", None)
    if config is not None:
        if getattr(config, "tensor_model_parallel_size", 1) > 1:
            raise OverlapConfigError(
                "--tensor-model-parallel-size", "the --hdp runtime runs with tensor-parallel size 1 so far (its rings "
                "are over the data-parallel group of one TP rank, untested with TP > 1); use TP 1")
        if getattr(config, "context_parallel_size", 1) > 1:
            raise OverlapConfigError("--context-parallel-size", "--hdp picks each sequence's ring itself; set 1")
        if getattr(config, "multi_latent_attention", False):
            raise OverlapConfigError("--hdp", "multi-latent attention applies RoPE its own way; not supported")
        if getattr(config, "attention_dropout", 0.0):
            raise OverlapConfigError("--attention-dropout", "--hdp ring attention runs without attention dropout; "
                                     f"got {config.attention_dropout}. Set --attention-dropout 0")
        if getattr(config, "softmax_type", "vanilla") != "vanilla" or getattr(config, "window_size", None):
            raise OverlapConfigError("--hdp", "ring attention supports the vanilla softmax without a sliding window")
        if not recompute_allowed and getattr(config, "recompute_granularity", None):
            raise OverlapConfigError(
                "--recompute-granularity", "the HDP forward step enters the ring context for the forward only, and "
                "recomputation re-runs the forward in the backward; use hdp.runtime.forward_backward (context "
                "kept through the backward) or drop activation recomputation")
    kind = getattr(inner, "position_embedding_type", None)
    if kind not in (None, "rope", "learned_absolute", "none"):
        raise OverlapConfigError(
            "--position-embedding-type", f"--hdp supports rope and learned_absolute positions, got {kind!r}")
    _rotary_modules(inner)
    if not any(isinstance(m, DotProductAttention) for m in inner.modules()):
        raise OverlapConfigError(
            "--transformer-impl", "--hdp runs its rings through Megatron's local DotProductAttention; the model has "
            "none (Transformer Engine?). Pass --transformer-impl local")


def default_group() -> dist.ProcessGroup:
    """Megatron's data-parallel group when its parallel state is up (CP must be 1), else WORLD."""
    try:
        from megatron.core import parallel_state
    except ImportError:
        return dist.group.WORLD
    if not parallel_state.model_parallel_is_initialized():
        return dist.group.WORLD
    if parallel_state.get_context_parallel_world_size() > 1:
        raise OverlapConfigError("--context-parallel-size", "--hdp merges DP and CP into one group; set CP to 1")
    return parallel_state.get_data_parallel_group(with_context_parallel=True)


# ------------------------------------------------------------------------------- runtime
class HdpRuntime:
    """Plans and loads steps for one process group (module docstring).

    ``capacity_tokens``: C of ``--hdp-max-tokens-per-rank``; ``mode``: ``--hdp-mode`` (dp, pp);
    ``scheduler``: ``hdp`` or ``static`` (the fixed-CP baseline, for comparisons);
    ``device``: where micro-batch tensors go (default: the current CUDA device under NCCL, else
    CPU)."""

    def __init__(self, capacity_tokens: int, group: Optional[dist.ProcessGroup] = None, mode: str = "dp",
                 scheduler: str = "hdp", cost=None, device=None):
        if scheduler not in SCHEDULERS:
            raise ValueError(f"the HDP runtime runs the {' or '.join(SCHEDULERS)} scheduler, not {scheduler!r}")
        if mode not in MODES:
            raise OverlapConfigError("--hdp-mode", f"unknown mode {mode!r}; choose dp or pp")
        if isinstance(capacity_tokens, bool) or not isinstance(capacity_tokens, int) or capacity_tokens <= 0:
            raise OverlapConfigError(CAPACITY_FLAG, f"must be a positive number of tokens, got {capacity_tokens!r}")
        self.capacity_tokens, self.mode, self.scheduler, self.cost = capacity_tokens, mode, scheduler, cost
        self.group = group if group is not None else default_group()
        self.rank, self.size = dist.get_rank(self.group), dist.get_world_size(self.group)
        if device is None:
            device = (torch.device("cuda", torch.cuda.current_device())
                      if dist.get_backend(self.group) == "nccl" else torch.device("cpu"))
        self.device = torch.device(device)

    @classmethod
    def from_config(cls, config=None, group=None, **kwargs) -> "HdpRuntime":
        """From the installed plugin's config (or ``config``): C and the mode of ``--hdp``."""
        from ..patch import active_config

        config = config or active_config()
        if config is None or not config.hdp:
            raise OverlapConfigError("--hdp", "no --hdp config: install megatron_overlap with --hdp first")
        return cls(config.hdp_max_tokens, group=group, mode=config.hdp_mode, **kwargs)

    # -- steps ---------------------------------------------------------------------------------
    def plan(self, seq_lens: Sequence[int]) -> Plan:
        """The plan of a global batch (deterministic: the same on every rank)."""
        from . import schedule

        kwargs = {"mode": self.mode} if self.scheduler == "hdp" else {}
        return schedule(self.scheduler, list(seq_lens), self.size, self.capacity_tokens, self.cost, **kwargs)

    def gather_lengths(self, samples: Sequence[Sample]):
        """All-gather (length, loss-mask sum) of every rank's samples. Returns (lengths, weights,
        owners) in global-id order."""
        dev = self._comm_device()
        count = torch.tensor([len(samples)], dtype=torch.int64, device=dev)
        counts = [torch.empty_like(count) for _ in range(self.size)]
        dist.all_gather(counts, count, group=self.group)
        counts = [int(c.item()) for c in counts]
        width = max(1, max(counts))
        mine = torch.zeros(width, 2, dtype=torch.float64)
        for i, s in enumerate(samples):
            mine[i, 0], mine[i, 1] = len(s), float(s.loss_mask.double().sum())
        mine = mine.to(dev)
        parts = [torch.empty_like(mine) for _ in range(self.size)]
        dist.all_gather(parts, mine, group=self.group)
        lens, weights, owners = [], [], []
        for r, (part, c) in enumerate(zip(parts, counts)):
            part = part.cpu()
            for i in range(c):
                lens.append(int(part[i, 0]))
                weights.append(float(part[i, 1]))
                owners.append((r, i))
        return tuple(lens), tuple(weights), tuple(owners)

    def step(self, item) -> HdpStep:
        """Plan one step from this rank's samples (``as_samples`` formats) and load this rank's
        micro-batches. Collective: every rank of the group calls it."""
        samples = as_samples(item)
        lens, weights, owners = self.gather_lengths(samples)
        plan = self.plan(lens)
        if any(p for ph in plan.phases for p in ph):
            raise ValueError("the HDP runtime runs plans of one phase (no barriers between groups of micro-batches)")
        layouts = [row_layout(mb, k, self.rank) for k, mb in enumerate(plan.microbatches[self.rank]) if mb]
        data, moved = self._exchange(plan, samples, owners)
        mbs = [self._microbatch(layout, rows) for layout, rows in zip(layouts, data)]
        return HdpStep(plan, self.rank, self.group, mbs, lens, weights, owners, moved)

    # -- internals -----------------------------------------------------------------------------
    def _comm_device(self) -> torch.device:
        return self.device if dist.get_backend(self.group) == "nccl" else torch.device("cpu")

    @staticmethod
    def _needs(plan: Plan, rank: int) -> List[Tuple[int, Tuple[Tuple[int, int], ...]]]:
        """(seq id, token ranges) that ``rank`` holds, in its canonical order: micro-batches in
        plan order, documents by ``doc_order``, ranges ascending (= the row order)."""
        return [(s.seq_id, s.ranges) for mb in plan.microbatches[rank] if mb for s in doc_order(mb)]

    def _exchange(self, plan: Plan, samples: Sequence[Sample], owners) -> Tuple[List[List[torch.Tensor]], int]:
        """Rows of every document this rank holds, ``[real tokens, 3]`` int64 per document, per
        micro-batch; and the number of tokens that crossed ranks (module docstring, step 3)."""
        me, R = self.rank, self.size
        needs = [self._needs(plan, r) for r in range(R)]
        traffic = [[0] * R for _ in range(R)]  # traffic[src][dst] rows
        for r in range(R):
            for sid, ranges in needs[r]:
                traffic[owners[sid][0]][r] += sum(b - a for a, b in ranges)
        moved = sum(traffic[s][d] for s in range(R) for d in range(R) if s != d)
        local_rows = [s.rows() for s in samples]
        if moved:
            send = []
            for r in range(R):
                for sid, ranges in needs[r]:
                    owner, i = owners[sid]
                    if owner == me:
                        send.extend(local_rows[i][a:b] for a, b in ranges)
            dev = self._comm_device()
            send_buf = (torch.cat(send) if send else torch.zeros(0, 3, dtype=torch.int64)).to(dev)
            recv_buf = torch.empty(sum(traffic[s][me] for s in range(R)), 3, dtype=torch.int64, device=dev)
            dist.all_to_all_single(recv_buf.view(-1), send_buf.view(-1),
                                   output_split_sizes=[3 * traffic[s][me] for s in range(R)],
                                   input_split_sizes=[3 * traffic[me][d] for d in range(R)], group=self.group)
            recv_buf = recv_buf.cpu()
            offsets, acc = [], 0
            for s in range(R):
                offsets.append(acc)
                acc += traffic[s][me]
        out: List[List[torch.Tensor]] = []
        for mb in plan.microbatches[me]:
            if not mb:
                continue
            docs = []
            for s in doc_order(mb):
                owner, i = owners[s.seq_id]
                if not moved:
                    rows = local_rows[i][_arange_ranges(s.ranges)]
                else:
                    take = s.tokens
                    rows = recv_buf[offsets[owner]:offsets[owner] + take]
                    offsets[owner] += take
                docs.append(rows)
            out.append(docs)
        return out, moved

    def _microbatch(self, layout: RowLayout, docs: List[torch.Tensor]) -> MicroBatch:
        T = layout.rows
        data = torch.zeros(T, 3, dtype=torch.int64)
        for i, rows in enumerate(docs):
            where = ((layout.doc == i) & layout.valid).nonzero().squeeze(1)
            data[where] = rows
        mask = data[:, 2].to(torch.int32).view(_MASK_DTYPE).clone()
        positions = torch.where(layout.valid, layout.pos, torch.zeros_like(layout.pos))
        dev = self.device
        return MicroBatch(layout, self.group, data[:, 0].to(dev), data[:, 1].to(dev), mask.to(dev),
                          positions.to(dev), _packed_params(layout))


# ------------------------------------------------------------------------ training helpers
def default_forward(model, mb: MicroBatch) -> torch.Tensor:
    """A Megatron ``GPTModel`` forward on one micro-batch: per-token losses ``[T]``."""
    out = model(input_ids=mb.tokens[None], position_ids=mb.position_ids[None], attention_mask=None,
                labels=mb.labels[None])
    return out.reshape(-1)


@dataclass
class StepResult:
    """``loss``: this rank's share of the global mean loss (sum it over the group, ``reduce_loss``);
    per micro-batch wall and thread-CPU seconds of forward + backward."""

    loss: torch.Tensor
    wall_s: List[float] = field(default_factory=list)
    cpu_s: List[float] = field(default_factory=list)


def forward_backward(model, step: HdpStep, forward: Callable = default_forward, loss_scale: float = 1.0,
                     check: bool = True, sync_timing: bool = False) -> StepResult:
    """Forward and backward of every micro-batch of this rank, in plan order, each inside its
    ring context: ``sum(m_t l_t) / N`` per micro-batch (module docstring). Gradients accumulate
    in ``.grad``; ``reduce_gradients`` sums them over the group afterwards. ``forward(model, mb)``
    returns per-token losses ``[T]``. On a GPU the per-micro-batch times are host-side launch
    times unless ``sync_timing`` (a device synchronisation after each micro-batch)."""
    if check:
        check_model(model)
    total = torch.zeros((), dtype=torch.float64, device=step.microbatches[0].tokens.device
                        if step.microbatches else "cpu")
    result = StepResult(total)
    for mb in step.microbatches:
        wall, cpu = time.perf_counter(), time.thread_time()
        with mb.context(model):
            losses = forward(model, mb)
            loss = (losses.float().reshape(-1) * mb.loss_mask).sum() / step.loss_denominator
            (loss * loss_scale).backward()
        if sync_timing and mb.tokens.is_cuda:
            torch.cuda.synchronize()
        result.wall_s.append(time.perf_counter() - wall)
        result.cpu_s.append(time.thread_time() - cpu)
        total += loss.detach().double()
    result.loss = total.cpu()
    return result


def reduce_loss(local: torch.Tensor, group: dist.ProcessGroup) -> float:
    """The global mean loss: the sum over the group of each rank's ``StepResult.loss``."""
    t = local.detach().double().reshape(1).clone()
    dist.all_reduce(t, group=group)
    return float(t.item())


def reduce_gradients(model_or_params, group: dist.ProcessGroup) -> None:
    """SUM every parameter's ``.grad`` over ``group`` (one flat all-reduce; a parameter without a
    gradient counts as zeros, so ranks that never touched it still take part)."""
    params = [p for p in (model_or_params.parameters() if isinstance(model_or_params, torch.nn.Module)
                          else model_or_params) if p.requires_grad]
    if any(getattr(p, "main_grad", None) is not None and p.grad is None for p in params):
        raise ValueError("these parameters keep their gradients in main_grad (Megatron's DDP): let DDP sum them, "
                         "with calculate_per_token_loss=True in the model config (gradient scaling 1)")
    if not params:
        return
    flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])
    dist.all_reduce(flat, group=group)
    offset = 0
    for p in params:
        n = p.numel()
        p.grad = flat[offset:offset + n].view_as(p).clone()
        offset += n


# --------------------------------------------------------------------- Megatron-style loop
class HdpDataIterator:
    """Wraps a data iterator that yields, per step, this rank's samples (``as_samples``
    formats). ``start_step()`` plans the next step (collective) and returns this rank's number of
    micro-batches for the schedule; then ``next()`` yields them as Megatron batch dicts, each with
    ``hdp`` (the ``MicroBatch``) for ``forward_step``."""

    def __init__(self, data_iterator: Iterable, runtime: HdpRuntime):
        self._source: Iterator = iter(data_iterator)
        self.runtime = runtime
        self.current: Optional[HdpStep] = None
        self._queue: List[dict] = []

    def start_step(self) -> int:
        if self._queue:
            raise RuntimeError(f"start_step() with {len(self._queue)} micro-batches of the previous step unused: "
                               f"the schedule must run every micro-batch start_step() counted")
        self.current = self.runtime.step(next(self._source))
        self._queue = [mb.batch() for mb in self.current.microbatches]
        if not self._queue:
            self._queue = [self._idle_microbatch().batch()]
        for b in self._queue:
            b["global_tokens"] = self.current.global_tokens
        return len(self._queue)

    def _idle_microbatch(self) -> MicroBatch:
        """One masked token on this rank alone: Megatron's schedules run at least one forward."""
        rt = self.runtime
        one = torch.ones(1, dtype=torch.int32)
        layout = RowLayout(-1, (rt.rank,), 0, (-1,), (1,), torch.tensor([0, 1], dtype=torch.int32),
                           torch.tensor([0, 1], dtype=torch.int32), torch.zeros(1, dtype=torch.long),
                           torch.zeros(1, dtype=torch.long), one.bool())
        zeros = torch.zeros(1, dtype=torch.long, device=rt.device)
        return MicroBatch(layout, rt.group, zeros, zeros.clone(), torch.zeros(1, dtype=_MASK_DTYPE, device=rt.device),
                          zeros.clone(), _packed_params(layout))

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        if not self._queue:
            raise RuntimeError("no HDP micro-batch left: call start_step() before each step's schedule and run "
                               "exactly the number of micro-batches it returned")
        return self._queue.pop(0)


def per_token_loss(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Megatron's ``calculate_per_token_loss`` contract: (loss sum, token count, report)."""
    losses = output_tensor.float().reshape(-1)
    mask = loss_mask.reshape(-1).float()
    total = (losses * mask).sum()
    count = mask.sum().round().to(torch.int)
    return total, count, {"lm loss": torch.stack([total.detach(), mask.sum().detach()])}


def forward_step(data_iterator, model):
    """A ``forward_step_func`` for Megatron's schedules with ``calculate_per_token_loss=True``:
    the forward inside the micro-batch's ring context; returns (per-token losses, loss func)."""
    import functools

    batch = next(data_iterator)
    mb: MicroBatch = batch["hdp"]
    check_model(model, recompute_allowed=False)
    with mb.context(model):
        output = model(input_ids=batch["tokens"], position_ids=batch["position_ids"], attention_mask=None,
                       labels=batch["labels"])
    return output, functools.partial(per_token_loss, batch["loss_mask"])
