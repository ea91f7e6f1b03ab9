"""One rule per value, wherever the value comes from.

Every count, size, range, time and path the plugin takes, whether from a flag, a plan file, an
autotune cache or an environment variable, is checked by a function here, once, where it enters
(argparse, the config, install, a file's loader), and refused with an
:class:`~.errors.OverlapConfigError` that names its *source* (``"tp.chunks"`` renders as
``--overlap-tp-chunks``, ``"env.MEGATRON_OVERLAP_CACHE"`` as the variable) and what would work.
Each rule is bounded in time and memory: text is length-capped before it is parsed, ranges stay
ranges (:class:`IterationSet`), nothing is expanded into a list.

What only the first step knows (rows per rank, micro-batches) goes through the same functions
there. Pure Python: no torch, no Megatron.
"""

from __future__ import annotations

import bisect
import math
import os
from dataclasses import dataclass
from typing import Optional

from .errors import OverlapConfigError

MAX_TEXT = 256  # characters of a list-valued flag (a typo can be long; a real value is short)
MAX_PARTS = 64  # comma-separated parts of such a flag
MAX_ITERATION = 10**12  # no run has more iterations
MAX_COUNT = 2**24  # ranks, tokens a rank holds, micro-batches, sub-batches: no run reaches it
MAX_GB = 1e6  # a stage's memory
MAX_TIMEOUT_S = 86400.0  # a day: beyond any process group's timeout


def whole_number(value, source: str, low: int = 0, high: Optional[int] = None, what: str = "a whole number"):
    """``value`` as an int in ``[low, high]`` (``high`` None: unbounded above), else refused naming
    ``source``. Text is parsed (argparse hands strings); bools and floats are refused."""
    if isinstance(value, str):
        text = value.strip()
        if len(text) > 24 or not text.lstrip("+-").isdigit():
            raise OverlapConfigError(source, f"expected {what}, got {value[:40]!r}")
        value = int(text)
    if isinstance(value, bool) or not isinstance(value, int):
        raise OverlapConfigError(source, f"expected {what}, got {value!r}")
    if value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"in {low} .. {high}"
        raise OverlapConfigError(source, f"must be {what} {bound}, got {value}")
    return value


def positive_finite(value, source: str, unit: str, high: Optional[float] = None) -> float:
    """A finite number > 0 (and <= ``high``): ``inf`` and ``nan`` are refused here, not by a
    conversion error at the first step."""
    if isinstance(value, str):
        try:
            value = float(value) if len(value) <= 40 else None
        except ValueError:
            value = None
        if value is None:
            raise OverlapConfigError(source, f"expected a positive number of {unit}")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise OverlapConfigError(source, f"must be a positive, finite number of {unit}, got {value!r}")
    if high is not None and value > high:
        raise OverlapConfigError(source, f"must be at most {high:g} {unit}, got {value:g}")
    return float(value)


@dataclass(frozen=True)
class IterationSet:
    """Iterations as sorted, merged, inclusive ranges ``((first, last), ...)``: membership by
    bisection, so ``2-100000000`` costs two integers, not a hundred million."""

    ranges: tuple

    def __contains__(self, iteration) -> bool:
        i = bisect.bisect_right(self.ranges, (iteration, MAX_ITERATION + 1)) - 1
        return i >= 0 and self.ranges[i][0] <= iteration <= self.ranges[i][1]

    def __iter__(self):
        for first, last in self.ranges:
            yield from range(first, last + 1)

    def __len__(self) -> int:
        return sum(last - first + 1 for first, last in self.ranges)

    @property
    def first(self) -> int:
        return self.ranges[0][0]

    def text(self) -> str:
        """The flag's spelling: ``3,5-7``."""
        return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in self.ranges)

    @classmethod
    def of(cls, iterations) -> "IterationSet":
        """From a few ints (the programmatic API)."""
        return cls(_merge([(int(i), int(i)) for i in iterations]))


def _merge(ranges: list) -> tuple:
    out: list = []
    for a, b in sorted(ranges):
        if out and a <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return tuple(out)


def iterations(text, source: str) -> IterationSet:
    """``'3'``, ``'3,5'`` or ``'3-5'`` (iterations counted from 0) -> :class:`IterationSet`,
    bounded: at most ``MAX_TEXT`` characters and ``MAX_PARTS`` parts, each below ``MAX_ITERATION``."""
    example = "expected e.g. '3', '3,5' or '3-5' (iterations from 0)"
    if not isinstance(text, str) or len(text) > MAX_TEXT:
        shown = text[:40] + "..." if isinstance(text, str) else repr(text)
        raise OverlapConfigError(source, f"{example}, at most {MAX_TEXT} characters; got {shown!r}")
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts or len(parts) > MAX_PARTS:
        raise OverlapConfigError(source, f"{example}, 1 to {MAX_PARTS} parts; got {text!r}")
    ranges = []
    for part in parts:
        a, sep, b = part.partition("-")
        try:
            first, last = int(a), int(b) if sep else int(a)
        except ValueError:
            raise OverlapConfigError(source, f"{example}, got {text!r}") from None
        if not 0 <= first <= last <= MAX_ITERATION:
            raise OverlapConfigError(source, f"{example}: each range first <= last, within 0 .. {MAX_ITERATION}; "
                                     f"got {part!r}")
        ranges.append((first, last))
    return IterationSet(_merge(ranges))


def usable_directory(path, source: str, what: str) -> str:
    """A directory the plugin may create and write ``what`` into: refused, naming ``source``,
    when the path (or one of its parents) is a regular file, or the place is not writable.
    Nothing is created here (install must leave no trace when it refuses)."""
    if not isinstance(path, str) or not path.strip() or "\0" in path:
        raise OverlapConfigError(source, f"expected a directory for {what}, got {path!r}")
    probe = os.path.abspath(os.path.expanduser(path))
    while not os.path.exists(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    if os.path.exists(probe) and not os.path.isdir(probe):
        where = "is a file" if probe == os.path.abspath(os.path.expanduser(path)) else f"is under the file {probe}"
        raise OverlapConfigError(source, f"{path} {where}, not a directory, so {what} cannot be written there; "
                                 "point it at a directory (created if missing)")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise OverlapConfigError(source, f"{probe} is not writable, so {what} cannot be written under {path}; "
                                 "point it at a writable directory")
    return path


def model_shape_problems(tp: int, heads=None, kv_heads=None, seq=None, cp: int = 1, sequence_parallel=True) -> list:
    """Why Megatron cannot build this layout (an empty list: it can), as ``(field, reason)``,
    the rules Megatron's own argument checks apply: query and key/value heads split over TP,
    the sequence over TP with sequence parallelism, and over 2 x CP (the zigzag chunks) with its
    CP share split over TP. The planner, ``auto``, the demo and install all ask here."""
    out = []
    for count, name in ((heads, "query heads"), (kv_heads, "key/value heads")):
        if count is not None and tp and count % tp:
            out.append(("megatron.tensor_model_parallel_size",
                        f"{count} {name} do not split over TP={tp}; TP must divide them"))
    if seq is not None and cp and cp > 1 and seq % (2 * cp):
        out.append(("megatron.seq_length", f"sequence {seq} does not cut into 2 x CP = {2 * cp} equal chunks"))
    elif seq is not None and sequence_parallel and tp and cp and (seq // max(cp, 1)) % tp:
        share = f"each CP rank's {seq // cp} rows do" if cp > 1 else f"sequence {seq} does"
        out.append(("megatron.seq_length", f"{share} not split over TP={tp} (sequence parallelism)"))
    return out


def divisors_that_build(n: int, *counts) -> list:
    """The sizes up to ``n`` that divide every count (what to suggest instead)."""
    return [d for d in range(1, n + 1) if all(c % d == 0 for c in counts if c)]
