"""Every rank's end of compute and its last data-parallel ops, stock interleaved against zb, on the
emulated cluster (PP=4 x DP=2, v=2, m=16, Llama-3-70B/H100): where the exposed DP of BENCHMARKS.md's
"Virtual pipelines on the emulated cluster" comes from. Times, emulated.

    python scripts/cluster_dp_trace.py
"""
from dataclasses import asdict

from megatron_overlap.lab.cluster import ClusterConfig, ClusterRanks
from megatron_overlap.lab.rank_pool import RankPool
from megatron_overlap.lab.session import RemoteSession


def main() -> None:
    cfg = ClusterConfig(pp=4, dp=2, microbatches=16, steps=3, warmup=1, exposed=True, vpp=2, modes=("stock","zb"))
    with RankPool(cfg.world, timeout=3600, threads_per_rank=1) as pool:
        ranks = RemoteSession(pool, ClusterRanks, asdict(cfg))
        rounds = ranks.rounds(cfg.warmup, cfg.steps, record_last=True)
        ranks.close()
    last = rounds[-1]
    for mode in cfg.modes:
        print("==", mode, "steps", [round(1e3*max(r[mode]["link"]["schedule_s"] for r in pr),1) for pr in rounds],
              "dpfree", [round(1e3*max(r[mode]["dp free"]["schedule_s"] for r in pr),1) for pr in rounds])
        for r in sorted(last, key=lambda x: (x["stage"], x["dp_rank"])):
            t = r[mode]["link"]["trace"]
            comp_end = max(b for _k, a, b in t["compute"])
            dp = [(op, round(1e3*a,1), round(1e3*b,1)) for op, a, b in t["link"] if "reduce" in op or "gather" in op]
            print(r["stage"], r["dp_rank"], "sched", round(1e3*r[mode]["link"]["schedule_s"],1), "comp_end", round(1e3*comp_end,1),
                  "last DP ops", dp[-3:], "first", dp[:2], "n", len(dp))


if __name__ == "__main__":
    main()
