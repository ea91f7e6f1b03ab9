"""The HDP planner's wall time per step (``schedule_hdp`` with locality), as BENCHMARKS.md's
HDP planner-time entry quotes it: at R = 64 and 256, C = 32768, T = 2 and 8 x R x C, two batches of the
packages corpus and one heavy-tailed batch per point, documents cut at R x C / 8; then a digest
of every plan (the same digest before and after a speed change means the same plans). With
the guard: the same, plus megatron-core's plan (``schedule_megatron_balanced``) and
``bound_tradeoff.for_both`` and ``guard.guarded``, what the runtime and ``bench hdp`` plan per step; a digest of those plans too.

    python scripts/hdp_planner_speed.py
"""

import hashlib
import time

from megatron_overlap.cli.bench_hdp import draw_batches, loading_ranks
from megatron_overlap.cli.corpus import corpus_batches, package_documents
from megatron_overlap.hdp import HdpCostModel, schedule_hdp
from megatron_overlap.hdp.bound_tradeoff import for_both
from megatron_overlap.hdp.guard import guarded
from megatron_overlap.integration.baselines import schedule_megatron_balanced

docs, cost, C = package_documents(), HdpCostModel(), 32768
plans, guarded_plans = [], []
schedule_megatron_balanced([1], 1, C)  # its first call may import megatron-core
for R in (64, 256):
    for mult in (2, 8):
        batches = corpus_batches(docs, mult * R * C, R * C // 8, 0, min_batches=2)[:2]
        batches += draw_batches("heavy-tailed", 1, mult * R * C, R * C // 8, 0)
        times, with_guard = [], []
        for lens in batches:
            t = time.perf_counter()
            home = loading_ranks(len(lens), R)
            ours = schedule_hdp(lens, R, C, cost, home=home)
            times.append(time.perf_counter() - t)
            kept = guarded(for_both(ours, cost, home=home), schedule_megatron_balanced(lens, R, C), cost)
            with_guard.append(time.perf_counter() - t)
            plans.append(repr(ours.microbatches))
            guarded_plans.append(repr(kept.microbatches))
        print(f"R={R} T={mult}xRC sequences {[len(b) for b in batches]}: s per step "
              + " ".join(f"{t:.2f}" for t in times) + "; with megatron-core's plan and the guard "
              + " ".join(f"{t:.2f}" for t in with_guard), flush=True)
print("plans digest", hashlib.sha1("".join(plans).encode()).hexdigest())
print("guarded plans digest", hashlib.sha1("".join(guarded_plans).encode()).hexdigest())
