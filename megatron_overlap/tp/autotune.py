"""Measured (``--overlap-tp-autotune``) and loaded (``--overlap-tp-plan-file FILE``) decompositions of the
overlapped linears; ``linear_plan.TPPlanner`` asks here before it falls back to the built-in rule.

A choice is (chunks per rank, tapered or uniform, reduce-scatter algorithm). The autotuner
measures every candidate on the real TP group the first time a linear shape is seen (forward
and backward primitives on random data of that shape, a few iterations each), all ranks of the
group agree (the candidate whose slowest rank is fastest), and the pick is cached on disk keyed
by shape, dtype, world size, device name and versions — the next start reuses it. A plan file
has the cache's format, so ``cp ~/.cache/megatron_overlap/tp_plans.json plan.json`` makes one.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist

from ..comm.agree import GroupAgreement
from ..errors import OverlapConfigError
from . import MAX_CHUNKS, check_chunks_fit
from ..tune.cache import DiskCache, choose, device_name, private_rng, time_call
from ..version import __version__

logger = logging.getLogger("megatron_overlap")


@dataclass(frozen=True)
class PlanChoice:
    """``chunks`` per rank (0: the built-in rule), ``taper`` (short first/last chunk), ``rs``."""

    chunks: int
    taper: bool
    rs: str

    def key(self) -> str:
        return f"c{self.chunks}{'t' if self.taper else ''}-{self.rs}"

    @classmethod
    def parse(cls, text: str) -> "PlanChoice":
        if not isinstance(text, str) or len(text) > 40:
            raise ValueError(f"not a plan choice: {str(text)[:40]!r} (expected e.g. 'c4t-ring' or 'c2-a2a')")
        try:
            head, rs = text.split("-", 1)
            taper = head.endswith("t")
            chunks = int(head[1:-1] if taper else head[1:])
        except ValueError:
            raise ValueError(f"not a plan choice: {text!r} (expected e.g. 'c4t-ring' or 'c2-a2a')") from None
        if rs not in ("ring", "a2a") or chunks < 0 or not head.startswith("c"):
            raise ValueError(f"not a plan choice: {text!r} (expected e.g. 'c4t-ring' or 'c2-a2a')")
        return cls(chunks, taper, rs)


def shape_key(kind: str, rows: int, batch: int, k: int, n: int, dtype: torch.dtype, world: int,
              device: torch.device, backend: str) -> str:
    return "|".join([kind, f"rows{rows}xb{batch}", f"k{k}n{n}", str(dtype).replace("torch.", ""),
                     f"tp{world}", device_name(device), backend,
                     f"torch{torch.__version__}", f"mo{__version__}"])


def candidates(world: int, rows: int, batch: int, all_reduce: bool = False) -> list:
    """The built-in rule (tapered), then 1, 2 and 4 uniform chunks per rank (where the shard has
    the rows), each with the ring and, where it differs (TP > 2), the all-to-all reduce-scatter.
    ``all_reduce`` (no sequence parallelism; ``rows``: the whole sequence): the same counts per
    rank, R times as many pieces of the sequence, one all-reduce each (no reduce-scatter to pick)."""
    out = []
    for chunks, taper in ((0, True), (1, False), (2, False), (4, False)):
        if chunks * (world if all_reduce else 1) > rows:
            continue
        for rs in ("ring", "a2a") if world > 2 and not all_reduce else ("ring",):
            out.append(PlanChoice(chunks, taper, rs))
    return out


MAX_PLAN_BYTES = 16 << 20  # a plan file holds a few entries per linear shape; more is not a plan file


def load_plan_file(path: str, rows_per_rank: Optional[int] = None) -> dict:
    """``{shape key: PlanChoice}`` from a plan file (the autotuner's cache format, or
    ``{key: "c2-ring"}``); a ``"default"`` key applies to every shape not listed. Read once, at
    install, and held to the rules of ``--overlap-tp-chunks``: every entry a plan choice, each
    chunk count at most one chunk per sequence row of its shape (the key's rows; for ``default``,
    ``rows_per_rank`` when the model is known, else at the first step, ``TPPlanner``). Anything
    else is refused naming the file and the entry."""
    where = lambda entry: f"{path}: entry {entry!r}"  # noqa: E731
    try:
        if os.path.getsize(path) > MAX_PLAN_BYTES:
            raise OverlapConfigError("tp.plan_file", f"{path} is over {MAX_PLAN_BYTES >> 20} MiB: not a plan file")
        with open(path, "rb") as f:
            data = json.loads(f.read().decode("utf-8"))
    except (OSError, ValueError, RecursionError) as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise OverlapConfigError("tp.plan_file", f"cannot read {path}: {str(exc)[:200]}") from None
    if not isinstance(data, dict):
        raise OverlapConfigError("tp.plan_file", f"{path} holds a JSON {type(data).__name__}; a plan file is an "
                                 "object {shape key: 'c2-ring' | {'choice': 'c2-ring'}}, e.g. "
                                 "{\"default\": \"c2-ring\"}")
    plans = {}
    for key, value in data.items():
        text = value.get("choice") if isinstance(value, dict) else value
        try:
            plans[key] = choice = PlanChoice.parse(text)
        except ValueError:
            raise OverlapConfigError("tp.plan_file", f"{where(key)} is not a plan choice ({str(value)[:60]!r}); "
                                     "expected e.g. 'c4t-ring' or 'c2-a2a'") from None
        if choice.chunks > MAX_CHUNKS:
            raise OverlapConfigError("tp.plan_file", f"{where(key)} ({choice.key()}) asks more chunks than the "
                                     f"{MAX_CHUNKS} messages a ring can tell apart")
        rows = rows_per_rank if key == "default" else _key_rows(key)
        if rows is not None:
            check_chunks_fit(choice.chunks, rows, "tp.plan_file", f"{where(key)} ({choice.key()})")
    return plans


def _key_rows(key: str) -> Optional[int]:
    """The rows per rank a cache key names (``...|rows64xb2|...``), None for other keys."""
    parts = key.split("|")
    if len(parts) > 1 and parts[1].startswith("rows") and "xb" in parts[1]:
        digits = parts[1][4:].split("xb", 1)[0]
        return int(digits) if digits.isdigit() and len(digits) < 12 else None
    return None


class PlanTuner:
    """One per installation; see the module docstring. ``measure(choice, ...) -> seconds`` can be
    injected (tests); by default the backend's primitives are timed."""

    def __init__(self, autotune: bool, plans: Optional[dict] = None, cache: Optional[DiskCache] = None,
                 measure: Optional[Callable] = None, iterations: int = 3, plan_file: str = "the plan file"):
        self.autotune = autotune
        self.plans = plans or {}
        self.plan_file = plan_file  # where ``plans`` came from (messages)
        self.cache = cache or DiskCache("tp_plans")
        self.measure = measure
        self.iterations = iterations

    def choose(self, kind: str, x: torch.Tensor, weight: torch.Tensor, group: dist.ProcessGroup, rows: int,
               backend, make_plan: Callable[[PlanChoice], object]) -> Optional[PlanChoice]:
        """The choice for this linear shape, or None (use the built-in rule)."""
        batch = x[0].numel() // x.shape[-1] if x.shape[0] else 1
        world = group.size()
        key = shape_key(kind, rows, batch, weight.shape[1], weight.shape[0], x.dtype, world, x.device, backend.name)
        for entry in (key, "default"):
            if entry in self.plans:  # the rows are known now: the file's entry held to the flag's rule
                choice = self.plans[entry]
                check_chunks_fit(choice.chunks, rows, "tp.plan_file", f"{self.plan_file}: entry {entry!r} "
                                 f"({choice.key()})")
                return choice
        if not self.autotune:
            return None

        def measure(choice: PlanChoice) -> float:
            if self.measure is not None:
                return self.measure(choice, kind, x, weight, group)
            return _time_primitives(kind, x, weight, group, backend, make_plan(choice), self.iterations)

        agree = GroupAgreement(group) if world > 1 else None
        ar = kind in ("column_ar", "row_ar")
        choice, hit = choose(self.cache, key, candidates(world, rows, batch, ar), measure, agree, encode=PlanChoice.key)
        if dist.get_rank() == 0:
            logger.warning("megatron-overlap: autotune %s: %s (%s)", key.split("|", 3)[:3], choice.key(),
                           "cached" if hit else "measured")
        return choice


def _time_primitives(kind, x, weight, group, backend, plan, iterations) -> float:
    """Forward and backward communication primitives of one linear with random data (from a
    private generator: the default one belongs to the model's dropout)."""
    size = group.size()
    gen = private_rng(x.device)
    rand = lambda *shape: torch.randn(shape, dtype=x.dtype, device=x.device, generator=gen)  # noqa: E731
    with torch.no_grad():
        if kind == "row_ar":  # the one collective of each: the all-reduce after a GEMM (fwd)
            xs = rand(*x.shape)
            run = lambda: backend.matmul_all_reduce(xs, weight.t(), group, plan).finish()  # noqa: E731
            return time_call(run, x.device, repeats=iterations)
        if kind == "column_ar":  # ... (its dgrad)
            dy = rand(*x.shape[:-1], weight.shape[0])
            run = lambda: backend.matmul_all_reduce(dy, weight, group, plan).finish()  # noqa: E731
            return time_call(run, x.device, repeats=iterations)
        if kind == "column":  # fwd AG(x) @ w^T; bwd RS(dy @ w)
            xs = rand(*x.shape)
            dy = rand(x.shape[0] * size, *x.shape[1:-1], weight.shape[0])
            run = lambda: (backend.gather_matmul(xs, weight.t(), group, plan),  # noqa: E731
                           backend.matmul_reduce_scatter(dy, weight, group, plan).finish())
        else:  # row: fwd RS(x @ w^T); bwd AG(dy) @ w
            xf = rand(*x.shape)
            dy = rand(x.shape[0] // size, *x.shape[1:-1], weight.shape[0])
            run = lambda: (backend.matmul_reduce_scatter(xf, weight.t(), group, plan).finish(),  # noqa: E731
                           backend.gather_matmul(dy, weight, group, plan, keep_gathered=True))
        return time_call(run, x.device, repeats=iterations)
