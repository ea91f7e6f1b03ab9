"""One-GPU check of the fused kernels, in one run (< 5 minutes on one H200):

1. correctness of AG-GEMM and GEMM-RS against their references (bf16 on GPU);
2. AG-GEMM with every flag preset vs ``torch.matmul`` of the same GEMM
   (M=16384, N=K=8192, bf16; target >= 0.95x its throughput);
3. AG-GEMM with a live producer on a side stream (one-process emulation, copy engine and
   push kernel) vs max(GEMM alone, copies alone) (target <= 1.10x);
4. chunked-GEMM efficiency: the same GEMM cut into 1, 2, 4, 8, 16 row chunks (cost-model input);
5. whether PyTorch's symmetric-memory ops are usable here.

Prints a short table last and writes every number as JSON (``--json``).

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
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = _args(argv)
    if args.interpret:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
        args.world, args.m, args.n, args.k, args.configs = 4, 96, 40, 48, 2
    import torch
    import triton

    from megatron_overlap.kernels.ag_gemm import CONFIGS, TileConfig, ag_gemm
    from megatron_overlap.kernels.emulation import emulate_ag_gemm, emulate_gemm_rs
    from megatron_overlap.tuning import time_call
    from megatron_overlap.ops import symm_mem

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

    def rel(a, b):
        return ((a.float() - b.float()).norm() / b.float().norm()).item()

    # 1. correctness
    m_local = args.m // args.world
    small = dict(world=min(args.world, 4), m_local=min(m_local, 333), n=min(args.n, 1000), k=min(args.k, 520))
    correctness = {}
    for producer in ("copy_engine", "push_kernel"):
        r = emulate_ag_gemm(small["world"], small["m_local"], small["n"], small["k"], dtype, device,
                            producer=producer, config=configs[-1])
        correctness[f"ag_gemm[{producer}]"] = rel(r["out"], r["reference"])
    r = emulate_gemm_rs(small["world"], small["m_local"], small["n"], small["k"], dtype, device, config=configs[-1])
    correctness["gemm_rs+reduce"] = max(rel(o, ref) for o, ref in zip(r["outs"], r["references"]))
    results["correctness_rel_err"] = correctness
    results["correctness_ok"] = all(v <= tol for v in correctness.values())

    # 2. AG-GEMM with flags preset vs torch.matmul, per tile config
    a = torch.randn(args.m, args.k, dtype=dtype, device=device)
    b = torch.randn(args.k, args.n, dtype=dtype, device=device)
    flags = torch.ones(args.world, dtype=torch.int32, device=device)
    bounds = [i * m_local for i in range(args.world)] + [args.m]
    order = list(range(args.world))
    flops = 2 * args.m * args.n * args.k
    t_mm = time_call(lambda: torch.matmul(a, b), device)
    per_config = {}
    for config in configs:
        per_config[config.key()] = time_call(lambda: ag_gemm(a, b, flags, bounds, order, config=config), device)
    best = min(per_config, key=per_config.get)
    t_fused = per_config[best]
    results["matmul_ms"] = 1e3 * t_mm
    results["ag_gemm_preset_ms"] = {k: 1e3 * v for k, v in per_config.items()}
    results["ag_gemm_best_config"] = best
    results["ag_gemm_vs_matmul_throughput"] = t_mm / t_fused
    results["matmul_tflops"] = flops / t_mm / 1e12

    # 3. live producer vs max(GEMM, copy)
    config = next(c for c in configs if c.key() == best)
    shards = [torch.randn(m_local, args.k, dtype=dtype, device=device) for _ in range(args.world)]
    dst = torch.empty(args.m, args.k, dtype=dtype, device=device)
    t_copy = time_call(lambda: [dst[i * m_local:(i + 1) * m_local].copy_(s) for i, s in enumerate(shards[1:], 1)], device)
    live = {}
    for producer in ("copy_engine", "push_kernel"):
        live[producer] = time_call(lambda: emulate_ag_gemm(args.world, m_local, args.n, args.k, dtype, device,
                                                           producer=producer, config=config,
                                                           inputs=(shards, b)), device)
    results["copy_ms"] = 1e3 * t_copy
    results["live_producer_ms"] = {k: 1e3 * v for k, v in live.items()}
    results["live_vs_max_gemm_copy"] = {k: v / max(t_fused, t_copy) for k, v in live.items()}

    # 4. chunked GEMM efficiency
    chunked = {}
    for c in (1, 2, 4, 8, 16):
        parts = a.tensor_split(c)
        t = time_call(lambda: [torch.matmul(p, b) for p in parts], device)
        chunked[c] = {"ms": 1e3 * t, "efficiency": t_mm / t}
    results["chunked_gemm"] = chunked

    # 5. symmetric memory
    ok, why = symm_mem.availability("cuda" if cuda else "cpu")
    results["symm_mem"] = {"usable": ok, "note": why}

    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    print(f"gpu_check {results['mode']}: {results['device']}, torch {results['torch']}, triton {results['triton']}")
    print(f"  correctness (rel. err, tol {tol:g}): " + ", ".join(f"{k} {v:.1e}" for k, v in correctness.items()))
    print(f"  GEMM {args.m}x{args.n}x{args.k} {results['dtype']}: torch.matmul {1e3 * t_mm:.3f} ms "
          f"({results['matmul_tflops']:.1f} TFLOP/s); AG-GEMM flags preset {1e3 * t_fused:.3f} ms [{best}] "
          f"= {results['ag_gemm_vs_matmul_throughput']:.3f}x matmul throughput (target >= 0.95)")
    print(f"  live producer: copies alone {1e3 * t_copy:.3f} ms; "
          + ", ".join(f"{k} {1e3 * live[k]:.3f} ms = {results['live_vs_max_gemm_copy'][k]:.3f}x max(GEMM, copy)"
                      for k in live) + " (target <= 1.10)")
    print("  chunked GEMM efficiency: " + ", ".join(f"{c}: {v['efficiency']:.3f}" for c, v in chunked.items()))
    print(f"  symm-mem: {'usable' if ok else 'not usable'} ({why})")
    return 0 if results["correctness_ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
