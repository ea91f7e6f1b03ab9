"""Model shapes and the run around them (parallel sizes, batch, phase) as small values."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer. ``gated``: SwiGLU (fc1 produces 2 x ffn), else GeLU."""

    name: str
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    layers: int
    vocab: int
    seq: int  # default sequence length (the model's training context)
    gated: bool = True

    def __post_init__(self):
        if min(self.hidden, self.ffn, self.heads, self.kv_heads, self.layers, self.vocab, self.seq) < 1:
            raise ValueError(f"model dimensions must be positive: {self}")
        if self.hidden % self.heads or self.heads % self.kv_heads:
            raise ValueError(f"hidden {self.hidden} / heads {self.heads} / kv heads {self.kv_heads} do not divide")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def qkv_out(self) -> int:
        return (self.heads + 2 * self.kv_heads) * self.head_dim

    @property
    def fc1_out(self) -> int:
        return 2 * self.ffn if self.gated else self.ffn

    @property
    def params_per_layer(self) -> int:
        return self.hidden * self.qkv_out + self.hidden * self.hidden + self.hidden * self.fc1_out + self.ffn * self.hidden

    @property
    def params(self) -> int:
        return self.layers * self.params_per_layer + 2 * self.vocab * self.hidden


# Published architectures (Llama 2 paper, Llama 3 model card, GPT-3 paper).
MODELS: dict[str, ModelSpec] = {
    "llama2-7b": ModelSpec("llama2-7b", 4096, 11008, 32, 32, 32, 32000, 4096),
    "llama2-13b": ModelSpec("llama2-13b", 5120, 13824, 40, 40, 40, 32000, 4096),
    "llama3-8b": ModelSpec("llama3-8b", 4096, 14336, 32, 8, 32, 128256, 8192),
    "llama3-70b": ModelSpec("llama3-70b", 8192, 28672, 64, 8, 80, 128256, 8192),
    "gpt3-175b": ModelSpec("gpt3-175b", 12288, 49152, 96, 96, 96, 50257, 2048, gated=False),
}


def get_model(name: str) -> ModelSpec:
    try:
        return MODELS[name]
    except KeyError:
        raise KeyError(f"unknown model {name!r}; known: {', '.join(MODELS)}") from None


PHASES = ("train", "prefill", "decode")


@dataclass(frozen=True)
class RunSpec:
    """How the model runs.

    ``prefill``: forward only over ``seq`` tokens per sequence. ``decode``: one generation step,
    one new token per sequence of the micro-batch, attending to ``seq`` cached tokens.
    ``micro_batches``: per optimizer step and pipeline (1F1B) in training; 1 otherwise.
    """

    tp: int = 1
    cp: int = 1
    pp: int = 1
    dp: int = 1
    seq: int = 4096
    micro_batch: int = 1
    micro_batches: int = 1
    phase: str = "train"
    sequence_parallel: bool = True

    def __post_init__(self):
        if min(self.tp, self.cp, self.pp, self.dp, self.seq, self.micro_batch, self.micro_batches) < 1:
            raise ValueError(f"sizes must be >= 1: {self}")
        if self.phase not in PHASES:
            raise ValueError(f"phase must be one of {PHASES}, got {self.phase!r}")
        if self.phase != "decode" and self.seq % (self.cp * (2 if self.cp > 1 else 1)):
            raise ValueError(f"seq {self.seq} does not split over CP={self.cp} (2 x CP chunks)")

    @property
    def training(self) -> bool:
        return self.phase == "train"

    @property
    def tokens(self) -> int:
        """Tokens one rank's layer processes per micro-batch (before the TP split)."""
        if self.phase == "decode":
            return self.micro_batch
        return self.seq // self.cp * self.micro_batch

    @property
    def world(self) -> int:
        return self.tp * self.cp * self.pp * self.dp
