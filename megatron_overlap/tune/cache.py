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

import contextlib
import glob
import hashlib
import json
import logging
import os
import time
from typing import Callable, Optional, Sequence

import torch

logger = logging.getLogger("megatron_overlap")


CACHE_ENV = "MEGATRON_OVERLAP_CACHE"


def cache_dir() -> str:
    """Where the measured choices live: ``$MEGATRON_OVERLAP_CACHE``, else
    ``~/.cache/megatron_overlap``; refused (an ``OverlapConfigError`` naming the variable) where
    it cannot be a directory (a regular file, or under one) or is not writable."""
    from ..rules import usable_directory

    path = os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "megatron_overlap")
    return usable_directory(path, f"env.{CACHE_ENV}", "the autotune cache")


def source_hash(*texts: str) -> str:
    digest = hashlib.sha256()
    for text in texts:
        digest.update(text.encode())
    return digest.hexdigest()[:16]


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{device.type}-{os.cpu_count()}cpu"


MAX_CACHE_BYTES = 64 << 20  # far above any real cache: a bigger file is not ours


class DiskCache:
    """A JSON file of ``key -> {"choice": str, ...}`` that cannot hurt a run.

    - A file or an entry of the wrong shape (not a JSON object, not UTF-8, a value that is not an
      object with a string ``choice``) is ignored with one notice naming the path, never an
      error; the next write rebuilds the file without it.
    - Writers on one machine never lose each other's entries: each write takes an exclusive
      lock (``<file>.lock``, ``fcntl.flock``), re-reads the file, adds its entry (merge) and
      replaces the file atomically (write a temporary file, then rename).
    - Temporary files left by a killed writer are removed by the next writer (under the lock no
      other writer is between its write and its rename).
    - A cache that cannot be written (read-only, disk full) is a notice; the choice still runs.
    """

    def __init__(self, name: str, directory: Optional[str] = None):
        self.path = os.path.join(directory or cache_dir(), f"{name}.json")
        self._noticed = False

    def _notice(self, why: str) -> None:
        if not self._noticed:
            self._noticed = True
            logger.warning("megatron-overlap: autotune cache %s: %s; ignored (rebuilt on the next write)", self.path,
                           why)

    def _load(self) -> dict:
        try:
            if os.path.getsize(self.path) > MAX_CACHE_BYTES:
                self._notice(f"over {MAX_CACHE_BYTES >> 20} MiB")
                return {}
            with open(self.path, "rb") as f:
                data = json.loads(f.read().decode("utf-8"))
        except FileNotFoundError:
            return {}
        except (OSError, ValueError, RecursionError) as exc:  # unreadable, not UTF-8, not JSON
            self._notice(f"unreadable ({type(exc).__name__}: {str(exc)[:120]})")
            return {}
        if not isinstance(data, dict):
            self._notice(f"holds a JSON {type(data).__name__}, not an object of entries")
            return {}
        good = {k: v for k, v in data.items() if isinstance(v, dict) and isinstance(v.get("choice"), str)}
        if len(good) < len(data):
            bad = next(k for k in data if k not in good)
            self._notice(f"{len(data) - len(good)} entr{'y' if len(data) - len(good) == 1 else 'ies'} of the wrong "
                         f"shape (e.g. {bad[:80]!r}: {str(data[bad])[:60]!r})")
        return good

    def get(self, key: str):
        return self._load().get(key)

    def put(self, key: str, value) -> None:
        try:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            with _locked(self.path + ".lock"):
                for stale in glob.glob(glob.escape(self.path) + ".*.tmp"):
                    os.remove(stale)  # a killed writer's: no live writer is between write and rename now
                data = self._load()
                data[key] = value
                tmp = f"{self.path}.{os.getpid()}.tmp"
                with open(tmp, "w", encoding="utf-8") as f:
                    json.dump(data, f, indent=1, sort_keys=True)
                os.replace(tmp, self.path)
        except OSError as exc:
            logger.warning("megatron-overlap: autotune cache %s not written (%s); the choice is used, not kept",
                           self.path, exc)


LOCK_TIMEOUT_S = 30.0  # a write is milliseconds; a writer frozen with the lock must not stall the run


@contextlib.contextmanager
def _locked(path: str, timeout_s: float = LOCK_TIMEOUT_S):
    """An exclusive lock held for the ``with`` block, waited for at most ``timeout_s`` (then an
    ``OSError``: the write is skipped, never the run); a no-op where ``fcntl`` is missing."""
    try:
        import fcntl
    except ImportError:  # not POSIX: one writer at a time is then the user's to ensure
        yield
        return
    with open(path, "a") as handle:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise OSError(f"{path} held by another writer for over {timeout_s:.0f} s") from None
                time.sleep(0.005)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


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
