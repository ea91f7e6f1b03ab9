"""Rank functions of the tuners: the tile-config and plan autotuners agree across ranks and reuse
their caches, and autotuned or planned layers still equal stock's."""

from __future__ import annotations

import torch
import torch.distributed as dist

from .rank_helpers import install, rel, run_layer, tiny_layers, tp_group


def tuning_agreement(directory: str) -> dict:
    """Deliberately different per-rank timings: every rank must pick the same config (the one
    whose slowest rank is fastest), and a second start must reuse the cache."""
    from megatron_overlap.kernels.ag_gemm import TileConfig
    from megatron_overlap.kernels.tuning import ConfigChooser
    from megatron_overlap.tune.cache import DiskCache

    rank = dist.get_rank()
    candidates = [TileConfig(16, 16, 16), TileConfig(32, 32, 16), TileConfig(64, 64, 32)]
    # rank r finds candidate r % 3 fastest on its own; the max over ranks makes candidate 1 best
    own = {0: [1.0, 3.0, 9.0], 1: [9.0, 3.0, 1.0], 2: [5.0, 4.0, 6.0], 3: [2.0, 3.5, 8.0]}[rank]
    calls = []

    def timer(kind, config, m, n, k, dtype, device):
        calls.append(config.key())
        return own[candidates.index(config)]

    cache = DiskCache("tile_configs", directory=f"{directory}/rank{rank}")
    from megatron_overlap.comm.agree import GroupAgreement

    world = dict(world=dist.get_world_size(), agree=GroupAgreement(dist.group.WORLD))
    first = ConfigChooser(candidates, cache=cache, timer=timer).choose("ag_gemm", 64, 48, 32, torch.float32, **world)
    measured_first = len(calls)

    def must_not_run(*a):
        raise AssertionError("measured although cached")

    second = ConfigChooser(candidates, cache=cache, timer=must_not_run).choose("ag_gemm", 64, 48, 32,
                                                                               torch.float32, **world)
    return {"first": first.key(), "second": second.key(), "measured_first": measured_first}


def plan_tuner_agreement(directory: str) -> dict:
    """Deliberately different per-rank timings on a TP=4 group: one pick on every rank (the
    candidate whose slowest rank is fastest), and the next start reuses the cache."""
    from megatron_overlap.tp.autotune import PlanChoice, PlanTuner, candidates
    from megatron_overlap.tp.backends.p2p import P2PBackend
    from megatron_overlap.tune.cache import DiskCache

    group = tp_group(4)
    rank = dist.get_rank()
    cands = [c.key() for c in candidates(4, 13, 3)]
    # each rank's own favourite differs (rank r finds candidate -r fastest); over the 4 ranks
    # every other candidate has a slow rank (>= 13), so cands[3] (10.5 everywhere) must win
    table = {c: 10.0 + ((i + rank) % len(cands)) for i, c in enumerate(cands)}
    table[cands[3]] = 10.5
    calls = []

    def measure(choice, *a):
        calls.append(choice.key())
        return table[choice.key()]

    cache = DiskCache("tp_plans", directory=f"{directory}/rank{rank}")
    x, w = torch.randn(13, 3, 96), torch.randn(50, 96)
    first = PlanTuner(True, cache=cache, measure=measure).choose("column", x, w, group, 13, P2PBackend(), None)

    def must_not_run(*a):
        raise AssertionError("measured although cached")

    second = PlanTuner(True, cache=cache, measure=must_not_run).choose("column", x, w, group, 13, P2PBackend(), None)
    return {"first": first.key(), "second": second.key(), "measured": len(calls), "expected": cands[3],
            "candidates": len(cands)}


def autotuned_layers_match_stock(tp: int, flags: list[str], cache_dir: str) -> dict:
    """Real measurements (--overlap-tp-autotune) or a plan file: results still equal stock's, the
    cache holds one entry per linear shape."""
    import glob
    import json
    import os

    from megatron_overlap.lab import tiny_gpt

    os.environ["MEGATRON_OVERLAP_CACHE"] = f"{cache_dir}/rank{dist.get_rank()}"
    tiny_gpt.init_parallel(tp)
    _config, layers = tiny_layers(tp, fusion=False)
    gen = torch.Generator().manual_seed(3 + dist.get_rank())
    worst = 0.0
    for name in ("fc1(column)", "fc2(row)"):
        layer = layers[name]
        column = "column" in name
        x = torch.randn(13 if column else 13 * tp, 3, 96 if column else layer.input_size_per_partition, generator=gen)
        dy = torch.randn(13 * tp if column else 13, 3, layer.output_size_per_partition if column else 96, generator=gen)
        install([])
        stock = run_layer(layer, x, dy, False)
        install(flags)
        ours = run_layer(layer, x, dy, False)
        worst = max(worst, max(rel(ours[k], stock[k]) for k in stock))
    from megatron_overlap.integration.install import find_installation

    tuned = list(find_installation().tp.plans().values())
    pieces = sorted({len(p.pieces) for p in tuned})
    install([])
    entries = 0
    for path in glob.glob(f"{cache_dir}/rank{dist.get_rank()}/tp_plans.json"):
        entries = len(json.load(open(path)))
    return {"worst": worst, "entries": entries, "pieces": pieces}
