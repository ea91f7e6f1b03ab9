#!/usr/bin/env python
"""Trace the CPU demo's real-compute part op by op and say where each step goes.

    python scripts/demo_op_trace.py '{"chunks": 8}' [OUT.json]   # DemoConfig fields as JSON

Runs ``megatron-overlap demo``'s ranks (``lab/demo.py``, per-op overlap unless the JSON says
otherwise, 5 steps), stock and ours alternating, and records per rank and step: every
``torch.matmul`` of the main thread, every transfer on the emulated link and every wait, the
main thread's CPU time and its run-queue wait (``/proc/self/task/<tid>/schedstat``: runnable,
not running). Prints, per rank, the medians after 2 warm-up steps: step, CPU, run-queue wait,
exposed communication split into forward and backward (and the embedding's two collectives), the link's busy
and idle time in each, stock's step, CPU and run-queue wait
(BENCHMARKS.md, the CPU demo). Hold the machine alone (``flock -x``).
"""

import json
import statistics
import sys
import threading
import time

import torch

from megatron_overlap.lab.demo import DemoConfig, DemoRanks


class TracedRanks(DemoRanks):
    def step(self, index, record):
        import torch.distributed as dist

        import megatron_overlap
        from megatron_overlap.lab import tiny_gpt

        out = {}
        for mode in ("baseline", "overlap") if index % 2 == 0 else ("overlap", "baseline"):
            self._install(mode)
            self.link.record_spans = True
            dist.barrier()
            self.link.reset()
            gemms, matmul, main = [], torch.matmul, threading.get_ident()

            def timed(*args, **kwargs):
                t = time.perf_counter()
                result = matmul(*args, **kwargs)
                if threading.get_ident() == main:
                    gemms.append((t, time.perf_counter(), tuple(args[0].shape), tuple(args[1].shape)))
                return result

            sched = f"/proc/self/task/{threading.get_native_id()}/schedstat"
            torch.matmul = timed
            q0 = [int(x) for x in open(sched).read().split()]
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                loss = tiny_gpt.train_step(self.models[mode], self.spec, index, lr=self.cfg.lr)
            finally:
                torch.matmul = matmul
            t1, c1 = time.perf_counter(), time.thread_time()
            q1 = [int(x) for x in open(sched).read().split()]
            st = self.link.reset()
            megatron_overlap.uninstall()
            out[mode] = {"loss": loss, "wall": t1 - t0, "cpu": c1 - c0, "blocked": st.blocked_s, "busy": st.busy_s,
                         "runq": (q1[1] - q0[1]) * 1e-9,
                         "spans": [(s.op, s.nbytes, s.issued - t0, s.start - t0, s.done - t0) for s in st.spans],
                         "waits": [(a - t0, b - t0, op) for (a, b), op in zip(st.waits, st.wait_ops)],
                         "gemms": [(a - t0, b - t0, s1, s2) for a, b, s1, s2 in gemms]}
        return out


def link_phases(r, fwd_end: float) -> dict:
    """The emulated link's busy and idle time (the union of its transfers) before and after the
    forward's end: where the link idles, no schedule of the same transfers gains from overlap."""
    busy = []
    for start, done in sorted((s, d) for _op, _n, _i, s, d in r["spans"]):
        if busy and start <= busy[-1][1]:
            busy[-1][1] = max(busy[-1][1], done)
        else:
            busy.append([start, done])
    fwd = sum(min(d, fwd_end) - s for s, d in busy if s < fwd_end)
    bwd = sum(d - max(s, fwd_end) for s, d in busy if d > fwd_end)
    return {"link_busy_fwd": fwd, "link_idle_fwd": fwd_end - fwd,
            "link_busy_bwd": bwd, "link_idle_bwd": r["wall"] - fwd_end - bwd}


def summary(rows, warmup: int = 2) -> list:
    """Per rank, medians over the timed steps (ms)."""
    out = []
    for rank in range(len(rows[0])):
        got = {}
        for step in rows[warmup:]:
            r, s = step[rank]["overlap"], step[rank]["baseline"]
            loss_ar = [a for a, _b, op in r["waits"] if op == "all_reduce"]  # the loss: forward ends
            fwd_end = loss_ar[0] if loss_ar else 0.0
            stock_ar = [a for a, _b, op in s["waits"] if op == "all_reduce"]
            values = {"step": r["wall"], "fwd": fwd_end, "stock_fwd": stock_ar[0] if stock_ar else 0.0, "cpu": r["cpu"], "runq": r["runq"], "exposed": r["blocked"],
                      "exposed_fwd": sum(b - a for a, b, _op in r["waits"] if b <= fwd_end),
                      "exposed_bwd": sum(b - a for a, b, _op in r["waits"] if a > fwd_end),
                      # the embedding's reduce-scatter (the first wait) and grad all-gather (at the end)
                      "embedding_rs": next((b - a for a, b, op in r["waits"][:1] if op.startswith("reduce_scatter")), 0.0),
                      "embedding_ag": max((b - a for a, b, op in r["waits"][-4:] if op.startswith("all_gather_into")),
                                          default=0.0),
                      "stock_step": s["wall"], "stock_cpu": s["cpu"], "stock_runq": s["runq"],
                      **link_phases(r, fwd_end)}
            for key, value in values.items():
                got.setdefault(key, []).append(1e3 * value)
        out.append({key: round(statistics.median(v), 1) for key, v in got.items()})
    return out


def main():
    from megatron_overlap.lab.rank_pool import RankPool
    from megatron_overlap.lab.session import RemoteSession

    cfg = DemoConfig(**{"sub_batches": 1, "steps": 5, **(json.loads(sys.argv[1]) if len(sys.argv) > 1 else {})})
    rows = []
    with RankPool(cfg.world, timeout=1800, threads_per_rank=1) as pool, \
            RemoteSession(pool, TracedRanks, cfg) as ranks:
        for index in range(cfg.steps):
            rows.append(ranks.call("step", index, False))
    if len(sys.argv) > 2:
        with open(sys.argv[2], "w") as f:
            json.dump(rows, f)
    for rank, values in enumerate(summary(rows)):
        print(f"rank {rank}:", json.dumps(values))


if __name__ == "__main__":
    main()
