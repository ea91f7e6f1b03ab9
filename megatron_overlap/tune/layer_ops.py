"""The ops of a transformer layer as data: linears (the TP-sharded GEMMs whose collectives the
strategies treat differently) and everything else (norms, activations, attention), with their
costs on a ``HardwareSpec``.

Per rank, R = TP, T tokens per micro-batch (``RunSpec.tokens``), s = T / R under sequence
parallelism, d bytes per element. A linear of ``n`` outputs and ``k`` inputs:

    column  fwd  [T, k] @ [k, n/R]      dgrad [T, n/R] @ [n/R, k]    wgrad [n/R, T] @ [T, k]
            comm AG(x [T, k]) before fwd; bwd: AG(x) again for wgrad, RS(dgrad [T, k])
    row     fwd  [T, k/R] @ [k/R, n]    dgrad [T, n] @ [n, k/R]      wgrad [n, T] @ [T, k/R]
            comm RS(y [T, n]) after fwd; bwd: AG(dy [T, n]) before dgrad and wgrad

Attention (flash): fwd flops 4 T S_kv d (heads / R), halved by the causal mask; bwd 2.5x fwd
(five GEMM-like products against two). Decode attention reads the KV cache instead
(``2 S kv_heads/R d`` elements per sequence). Not modelled: rotary embedding, dropout,
softmax statistics, the optimizer step, activation recomputation, kernel launch gaps.
"""

from __future__ import annotations

from dataclasses import dataclass

from .gemm import elementwise_ms
from .models import ModelSpec, RunSpec


@dataclass(frozen=True)
class Linear:
    name: str
    kind: str  # "column" | "row"
    n: int  # output features (whole layer, before the TP split)
    k: int  # input features


@dataclass(frozen=True)
class Elementwise:
    name: str
    fwd_ms: float
    bwd_ms: float


@dataclass(frozen=True)
class Attention:
    name: str
    fwd_ms: float
    bwd_ms: float
    kv_bytes: float = 0.0  # K and V of this CP rank's tokens (what a CP ring step moves)


@dataclass(frozen=True)
class Exchange:
    """Communication no strategy overlaps (embedding reduce-scatter, cross-entropy all-reduces):
    ``fwd`` / ``bwd`` are ``(collective, total_bytes)`` with collective in {ag, rs, ar} or None."""

    name: str
    fwd: tuple = None
    bwd: tuple = None
    fwd_ms: float = 0.0  # compute beside it (lookup, scatter-add, loss)
    bwd_ms: float = 0.0


def attention_ms(model: ModelSpec, run: RunSpec, hw) -> tuple[float, float]:
    """(fwd, bwd) of the core attention of one layer on one rank."""
    heads = model.heads / run.tp
    d = model.head_dim
    peak = hw.peak_tflops * 1e12 * hw.attention_fraction
    if run.phase == "decode":
        flops = 4.0 * run.micro_batch * run.seq * d * heads
        kv = run.micro_batch * run.seq * 2 * (model.kv_heads / run.tp) * d * hw.dtype_bytes
        return max(flops / peak * 1e3, elementwise_ms(kv, hw)), 0.0
    q_tokens = run.tokens  # this CP rank's queries
    flops = 4.0 * q_tokens * run.seq * d * heads * 0.5  # causal: half the score matrix
    fwd = flops / peak * 1e3
    return fwd, 2.5 * fwd


def transformer_layer_ops(model: ModelSpec, run: RunSpec, hw) -> list:
    """Forward order: norm, qkv (column), attention, proj (row), norm, fc1 (column), act, fc2 (row)."""
    d, t, r = hw.dtype_bytes, run.tokens, run.tp
    sp_rows = t / r if run.sequence_parallel and t % r == 0 else t
    h, f = model.hidden, model.ffn / r
    norm = Elementwise("norm", elementwise_ms(2 * sp_rows * h * d, hw), elementwise_ms(3 * sp_rows * h * d, hw))
    residual = Elementwise("residual+norm", elementwise_ms(5 * sp_rows * h * d, hw), elementwise_ms(6 * sp_rows * h * d, hw))
    if model.gated:  # SwiGLU: reads gate and up, writes the product; bwd reads three, writes two
        act = Elementwise("swiglu", elementwise_ms(3 * t * f * d, hw), elementwise_ms(5 * t * f * d, hw))
    else:
        act = Elementwise("gelu", elementwise_ms(2 * t * f * d, hw), elementwise_ms(3 * t * f * d, hw))
    attn_fwd, attn_bwd = attention_ms(model, run, hw)
    kv_bytes = t * 2 * (model.kv_heads / r) * model.head_dim * d
    return [
        norm,
        Linear("qkv", "column", model.qkv_out, h),
        Attention("attention", attn_fwd, attn_bwd, kv_bytes),
        Linear("proj", "row", h, model.heads * model.head_dim),
        residual,
        Linear("fc1", "column", model.fc1_out, h),
        act,
        Linear("fc2", "row", h, model.ffn),
        Elementwise("residual", elementwise_ms(3 * sp_rows * h * d, hw), 0.0),
    ]


def head_ops(model: ModelSpec, run: RunSpec, hw) -> list:
    """Last pipeline stage: final norm, output layer (a column linear), vocab-parallel
    cross-entropy (three all-reduces of T fp32 values over TP, and passes over the logits)."""
    d, t, r = hw.dtype_bytes, run.tokens, run.tp
    sp_rows = t / r if run.sequence_parallel and t % r == 0 else t
    logits = t * model.vocab / r * 4  # fp32 logits
    loss = Exchange("cross-entropy", ("ar", 3 * t * 4), None, elementwise_ms(3 * logits, hw),
                    elementwise_ms(2 * logits, hw) if run.training else 0.0)
    return [
        Elementwise("final norm", elementwise_ms(2 * sp_rows * model.hidden * d, hw),
                    elementwise_ms(3 * sp_rows * model.hidden * d, hw)),
        Linear("output", "column", model.vocab, model.hidden),
        loss,
    ]


def embedding_ops(model: ModelSpec, run: RunSpec, hw) -> list:
    """First stage: vocab-parallel lookup; with SP its output is reduce-scattered, its gradient
    all-gathered (no strategy overlaps either)."""
    d, t, r = hw.dtype_bytes, run.tokens, run.tp
    sp = run.sequence_parallel and t % r == 0
    total = t * model.hidden * d
    return [Exchange("embedding", ("rs" if sp else "ar", total), ("ag", total) if sp and run.training else None,
                     elementwise_ms(total, hw), elementwise_ms(2 * total, hw) if run.training else 0.0)]


def mlp_ops(hidden: int, ffn: int, act_fwd_ms: float, act_bwd_ms: float) -> list:
    """The MLP block alone (the ``bench mlp`` op list): fc1 (column), activation, fc2 (row)."""
    return [
        Linear("fc1", "column", ffn, hidden),
        Elementwise("gelu", act_fwd_ms, act_bwd_ms),
        Linear("fc2", "row", hidden, ffn),
    ]
