"""The main job's second part: pipelines with data parallelism at scale, on the emulated
cluster (``lab/cluster.py``; what ``bench pp --emulate`` measures, the same code).

16 ranks fit on this machine because their compute is a wait of the cost model's times that
holds no core: PP=8 x DP=2 of Llama-3-70B on H100s (TP=8 folded into each rank), Megatron's
1F1B against ours, the real executor, DDP and distributed optimizer, every byte on the emulated
link. What it shows is time (emulated), not numerics: the losses are those of the blocks' cheap
math, equal when the schedules compute the same thing; the numerics of our schedules are
tested on real compute (tests/test_pp_training.py). Printed beside the measurement: the
simulator's prediction, the floor any schedule can reach with the DP sync (CP-SAT), and the
limit, the busiest stage's compute alone (no bubble, no transfer).
"""

from __future__ import annotations

from typing import Optional

DEFAULT = (8, 2, 8)  # PP x DP, micro-batches
OLD_SPELLINGS = (("--cluster PPxDPxM", "--cluster PPxDP --micro-batches M"),)  # still read, with a warning


def parse_cluster(text: str, microbatches: Optional[int] = None) -> Optional[tuple]:
    """``--cluster PPxDP`` and ``--micro-batches M`` (``off``: skip the part); the old
    ``PPxDPxM`` still works, with a deprecation warning."""
    if text in ("off", "none", ""):
        return None
    try:
        sizes = [int(x) for x in text.lower().split("x")]
        if len(sizes) not in (2, 3):
            raise ValueError(text)
    except ValueError:
        raise SystemExit(f"demo: --cluster {text!r}: give PPxDP (pipeline stages x data-parallel replicas, e.g. "
                         f"{DEFAULT[0]}x{DEFAULT[1]}; micro-batches: --micro-batches) or off")
    if len(sizes) == 3:
        from ..args import deprecation

        if microbatches is not None:
            raise SystemExit(f"demo: --cluster {text!r} gives the micro-batches too; drop --micro-batches or give "
                             "--cluster PPxDP")
        deprecation(*OLD_SPELLINGS[0])
        return tuple(sizes)
    return sizes[0], sizes[1], DEFAULT[2] if microbatches is None else microbatches


def cluster_config(spec: tuple, model: str = "llama3-70b", hardware: str = "h100-sxm", steps: int = 4):
    """The part's ``ClusterConfig``, checked (``bench_cluster.check``) before anything runs."""
    from ..lab.cluster import ClusterConfig
    from .bench_cluster import check

    pp, dp, m = spec
    cfg = ClusterConfig(pp=pp, dp=dp, microbatches=m, model=model, hardware=hardware, steps=steps, warmup=1,
                        exposed=False)
    check(cfg)
    return cfg


def run_cluster_part(cfg, progress: bool = True) -> dict:
    from .bench_cluster import run

    m = cfg.microbatches
    result = run(cfg, progress=progress, floor_time_s=30.0)
    times = [t for t in result["times_ms"]]
    result["limit_ms"] = max(m * (t["f"] + t["b"] + t["w"]) for t in times)  # the busiest stage's compute alone
    stock = result["modes"]["stock"]["step_ms"]
    result["ceiling"] = stock / result["limit_ms"]
    return result


def format_cluster_part(result: dict) -> str:
    from .cluster_report import NAMES

    cfg = result["config"]
    lines = [
        f"pipelines at scale, emulated (times, not numerics): {cfg['model']} on {cfg['hardware']}, "
        f"PP={cfg['pp']} x DP={cfg['dp']} = {cfg['pp'] * cfg['dp']} ranks on this machine (each a GPU whose compute is "
        f"a wait of the cost model's F/B/W), m = {cfg['microbatches']}, Megatron's DDP with the distributed optimizer, "
        f"{cfg['steps']} rounds",
        "",
        f"{'':24}{'step ms':>9}{'vs stock':>10}{'predicted':>11}{'error':>8}{'CPU/step':>10}",
    ]
    for mode, r in result["modes"].items():
        lines.append(f"{NAMES[mode]:24}{r['step_ms']:>9.1f}{r.get('speedup', 1.0):>9.2f}x{r['predicted_step_ms']:>11.1f}"
                     f"{100 * r['prediction_error']:>+7.1f}%{100 * r['cpu_share']:>9.1f}%")
    best = max((m for m in result["modes"] if m != "stock"), key=lambda m: result["modes"][m].get("speedup", 0))
    fl = result["floor"]
    floor = f"{fl['bound_ms']:.1f} ms (CP-SAT{'' if fl.get('optimal') else ', proved bound'})" if "bound_ms" in fl \
        else f"not computed ({fl.get('error')})"
    lines += [
        "",
        f"median speedup of {NAMES[best]} over stock: {result['modes'][best]['speedup']:.2f}x; losses "
        f"{'identical' if result['losses_identical'] else 'DIFFER'} across schedules (the blocks' cheap math)",
        f"limit (the busiest stage's compute alone, no bubble, no transfer): {result['limit_ms']:.1f} ms, ceiling "
        f"stock / limit {result['ceiling']:.2f}x; floor with the DP sync at 1F1B's memory (simulated): {floor}",
    ]
    return "\n".join(lines)
