"""The planners' input checked: a batch's lengths, the ranks R, the per-rank capacity C and the
balance mode, with errors that name what to change (``check_batch``; every scheduler calls it)."""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

from ..errors import OverlapConfigError
from .shard import ranks_needed

MODES = ("dp", "pp")
CAPACITY_FIELD = "hdp.max_tokens"  # the config field errors about C name


def check_batch(seq_lens: Sequence[int], ranks: int, capacity_tokens: int, mode: Optional[str] = None
                ) -> Tuple[int, ...]:
    """The lengths as a tuple of ints, or a clear error: no ranks, C <= 0, an empty batch, a
    non-positive length, a sequence no ring of the R ranks can hold, an unknown mode."""
    if mode is not None and mode not in MODES:
        raise ValueError(f"unknown HDP balance mode {mode!r}: use 'dp' (balance every rank's work per "
                         f"step) or 'pp' (also keep similar lengths at the same micro-batch index, for "
                         f"pipeline parallelism)")
    if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1:
        raise ValueError(f"ranks (DP x CP) must be a positive integer, got {ranks!r}")
    if isinstance(capacity_tokens, bool) or not isinstance(capacity_tokens, int) or capacity_tokens <= 0:
        raise OverlapConfigError(CAPACITY_FIELD, f"must be a positive number of tokens, got {capacity_tokens!r}; "
                                 f"set it to the tokens one rank fits in a micro-batch (e.g. the sequence "
                                 f"length of a run without context parallelism)")
    lens = tuple(seq_lens)
    if not lens:
        raise ValueError("empty batch: the batch has no sequences to schedule (check the data "
                         "loader and the full batch size)")
    for i, length in enumerate(lens):
        if isinstance(length, bool) or not isinstance(length, int) or length < 1:
            raise ValueError(f"sequence {i} has length {length!r}: every sequence needs a positive integer "
                             f"number of tokens")
    for i, length in enumerate(lens):
        if length <= capacity_tokens:
            continue
        if capacity_tokens < 2 or ranks_needed(length, capacity_tokens) > ranks:
            need = 2 * -(-length // (2 * ranks))  # smallest even C with ceil(L / C) <= R
            raise OverlapConfigError(
                CAPACITY_FIELD,
                f"sequence {i} has {length} tokens, more than the {ranks} ranks hold at {capacity_tokens} "
                f"tokens each (R x C = {ranks * capacity_tokens}; a zigzag shard needs an even C); raise "
                f"`hdp.max_tokens` to at least {need}, use more DP x CP ranks, or truncate the sequence")
    return lens
