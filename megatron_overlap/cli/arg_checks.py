"""The commands' own arguments (``demo``, ``bench``, ``floor``, ``plan``), checked before any rank
starts or any solver runs: a refusal names the flag and what it takes, as the plugin's flags do."""

from __future__ import annotations

import math


def counts(command: str, **values) -> None:
    """``flag_name=(value, lowest)``: whole numbers at or above their lowest value."""
    for name, (value, low) in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise SystemExit(f"{command}: --{name.replace('_', '-')} must be a whole number >= {low}, got {value!r}")


def amounts(command: str, positive: tuple = (), **values) -> None:
    """``flag_name=value``: finite numbers >= 0 (> 0 for the names in ``positive``)."""
    for name, value in values.items():
        low_ok = value > 0 if name in positive else value >= 0
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or not low_ok:
            bound = "> 0" if name in positive else ">= 0"
            raise SystemExit(f"{command}: --{name.replace('_', '-')} must be a finite number {bound}, got {value!r}")


def tp_chunks(command: str, chunks: int, tp: int, rows: int) -> None:
    """``--overlap-tp-chunks`` of a bench or the demo: the plugin's rule (a multiple of TP, at
    most one chunk per row of the ``rows`` each rank holds)."""
    if chunks and (chunks % tp or chunks // tp > rows):
        raise SystemExit(f"{command}: --overlap-tp-chunks {chunks} must be a multiple of --tp {tp} and at most "
                         f"{rows * tp} (one chunk per row of the {rows} rows per rank), or 0")
