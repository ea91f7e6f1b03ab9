"""Reading traces back: spans per rank, step time and exposed communication, the report table
and its PNG (``megatron-overlap report DIR``).

Exposed communication of an iteration, per rank, and where each figure comes from
(``summarize(...)["source"]``):

- ``gpu`` (measured): the time communication ran while no compute kernel did. Communication is
  NCCL kernels and copy-engine transfers (``gpu_memcpy`` events: symm-mem's pulls, P2P copies).
  Our fused Triton kernels spin on flags inside their own time; the profiler cannot split that
  time, so it counts as compute and the exposure is a lower bound (the report says so);
- ``waits`` (measured): on CPU, the time the main thread spent blocked in the waits the plugin
  marks (its own rings and exchanges) and the emulated link marks (every transfer it delays,
  stock Megatron's included);
- ``none``: no wait marked and no GPU kernels: a CPU run of stock Megatron without the emulated
  link, whose waits nothing marks. Exposure is then not measured (shown as n/a, never as 0).
"""

from __future__ import annotations

import json
import os
import time
from typing import Optional

from .markers import STEP, WAIT

FUSED_KERNELS = ("ag_gemm_kernel", "gemm_rs_kernel", "reduce_slots_kernel", "_push_chunk_kernel")
COMPUTE_PREFIXES = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_scaled_dot_product",
                    "aten::gelu", "aten::silu", "aten::softmax", "aten::_softmax", "aten::layer_norm",
                    "aten::rms_norm", "aten::native_layer_norm")


def add_link_track(path: str, spans_perf_counter: list) -> None:
    """Put emulated-link transfer windows (``time.perf_counter`` seconds) into the trace file."""
    with open(path) as f:
        data = json.load(f)
    base_us = data.get("baseTimeNanoseconds", 0) / 1e3
    offset_us = (time.time() - time.perf_counter()) * 1e6 - base_us
    pid = next((e["pid"] for e in data["traceEvents"] if e.get("name") == STEP), 0)
    for start, end in spans_perf_counter:
        data["traceEvents"].append({"ph": "X", "name": "link transfer", "cat": "link", "pid": pid,
                                    "tid": "link", "ts": start * 1e6 + offset_us, "dur": (end - start) * 1e6})
    with open(path, "w") as f:
        json.dump(data, f)


def _union(intervals) -> list:
    out = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out


def _length(intervals) -> float:
    return sum(b - a for a, b in _union(intervals))


def _minus(intervals, holes) -> list:
    holes = _union(holes)
    out = []
    for a, b in _union(intervals):
        cursor = a
        for h0, h1 in holes:
            if h1 <= cursor or h0 >= b:
                continue
            if h0 > cursor:
                out.append([cursor, h0])
            cursor = max(cursor, h1)
        if cursor < b:
            out.append([cursor, b])
    return out


def spans(path: str) -> dict:
    """Spans (us, relative to the step's start) of one trace: step, compute, waits, link,
    and GPU compute/communication kernels when present."""
    with open(path) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    step = next(e for e in events if e.get("name") == STEP)
    t0, main = step["ts"], (step["pid"], step["tid"])
    rel = lambda e: [e["ts"] - t0, e["ts"] - t0 + e["dur"]]  # noqa: E731
    out = {"step": [0.0, step["dur"]], "compute": [], "wait": [], "link": [], "gpu_compute": [], "gpu_comm": [],
           "gpu_fused": []}
    for e in events:
        name, cat = e.get("name", ""), e.get("cat", "")
        if name == WAIT and (e["pid"], e["tid"]) == main:
            out["wait"].append(rel(e))
        elif name == "link transfer":
            out["link"].append(rel(e))
        elif cat == "gpu_memcpy":
            out["gpu_comm"].append(rel(e))  # copy engine: symm-mem's pulls and P2P copies move data
        elif cat == "kernel":
            if "nccl" in name.lower():
                out["gpu_comm"].append(rel(e))
            elif name.startswith(FUSED_KERNELS):
                out["gpu_fused"].append(rel(e))
            else:
                out["gpu_compute"].append(rel(e))
        elif name.startswith(COMPUTE_PREFIXES) and (e["pid"], e["tid"]) == main:
            out["compute"].append(rel(e))
    return out


def summarize(path: str) -> dict:
    """Step time, compute, communication and exposed communication (ms) of one trace file, and
    the ``source`` of the exposure (module docstring); None where a figure is not measured."""
    s = spans(path)
    step_ms = (s["step"][1] - s["step"][0]) / 1e3
    fused_ms = _length(s["gpu_fused"]) / 1e3
    if s["gpu_comm"] or s["gpu_compute"] or s["gpu_fused"]:
        busy = s["gpu_compute"] + s["gpu_fused"]
        out = {"source": "gpu", "compute_ms": _length(busy) / 1e3, "comm_ms": _length(s["gpu_comm"]) / 1e3,
               "exposed_comm_ms": _length(_minus(s["gpu_comm"], busy)) / 1e3}
    elif s["wait"]:
        out = {"source": "waits", "compute_ms": _length(s["compute"]) / 1e3,
               "comm_ms": _length(s["link"]) / 1e3 if s["link"] else None, "exposed_comm_ms": _length(s["wait"]) / 1e3}
    else:
        out = {"source": "none", "compute_ms": _length(s["compute"]) / 1e3, "comm_ms": None, "exposed_comm_ms": None}
    return dict(out, step_ms=step_ms, fused_ms=fused_ms)


_LEGEND = {
    "gpu": "measured gpu: NCCL kernels and copy-engine transfers not covered by compute kernels; our fused kernels' "
           "flag waits are inside their kernel time and count as compute (not split): a lower bound there",
    "waits": "measured waits: time blocked in the waits the plugin marks, and the emulated link's (which covers stock "
             "Megatron's transfers too); comm ms is the emulated link's busy time (n/a without it)",
    "none": "none: no wait marked and no GPU kernels (stock Megatron on CPU without the emulated link): exposure not "
            "measured",
}


def report(directory: str, png: Optional[str] = None) -> tuple[str, Optional[str]]:
    """A summary table of every trace in ``directory`` and a PNG timeline (one panel per
    iteration/label, one row group per rank)."""
    from . import timeline

    files = sorted(f for f in os.listdir(directory) if f.startswith("rank") and f.endswith(".json"))
    if not files:
        raise FileNotFoundError(f"report: no rank*.json traces in {directory}")
    groups: dict = {}
    for name in files:
        rank_part, rest = name.split(".", 1)
        groups.setdefault(rest[: -len(".json")], []).append((int(rank_part[4:]), os.path.join(directory, name)))
    lines = [f"{'trace':24}{'rank':>5}{'step ms':>10}{'compute ms':>12}{'comm ms':>10}{'exposed ms':>12}  measured"]
    panels, sources = [], set()
    fmt = lambda v: f"{v:.1f}" if v is not None else "n/a"  # noqa: E731
    for key in sorted(groups):
        rows, width = [], 0.0
        for rank, path in sorted(groups[key]):
            s, m = spans(path), summarize(path)
            sources.add(m["source"])
            lines.append(f"{key:24}{rank:>5}{m['step_ms']:>10.1f}{m['compute_ms']:>12.1f}{fmt(m['comm_ms']):>10}"
                         f"{fmt(m['exposed_comm_ms']):>12}  {m['source']}")
            width = max(width, s["step"][1] / 1e3)
            ms = lambda iv: [(a / 1e3, b / 1e3) for a, b in _union(iv)]  # noqa: E731
            rows.append((f"rank {rank} compute", "compute", ms(s["gpu_compute"] or s["compute"])))
            rows.append((f"rank {rank} blocked", "blocked", ms(_minus(s["gpu_comm"], s["gpu_compute"]) if s["gpu_comm"] else s["wait"])))
            if s["link"] or s["gpu_comm"]:
                rows.append((f"rank {rank} link", "link", ms(s["link"] or s["gpu_comm"])))
        panels.append(timeline.Panel(key, width, rows))
    lines.append("")
    lines += [_LEGEND[src] for src in ("gpu", "waits", "none") if src in sources]
    table = "\n".join(lines)
    written = None
    if png:
        written = timeline.draw(panels, png, title=f"megatron-overlap traces: {directory}", columns=1)
    return table, written
