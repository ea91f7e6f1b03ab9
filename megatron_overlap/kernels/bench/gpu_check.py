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
    p.add_argument("--world", type=int, default=8, help="virtual ranks of the emulation")
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
    import triton

    from megatron_overlap.kernels.ag_gemm import CONFIGS, TileConfig, ag_gemm
    from megatron_overlap.kernels.emulation import emulate_ag_gemm, emulate_gemm_rs
    from megatron_overlap.tune.cache import time_call
    from megatron_overlap.tp.backends import symm_mem

    cuda = torch.cuda.is_available() and not args.interpret
    if not cuda and not args.interpret:
        print("gpu_check: no CUDA device; run with --interpret for the CPU emulation", file=sys.stderr)
        return 2
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    configs = CONFIGS[: args.configs] if cuda else (TileConfig(32, 32, 16), TileConfig(16, 32, 16))
    results = {
        "mode": "gpu" if cuda else "cpu-interpreter (timings are not meaningful)",
        "device": torch.cuda.get_device_name(0) if cuda else platform.processor() or "cpu",
        "torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d"), "shape": {"M": args.m, "N": args.n, "K": args.k},
        "dtype": str(dtype).replace("torch.", ""), "world": args.world,
    }
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5  # bf16 keeps 8 mantissa bits; fp32 ~1e-7
    ok = True
    print(f"gpu_check {results['mode']}: {results['device']}, torch {results['torch']}, "
          f"triton {results['triton']}; sections {sections}", flush=True)
    _save(args.json, results)

    def rel(a, b):
        return ((a.float() - b.float()).norm() / b.float().norm()).item()

    m_local = args.m // args.world
    small = dict(world=min(args.world, 4), m_local=min(m_local, 333), n=min(args.n, 1000), k=min(args.k, 520))
    a = torch.randn(args.m, args.k, dtype=dtype, device=device)
    b = torch.randn(args.k, args.n, dtype=dtype, device=device)
    flops = 2 * args.m * args.n * args.k
    t_mm = time_call(lambda: torch.matmul(a, b), device)
    results["matmul_ms"] = 1e3 * t_mm
    results["matmul_tflops"] = flops / t_mm / 1e12
    print(f"  torch.matmul {args.m}x{args.n}x{args.k} {results['dtype']}: {1e3 * t_mm:.3f} ms "
          f"({results['matmul_tflops']:.1f} TFLOP/s)", flush=True)
    best_config = configs[-1]

    if "preset" in sections:
        # correctness with every flag raised (no producer: cannot wait forever), odd shapes
        w, ml, n, k = small["world"], small["m_local"], small["n"], small["k"]
        x = torch.randn(w * ml, k, dtype=dtype, device=device)
        y = torch.randn(k, n, dtype=dtype, device=device)
        fl = torch.ones(w, dtype=torch.int32, device=device)
        bnd = [i * ml for i in range(w)] + [w * ml]
        errs = {c.key(): rel(ag_gemm(x, y, fl, bnd, list(range(w)), config=c), x @ y) for c in configs}
        results["ag_gemm_preset_rel_err"] = errs
        ok &= all(v <= tol for v in errs.values())
        flags = torch.ones(args.world, dtype=torch.int32, device=device)
        bounds = [i * m_local for i in range(args.world)] + [args.m]
        order = list(range(args.world))
        per_config = {}
        for config in configs:
            per_config[config.key()] = time_call(lambda: ag_gemm(a, b, flags, bounds, order, config=config), device)
        best = min(per_config, key=per_config.get)
        best_config = next(c for c in configs if c.key() == best)
        results["ag_gemm_preset_ms"] = {k_: 1e3 * v for k_, v in per_config.items()}
        results["ag_gemm_best_config"] = best
        results["ag_gemm_vs_matmul_throughput"] = t_mm / per_config[best]
        print(f"  AG-GEMM correctness, flags preset (rel. err, tol {tol:g}): "
              + ", ".join(f"{k_} {v:.1e}" for k_, v in errs.items()), flush=True)
        print("  AG-GEMM flags preset: " + ", ".join(f"{k_} {1e3 * v:.3f} ms" for k_, v in per_config.items())
              + f"; best = {results['ag_gemm_vs_matmul_throughput']:.3f}x matmul throughput (target >= 0.95)",
              flush=True)
        _save(args.json, results)

    if "rs" in sections:
        r = emulate_gemm_rs(small["world"], small["m_local"], small["n"], small["k"], dtype, device,
                            config=best_config)
        results["gemm_rs_rel_err"] = max(rel(o, ref) for o, ref in zip(r["outs"], r["references"]))
        ok &= results["gemm_rs_rel_err"] <= tol
        print(f"  GEMM-RS + reduce correctness: rel. err {results['gemm_rs_rel_err']:.1e}", flush=True)
        _save(args.json, results)

    if "chunked" in sections:
        chunked = {}
        for c in (1, 2, 4, 8, 16):
            parts = a.tensor_split(c)
            t = time_call(lambda: [torch.matmul(p_, b) for p_ in parts], device)
            chunked[c] = {"ms": 1e3 * t, "efficiency": t_mm / t}
        results["chunked_gemm"] = chunked
        print("  chunked GEMM efficiency: " + ", ".join(f"{c}: {v['efficiency']:.3f}" for c, v in chunked.items()),
              flush=True)
        _save(args.json, results)

    if "symm_mem" in sections:
        usable, why = symm_mem.availability("cuda" if cuda else "cpu")
        results["symm_mem"] = {"usable": usable, "note": why}
        if usable:
            results["symm_mem"]["world1"] = _symm_mem_world1(torch, symm_mem, rel, dtype)
        print(f"  symm-mem: {'usable' if usable else 'not usable'} ({why}); "
              f"world-1 ops: {results['symm_mem'].get('world1', 'not run')}", flush=True)
        _save(args.json, results)

    if "live" in sections:
        correctness = {}
        for producer in ("copy_engine", "push_kernel"):
            r = emulate_ag_gemm(small["world"], small["m_local"], small["n"], small["k"], dtype, device,
                                producer=producer, config=best_config)
            correctness[f"ag_gemm[{producer}]"] = rel(r["out"], r["reference"])
        results["live_rel_err"] = correctness
        ok &= all(v <= tol for v in correctness.values())
        print("  AG-GEMM correctness, live producer: " + ", ".join(f"{k_} {v:.1e}" for k_, v in correctness.items()),
              flush=True)
        _save(args.json, results)
        flags = torch.ones(args.world, dtype=torch.int32, device=device)
        bounds = [i * m_local for i in range(args.world)] + [args.m]
        t_fused = time_call(lambda: ag_gemm(a, b, flags, bounds, list(range(args.world)), config=best_config,
                                            reserved_sms=8), device)  # as in the emulation
        shards = [torch.randn(m_local, args.k, dtype=dtype, device=device) for _ in range(args.world)]
        dst = torch.empty(args.m, args.k, dtype=dtype, device=device)
        t_copy = time_call(lambda: [dst[i * m_local:(i + 1) * m_local].copy_(s) for i, s in enumerate(shards[1:], 1)],
                           device)
        live = {}
        for producer in ("copy_engine", "push_kernel"):
            live[producer] = time_call(lambda: emulate_ag_gemm(args.world, m_local, args.n, args.k, dtype, device,
                                                               producer=producer, config=best_config,
                                                               inputs=(shards, b), reference=False), device)
            print(f"  live producer {producer}: {1e3 * live[producer]:.3f} ms", flush=True)
            _save(args.json, {"live_producer_ms": {k_: 1e3 * v for k_, v in live.items()}})
        results["copy_ms"] = 1e3 * t_copy
        results["live_fused_preset_ms"] = 1e3 * t_fused
        results["live_producer_ms"] = {k_: 1e3 * v for k_, v in live.items()}
        results["live_vs_max_gemm_copy"] = {k_: v / max(t_fused, t_copy) for k_, v in live.items()}
        print(f"  live producer: copies alone {1e3 * t_copy:.3f} ms, AG-GEMM preset {1e3 * t_fused:.3f} ms; "
              + ", ".join(f"{k_} {1e3 * live[k_]:.3f} ms = {results['live_vs_max_gemm_copy'][k_]:.3f}x "
                          "max(GEMM, copy)" for k_ in live) + " (target <= 1.10)", flush=True)
        _save(args.json, results)

    if args.json and os.path.exists(args.json):  # AND with the sections run by earlier processes
        with open(args.json) as f:
            ok = ok and json.load(f).get("correctness_ok", True)
    _save(args.json, {"correctness_ok": ok})
    print(f"  correctness: {'all within' if ok else 'NOT within'} tolerance {tol:g}", flush=True)
    return 0 if ok else 1


def _symm_mem_world1(torch, symm_mem, rel, dtype) -> dict:
    """Run the two fused ops on a one-rank NCCL group: proves the calls, not the overlap."""
    import torch.distributed as dist

    out = {}
    try:
        if not dist.is_initialized():
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", "29571")
            dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
        group = dist.group.WORLD
        ops = symm_mem.TorchSymmMemOps()
        x = torch.randn(1024, 512, dtype=dtype, device="cuda")
        w = torch.randn(512, 768, dtype=dtype, device="cuda")
        y, gathered = ops.all_gather_matmul(x, w, group, True)
        out["all_gather_matmul_rel_err"] = rel(y, x @ w)
        out["returned_gathered"] = gathered is not None
        z = ops.matmul_reduce_scatter(x, w, group)
        out["matmul_reduce_scatter_rel_err"] = rel(z, x @ w)
    except Exception as exc:  # record what this torch does at world size 1, do not stop the check
        out["error"] = f"{type(exc).__name__}: {exc}"[:400]
    return out


if __name__ == "__main__":
    raise SystemExit(main())
