"""Measure this CPU's single-thread GEMM and element-wise rates for the cost model.

The table it writes is what ``gemm.fit_efficiency`` calibrates on and what
``bench_predict.predict_mlp_bench`` uses for the *relative* cost of each op of the MLP bench
(the absolute level comes from the bench's own ``compute_ms``, measured in the same run as the
step times). One intra-op thread, as the bench's ranks run.

    python -m megatron_overlap.tune.measure_cpu --hidden 1024 --ffn 4096 --tp 2 --seq 2048 > rates.json

Every GEMM ``[M, K] @ [K, N]`` is timed for the full M of the bench and for M cut into 2, 4, 8
and 16 chunks (the time of one chunk is recorded, with its own M), so the table holds the
chunked-GEMM efficiency the overlap pays for.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def _median_ms(fn, reps: int) -> float:
    fn()  # warm
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        samples.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(samples)


def measure(hidden: int, ffn: int, seq: int, tp: int, reps: int = 5, chunk_counts=(1, 2, 4, 8, 16)) -> dict:
    """Times (ms) of the MLP bench's GEMM shapes, chunked along M, and of its element-wise ops."""
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(1)
    torch.manual_seed(0)
    f = ffn // tp
    shapes = {(seq, f, hidden), (seq, hidden, f), (hidden, f, seq)}  # fc1 fwd/fc2 dgrad, fc2 fwd/fc1 dgrad, wgrad
    table = []
    for m, n, k in sorted(shapes):
        b = torch.randn(k, n)
        for chunks in chunk_counts:
            rows = m // chunks
            a = torch.randn(rows, k)
            out = torch.empty(rows, n)
            ms = _median_ms(lambda: torch.matmul(a, b, out=out), reps)
            table.append({"M": rows, "N": n, "K": k, "ms": ms, "chunks": chunks})
    h = torch.randn(seq, 1, f)
    bias = torch.randn(f)
    dy = torch.randn(seq, 1, f)
    elementwise = {
        "gelu_fwd_ms": _median_ms(lambda: F.gelu(h), reps),
        "gelu_bwd_ms": _median_ms(lambda: torch.ops.aten.gelu_backward(dy, h), reps),
        "bias_add_ms": _median_ms(lambda: h + bias, reps),
        "bias_grad_ms": _median_ms(lambda: dy.sum(dim=(0, 1)), reps),
        "elements": seq * f,
    }
    return {
        "what": "single-thread CPU GEMM [M,K]@[K,N] and element-wise times, fp32",
        "torch": torch.__version__,
        "threads": 1,
        "gemm_table": table,
        "elementwise": elementwise,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--ffn", type=int, default=4096)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args(argv)
    print(json.dumps(measure(args.hidden, args.ffn, args.seq, args.tp, args.reps), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
