"""Cost model, simulator and planner for TP-overlap strategies. Pure Python: no torch, no
probing of the machine (``measure_cpu`` is the one module that times anything, on request).

    hardware.py    HardwareSpec values (datasheet numbers, cited) and the cpu-emulated builder
    models.py      model shapes and the run around them (parallel sizes, batch, phase)
    measured.py    figures measured on hardware, taken instead of assumptions
    measure_cpu.py this CPU's GEMM and element-wise rates (the one module that times anything)
    gemm.py        roofline / efficiency-curve GEMM time, calibration from measured tables
    comm.py        alpha-beta collectives on a one-egress-port-per-rank switch
    two_tier.py    the two-tier fabric (nodes, intra- and inter-node links) the long-context
                   simulators and the emulated link share
    engine.py      in-order stream scheduler (tasks as data) and exposed-communication accounting
    layer_ops.py   a transformer layer's ops and their costs
    strategies.py, transfers.py, sub_batches.py
                   megatron / p2p / symm-mem / fused (and sub-batches) as task graphs
    strategy_sim.py          one layer's schedules -> a step (TP, CP, PP, DP)
    pipeline.py, virtual.py  pipeline schedules (plain and virtual) over the layer model's F, B, W
    strategy_ranking.py      the strategies ranked, the flags to pass: ``megatron-overlap plan``
                             (its command line: ``cli/plan_command.py``)
    auto.py        ``--overlap-tp auto`` and ``--overlap-pp auto`` from the model
    cache.py       choosing among measured candidates: ranks agree, the choice cached on disk
    published.py   published results beside the model's predictions
    bench_predict.py         the model against ``megatron-overlap bench mlp``
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
