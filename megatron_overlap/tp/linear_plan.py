"""How each overlapped linear runs (``TPPlan``, plain data) and who decides it (``TPPlanner``).

A plan is the decomposition of one linear's collectives: the pieces its shard is cut into and the
reduce-scatter algorithm. It holds no process group and no backend (those travel beside it, ``linear.TPComm``),
so it can be printed, cached and compared across ranks.

The planner owns every rule that picks one:

- the built-in chunk rule (:func:`chunks_per_rank`), tapered when it chooses, uniform when the
  user set ``--overlap-tp-chunks``;
- ``--overlap-tp-autotune`` / ``--overlap-tp-plan-file`` (:class:`.autotune.PlanTuner`), once per shape;
- ``--overlap-tp auto``, which is resolved before the planner exists (``tp.backends.resolve_backend``),
  so the planner only ever sees a concrete backend.

Without sequence parallelism (kinds ``column_ar`` / ``row_ar``, ``linear_ar.py``) the pieces cut
the whole sequence, S rows, not a shard: R times the chunks per rank the same rule gives for
S / R rows (``--overlap-tp-chunks N``: N uniform pieces), one all-reduce each.
"""

from __future__ import annotations

from dataclasses import dataclass
import torch

from ..comm.rings import Piece, split_pieces


@dataclass(frozen=True)
class TPPlan:
    """One linear's decomposition: ``pieces`` of its shard and ``rs_algo`` (``ring`` | ``a2a``)."""

    pieces: tuple[Piece, ...]
    rs_algo: str = "ring"

    def describe(self) -> str:
        return f"{len(self.pieces)} pieces {[p.rows for p in self.pieces]}, {self.rs_algo}"


def chunks_per_rank(tp, tp_size: int, rows_per_rank: int, batch: int = 1) -> int:
    """Chunks of each rank's shard (before the bidirectional halving); ``tp`` is the config's
    TP section.

    ``--overlap-tp-chunks N`` gives N / TP uniform chunks. With 0 the plugin picks one chunk per
    ~256 tokens of the rank's shard (``rows_per_rank * batch``) plus one, between 1 and 5, and
    tapers them (first and last half-size, see ``split_pieces``): finer chunks shorten the
    pipeline's fill and drain, coarser ones pay less per message and run larger GEMMs. Chosen
    on the MLP benchmark (BENCHMARKS.md).
    """
    if tp.chunks:
        return tp.chunks // tp_size
    tokens = rows_per_rank * batch
    return max(1, min(5, tokens // 256 + 1))


AR_KINDS = ("column_ar", "row_ar")  # the linears without sequence parallelism (all-reduce path)


EXPLICIT_SHAPE = ("chunks", "rs", "bidirectional")  # decomposition flags only p2p (and fused, partly) take


def tokens_per_row(x: torch.Tensor) -> int:
    """Tokens per sequence row: the product of the dims between sequence and features."""
    batch = 1
    for dim in x.shape[1:-1]:
        batch *= dim
    return batch


class TPPlanner:
    """The plans of one installation (module docstring). ``tp``: the config's TP section with a
    concrete mode; ``backend``: the backend object the plans run on; ``tuner``: a
    :class:`.autotune.PlanTuner` for ``--overlap-tp-autotune`` / ``--overlap-tp-plan-file``, or None."""

    def __init__(self, tp, backend, tuner=None):
        if tp.mode == "auto":
            raise ValueError("TPPlanner needs a concrete backend: resolve the TP mode 'auto' first")
        self.tp = tp
        self.backend = backend
        self.tuner = tuner
        self._plans: dict = {}

    def _make(self, chunks: int, taper: bool, rs: str, shard_rows: int) -> TPPlan:
        return TPPlan(pieces=split_pieces(shard_rows, chunks, self.tp.bidirectional, taper=taper), rs_algo=rs)

    def default_plan(self, tp_size: int, shard_rows: int, batch: int, kind: str = "column") -> TPPlan:
        """The built-in rule's plan: chosen chunks tapered (short first/last), set ones uniform.
        For the all-reduce kinds ``shard_rows`` is the whole sequence (module docstring)."""
        if kind in AR_KINDS:
            return self._make_ar(chunks_per_rank(self.tp, tp_size, shard_rows // tp_size, batch), not self.tp.chunks,
                                 tp_size, shard_rows)
        chunks = chunks_per_rank(self.tp, tp_size, shard_rows, batch)
        return self._make(chunks, not self.tp.chunks, self.tp.rs_algo, shard_rows)

    def _make_ar(self, chunks_per_rank_: int, taper: bool, tp_size: int, rows: int) -> TPPlan:
        pieces = split_pieces(rows, max(1, min(rows, chunks_per_rank_ * tp_size)), taper=taper)
        return TPPlan(pieces=pieces, rs_algo=self.tp.rs_algo)

    def plan(self, kind: str, x: torch.Tensor, weight: torch.Tensor, group, shard_rows: int) -> TPPlan:
        """The plan of a ``kind`` (``column`` | ``row``, or without sequence parallelism ``column_ar``
        | ``row_ar``) linear with input ``x`` and ``weight`` on TP group ``group`` whose shard has
        ``shard_rows`` sequence rows (the all-reduce kinds: the whole sequence's); decided once per
        shape."""
        size, batch = group.size(), tokens_per_row(x)
        key = (kind, id(group), size, shard_rows, batch, tuple(weight.shape), x.dtype, x.device)
        plan = self._plans.get(key)
        if plan is None:
            plan = self.default_plan(size, shard_rows, batch, kind)
            choice = self._tuned(kind, x, weight, group, shard_rows)
            if choice is not None:
                plan = self._from_choice(choice, size, shard_rows, batch, kind)
            self._plans[key] = plan
        return plan

    def _tuned(self, kind, x, weight, group, shard_rows):
        if self.tuner is None or self.backend.name == "symm-mem":  # symm-mem chooses its own chunking
            return None
        size, batch = group.size(), tokens_per_row(x)
        make = lambda c: self._from_choice(c, size, shard_rows, batch, kind)  # noqa: E731
        return self.tuner.choose(kind, x, weight, group, shard_rows, self.backend, make)

    def _from_choice(self, choice, size: int, shard_rows: int, batch: int, kind: str = "column") -> TPPlan:
        if kind in AR_KINDS:
            chunks = chunks_per_rank(self.tp, size, shard_rows // size, batch) if choice.chunks == 0 else choice.chunks
            return self._make_ar(chunks, choice.taper, size, shard_rows)
        chunks = chunks_per_rank(self.tp, size, shard_rows, batch) if choice.chunks == 0 else choice.chunks
        return self._make(chunks, choice.taper, "a2a" if self.backend.name == "fused" else choice.rs, shard_rows)

    def plans(self) -> dict:
        """Every plan decided so far, by (kind, group, size, rows, batch, weight shape, dtype, device)."""
        return dict(self._plans)

