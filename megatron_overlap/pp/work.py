"""What one pipeline stage computes and holds per micro-batch, as data: blocks (the embedding,
each transformer layer, the output layer) with their forward (F), input-gradient (B) and
weight-gradient (W) times and their parameter tensors. The cost model fills it in
(``tune/pipeline.stage_work``); the simulator sums it (``stage_times``); the emulated cluster
builds a Megatron module of it whose compute is a wait of these times (``lab/emulated_model.py``).
Pure Python."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Sequence, Tuple

from .schedule_sim import StageTimes


@dataclass(frozen=True)
class BlockWork:
    """``f_ms`` / ``b_ms`` / ``w_ms``: per micro-batch (B without the weight gradients, which
    are ``w_ms``); ``params``: elements of each parameter tensor, in registration order, as the
    modelled run holds them on one rank (after the TP split); W's time is spread over them by
    size."""

    name: str
    f_ms: float
    b_ms: float
    w_ms: float
    params: Tuple[int, ...] = ()

    def __post_init__(self):
        if min(self.f_ms, self.b_ms, self.w_ms) < 0 or any(n < 0 for n in self.params):
            raise ValueError(f"block {self.name!r}: times and sizes must be >= 0")

    @property
    def param_count(self) -> int:
        return sum(self.params)


def stage_times(stages: Sequence[Sequence[BlockWork]]) -> List[StageTimes]:
    """Each stage's F, B and W per micro-batch: its blocks' summed."""
    return [StageTimes(sum(b.f_ms for b in blocks), sum(b.b_ms for b in blocks), sum(b.w_ms for b in blocks))
            for blocks in stages]


def stage_params(stages: Sequence[Sequence[BlockWork]]) -> List[List[int]]:
    """Each stage's parameter tensors (elements, registration order)."""
    return [[n for b in blocks for n in b.params] for blocks in stages]
