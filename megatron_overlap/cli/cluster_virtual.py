"""Virtual pipelines on the emulated cluster (``bench pp --emulate --vpp V``): what is refused
before a rank starts, the per-chunk data-parallel sync the simulator predicts with, and the
floor at 1.05x stock interleaved's activation memory.

Megatron-LM builds one DDP per model chunk; its interleaved schedule dispatches a chunk's
gradient buckets ``pipeline rank`` backwards after the chunk's last one (``sync_delay``); ours
(the run's own buckets per schedule: Megatron's, or with ``--overlap-pp-buckets every-chunk``
on every stage and chunk, ``integration/ddp.py``) sends each as it fills over the chunk's last gradient action (``fill``); both gather chunks 0 and 1's parameters at the step's
start (``align_param_gather``), stock in bucket order (last layers first, ``gather_aligned``),
ours in the order the forward needs them. The simulator takes that from ``DPSync.reduce_chunks``.

The floor (``pp/optimal.py``) prices a stage's data-parallel sync as one block after the
stage's last gradient. With one DDP per chunk only the chunk that finishes last is certain to
reduce after it, so the floor runs with a relaxation that stays a lower bound: per stage the
buckets of its cheapest chunk after the last gradient, and chunk 0's parameter gather (the
first forward's) at the start, from the finest cut any schedule's DDP made (every-chunk: buckets on
every chunk), since a finer cut only relaxes it. The floor is the smaller over the interleaved and (v = 2) the V
placement, at the memory allowed: 1.05x stock interleaved's peak per stage.
"""

from __future__ import annotations

from ..lab.cluster_chunks import EVERY_CHUNK, VIRTUAL_MODES, base_mode
VIRTUAL_NAMES = {"stock": "stock Megatron interleaved 1F1B", "1f1b": "1f1b interleaved (async P2P)",
                 "zb": "zb interleaved (B/W split)", "zbv": "zbv (ZB-V)"}
VIRTUAL_NAMES.update({m: f"{base_mode(m)}, every-chunk buckets" for m in EVERY_CHUNK})


def check_virtual(cfg, layers: int, error) -> None:
    """Refuse what virtual pipelines cannot run here; ``error`` builds the exception."""
    v = cfg.vpp
    if v < 1:
        raise error(f"--vpp {v}: model chunks per stage must be >= 1")
    if any(base_mode(m) == "zbv" for m in cfg.modes) and v != 2:
        raise error(f"zbv needs exactly 2 model chunks per stage (the V), got --vpp {v}: give --vpp 2")
    if set(EVERY_CHUNK) & set(cfg.modes) and v == 1:
        raise error(f"{'/'.join(EVERY_CHUNK)} (ours with every-chunk DDP buckets) compare bucket layouts of virtual "
                    "pipelines: give --vpp 2 or more")
    if v == 1:
        return
    bad = [m for m in cfg.modes if m not in VIRTUAL_MODES + EVERY_CHUNK]
    if bad:
        raise error(f"--schedules {','.join(bad)} with --vpp {v}: virtual pipelines run {', '.join(VIRTUAL_MODES + EVERY_CHUNK)}")
    if cfg.microbatches % cfg.pp:
        raise error(f"--micro-batches {cfg.microbatches} is not a multiple of --pp {cfg.pp}: Megatron's interleaved "
                    "schedule (stock, with --vpp > 1) requires it")
    if layers and layers % (cfg.pp * v):
        raise error(f"{cfg.model}'s {layers} layers do not divide into --pp {cfg.pp} x --vpp {v} = {cfg.pp * v} "
                    "model chunks")


def schedule_syncs(syncs, kind: str, v: int) -> list:
    """The simulator's per-chunk sync of each stage for schedule ``kind``."""
    if v == 1:
        return syncs if kind == "megatron" else [d.replace(gather_at_start=True) for d in syncs]
    stock = kind == "megatron"
    return [d.replace(gather_at_start=True, sync_delay=s if stock else 0, gather_aligned=stock, fill=not stock)
            for s, d in enumerate(syncs)]


def relaxed_syncs(syncs) -> list:
    """The floor's data-parallel sync (module docstring): a lower bound of the per-chunk one."""
    out = []
    for d in syncs:
        if not d.reduce_chunks:
            out.append(d.replace(gather_at_start=True))
            continue
        by_chunk = {}
        for ms, c in zip(d.reduce_ms, d.reduce_chunks):
            by_chunk.setdefault(c, []).append(ms)
        cheapest = min(by_chunk.values(), key=sum)
        gather = tuple(ms for ms, c in zip(d.gather_ms, d.gather_chunks) if c == 0)
        out.append(d.replace(reduce_ms=tuple(cheapest), gather_ms=gather, reduce_chunks=(), gather_chunks=(),
                             gather_at_start=True))
    return out


def virtual_floor(cfg, costs, syncs, time_limit_s: float, factor: float = 1.05) -> dict:
    """The floor over the placements (module docstring), simulated."""
    try:
        from ..pp import build
        from ..pp.chunks import interleaved_placement, v_placement
        from ..pp.optimal import floor
    except ImportError as exc:  # pragma: no cover - ortools is a test dependency
        return {"error": str(exc)}
    p, m, v = cfg.pp, cfg.microbatches, cfg.vpp
    stock = build("megatron", p, m, chunks=v)
    memory = [factor * x for x in stock.memory_bound]
    placements = {"interleaved": interleaved_placement(p, v)}
    if v == 2:
        placements["V"] = v_placement(p)
    found = {}
    for name, placement in placements.items():
        try:
            f = floor(costs.times, m, costs.transfer_ms, 0.0, memory=memory, time_limit_s=time_limit_s,
                      dp=relaxed_syncs(syncs), placement=placement, bound_only=True)
        except (ImportError, RuntimeError, ValueError) as exc:
            return {"error": f"{name} placement: {exc}"}
        found[name] = f
    best = min(found, key=lambda k: found[k].bound_ms)  # no schedule in either placement is below it
    f = found[best]
    return {"step_ms": min(x.step_ms for x in found.values()), "bound_ms": f.bound_ms,
            "optimal": all(x.optimal for x in found.values()), "bubble": f.bubble_floor, "placement": best,
            "memory": max(memory), "per_placement": {k: {"bound_ms": x.bound_ms, "step_ms": x.step_ms,
                                                         "optimal": x.optimal} for k, x in found.items()}}
