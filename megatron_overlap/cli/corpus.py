"""Sequence lengths from a real corpus on this machine, with no download: the source files of
the installed Python packages and of the standard library, concatenated per package, as
repository-level long-context data is built (every file of a repository in one sequence).

    documents   one per top-level package or module of each library folder (``site-packages``,
                the standard library): the bytes of its text source files (``SOURCE_SUFFIXES``)
    tokens      ceil(bytes / BYTES_PER_TOKEN): an assumption (no tokenizer is installed here;
                code tokenizes at roughly 3-4 bytes a token)
    sequences   a document longer than the longest sequence the ranks hold is cut into pieces of
                that length, as pre-training pipelines cut at the context length
    batches     the sequences shuffled with a fixed seed and dealt into full batches of at least
                ``batch_tokens`` tokens (a last, smaller remainder is dropped); when a run asks for
                more batches than one pass gives (``bench hdp --steps``), the corpus is read again,
                reshuffled, as training runs epochs

The corpus is whatever this machine has installed, so its lengths differ between machines:
``bench hdp --write-lengths F`` saves them for ``--lengths-file``.
"""

from __future__ import annotations

import math
import os
import random
import statistics
import sys
import sysconfig
from typing import Dict, List, Sequence, Tuple

SOURCE_SUFFIXES = (".py", ".pyi", ".pyx", ".pxd", ".c", ".h", ".cc", ".cpp", ".hpp", ".cu", ".cuh", ".md", ".rst",
                   ".txt")
BYTES_PER_TOKEN = 4.0
_SKIP_DIRS = {"__pycache__", "site-packages", "dist-packages", "test", "tests"}


def _source_bytes(path: str) -> int:
    if os.path.isfile(path):
        return os.path.getsize(path) if path.endswith(SOURCE_SUFFIXES) else 0
    total = 0
    for root, dirs, files in os.walk(path):
        dirs[:] = sorted(d for d in dirs if d not in _SKIP_DIRS)
        total += sum(os.path.getsize(os.path.join(root, f)) for f in files if f.endswith(SOURCE_SUFFIXES)
                     and not os.path.islink(os.path.join(root, f)))
    return total


def library_roots() -> List[str]:
    """The folders this interpreter imports libraries from: site-packages and the standard library."""
    paths = sysconfig.get_paths()
    roots = [paths.get("purelib"), paths.get("platlib"), paths.get("stdlib")]
    roots += [p for p in sys.path if p.endswith(("site-packages", "dist-packages"))]
    return list(dict.fromkeys(os.path.realpath(p) for p in roots if p and os.path.isdir(p)))


def package_documents(roots: Sequence[str] = ()) -> List[Tuple[str, int]]:
    """(name, tokens) of every package with source files in ``roots`` (default:
    ``library_roots()``), sorted by name."""
    docs: Dict[str, int] = {}
    for root in roots or library_roots():
        for entry in sorted(os.listdir(root)):
            if entry.endswith((".dist-info", ".egg-info", ".pth")) or entry.startswith((".", "_")) \
                    or entry in _SKIP_DIRS:
                continue
            size = _source_bytes(os.path.join(root, entry))
            if size:
                docs[f"{os.path.basename(root)}/{entry}"] = math.ceil(size / BYTES_PER_TOKEN)
    if not docs:
        raise ValueError(f"no source files found under {list(roots or library_roots())}")
    return sorted(docs.items())


def cut_batches(lengths: Sequence[int], batch_tokens: int) -> Tuple[List[List[int]], int]:
    """``lengths`` in their order dealt into full batches of at least ``batch_tokens`` tokens (a
    batch closes with the sequence that reaches the budget, as a data loader fills a step);
    returns (the batches, the tokens of the smaller remainder dropped at the end)."""
    if batch_tokens < 1:
        raise ValueError(f"batch tokens must be >= 1, got {batch_tokens}")
    batches, batch, total = [], [], 0
    for length in lengths:
        batch.append(length)
        total += length
        if total >= batch_tokens:
            batches.append(batch)
            batch, total = [], 0
    return batches, total


def corpus_batches(docs: Sequence[Tuple[str, int]], batch_tokens: int, max_len: int, seed: int = 0,
                   min_batches: int = 1) -> List[List[int]]:
    """Full batches of sequence lengths from ``docs`` (module docstring). ``min_batches``: the
    corpus is read again, reshuffled (pass p with seed (seed, p)), until it gives that many
    batches, as training runs epochs; the remainder of the last pass is dropped."""
    if batch_tokens < 1 or max_len < 1:
        raise ValueError(f"batch tokens and the longest sequence must be >= 1, got {batch_tokens} and {max_len}")
    pieces = []
    for _, tokens in docs:
        pieces += [max_len] * (tokens // max_len) + ([tokens % max_len] if tokens % max_len else [])
    lengths: List[int] = []
    passes = 0
    while True:
        shuffled = list(pieces)
        random.Random(f"hdp-corpus-{seed}" + (f"-pass{passes}" if passes else "")).shuffle(shuffled)
        lengths += shuffled
        passes += 1
        batches, _ = cut_batches(lengths, batch_tokens)
        if len(batches) >= min_batches or min_batches <= 1 or not pieces:
            break
    if not batches:
        raise ValueError(f"the corpus holds {sum(lengths)} tokens, fewer than one batch of {batch_tokens}: "
                         f"lower --batch-tokens")
    return batches


def describe(batches: Sequence[Sequence[int]]) -> str:
    """Median, p99 and the longest of the sequences, and how many there are."""
    flat = sorted(length for b in batches for length in b)
    p99 = flat[min(len(flat) - 1, int(0.99 * len(flat)))]
    return (f"{len(flat)} sequences, median {statistics.median(flat):.0f} tokens, p99 {p99}, longest {flat[-1]}, "
            f"{BYTES_PER_TOKEN:g} bytes a token assumed")
