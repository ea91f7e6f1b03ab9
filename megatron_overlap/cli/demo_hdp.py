"""``megatron-overlap demo --overlap-hdp``: hybrid data parallelism on real ranks, on a CPU.

Four gloo ranks (spawned here) hold one tiny GPT each (Megatron's local spec, fp32, CP 1,
``--overlap-hdp`` installed) and one mixed-length full batch, dealt round-robin to the HDP ranks as a data
loader would. TP 1: four HDP ranks. ``--tp 2``: two HDP ranks, each a TP group of two running
the TP-overlap linears with sequence parallelism, rings between the groups. The same batch runs twice through ``hdp.runtime`` (lengths all-gathered, plan,
token exchange, forward + backward per micro-batch inside its ring context):

    static   the fixed-CP layout (``baselines.schedule_static``): one CP size for every sequence,
             the smallest divisor of R whose ring holds the longest sequence; sequences packed by
             tokens and dealt to the DP groups
    hdp      ``schedule_hdp``: each sequence on ceil(L / C) ranks (short ones whole on one rank),
             work balanced per rank

Per rank and layout: busy time = thread CPU time of its micro-batches' forward + backward
(``time.thread_time``; on a machine with fewer cores than ranks, wall time per rank mostly
measures whose turn it was on a core, CPU time what the rank computed; a rank blocked in a ring
receive uses none); step time = wall time from a barrier to the last rank's end; max / mean of
busy time (1 = balanced). Both layouts compute the same loss and gradients (the runtime is exact;
printed as a check). Timed steps are the median of ``repeats`` after one warm-up step.
"""


from __future__ import annotations

import collections
import contextlib
import os
import time
from typing import Callable, Optional, Sequence

DEFAULT_LENGTHS = (190, 121, 75, 60, 44, 37, 30, 26, 21, 17, 14, 11, 9, 7, 5, 3)
DEFAULT_CAPACITY = 64
LAYOUTS = ("static", "hdp")


# ----------------------------------------------------------------------------- driver side
@contextlib.contextmanager
def _cpu_only_children():
    """The ranks run on the CPU even on a GPU machine (the shims map Megatron's CUDA calls)."""
    old = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = old


def run_hdp_demo(out: Optional[Callable[[str], None]] = print, ranks: int = 4,
                 lengths: Sequence[int] = DEFAULT_LENGTHS, capacity: int = DEFAULT_CAPACITY, repeats: int = 5,
                 seed: int = 1234, hidden: int = 256, ffn: int = 704, layers: int = 2, tp: int = 1,
                 planning_steps: int = 0) -> dict:
    """Run the demo (module docstring); ``out`` gets progress lines and the table (None: quiet).
    Returns the measured numbers: per layout, per-rank ``busy_ms`` (CPU), ``wall_ms``,
    micro-batches, rows, tokens, plus ``step_ms``, ``imbalance`` (max / mean busy), ``loss``; and
    ``grad_rel_diff`` between the two layouts' gradients; with ``planning_steps``, ``planning``:
    per mode (inline, ahead) the median step through ``HdpDataIterator`` and its wait for the plan
    (rank 0's; ``lab.hdp_demo.HdpDemoRanks.measure_planning``)."""
    from ..hdp import check_batch
    from ..lab.hdp_demo import HdpDemoRanks
    from ..lab.rank_pool import RankPool
    from ..lab.session import RemoteSession

    say = out or (lambda _line: None)
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    if tp < 1 or ranks % tp:
        raise ValueError(f"--tp {tp} does not divide the {ranks} ranks")
    lengths = tuple(int(L) for L in lengths)
    check_batch(lengths, ranks // tp, capacity)
    shape = (f"{ranks} CPU gloo ranks" if tp == 1 else
             f"{ranks} CPU gloo ranks as TP {tp} x HDP {ranks // tp} (each HDP rank a TP group, TP overlap on)")
    say(f"HDP demo: {len(lengths)} sequences of {min(lengths)}..{max(lengths)} tokens ({sum(lengths)} in all) "
        f"on {shape}, C = {capacity} tokens per HDP rank per micro-batch")
    say(f"[1/4] starting {ranks} ranks and building the model on each ...")
    t_start = time.perf_counter()
    result = {"ranks": ranks, "tp": tp, "capacity": capacity, "lengths": list(lengths), "layouts": {},
              "cpu_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()}
    with _cpu_only_children(), RankPool(ranks, timeout=900, threads_per_rank=1) as pool:
        demo = RemoteSession(pool, HdpDemoRanks, lengths, capacity, seed, hidden, ffn, layers, tp)
        for i, layout in enumerate(LAYOUTS):
            say(f"[{i + 2}/4] {layout}: plan, load, 1 warm-up + {repeats} timed steps ...")
            rows = demo.call("measure", layout, repeats)
            busy = [r["busy_ms"] for r in rows]
            mean = sum(busy) / len(busy)
            result["layouts"][layout] = {
                "busy_ms": busy,
                "wall_ms": [r["wall_ms"] for r in rows],
                "microbatches": [r["microbatches"] for r in rows],
                "rows": [r["rows"] for r in rows],
                "tokens": [r["tokens"] for r in rows],
                "ring_sizes": rows[0]["ring_sizes"],
                "step_ms": rows[0]["step_ms"],
                "load_ms": max(r["load_ms"] for r in rows),
                "imbalance": max(busy) / mean if mean > 0 else 1.0,
                "moved_tokens": rows[0]["moved_tokens"],
                "loss": rows[0]["loss"],
            }
        say("[4/4] comparing the two layouts' gradients ...")
        result["grad_rel_diff"] = max(demo.call("compare_grads"))
        if planning_steps:
            say(f"[+] hdp: {planning_steps} steps through HdpDataIterator, planning inline, then one step ahead ...")
            result["planning"] = {}
            for mode in ("inline", "ahead"):
                rows = demo.call("measure_planning", mode == "ahead", planning_steps)
                result["planning"][mode] = {"step_ms": rows[0]["step_ms"],  # the same on every rank
                                            "plan_wait_ms": max(r["plan_wait_ms"] for r in rows),
                                            "plan_ms": max(r["plan_ms"] or 0.0 for r in rows) or None}
        result["tp_column_calls"] = sum(demo.call("tp_calls"))
        demo.close()
    result["seconds"] = time.perf_counter() - t_start
    for line in format_table(result).splitlines():
        say(line)
    return result


def format_table(result: dict) -> str:
    ranks = result["ranks"]
    head = ["layout", *[f"rank{r}" for r in range(ranks)], "max/mean", "step ms", "rows/rank", "mbs/rank"]
    lines = []
    static_cp = result["layouts"]["static"]["ring_sizes"]
    names = {"static": f"static CP {static_cp[0] if static_cp else 1}", "hdp": "hdp"}
    n_seq = len(result["lengths"])
    table = []
    for layout, d in result["layouts"].items():
        table.append([names[layout], *[f"{b:.1f}" for b in d["busy_ms"]], f"{d['imbalance']:.2f}", f"{d['step_ms']:.1f}",
                      "/".join(str(x) for x in d["rows"]), "/".join(str(x) for x in d["microbatches"])])
    widths = [max(len(str(row[i])) for row in [head, *table]) for i in range(len(head))]
    fmt = lambda row: "  ".join(str(c).rjust(w) if i else str(c).ljust(w) for i, (c, w) in enumerate(zip(row, widths)))  # noqa: E731
    lines.append("busy ms per rank = thread CPU time of forward + backward (median of the timed steps)")
    tp = result.get("tp", 1)
    if tp > 1:
        lines.append(f"(TP {tp} x HDP {ranks // tp}: ranks 0-{tp - 1} are HDP rank 0's TP group, and so on; TP overlap on, "
                     f"{result.get('tp_column_calls', 0)} column-parallel GEMMs overlapped)")
    if result.get("cpu_cores") and result["cpu_cores"] < ranks:
        lines.append(f"({ranks} ranks share {result['cpu_cores']} CPU cores: step times include waits for a core)")
    lines.append(fmt(head))
    lines.extend(fmt(row) for row in table)
    s, h = result["layouts"]["static"], result["layouts"]["hdp"]
    def rings(d):
        sizes = collections.Counter(d["ring_sizes"])
        shape = ", ".join(f"{count}x{size}" for size, count in sorted(sizes.items(), reverse=True))
        return (f"{len(d['ring_sizes'])} sequences sharded (rings: {shape or '-'} ranks), "
                f"{n_seq - len(d['ring_sizes'])} held whole")

    lines.append(f"static: {rings(s)}; hdp: {rings(h)}")
    lines.append(f"sample exchange: static moved {s['moved_tokens']} tokens between ranks, hdp {h['moved_tokens']}; "
                 f"lengths all-gather + plan + exchange: static {s['load_ms']:.1f} ms, hdp {h['load_ms']:.1f} ms")
    lines.append(f"total busy: static {sum(s['busy_ms']):.1f} ms, hdp {sum(h['busy_ms']):.1f} ms; "
                 f"step: static {s['step_ms']:.1f} ms, hdp {h['step_ms']:.1f} ms ({s['step_ms'] / h['step_ms']:.2f}x)")
    for mode, p in result.get("planning", {}).items():
        lines.append(f"hdp steps planned {mode}: step {p['step_ms']:.1f} ms, start_step waited {p['plan_wait_ms']:.1f} ms "
                     f"for its plan" + (f" (the helper planned in {p['plan_ms']:.1f} ms)" if p.get("plan_ms") else
                                        " (lengths all-gather + plan + exchange)"))
    lines.append(f"same result: loss static {s['loss']:.6f}, hdp {h['loss']:.6f}; gradients differ by "
                 f"{result['grad_rel_diff']:.1e} (relative)  [{result['seconds']:.0f} s]")
    return "\n".join(lines)
