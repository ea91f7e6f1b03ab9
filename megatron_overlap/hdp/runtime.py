"""The ``--overlap-hdp`` runtime: one step's full batch, planned by the scheduler, run on real ranks.

Per step, on every rank of one process group G (Megatron's data-parallel group with CP = 1, or
WORLD), R = |G| ranks::

    1. lengths     each rank brings its own samples (what its data iterator loaded); the ranks
                   all-gather only their lengths (and each sample's loss-mask sum, for the total
                   token count): two small collectives. Global sample id = position in
                   (rank 0's samples, rank 1's, ...).
    2. plan        every rank runs the same deterministic scheduler (``schedule_hdp``, or the
                   ``static`` baseline) on the same lengths and loading ranks: the same ``Plan``
                   everywhere, with no further agreement needed; hdp keeps sequences on the rank
                   that loaded them where the step allows.
    3. exchange    rows a rank needs from a sample another rank loaded travel in one
                   ``all_to_all_single`` (``exchange.py``; rows per rank: ``layout.py``).
    4. micro-batches  per rank, its non-idle micro-batches in plan order (``MicroBatch``; with
                   ``mode="pp"`` every slot, the idle ones masked, so a pipeline runs one count): token
                   rows, labels, loss mask, the TRUE position of every row in its sequence, and the
                   ring (ordered group ranks; a ring of one rank, ``(me,)``, for a micro-batch of
                   short sequences held whole) with its THD ``PackedSeqParams``.

Attention. ``MicroBatch.context(model)`` enters ``cp.ring_context.ring(G, ring, packed)``: the
patched Megatron ``DotProductAttention.forward`` (``megatron_overlap.install`` with ``--overlap-hdp``)
then runs ``cp_attention(mode="ring")`` over that explicit rank list inside G; no process group
is ever created per ring or per step (``integration.hdp.make_runtime`` makes G itself once: a
communicator of HDP's own over the data-parallel ranks, so that Megatron's overlapped gradient
reductions on the data-parallel group never queue with the rings). Activation recomputation
re-runs a forward inside the backward in the ring its first run saw (``cp.ring_context.keep``, put
into Megatron's checkpoints by the installation). A micro-batch's rows are, per document, chunks x and
2n-1-x of the document padded to a multiple of 2n (n = ring size, x = this rank's position;
n = 1: the document whole, unpadded): exactly ``Shard.ranges`` plus padding, which the runtime
checks. Ring peers must agree on the document order: documents are sorted by sequence id.

The model sees a plain ``[T, 1]`` sequence (``packed_seq_params=None``, no attention mask): the
document structure reaches attention only through the ring context, whose ``PackedSeqParams``
describe the documents as the ring holds them (``cu_seqlens_q`` real lengths,
``cu_seqlens_q_padded`` padded to 2n), which Megatron's own THD code could not be given here
(its RoPE would split the local rows by the ring-wide offsets).

Positions. ``position_ids`` are the true positions (learned absolute embeddings read them).
RoPE needs every row rotated at its true position, which Megatron's rotary embedding does not
know for a shard: the model adapter (``integration.hdp``) hooks it while ``context(model)`` is
entered. Padding rows get position 0 (their outputs are never seen and their loss weight is 0).

The model adapter. The runtime knows no Megatron: what it needs of the model comes from an
adapter object (``integration.hdp.MegatronModel`` for Megatron's GPT): ``check(model)`` refuses
models it cannot run exactly, ``positions(model, position_ids,
count)`` is the true-position context, ``require_patched()`` refuses to run while the patched
attention is not installed, ``packed_params(layout)`` is the ring's THD view for attention.

Loss. Each rank sums its tokens' losses, weighted by the loss mask, and divides by the TOTAL
token count N = sum of every sample's loss mask (from step 1, no extra collective)::

    L_r = sum_{t on r} m_t l_t / N          sum_r L_r = (1/N) sum_t m_t l_t  (the mean over all tokens)

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
count, which is N). Its context covers the forward only; a forward that activation
recomputation re-runs inside the backward runs in the ring Megatron's checkpoint captured with
it (Attention, above).
"""

from __future__ import annotations

import contextlib
import functools
import time
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ..comm.agree import group_device
from ..errors import OverlapConfigError
from .exchange import exchange_rows, gather_lengths
from .layout import RowLayout, idle_layout, row_layout
from .step_plan import Plan
from .planahead import HdpDataIterator, Planner  # noqa: F401 (HdpDataIterator: the loop's view, re-exported)
from .samples import MASK_DTYPE, as_samples
from .scheduler import MODES

SCHEDULERS = ("hdp", "static")


@dataclass
class MicroBatch:
    """One micro-batch of this rank, ready for the model (``[T]`` tensors on the model's device;
    T = rows incl. padding). ``packed_seq_params`` is the ring's THD view for the attention
    context, not for the model (module docstring)."""

    layout: RowLayout
    group: dist.ProcessGroup
    adapter: object
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
        (module docstring), for the forward (a recomputed forward keeps the ring it ran in)."""
        from ..comm import waits
        from ..cp import ring_context

        self.adapter.require_patched()
        label = f"HDP micro-batch {self.index}" + (f" (ring {list(self.ring)})" if len(self.ring) > 1 else "")
        with ring_context.ring(self.group, self.layout.ring, packed=self.packed_seq_params), waits.at(label):
            if model is None:
                yield
            else:
                real = self.layout.pos[self.layout.valid]
                with self.adapter.positions(model, self.position_ids, int(real.max()) + 1 if real.numel() else 1):
                    yield

    def batch(self) -> dict:
        """Megatron-style batch dict (``[1, T]`` tensors) plus this micro-batch (``hdp``)."""
        return dict(tokens=self.tokens[None], labels=self.labels[None], loss_mask=self.loss_mask[None],
                    position_ids=self.position_ids[None], attention_mask=None,
                    packed_seq_params=self.packed_seq_params, hdp=self)


@dataclass(frozen=True)
class Gathered:
    """What the lengths all-gather gives every rank: the batch's lengths, loss weights and, per
    sample, (the rank that loaded it, its index there)."""

    seq_lens: Tuple[int, ...]
    weights: Tuple[float, ...]
    owners: Tuple[Tuple[int, int], ...]

    @property
    def home(self) -> List[int]:
        return [rank for rank, _ in self.owners]


@dataclass
class HdpStep:
    """One planned step on this rank: the plan, this rank's micro-batches in order, and the
    total token count N (the loss divisor)."""

    plan: Plan
    rank: int
    group: dist.ProcessGroup
    adapter: object
    microbatches: List[MicroBatch]
    seq_lens: Tuple[int, ...]
    token_weights: Tuple[float, ...]
    owners: Tuple[Tuple[int, int], ...]  # sample id -> (rank that loaded it, its index there)
    moved_tokens: int  # tokens that crossed ranks in the exchange (all ranks together)

    @property
    def num_microbatches(self) -> int:
        return len(self.microbatches)

    @property
    def global_tokens(self) -> float:
        """N: loss-weighted tokens of the whole full batch."""
        return float(sum(self.token_weights))

    @property
    def loss_denominator(self) -> float:
        return self.global_tokens if self.global_tokens > 0 else 1.0


class HdpRuntime:
    """Plans and loads steps for one process group (module docstring).

    ``capacity_tokens``: C of ``--overlap-hdp-max-tokens-per-rank``; ``mode``: ``dp`` (whole steps
    balanced) or ``pp`` (the same micro-batch count on every rank, for a pipeline);
    ``scheduler``: ``hdp`` or ``static`` (the fixed-CP baseline, for comparisons);
    ``adapter``: the model adapter (module docstring); ``device``: where micro-batch tensors go
    (default: the current CUDA device under NCCL, else CPU); ``row_multiple``: every micro-batch's
    rows padded to a multiple of it (the TP size under sequence parallelism: each HDP "rank" is
    then a TP group, its TP ranks holding the same samples and running the same plan); ``stages``:
    mode ``pp``'s pipeline stages, what its plans are scored for (``pp_timeline``). ``integration.hdp.make_runtime``
    builds one from the config of ``--overlap-hdp`` for Megatron's model and groups."""

    def __init__(self, capacity_tokens: int, group: dist.ProcessGroup, adapter, mode: str = "dp",
                 scheduler: str = "hdp", cost=None, device=None, row_multiple: int = 1, timeout_s=None, peer=None,
                 stages=None):
        if scheduler not in SCHEDULERS:
            raise ValueError(f"the HDP runtime runs the {' or '.join(SCHEDULERS)} scheduler, not {scheduler!r}")
        if mode not in MODES:
            raise ValueError(f"the HDP runtime plans in mode dp or pp, not {mode!r}")
        if isinstance(capacity_tokens, bool) or not isinstance(capacity_tokens, int) or capacity_tokens <= 0:
            raise OverlapConfigError("hdp.max_tokens", f"must be a positive number of tokens, got {capacity_tokens!r}")
        if isinstance(row_multiple, bool) or not isinstance(row_multiple, int) or row_multiple < 1:
            raise ValueError(f"row_multiple must be a positive integer, got {row_multiple!r}")
        self.capacity_tokens, self.mode, self.scheduler, self.cost = capacity_tokens, mode, scheduler, cost
        self.row_multiple = row_multiple
        self.timeout_s = timeout_s  # comm.timeout_s: bounds the step's exchange (the rings: the attention's)
        self.group, self.adapter = group, adapter
        self.rank, self.size = dist.get_rank(self.group), dist.get_world_size(self.group)
        self.planner = Planner(scheduler, self.size, capacity_tokens, mode, cost, peer, stages)
        if device is None:
            device = group_device(self.group)
        self.device = torch.device(device)

    # -- steps ---------------------------------------------------------------------------------
    def plan(self, seq_lens: Sequence[int], home: Optional[Sequence[int]] = None) -> Plan:
        """The plan of a full batch (deterministic: the same on every rank). ``home``: per
        sequence, the group rank that loaded it (the hdp scheduler keeps sequences there where
        the step allows). With a ``peer``, guarded (``planahead.Planner``)."""
        return self.planner(seq_lens, home)

    def step(self, item) -> HdpStep:
        """Plan one step from this rank's samples (``as_samples`` formats) and load this rank's
        micro-batches. Collective: every rank of the group calls it."""
        samples = as_samples(item)
        gathered = self.gather(samples)
        return self.load(samples, gathered, self.plan(gathered.seq_lens, home=gathered.home))

    def gather(self, samples) -> "Gathered":
        """Step part 1 (collective): every sample's length, loss weight and loading rank."""
        from ..comm import waits

        with waits.at("HDP step", timeout_s=self.timeout_s):
            lens, weights, owners = gather_lengths(samples, self.group)
        return Gathered(lens, weights, owners)

    def load(self, samples, gathered: "Gathered", plan: Plan) -> HdpStep:
        """Step part 3 (collective): the row exchange of ``plan`` and this rank's micro-batches."""
        from ..comm import waits

        if any(p for ph in plan.phases for p in ph):
            raise ValueError("the HDP runtime runs plans of one phase (no barriers between groups of micro-batches)")
        slots = plan.microbatches[self.rank]
        layouts = [row_layout(mb, k, self.rank, self.row_multiple) for k, mb in enumerate(slots) if mb]
        with waits.at("HDP step", timeout_s=self.timeout_s):
            data, moved = exchange_rows(plan, samples, gathered.owners, self.group)
        mbs = [self._microbatch(layout, rows) for layout, rows in zip(layouts, data)]
        if self.mode == "pp":  # a pipeline runs a fixed count: every slot, the empty ones as masked micro-batches
            work = iter(mbs)
            mbs = [next(work) if mb else self.idle_microbatch() for mb in slots]
        return HdpStep(plan, self.rank, self.group, self.adapter, mbs, gathered.seq_lens, gathered.weights,
                       gathered.owners, moved)

    def microbatch(self, layout: RowLayout, data: torch.Tensor) -> "MicroBatch":
        """The micro-batch of ``layout`` with its rows' ``data [T, 3]`` (token, label, mask bits)."""
        mask = data[:, 2].to(torch.int32).view(MASK_DTYPE).clone()
        positions = torch.where(layout.valid, layout.pos, torch.zeros_like(layout.pos))
        dev = self.device
        return MicroBatch(layout, self.group, self.adapter, data[:, 0].to(dev), data[:, 1].to(dev), mask.to(dev),
                          positions.to(dev), self.adapter.packed_params(layout))

    def idle_microbatch(self) -> "MicroBatch":
        """``row_multiple`` masked tokens on this rank alone (``layout.idle_layout``)."""
        return self.microbatch(idle_layout(self.rank, self.row_multiple),
                               torch.zeros(self.row_multiple, 3, dtype=torch.int64))

    def _microbatch(self, layout: RowLayout, docs: List[torch.Tensor]) -> "MicroBatch":
        data = torch.zeros(layout.rows, 3, dtype=torch.int64)
        for i, rows in enumerate(docs):
            where = ((layout.doc == i) & layout.valid).nonzero().squeeze(1)
            data[where] = rows
        return self.microbatch(layout, data)


# ------------------------------------------------------------------------ training helpers
def default_forward(model, mb: MicroBatch) -> torch.Tensor:
    """A Megatron ``GPTModel`` forward on one micro-batch: per-token losses ``[T]``."""
    out = model(input_ids=mb.tokens[None], position_ids=mb.position_ids[None], attention_mask=None,
                labels=mb.labels[None])
    return out.reshape(-1)


@dataclass
class StepResult:
    """``loss``: this rank's share of the mean loss over all tokens (sum it over the group, ``reduce_loss``);
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
        step.adapter.check(model)
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
    """The mean loss over all tokens: the sum over the group of each rank's ``StepResult.loss``."""
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
    batch = next(data_iterator)
    mb: MicroBatch = batch["hdp"]
    mb.adapter.check(model)
    with mb.context(model):
        output = model(input_ids=batch["tokens"], position_ids=batch["position_ids"], attention_mask=None,
                       labels=batch["labels"])
    return output, functools.partial(per_token_loss, batch["loss_mask"])
