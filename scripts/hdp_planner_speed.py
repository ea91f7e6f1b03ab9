"""The HDP planner's wall time per step (``schedule_hdp`` with locality), as BENCHMARKS.md's
issue-24 entry quotes it: at R = 64 and 256, C = 32768, T = 2 and 8 x R x C, two batches of the
packages corpus and one heavy-tailed batch per point, documents cut at R x C / 8; then a digest
of every plan (the same digest before and after a speed change means the same plans).

    python scripts/hdp_planner_speed.py
"""

import hashlib
import time

from megatron_overlap.cli.bench_hdp import draw_batches, loading_ranks
from megatron_overlap.cli.corpus import corpus_batches, package_documents
from megatron_overlap.hdp import HdpCostModel, schedule_hdp

docs, cost, C = package_documents(), HdpCostModel(), 32768
plans = []
for R in (64, 256):
    for mult in (2, 8):
        batches = corpus_batches(docs, mult * R * C, R * C // 8, 0, min_batches=2)[:2]
        batches += draw_batches("heavy-tailed", 1, mult * R * C, R * C // 8, 0)
        times = []
        for lens in batches:
            t = time.perf_counter()
            plans.append(repr(schedule_hdp(lens, R, C, cost, home=loading_ranks(len(lens), R)).microbatches))
            times.append(time.perf_counter() - t)
        print(f"R={R} T={mult}xRC sequences {[len(b) for b in batches]}: s per step "
              + " ".join(f"{t:.2f}" for t in times), flush=True)
print("plans digest", hashlib.sha1("".join(plans).encode()).hexdigest())
