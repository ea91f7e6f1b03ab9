"""``--overlap-trace DIR``: per-rank Chrome traces (open in Perfetto) of chosen iterations, and
the exposed communication of each traced iteration, logged (``report.py`` reads them back).

The timeline comes from ``torch.profiler`` (CPU ops here; CUDA kernels too on a GPU). The
plugin marks what the profiler cannot know: ``megatron_overlap::step`` around each traced
iteration and ``megatron_overlap::wait`` around every wait for communication of ours (and of
the emulated link's, which wraps stock Megatron's as well). When an emulated link is active, its
transfer windows are added to the trace on a ``link`` track.

Exposed communication of an iteration, per rank:
- on CPU, the time the main thread spent blocked in those waits (union of the wait spans);
- on a GPU, the time communication kernels (NCCL) ran while no compute kernel did.
"""

from __future__ import annotations

import logging
import os
from contextlib import contextmanager
from typing import Iterable

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from ..errors import OverlapConfigError
from ..rules import iterations
from .markers import STEP
from .report import add_link_track, summarize

logger = logging.getLogger("megatron_overlap")



def parse_iterations(text: str):
    """'3' or '3,5' or '3-5' -> the iterations, as ranges (``rules.iterations``: bounded, never
    expanded); a ``ValueError`` for anything else."""
    try:
        return iterations(text, "trace.iterations")
    except OverlapConfigError as exc:
        raise ValueError(exc.reason) from None


class StepTracer:
    """Profiles the chosen iterations; ``with tracer.step(i):`` around each iteration."""

    def __init__(self, directory: str, iterations: Iterable[int], rank: int = 0, label: str = "",
                 link=None):
        self.directory = directory
        # anything with `in` (rules.IterationSet: ranges); a plain iterable becomes a set
        self.iterations = iterations if hasattr(iterations, "ranges") else frozenset(iterations)
        self.rank = rank
        self.label = label
        self.link = link  # an EmulatedLink whose spans go on the link track
        self.written: list = []

    @contextmanager
    def step(self, iteration: int):
        if iteration not in self.iterations:
            yield
            return
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        if self.link is not None:
            self.link.record_spans = True
            self.link.stats.spans.clear()
        with profile(activities=activities) as prof:
            with record_function(STEP):
                yield
        os.makedirs(self.directory, exist_ok=True)
        name = f"rank{self.rank}.iter{iteration}{'.' + self.label if self.label else ''}.json"
        path = os.path.join(self.directory, name)
        prof.export_chrome_trace(path)
        link_spans = []
        if self.link is not None:
            link_spans = [(s.start, s.done) for s in self.link.stats.spans]
            self.link.record_spans = False
        add_link_track(path, link_spans)
        summary = summarize(path)
        exposed = summary["exposed_comm_ms"]
        logger.warning("megatron-overlap: rank %d iteration %d%s: step %.1f ms, exposed communication %s (%s)",
                       self.rank, iteration, f" ({self.label})" if self.label else "", summary["step_ms"],
                       "not measured" if exposed is None else f"{exposed:.1f} ms", summary["source"])
        self.written.append(path)
