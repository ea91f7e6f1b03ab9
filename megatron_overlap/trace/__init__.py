"""What is still exposed: traces and pictures.

    markers.py    the names of the wait markers (``wait``), a leaf the areas import
    tracer.py     ``--overlap-trace``: torch.profiler around chosen iterations, wait markers
    report.py     spans, step time and exposed communication per trace; ``megatron-overlap report``
    timeline.py   the PNG timelines of the demo, the benchmarks, ``plan`` and ``report``
"""

from .markers import wait
from .tracer import StepTracer, parse_iterations

__all__ = ["StepTracer", "parse_iterations", "wait"]
