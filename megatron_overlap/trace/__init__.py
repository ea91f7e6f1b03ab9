"""What is still exposed: traces and pictures.

    tracer.py     ``--overlap-trace``: torch.profiler around chosen iterations, wait markers
    report.py     spans, step time and exposed communication per trace; ``megatron-overlap report``
    markers.py    the names a trace is marked with, written by the tracer, read by the report
    timeline.py   the PNG timelines of the demo, the benchmarks, ``plan`` and ``report``
"""

from .markers import wait
from .tracer import StepTracer, parse_iterations

__all__ = ["StepTracer", "parse_iterations", "wait"]
