"""The trade-off behind hdp.bound_tradeoff: per heavy-tailed batch (the sweep's, R = 64 and 256,
1-2 x R x C), our plan made with the linears 1.0-2.0x cheaper, scored under our model (+1 ms per
micro-batch) and the L^2 model against their bounds; per selection rule (ours-model target, L^2
target, candidate speedups; ours where it is within 1.10x of the L^2 bound) the time-weighted pair.

    python scripts/hdp_bound_tradeoff_scan.py
"""
import dataclasses
import warnings

warnings.simplefilter("ignore")
from megatron_overlap.cli.bench_hdp import draw_batches, loading_ranks
from megatron_overlap.hdp import HdpCostModel, schedule_hdp, simulate
from megatron_overlap.hdp.cost import SquareWorkload
from megatron_overlap.hdp.simulate import lower_bound_ms
cost, C = HdpCostModel(), 32768
scoring = dataclasses.replace(cost, microbatch_overhead_ms=1.0); sq = SquareWorkload(gpus_per_node=8)
SP = [1.0, 1.1, 1.2, 1.33, 1.5, 1.67, 2.0]
rules = {"A": (1.05, 1.10, SP), "B": (1.04, 1.10, SP), "C": (1.045, 1.095, SP), "D": (1.04, 1.10, [1.0, 1.2, 1.5, 2.0]),
         "E": (1.04, 1.10, [1.0, 1.33, 2.0]), "F": (1.03, 1.10, SP), "G": (1.045, 1.10, [1.0, 1.1, 1.2, 1.33, 1.5]),
         "shipped": (1.05, 1.10, [1.0, 1.33, 2.0])}
for R, mult in [(64, 1), (64, 2), (256, 1), (256, 2)]:
    batches = draw_batches("heavy-tailed", 8, mult * R * C, R * C // 8, 0)
    B = [0, 0]; tot = {k: [0, 0] for k in rules}
    for lens in batches:
        b = (lower_bound_ms(lens, R, C, scoring), lower_bound_ms(lens, R, C, sq)); B[0] += b[0]; B[1] += b[1]
        res = {}
        for f in SP:
            p = schedule_hdp(lens, R, C, dataclasses.replace(cost, gemm_fraction=0.75 * f), home=loading_ranks(len(lens), R))
            res[f] = (simulate(p, scoring).step_ms, simulate(p, sq).step_ms)
        for k, (to, tl, cands) in rules.items():
            f = 1.0 if res[1.0][1] <= 1.10 * b[1] else min(cands, key=lambda f: max(res[f][0] / b[0] / to, res[f][1] / b[1] / tl))
            tot[k][0] += res[f][0]; tot[k][1] += res[f][1]
    print(R, mult, " ".join(f"{k}: {v[0]/B[0]:.3f}/{v[1]/B[1]:.3f}" for k, v in tot.items()), flush=True)
