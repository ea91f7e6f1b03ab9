"""Where ``bench hdp``'s full batches come from (its module docstring): a lengths file, cut
into batches by ``--batch-tokens`` or by its blank lines; the ``packages`` corpus; the ``pile``
sample (The Pile's published per-component statistics, ``pile_lengths.py``); a built-in
distribution."""

from __future__ import annotations

import math
import random
from typing import List

DISTRIBUTIONS = ("heavy-tailed", "uniform")
MIN_LEN = 64
HEAVY_MEDIAN = 2048
HEAVY_SIGMA = 1.8


def max_len_for(ranks: int, capacity_tokens: int, max_len: int) -> int:
    """``max_len`` lowered to the longest sequence R ranks hold: C on one rank, R x 2 floor(C/2)
    on a ring of all R (a zigzag shard needs an even C)."""
    return max(1, min(max_len, max(capacity_tokens, ranks * 2 * (capacity_tokens // 2))))


def draw_batches(distribution: str, steps: int, batch_tokens: int, max_len: int, seed: int = 0) -> List[List[int]]:
    """``steps`` batches of at least ``batch_tokens`` tokens from a built-in distribution (module
    docstring); the same arguments give the same batches on every machine (``random.Random``)."""
    if distribution not in DISTRIBUTIONS:
        raise ValueError(f"unknown distribution {distribution!r}: choose one of {', '.join(DISTRIBUTIONS)}")
    if steps < 1 or batch_tokens < 1:
        raise ValueError(f"steps and batch tokens must be >= 1, got {steps} and {batch_tokens}")
    rng = random.Random(f"hdp-{distribution}-{seed}")  # a str seed goes through sha512: no hash()
    hi = max(1, max_len)
    lo = min(MIN_LEN, hi)
    batches = []
    for _ in range(steps):
        batch, total = [], 0
        while total < batch_tokens:
            if distribution == "heavy-tailed":
                length = int(round(rng.lognormvariate(math.log(HEAVY_MEDIAN), HEAVY_SIGMA)))
            else:
                length = rng.randint(lo, hi)
            length = min(hi, max(lo, length))
            batch.append(length)
            total += length
        batches.append(batch)
    return batches


def read_lengths_file(path: str) -> List[List[int]]:
    """Batches from a file: one token count per line, a blank line between batches, ``#`` comments."""
    batches: List[List[int]] = [[]]
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            text = line.split("#", 1)[0].strip()
            if not text:
                if not line.lstrip().startswith("#") and batches[-1]:
                    batches.append([])
                continue
            try:
                length = int(text)
            except ValueError:
                raise ValueError(f"{path}:{lineno}: {text!r} is not a token count (one integer per line)") from None
            batches[-1].append(length)
    batches = [b for b in batches if b]
    if not batches:
        raise ValueError(f"{path}: no sequence lengths (expected one token count per line)")
    return batches


def cut_lengths_file(path: str, batch_tokens: int, ranks: int, capacity_tokens: int):
    """(batches, what was done) from a lengths file. With ``batch_tokens`` its sequences, in file
    order, are cut into full batches of at least that many tokens (blank lines ignored); without,
    its blank lines separate the batches, and a file with none is refused: a list of document
    lengths is not one training step."""
    from .corpus import cut_batches

    batches = read_lengths_file(path)
    flat = [length for b in batches for length in b]
    if not batch_tokens:
        if len(batches) == 1:
            raise ValueError(
                f"{path} has no blank line between batches, so it would be one full batch of {len(flat)} sequences "
                f"({sum(flat)} tokens, the longest {max(flat)}), planned as one step: pass --batch-tokens T to cut "
                f"it into full batches of at least T tokens (8 x R x C = {8 * ranks * capacity_tokens} here), or "
                f"put a blank line after each batch")
        return batches, f"{path} ({len(batches)} batches, as its blank lines separate them)"
    cut, left = cut_batches(flat, batch_tokens)
    if not cut:
        raise ValueError(f"{path} holds {sum(flat)} tokens, fewer than one batch of --batch-tokens {batch_tokens}")
    return cut, (f"{path} cut into {len(cut)} batches of >= {batch_tokens} tokens"
                 + (f", the last {left} tokens dropped" if left else "")
                 + (f" ({len(batches)} blank-line batches ignored)" if len(batches) > 1 else ""))


def load_batches(args):
    """(batches, their source in words) for ``--lengths-file``, ``--corpus`` or a built-in distribution."""
    R, C = args.ranks, args.max_tokens_per_rank
    if args.batch_tokens < 0:
        raise ValueError(f"--batch-tokens must be >= 1, got {args.batch_tokens}")
    if args.lengths_file and args.corpus:
        raise ValueError("pass --lengths-file or --corpus, not both")
    if args.lengths_file:
        return cut_lengths_file(args.lengths_file, args.batch_tokens, R, C)
    if args.corpus == "pile":
        from .pile_lengths import describe, pile_batches

        batches = pile_batches(args.batch_tokens or 8 * R * C, max_len_for(R, C, args.max_len or R * C), args.steps,
                               args.seed)
        return batches, f"corpus pile ({describe(batches)})"
    if args.corpus:
        from .corpus import corpus_batches, describe, package_documents

        batches = corpus_batches(package_documents(), args.batch_tokens or 8 * R * C,
                                 max_len_for(R, C, args.max_len or R * C), args.seed, min_batches=args.steps)
        return batches, f"corpus {args.corpus} ({describe(batches)})"
    max_len = max_len_for(R, C, args.max_len or 262144)
    batches = draw_batches(args.distribution, args.steps, args.batch_tokens or 8 * R * C, max_len, args.seed)
    return batches, f"{args.distribution} (seed {args.seed}, max {max_len})"
