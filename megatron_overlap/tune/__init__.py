"""Cost model, simulator and planner for TP-overlap strategies. Pure Python: no torch, no
probing of the machine (``measure_cpu`` is the one module that times anything, on request).

    hardware.py    HardwareSpec values (datasheet numbers, cited) and the cpu-emulated builder
    gemm.py        roofline / efficiency-curve GEMM time, calibration from measured tables
    comm.py        alpha-beta collectives on a one-egress-port-per-rank switch
    overlap.py     closed forms: pipelining, SM contention, fused kernels
    engine.py      in-order stream scheduler (tasks as data) and exposed-communication accounting
    layer_ops.py   a transformer layer's ops and their costs
    strategies.py  megatron / p2p / symm-mem / fused as task graphs
    simulate.py    one layer's schedules -> a step (TP, CP, PP, DP)
    planner.py, cli_plan.py   ``megatron-overlap plan``
    published.py   published results beside the model's predictions
    bench_predict.py          the model against ``megatron-overlap bench mlp``
"""

from .hardware import HARDWARE, HardwareSpec, Link, cpu_emulated_spec, get_hardware
from .models import MODELS, ModelSpec, RunSpec, get_model
from .strategy_sim import StrategyResult, simulate
from .strategies import Strategy

__all__ = [
    "HARDWARE",
    "HardwareSpec",
    "Link",
    "MODELS",
    "ModelSpec",
    "RunSpec",
    "Strategy",
    "StrategyResult",
    "cpu_emulated_spec",
    "get_hardware",
    "get_model",
    "simulate",
]
