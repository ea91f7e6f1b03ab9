"""Virtual pipelines in the planner: Megatron's interleaved 1F1B (v = 2, 4), our
interleaved zero bubble and ZB-V, simulated on the same per-stage costs as the non-interleaved
schedules (``tune/pipeline.py``), each with its peak activation memory per stage.

Assumptions beyond the non-interleaved rows': a chunk takes ``1 / v`` of its stage's F, B and W
and holds ``1 / v`` of its activations; every hop between stages carries one activation (the
interleaved schedule has ``v p - 1`` hops per micro-batch, ZB-V ``2 p - 2``: its turn stays on
the last stage); stock interleaved's transfers overlapped as its ``overlap_p2p_comm`` does
(posted early, waited late); the data-parallel sync per model chunk, as Megatron-LM's
``get_model`` builds one DDP per chunk (``chunk_syncs``): each chunk holds ``1 / v`` of every
parameter of its stage (the emulated cluster's assumption, ``lab/cluster_chunks.py``); stock:
chunk 0 bucketed as the stage is (only stage 0 has several buckets), later chunks one bucket
each, a chunk's buckets leaving together ``pipeline rank`` backwards after its last gradient
(as Megatron's interleaved schedule staggers them); ours: the same buckets (with
``--overlap-pp-buckets every-chunk`` every chunk of every stage bucketed as stage 0 is,
``integration/ddp.py``), each bucket leaving as it fills over the chunk's last gradient action
(``DPSync.fill``); chunks 0 and 1 gather their parameters from
the step's start (``align_param_gather``): stock in bucket order, the chunk's last layers first
(so its first forward waits for every bucket), ours in the order the forward needs them.
"""

from __future__ import annotations

from ..config import PPConfig
from ..pp import build
from ..pp.buckets import buckets as cut_buckets, stage_bucket_size
from ..pp.schedule_sim import DPSync, LinkCost, simulate as simulate_pipeline
from ..pp.work import stage_params
from .comm import all_gather_cost, all_reduce_cost, reduce_scatter_cost
from .pipeline import DPOptions, ScheduleResult, stage_costs
from .strategies import Strategy

VIRTUAL = (
    ("stock Megatron interleaved v=2", "megatron", 2),
    ("stock Megatron interleaved v=4", "megatron", 4),
    ("zb interleaved v=2", "zb", 2),
    ("zbv (ZB-V)", "zbv", 2),
)


def simulate_virtual(model, run, hw, strategy: Strategy = Strategy("megatron"),
                     dp_options: DPOptions = DPOptions(), chunks=(2, 4), buckets=("megatron",)) -> list:
    """The rows of ``VIRTUAL`` that this model and layout can run (layers divisible into the
    chunks, micro-batches as Megatron's interleaved schedule requires); ours once per DDP bucket
    layout in ``buckets`` (``--overlap-pp-buckets``)."""
    costs = stage_costs(model, run, hw, strategy, dp_options)
    p, m = run.pp, run.micro_batches
    link, free = LinkCost(transfer_ms=costs.transfer_ms), LinkCost()
    own = tuple(sum(getattr(t, x) for t in costs.times) / p for x in ("f", "b", "w"))
    out = []
    rows = [(label, kind, v, "megatron") for label, kind, v in VIRTUAL if kind == "megatron"]
    rows += [(label + ("" if b == "megatron" else ", every-chunk"), kind, v, b) for b in buckets
             for label, kind, v in VIRTUAL if kind != "megatron"]
    for label, kind, v, layout in rows:
        if model.layers % (p * v) or p < 2 or v not in chunks:
            continue
        try:
            schedule = build(kind, p, m, chunks=v, times=own)
        except ValueError:
            continue
        dp = chunk_syncs(costs.work, run, hw, dp_options, v, kind, layout)
        on_link = simulate_pipeline(schedule, costs.times, link, dp)
        no_dp = simulate_pipeline(schedule, costs.times, link)
        alone = simulate_pipeline(schedule, costs.times, free)
        layers = f"--num-layers-per-virtual-pipeline-stage {model.layers // (p * v)}"
        flags = layers if kind == "megatron" else " ".join(PPConfig(mode=kind, buckets=layout).flags() + [layers])
        out.append(ScheduleResult(label, flags, on_link.step_ms, alone.bubble, no_dp.step_ms - alone.step_ms,
                                  on_link.step_ms - no_dp.step_ms,
                                  max(schedule.memory_bound) * costs.activation_bytes / 1e9))
    return out


def chunk_syncs(work, run, hw, options: DPOptions, v: int, kind: str, buckets: str = "megatron") -> list:
    """Each stage's ``DPSync`` with one DDP per model chunk (module docstring); ``buckets``: ours'
    layout (``--overlap-pp-buckets``)."""
    ranks = run.dp * run.cp
    if ranks <= 1:
        return [DPSync() for _ in work]
    link = hw.link_for(run.tp * run.cp * run.dp)
    gather = options.distributed_optimizer and options.overlap_param_gather
    out = []
    stock = kind == "megatron"
    everywhere = not stock and buckets == "every-chunk"
    for stage, params in enumerate(stage_params(work)):
        share = [max(1, n // v) for n in params]
        sizes, chunks = [], []
        for c in range(v):
            cut = stage_bucket_size(ranks, 0 if everywhere else stage, options.overlap_grad_reduce)
            mine = cut_buckets(share, cut if c == 0 or everywhere else None)
            sizes += mine
            chunks += [c] * len(mine)
        out.append(bucket_sync(sizes, chunks, ranks, link, hw.dtype_bytes, options.distributed_optimizer, gather,
                               gather_at_start=True, sync_delay=stage if stock else 0, gather_aligned=stock,
                               fill=not stock))
    return out


def bucket_sync(sizes, chunks, ranks: int, link, dtype_bytes: float, distributed_optimizer: bool, gather: bool,
                **kw) -> DPSync:
    """One stage's ``DPSync`` from its DDP buckets (elements, in the order the backward fills
    them; ``chunks``: each bucket's model chunk, or empty for one DDP): fp32 gradients
    reduce-scattered (distributed optimizer) or all-reduced, bf16 parameters all-gathered
    (``gather``) in the order the forward needs them, each chunk's buckets reversed, chunk by
    chunk. ``kw``: the other ``DPSync`` fields."""
    reduce = reduce_scatter_cost if distributed_optimizer else all_reduce_cost
    rs = [reduce(4.0 * n, ranks, link) for n in sizes]
    order = sorted(range(len(sizes)), key=lambda i: (chunks[i] if chunks else 0, -i))
    ag = [all_gather_cost(dtype_bytes * sizes[i], ranks, link) for i in order] if gather else []
    return DPSync(reduce_ms=tuple(c.busy_ms for c in rs), gather_ms=tuple(c.busy_ms for c in ag),
                  latency_ms=rs[0].latency_ms, reduce_chunks=tuple(chunks),
                  gather_chunks=tuple(chunks[i] for i in order) if chunks and ag else (), **kw)
