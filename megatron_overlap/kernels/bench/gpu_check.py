"""One-GPU check of the fused kernels, in one run (< 5 minutes on one H200):

1. correctness of AG-GEMM and GEMM-RS against their references (bf16 on GPU);
2. AG-GEMM with every flag preset vs ``torch.matmul`` of the same GEMM
   (M=16384, N=K=8192, bf16; target >= 0.95x its throughput);
3. AG-GEMM with a live producer on a side stream (one-process emulation, copy engine and
   push kernel) vs max(GEMM alone, copies alone) (target <= 1.10x);
4. chunked-GEMM efficiency: the same GEMM cut into 1, 2, 4, 8, 16 row chunks (cost-model input);
5. whether PyTorch's symmetric-memory ops are usable here.

Prints each section as it finishes and merges every number into the JSON of ``--json``
(sections can run in separate processes, ``--only``, each under its own time limit).

    python -m megatron_overlap.kernels.bench.gpu_check --json out.json          # on a GPU
    python -m megatron_overlap.kernels.bench.gpu_check --interpret --json o.json  # CPU, tiny shapes

With ``--interpret`` everything runs under Triton's CPU interpreter in fp32 on tiny shapes:
correctness means something, the timings do not (they are printed as such).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time


def _args(argv=None):
    p = argparse.ArgumentParser(prog="gpu_check", description=__doc__.split("\n\n")[0])
    p.add_argument("--interpret", action="store_true", help="CPU, Triton interpreter, tiny fp32 shapes")
    p.add_argument("--json", default="", help="write the full results here")
    p.add_argument("--ranks", "--world", dest="world", type=int, default=8,
                   help="virtual ranks of the emulation (--world: the old spelling)")
    p.add_argument("--m", type=int, default=16384)
    p.add_argument("--n", type=int, default=8192)
    p.add_argument("--k", type=int, default=8192)
    p.add_argument("--configs", type=int, default=3, help="tile configs to time (first N of CONFIGS)")
    p.add_argument("--only", default="", help="comma-separated sections to run (default: all): " + ",".join(SECTIONS))
    return p.parse_args(argv)


SECTIONS = ("preset", "rs", "chunked", "symm_mem", "live")


def _save(path: str, results: dict) -> None:
    """Merge ``results`` into the JSON at ``path`` (sections may run in separate processes)."""
    if not path:
        return
    old = {}
    if os.path.exists(path):
        with open(path) as f:
            old = json.load(f)
    old.update(results)
    with open(path, "w") as f:
        json.dump(old, f, indent=1)


def main(argv=None) -> int:
    args = _args(argv)
    sections = [s for s in args.only.split(",") if s] or list(SECTIONS)
    unknown = sorted(set(sections) - set(SECTIONS))
    if unknown:
        print(f"gpu_check: unknown section(s) {unknown}; choose from {list(SECTIONS)}", file=sys.stderr)
        return 2
    if args.interpret:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
        args.world, args.m, args.n, args.k, args.configs = 4, 96, 40, 48, 2
    import torch

    if not torch.cuda.is_available() and not args.interpret:
        print("gpu_check: no CUDA device; run with --interpret for the CPU emulation", file=sys.stderr)
        return 2
    c = _context(args, sections)
    ok = True
    for name, run in (("preset", _preset), ("rs", _rs), ("chunked", _chunked), ("symm_mem", _symm_mem),
                      ("live", _live)):
        if name in sections:
            ok &= run(c)
            _save(args.json, c.results)
    if args.json and os.path.exists(args.json):  # AND with the sections run by earlier processes
        with open(args.json) as f:
            ok = ok and json.load(f).get("correctness_ok", True)
    _save(args.json, {"correctness_ok": ok})
    print(f"  correctness: {'all within' if ok else 'NOT within'} tolerance {c.tol:g}", flush=True)
    return 0 if ok else 1


def _context(args, sections):
    """What every section shares: device, dtype, tile configs, the big GEMM's operands and its
    ``torch.matmul`` time (timed here, first)."""
    import types

    import torch
    import triton

    from megatron_overlap.kernels.ag_gemm import CONFIGS, TileConfig
    from megatron_overlap.tune.cache import time_call

    cuda = torch.cuda.is_available() and not args.interpret
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    c = types.SimpleNamespace(args=args, torch=torch, cuda=cuda, device=device, dtype=dtype, time_call=time_call)
    c.configs = CONFIGS[: args.configs] if cuda else (TileConfig(32, 32, 16), TileConfig(16, 32, 16))
    c.results = {
        "mode": "gpu" if cuda else "cpu-interpreter (timings are not meaningful)",
        "device": torch.cuda.get_device_name(0) if cuda else platform.processor() or "cpu",
        "torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d"), "shape": {"M": args.m, "N": args.n, "K": args.k},
        "dtype": str(dtype).replace("torch.", ""), "world": args.world,
    }
    c.tol = 2e-2 if dtype == torch.bfloat16 else 1e-5  # bf16 keeps 8 mantissa bits; fp32 ~1e-7
    print(f"gpu_check {c.results['mode']}: {c.results['device']}, torch {c.results['torch']}, "
          f"triton {c.results['triton']}; sections {sections}", flush=True)
    _save(args.json, c.results)
    c.rel = lambda a, b: ((a.float() - b.float()).norm() / b.float().norm()).item()
    c.m_local = args.m // args.world
    c.small = dict(world=min(args.world, 4), m_local=min(c.m_local, 333), n=min(args.n, 1000), k=min(args.k, 520))
    c.a = torch.randn(args.m, args.k, dtype=dtype, device=device)
    c.b = torch.randn(args.k, args.n, dtype=dtype, device=device)
    c.t_mm = time_call(lambda: torch.matmul(c.a, c.b), device)
    c.results["matmul_ms"] = 1e3 * c.t_mm
    c.results["matmul_tflops"] = 2 * args.m * args.n * args.k / c.t_mm / 1e12
    print(f"  torch.matmul {args.m}x{args.n}x{args.k} {c.results['dtype']}: {1e3 * c.t_mm:.3f} ms "
          f"({c.results['matmul_tflops']:.1f} TFLOP/s)", flush=True)
    c.best_config = c.configs[-1]
    c.warmed = set()  # producer kernels loaded before a GEMM spins (kernels/emulation.py)
    return c


def _preset(c) -> bool:
    """AG-GEMM with every flag raised: correct on odd shapes (no producer: cannot wait forever),
    and its throughput against ``torch.matmul`` per tile config."""
    from megatron_overlap.kernels.ag_gemm import ag_gemm, check_error, spin_limit

    torch, args, results = c.torch, c.args, c.results
    w, ml, n, k = c.small["world"], c.small["m_local"], c.small["n"], c.small["k"]
    x = torch.randn(w * ml, k, dtype=c.dtype, device=c.device)
    y = torch.randn(k, n, dtype=c.dtype, device=c.device)
    fl = torch.ones(w, dtype=torch.int32, device=c.device)
    bnd = [i * ml for i in range(w)] + [w * ml]
    errs = {cfg.key(): c.rel(ag_gemm(x, y, fl, bnd, list(range(w)), config=cfg), x @ y) for cfg in c.configs}
    results["ag_gemm_preset_rel_err"] = errs
    flags = torch.ones(args.world, dtype=torch.int32, device=c.device)
    bounds = [i * c.m_local for i in range(args.world)] + [args.m]
    order = list(range(args.world))
    per_config = {}
    for config in c.configs:
        error = torch.zeros(1, dtype=torch.int32, device=c.device)  # checked after timing, not per call
        per_config[config.key()] = c.time_call(lambda: ag_gemm(c.a, c.b, flags, bounds, order, config=config,
                                                               error=error), c.device)
        check_error(error, "ag_gemm", spin_limit(300.0))
    best = min(per_config, key=per_config.get)
    c.best_config = next(cfg for cfg in c.configs if cfg.key() == best)
    results["ag_gemm_preset_ms"] = {k_: 1e3 * v for k_, v in per_config.items()}
    results["ag_gemm_best_config"] = best
    results["ag_gemm_vs_matmul_throughput"] = c.t_mm / per_config[best]
    print(f"  AG-GEMM correctness, flags preset (rel. err, tol {c.tol:g}): "
          + ", ".join(f"{k_} {v:.1e}" for k_, v in errs.items()), flush=True)
    print("  AG-GEMM flags preset: " + ", ".join(f"{k_} {1e3 * v:.3f} ms" for k_, v in per_config.items())
          + f"; best = {results['ag_gemm_vs_matmul_throughput']:.3f}x matmul throughput (target >= 0.95)", flush=True)
    return all(v <= c.tol for v in errs.values())


def _rs(c) -> bool:
    """GEMM-RS + reduce against the plain GEMM, every virtual rank on one device."""
    from megatron_overlap.kernels.emulation import emulate_gemm_rs

    r = emulate_gemm_rs(c.small["world"], c.small["m_local"], c.small["n"], c.small["k"], c.dtype, c.device,
                        config=c.best_config)
    c.results["gemm_rs_rel_err"] = max(c.rel(o, ref) for o, ref in zip(r["outs"], r["references"]))
    print(f"  GEMM-RS + reduce correctness: rel. err {c.results['gemm_rs_rel_err']:.1e}", flush=True)
    return c.results["gemm_rs_rel_err"] <= c.tol


def _chunked(c) -> bool:
    """What cutting the GEMM costs: ``torch.matmul`` on 1 .. 16 row chunks."""
    chunked = {}
    for n_chunks in (1, 2, 4, 8, 16):
        parts = c.a.tensor_split(n_chunks)
        t = c.time_call(lambda: [c.torch.matmul(p_, c.b) for p_ in parts], c.device)
        chunked[n_chunks] = {"ms": 1e3 * t, "efficiency": c.t_mm / t}
    c.results["chunked_gemm"] = chunked
    print("  chunked GEMM efficiency: " + ", ".join(f"{n_}: {v['efficiency']:.3f}" for n_, v in chunked.items()),
          flush=True)
    return True


def _symm_mem(c) -> bool:
    from megatron_overlap.tp.backends import symm_mem

    usable, why = symm_mem.availability("cuda" if c.cuda else "cpu")
    c.results["symm_mem"] = {"usable": usable, "note": why}
    if usable:
        c.results["symm_mem"]["world1"] = symm_mem.one_rank_check(c.dtype)
    print(f"  symm-mem: {'usable' if usable else 'not usable'} ({why}); "
          f"world-1 ops: {c.results['symm_mem'].get('world1', 'not run')}", flush=True)
    return True


def _live(c) -> bool:
    """AG-GEMM fed by a live producer (copy engine, push kernel): correct, and its time against
    max(GEMM with flags preset, the copies alone)."""
    from megatron_overlap.kernels.ag_gemm import ag_gemm, check_error, spin_limit
    from megatron_overlap.kernels.emulation import emulate_ag_gemm

    torch, args, results = c.torch, c.args, c.results
    correctness = {}
    for producer in ("copy_engine", "push_kernel"):
        r = emulate_ag_gemm(c.small["world"], c.small["m_local"], c.small["n"], c.small["k"], c.dtype, c.device,
                            producer=producer, config=c.best_config, warmed=c.warmed)
        correctness[f"ag_gemm[{producer}]"] = c.rel(r["out"], r["reference"])
    results["live_rel_err"] = correctness
    print("  AG-GEMM correctness, live producer: " + ", ".join(f"{k_} {v:.1e}" for k_, v in correctness.items()),
          flush=True)
    _save(args.json, results)
    m_local = c.m_local
    flags = torch.ones(args.world, dtype=torch.int32, device=c.device)
    bounds = [i * m_local for i in range(args.world)] + [args.m]
    error = torch.zeros(1, dtype=torch.int32, device=c.device)  # one word for every timed call, checked after
    t_fused = c.time_call(lambda: ag_gemm(c.a, c.b, flags, bounds, list(range(args.world)), config=c.best_config,
                                          reserved_sms=8, error=error), c.device)  # as in the emulation
    shards = [torch.randn(m_local, args.k, dtype=c.dtype, device=c.device) for _ in range(args.world)]
    dst = torch.empty(args.m, args.k, dtype=c.dtype, device=c.device)
    t_copy = c.time_call(lambda: [dst[i * m_local:(i + 1) * m_local].copy_(s) for i, s in enumerate(shards[1:], 1)],
                         c.device)
    live = {}
    for producer in ("copy_engine", "push_kernel"):
        live[producer] = c.time_call(lambda: emulate_ag_gemm(args.world, m_local, args.n, args.k, c.dtype, c.device,
                                                             producer=producer, config=c.best_config,
                                                             inputs=(shards, c.b), reference=False,
                                                             warmed=c.warmed, error=error), c.device)
        print(f"  live producer {producer}: {1e3 * live[producer]:.3f} ms", flush=True)
        _save(args.json, {"live_producer_ms": {k_: 1e3 * v for k_, v in live.items()}})
    check_error(error, "ag_gemm", spin_limit(300.0))
    results["copy_ms"] = 1e3 * t_copy
    results["live_fused_preset_ms"] = 1e3 * t_fused
    results["live_producer_ms"] = {k_: 1e3 * v for k_, v in live.items()}
    results["live_vs_max_gemm_copy"] = {k_: v / max(t_fused, t_copy) for k_, v in live.items()}
    print(f"  live producer: copies alone {1e3 * t_copy:.3f} ms, AG-GEMM preset {1e3 * t_fused:.3f} ms; "
          + ", ".join(f"{k_} {1e3 * live[k_]:.3f} ms = {results['live_vs_max_gemm_copy'][k_]:.3f}x "
                      "max(GEMM, copy)" for k_ in live) + " (target <= 1.10)", flush=True)
    return all(v <= c.tol for v in correctness.values())


if __name__ == "__main__":
    raise SystemExit(main())
