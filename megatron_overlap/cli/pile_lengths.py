"""Document lengths from public statistics, shipped for the demo (``bench hdp --corpus pile``):
The Pile's per-component document counts and mean document sizes (Gao et al., "The Pile: An
800GB Dataset of Diverse Text for Language Modeling", arXiv 2101.00027, Table 1: effective size
and mean document size of each of its 22 components).

    documents   each drawn from a component with probability proportional to its documents in
                the mixture (effective size / mean document size)
    length      lognormal with the component's mean (mean document size / ``BYTES_PER_TOKEN``)
                and ``SIGMA``: the paper gives means only, so the spread is an assumption
    sequences   a document longer than the longest sequence the ranks hold is cut into pieces of
                that length (``corpus.corpus_batches``), as pre-training pipelines cut at the
                context length

The same seed gives the same lengths on every machine (``random.Random`` of a string).
``bench hdp --write-lengths F`` saves them for ``--lengths-file``.
"""

from __future__ import annotations

import math
import random
from typing import List, Tuple

BYTES_PER_TOKEN = 4.0  # assumption (corpus.py's): English text and code tokenize at roughly 3-4 bytes a token
SIGMA = 1.0  # assumption: the spread of lengths inside one component (lognormal sigma)

# (component, effective size GiB, mean document size KiB): The Pile, Table 1
PILE = (
    ("Pile-CC", 227.12, 4.33),
    ("PubMed Central", 180.55, 30.55),
    ("Books3", 151.44, 538.36),
    ("OpenWebText2", 125.54, 3.85),
    ("ArXiv", 112.42, 46.61),
    ("Github", 95.16, 5.25),
    ("FreeLaw", 76.73, 15.06),
    ("StackExchange", 64.39, 2.16),
    ("USPTO Backgrounds", 45.81, 4.08),
    ("PubMed Abstracts", 38.53, 1.30),
    ("Gutenberg (PG-19)", 27.19, 398.73),
    ("OpenSubtitles", 19.47, 30.48),
    ("Wikipedia (en)", 19.13, 1.11),
    ("DM Mathematics", 15.49, 8.00),
    ("Ubuntu IRC", 11.03, 545.48),
    ("BookCorpus2", 9.45, 369.87),
    ("EuroParl", 9.17, 68.87),
    ("HackerNews", 7.80, 4.92),
    ("YoutubeSubtitles", 7.47, 22.55),
    ("PhilPapers", 4.76, 73.37),
    ("NIH ExPorter", 3.79, 2.11),
    ("Enron Emails", 1.76, 1.78),
)


def mean_tokens(kib: float) -> float:
    return kib * 1024 / BYTES_PER_TOKEN


def document_shares() -> List[Tuple[str, float]]:
    """(component, share of the documents): effective size / mean document size, normalised."""
    docs = [(name, gib * 1024 * 1024 / kib) for name, gib, kib in PILE]
    total = sum(n for _, n in docs)
    return [(name, n / total) for name, n in docs]


def pile_documents(count: int, seed: int = 0) -> List[Tuple[str, int]]:
    """``count`` documents (component, tokens) drawn as the module docstring says."""
    if count < 1:
        raise ValueError(f"count must be >= 1, got {count}")
    rng = random.Random(f"pile-lengths-{seed}")
    shares = document_shares()
    names = [n for n, _ in shares]
    weights = [w for _, w in shares]
    means = {name: mean_tokens(kib) for name, _, kib in PILE}
    out = []
    for _ in range(count):
        name = rng.choices(names, weights)[0]
        mu = math.log(means[name]) - SIGMA * SIGMA / 2  # the lognormal's mean is exp(mu + sigma^2 / 2)
        out.append((name, max(1, int(round(rng.lognormvariate(mu, SIGMA))))))
    return out


def pile_batches(batch_tokens: int, max_len: int, batches: int = 1, seed: int = 0) -> List[List[int]]:
    """``batches`` full batches of at least ``batch_tokens`` tokens of Pile-shaped documents, cut
    at ``max_len`` (dealt in draw order, a document's pieces in order, as ``corpus.cut_batches``)."""
    from .corpus import cut_batches

    if batch_tokens < 1 or max_len < 1:
        raise ValueError(f"batch tokens and the longest sequence must be >= 1, got {batch_tokens} and {max_len}")
    mean = sum(w * mean_tokens(kib) for (_, w), (_, _, kib) in zip(document_shares(), PILE))
    count = max(64, int(1.2 * batch_tokens * batches / mean) + 64)
    while True:  # the same seed draws the same documents first: more documents only extend the list
        lengths = []
        for _, tokens in pile_documents(count, seed):
            lengths += [max_len] * (tokens // max_len) + ([tokens % max_len] if tokens % max_len else [])
        cut, _ = cut_batches(lengths, batch_tokens)
        if len(cut) >= batches:
            return cut[:batches]
        count *= 2


def describe(batches) -> str:
    from .corpus import describe as describe_lengths

    return describe_lengths(batches).replace(f"{BYTES_PER_TOKEN:g} bytes a token assumed",
                                             f"{BYTES_PER_TOKEN:g} bytes a token and lognormal sigma {SIGMA:g} "
                                             "per component assumed")
