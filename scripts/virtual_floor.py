"""The floor of BENCHMARKS.md's "Virtual pipelines, simulated": Llama-3-70B on H100, TP=8 x
PP=4 x DP=2, v = 2, m = 16, `symm-mem` inside each stage (the plan's costs), over the
interleaved and the V placement at 1.05x stock interleaved's activation memory per stage, with
the per-chunk DP sync (tune/virtual.chunk_syncs) relaxed to stay a bound
(cli/cluster_virtual.relaxed_syncs). Simulated; CP-SAT.

    python scripts/virtual_floor.py [seconds per placement, default 100]
"""

import sys
import time

from megatron_overlap.cli.cluster_virtual import relaxed_syncs
from megatron_overlap.pp import build
from megatron_overlap.pp.chunks import interleaved_placement, v_placement
from megatron_overlap.pp.optimal import floor
from megatron_overlap.tune.hardware import get_hardware
from megatron_overlap.tune.models import RunSpec, get_model
from megatron_overlap.tune.pipeline import DPOptions, stage_costs
from megatron_overlap.tune.strategies import Strategy
from megatron_overlap.tune.virtual import chunk_syncs


def main(limit_s: float) -> None:
    model, hw = get_model("llama3-70b"), get_hardware("h100-sxm")
    run = RunSpec(tp=8, pp=4, dp=2, seq=8192, micro_batch=1, micro_batches=16, phase="train")
    costs = stage_costs(model, run, hw, Strategy("symm-mem"))
    syncs = relaxed_syncs(chunk_syncs(costs.work, run, hw, DPOptions(), 2, "zb", "every-chunk"))  # the finest cut
    memory = [1.05 * x for x in build("megatron", 4, 16, chunks=2).memory_bound]
    for name, placement in (("interleaved", interleaved_placement(4, 2)), ("V", v_placement(4))):
        t0 = time.time()
        f = floor(costs.times, 16, costs.transfer_ms, 0.0, memory=memory, time_limit_s=limit_s, dp=syncs,
                  placement=placement, bound_only=True)
        found = "none found in time" if f.step_ms == float("inf") else f"{f.step_ms:.1f} ms"
        print(f"{name:12} proved bound {f.bound_ms:.1f} ms, best schedule {found}, optimal {f.optimal} "
              f"({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main(float(sys.argv[1]) if len(sys.argv) > 1 else 100.0)
