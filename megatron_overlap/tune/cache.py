"""Choosing among measured candidates: every rank agrees, and the choice is cached on disk.

Used by the Triton tile-config autotuner (``megatron_overlap.kernels.tuning``) and by the
plan autotuner (``tp.autotune``). Rules (style notes, point 9): a cache entry is keyed by
everything that can change the answer (shape, dtype, world size, device name, versions, kernel
source hash); all ranks take the candidate whose *slowest* rank is fastest (the maximum of the
timings over the ranks), so a rank with a noisy clock cannot make the ranks disagree.

No process group here: the caller passes an *agreement* (``comm.agree.GroupAgreement``, or
anything with ``max(values) -> values`` and ``any(flag) -> flag``); None means one rank alone.
Measurements draw random inputs from a private generator (:func:`private_rng`), never from
the default one the model's dropout uses.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from typing import Callable, Optional, Sequence

import torch


def cache_dir() -> str:
    return os.environ.get(
        "MEGATRON_OVERLAP_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "megatron_overlap")
    )


def source_hash(*texts: str) -> str:
    digest = hashlib.sha256()
    for text in texts:
        digest.update(text.encode())
    return digest.hexdigest()[:16]


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{device.type}-{os.cpu_count()}cpu"


class DiskCache:
    """A JSON file of ``key -> value``; writes are atomic (write then rename)."""

    def __init__(self, name: str, directory: Optional[str] = None):
        self.path = os.path.join(directory or cache_dir(), f"{name}.json")

    def _load(self) -> dict:
        try:
            with open(self.path) as f:
                return json.load(f)
        except (FileNotFoundError, json.JSONDecodeError):
            return {}

    def get(self, key: str):
        return self._load().get(key)

    def put(self, key: str, value) -> None:
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        data = self._load()
        data[key] = value
        tmp = f"{self.path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(tmp, self.path)


def agree_on_best(timings: Sequence[float], agree=None) -> tuple[int, list[float]]:
    """Index of the candidate whose slowest rank is fastest, the same on every rank, and the
    per-candidate maxima. Without an agreement, this rank's own timings decide."""
    values = [float(t) for t in timings] if agree is None else agree.max(timings)
    return min(range(len(values)), key=lambda i: (values[i], i)), values


def choose(
    cache: DiskCache,
    key: str,
    candidates: Sequence,
    measure: Callable[[object], float],
    agree=None,
    encode: Callable[[object], str] = str,
):
    """The cached choice for ``key`` if there is one (and it is still a candidate), else
    measure every candidate on this rank, agree across the ranks, cache and return it.

    Every rank must call this with the same key and candidates: the decision to measure is
    itself agreed on (all ranks measure if any rank misses the cache), so ranks with different
    cache files cannot end up in different collectives.
    """
    names = [encode(c) for c in candidates]
    cached = cache.get(key)
    hit = cached is not None and cached.get("choice") in names
    if agree is not None:
        hit = not agree.any(not hit)
    if hit:
        return candidates[names.index(cached["choice"])], True
    timings = [measure(c) for c in candidates]
    best, worst = agree_on_best(timings, agree)
    cache.put(key, {"choice": names[best], "timings_s": dict(zip(names, worst))})
    return candidates[best], False


def private_rng(device: torch.device, seed: int = 0) -> torch.Generator:
    """A generator of its own for measurement inputs, so timing never moves the default RNG
    stream (which Megatron's dropout and initialisation draw from)."""
    return torch.Generator(device=device).manual_seed(seed)


def time_call(fn: Callable[[], object], device: torch.device, repeats: int = 5) -> float:
    """Median seconds of ``fn()`` (CUDA events on GPU, perf_counter elsewhere), after a warm-up."""
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]
