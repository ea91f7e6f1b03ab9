"""A Megatron model whose compute is a wait: one pipeline stage of the emulated cluster.

Each block of ``pp.work.BlockWork`` (the embedding, a transformer layer, the output layer)
becomes a module whose forward, input-gradient (B) and weight-gradient (W) ops sleep for the
block's modelled times on the rank's ``ComputeClock`` (no core held), and whose tensors have
the modelled sizes times one factor (``scale``): every parameter tensor (so Megatron DDP's
buckets, the distributed optimizer's shards and their reduce-scatters and all-gathers carry
the modelled bytes x ``scale``) and the activation handed to the next stage. The emulated link
is scaled by the same factor, so every transfer takes the modelled time.

The math is real and cheap, so stock and ours can be compared for equal losses: a layer half
maps ``x -> x * w`` with ``w`` the first ``HIDDEN`` elements of its parameter (the rest of it
takes part in no math: its gradient is zero, its bytes move all the same); the embedding looks
tokens up in a small table, the output layer scores a small vocabulary with cross-entropy. Weight gradients follow Megatron's gradient-accumulation fusion
(``main_grad``, a dummy returned, ``grad_added_to_main_grad``), so a split schedule defers them
through the installation's weight-gradient store as it defers a real linear's
(``tp/wgrad_store.py``), one task per parameter, W's time spread over them by size.

Memory, as the pipeline's validator counts it (``pp/validate.py``), counted as the blocks run
(``Device.live``): each layer block holds its share of one micro-batch's activations on the
stage from its forward to its backward, and ``W_SHARE`` of that share until its weight
gradient ran; the peak, in micro-batches, times the cost model's activation bytes of one
micro-batch is the peak activation memory the benchmark reports.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Sequence

import torch

from ..pp.work import BlockWork
from .compute_clock import ComputeClock

HIDDEN = 64  # the width of the emulated activations (their bytes set the row count)
VOCAB = 128  # the emulated vocabulary (the tables' modelled sizes are carried by their parameters)
W_SHARE = 0.5  # of a micro-batch's activations a pending W keeps (pp/validate.py's default)


@dataclass(frozen=True)
class EmulatedShape:
    """The emulated tensors of one stage: ``rows`` x ``micro_batch`` x ``HIDDEN`` activations
    (bf16) for ``act_bytes`` x ``scale`` bytes on the wire."""

    rows: int
    micro_batch: int
    scale: float

    @staticmethod
    def for_bytes(act_bytes: float, micro_batch: int, scale: float) -> "EmulatedShape":
        rows = max(1, round(act_bytes * scale / (2 * HIDDEN * micro_batch)))
        return EmulatedShape(rows, micro_batch, scale)

    @property
    def act_elements(self) -> int:
        return self.rows * self.micro_batch * HIDDEN


def scaled(n: int, scale: float, at_least: int = 1) -> int:
    return max(at_least, int(round(n * scale)))


class Device:
    """What a stage's blocks share: the rank's clock, the weight-gradient store of the plugin's
    installation while one is installed (set per step by the driver; None: stock), and the
    activations held (in micro-batches of this stage, module docstring)."""

    def __init__(self, clock: ComputeClock):
        self.clock = clock
        self.store = None
        self.live = 0.0
        self.peak = 0.0

    def hold(self, amount: float) -> None:
        self.live += amount
        if self.live > self.peak:
            self.peak = self.live

    def reset_memory(self) -> None:
        self.live = self.peak = 0.0


def _dummy(weight: torch.Tensor) -> torch.Tensor:
    """What a linear with gradient-accumulation fusion returns for its weight (as ``tp/wgrad.py``
    and Megatron: an uninitialised tensor, ``grad_added_to_main_grad`` set for DDP's hook)."""
    weight.grad_added_to_main_grad = True
    return torch.empty(weight.shape, dtype=weight.dtype)


def _weight_grads(weights, grad_fn, w_s: float, device: Device, nbytes: int, held: float = 0.0):
    """The W of one block: one task per weight (the backward's order, the last weight first),
    the first weight's ``main_grad`` slice accumulated from ``grad_fn()``; deferred to the
    store's W where a split schedule holds it, else run now. ``held``: the activations (in
    micro-batches) the block keeps until its W ran."""
    store, clock = device.store, device.clock
    total = sum(w.numel() for w in weights) or 1
    grads = [None] * len(weights)
    for k in reversed(range(len(weights))):
        weight = weights[k]
        share = w_s * weight.numel() / total

        def task(weight=weight, share=share, first=k == 0):
            clock.run(share, "W")
            if first:
                g = grad_fn()
                weight.main_grad.view(-1)[: g.numel()].add_(g.view(-1).to(weight.main_grad.dtype))
                device.hold(-held)

        if store is not None:
            store.push(weight, task, nbytes if k == 0 else 0)
        else:
            with torch.no_grad():
                task()
        grads[k] = _dummy(weight)
    return tuple(grads)


class _Layer(torch.autograd.Function):
    """``y = x * w`` with the block's F, B and W as waits."""

    @staticmethod
    def forward(ctx, x, block, device, share, *weights):
        device.clock.run(block.f_ms * 1e-3, "F")
        device.hold(share)
        w = weights[0].view(-1)[:HIDDEN]
        ctx.save_for_backward(x)
        ctx.block, ctx.device, ctx.weights, ctx.share = block, device, weights, share
        return x * w

    @staticmethod
    def backward(ctx, dy):
        (x,) = ctx.saved_tensors
        block, device, weights, share = ctx.block, ctx.device, ctx.weights, ctx.share
        device.clock.run(block.b_ms * 1e-3, "B")
        w = weights[0].view(-1)[:HIDDEN]
        dx = dy * w
        kept = W_SHARE * share if device.store is not None else 0.0
        device.hold(kept - share)

        def grad_w():
            return (dy.float() * x.float()).sum(dim=(0, 1))

        nbytes = x.untyped_storage().nbytes() + dy.untyped_storage().nbytes()
        return (dx, None, None, None) + _weight_grads(weights, grad_w, block.w_ms * 1e-3, device, nbytes, kept)


class _Embedding(torch.autograd.Function):
    """Token lookup in a ``VOCAB`` x ``HIDDEN`` table held in the first parameter."""

    @staticmethod
    def forward(ctx, tokens, block, device, dtype, *weights):
        device.clock.run(block.f_ms * 1e-3, "F")
        table = weights[0].view(-1)[: VOCAB * HIDDEN].view(VOCAB, HIDDEN)
        ctx.save_for_backward(tokens)
        ctx.block, ctx.device, ctx.weights = block, device, weights
        return table[tokens].transpose(0, 1).contiguous().to(dtype)  # [s, b, h], as Megatron's

    @staticmethod
    def backward(ctx, dy):
        (tokens,) = ctx.saved_tensors
        block, device, weights = ctx.block, ctx.device, ctx.weights
        device.clock.run(block.b_ms * 1e-3, "B")
        dyf = dy.float().transpose(0, 1).reshape(-1, HIDDEN)

        def grad_table():
            g = torch.zeros(VOCAB, HIDDEN)
            g.index_add_(0, tokens.reshape(-1), dyf)
            return g

        nbytes = dy.untyped_storage().nbytes()
        return (None, None, None, None) + _weight_grads(weights, grad_table, block.w_ms * 1e-3, device, nbytes)


class _Head(torch.autograd.Function):
    """Per-token cross-entropy over ``VOCAB`` classes scored against the second parameter."""

    @staticmethod
    def forward(ctx, x, labels, block, device, *weights):
        device.clock.run(block.f_ms * 1e-3, "F")
        table = weights[-1].view(-1)[: VOCAB * HIDDEN].view(VOCAB, HIDDEN).float()
        x2 = x.float().transpose(0, 1).reshape(-1, HIDDEN)  # [b * s, h]
        logits = x2 @ table.t() / math.sqrt(HIDDEN)
        logp = torch.log_softmax(logits, dim=-1)
        flat = labels.reshape(-1)
        losses = -logp.gather(1, flat.unsqueeze(1)).squeeze(1)
        ctx.save_for_backward(x, logp, flat)
        ctx.block, ctx.device, ctx.weights = block, device, weights
        return losses.view(labels.shape)  # [b, s], as Megatron's

    @staticmethod
    def backward(ctx, dloss):
        x, logp, flat = ctx.saved_tensors
        block, device, weights = ctx.block, ctx.device, ctx.weights
        device.clock.run(block.b_ms * 1e-3, "B")
        table = weights[-1].view(-1)[: VOCAB * HIDDEN].view(VOCAB, HIDDEN).float()
        dlogits = logp.exp()
        dlogits[torch.arange(flat.numel()), flat] -= 1
        dlogits = dlogits * dloss.reshape(-1, 1).float() / math.sqrt(HIDDEN)
        b, s = dloss.shape
        dx = (dlogits @ table).view(b, s, HIDDEN).transpose(0, 1).contiguous().to(x.dtype)
        x2 = x.float().transpose(0, 1).reshape(-1, HIDDEN)

        def grad_table():
            return dlogits.t() @ x2

        nbytes = x.untyped_storage().nbytes() + dloss.untyped_storage().nbytes()
        grads = _weight_grads(weights[::-1], grad_table, block.w_ms * 1e-3, device, nbytes)[::-1]
        return (dx, None, None, None) + grads


class EmulatedBlock(torch.nn.Module):
    """One ``BlockWork``: its parameters at ``scale`` of their modelled sizes."""

    def __init__(self, work: BlockWork, scale: float, dtype, device: Device, kind: str, share: float,
                 seed: int):
        super().__init__()
        self.work, self.kind, self.device, self.share = work, kind, device, share
        gen = torch.Generator().manual_seed(seed)
        need = VOCAB * HIDDEN if kind != "layer" else HIDDEN
        sizes = [scaled(n, scale) for n in work.params] or [need]
        if kind == "head":
            sizes[-1] = max(sizes[-1], need)
        else:
            sizes[0] = max(sizes[0], need)
        # on the block itself, not in a ParameterList: DDP's forward pre-hook (the distributed
        # optimizer's parameter all-gather) looks at the parameters of the module that runs
        self._names = []
        for i, n in enumerate(sizes):
            value = 0.02 * torch.randn(n, generator=gen)
            if kind == "layer" and i == 0:
                value[:HIDDEN] += 1.0  # a layer scales its input by ~1
            self.register_parameter(f"w{i}", torch.nn.Parameter(value.to(dtype)))
            self._names.append(f"w{i}")

    @property
    def weights(self) -> tuple:
        return tuple(getattr(self, name) for name in self._names)

    def forward(self, x, labels=None):
        ws = self.weights
        if self.kind == "embedding":
            return _Embedding.apply(x, self.work, self.device, ws[0].dtype, *ws)
        if self.kind == "head":
            return _Head.apply(x, labels, self.work, self.device, *ws)
        return _Layer.apply(x, self.work, self.device, self.share, *ws)


def _megatron_module():
    from megatron.core.transformer.module import MegatronModule

    return MegatronModule


class EmulatedStage(_megatron_module()):
    """This rank's pipeline stage (or one model chunk of it, holding ``unit`` of a stage's
    micro-batch of activations): its blocks in order, Megatron's ``set_input_tensor`` contract,
    per-token losses on the last stage."""

    def __init__(self, config, blocks: Sequence[BlockWork], shape: EmulatedShape, device: Device,
                 first: bool, last: bool, seed: int = 0, unit: float = 1.0):
        super().__init__(config=config)
        from megatron.core.enums import ModelType

        self.model_type = ModelType.encoder_or_decoder
        dtype = config.params_dtype
        n_layers = sum(1 for b in blocks if b.name.startswith("layer")) or 1
        mods = []
        for i, work in enumerate(blocks):
            kind = "embedding" if first and i == 0 else "head" if last and i == len(blocks) - 1 else "layer"
            mods.append(EmulatedBlock(work, shape.scale, dtype, device, kind, unit / n_layers, seed * 1000 + i))
        self.blocks = torch.nn.ModuleList(mods)
        self.first, self.last = first, last
        self.pre_process, self.post_process = first, last  # what Megatron's finalize_model_grads reads
        self.share_embeddings_and_output_weights = False  # untied: no embedding all-reduce across stages
        self.input_tensor = None
        self.shape = shape

    def set_input_tensor(self, input_tensor):
        if isinstance(input_tensor, (list, tuple)):
            assert len(input_tensor) == 1, "the emulated stage takes one tensor from the previous stage"
            input_tensor = input_tensor[0]
        self.input_tensor = input_tensor

    def forward(self, tokens, labels):
        x = tokens if self.first else self.input_tensor
        for block in self.blocks:
            x = block(x, labels) if block.kind == "head" else block(x)
        return x


def stage_config(pp: int, num_blocks: int, dtype=torch.bfloat16, **overrides):
    """A TransformerConfig Megatron's schedule, DDP and optimizer read for this stage."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    values = dict(num_layers=max(pp, num_blocks * pp), hidden_size=HIDDEN, num_attention_heads=1,
                  pipeline_model_parallel_size=pp, pipeline_dtype=dtype, params_dtype=dtype,
                  bf16=dtype == torch.bfloat16, use_cpu_initialization=True, gradient_accumulation_fusion=True,
                  hidden_dropout=0.0, attention_dropout=0.0)
    values.update(overrides)
    return TransformerConfig(**values)


def data(shape: EmulatedShape, step: int, microbatches: int, dp_rank: int, seed: int = 7) -> List:
    """Deterministic (tokens, labels) per micro-batch, [micro_batch, rows] each: a noisy
    'next = previous + 1' rule, so the loss has something to learn."""
    out = []
    for i in range(microbatches):
        gen = torch.Generator().manual_seed(seed * 100003 + (step * microbatches + i) * 101 + dp_rank)
        start = torch.randint(0, VOCAB, (shape.micro_batch, 1), generator=gen)
        seq = (start + torch.arange(shape.rows + 1)) % VOCAB
        noise = torch.rand(seq.shape, generator=gen) < 0.1
        seq = torch.where(noise, torch.randint(0, VOCAB, seq.shape, generator=gen), seq)
        out.append((seq[:, :-1].contiguous(), seq[:, 1:].contiguous()))
    return out
