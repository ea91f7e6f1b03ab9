"""``--overlap-tp auto`` from the cost model: which strategy the simulator predicts fastest for
the model in Megatron's arguments on a GPU it knows. Pure Python; the arguments are read by
name, Megatron is not imported."""

from __future__ import annotations

import dataclasses
from typing import Optional


def hardware_for_device(name: Optional[str]) -> Optional[str]:
    """The cost model's HardwareSpec name for a CUDA device name, or None if it has none."""
    if not name:
        return None
    upper = name.upper()
    for key, spec in (("H200", "h200-sxm"), ("H800", "h800-sxm"), ("H100", "h100-sxm")):
        if key in upper and "PCIE" not in upper:
            return spec
    if "A100" in upper:
        return "a100-pcie" if "PCIE" in upper else "a100-sxm"
    return None


def predicted_choice(args, device: Optional[str], symm_mem_usable: bool, fixed_p2p: Optional[tuple] = None,
                     sub_batches=1, backend: Optional[str] = None, blocks: Optional[str] = None):
    """What ``--overlap-tp auto`` (or ``--overlap-tp-sub-batches auto``) runs when nothing was
    measured: the cost model simulates the model in Megatron's ``args`` on this GPU for stock,
    ``p2p`` (every chunk count and reduce-scatter the planner knows) and, where it runs,
    ``symm-mem``, and returns the fastest (a ``tune.strategy_sim.StrategyResult`` and the stock one),
    or None without a known GPU or the model's dimensions. ``fixed_p2p = (chunks per rank, rs)``:
    the user fixed the decomposition, so the only candidates are stock and ``p2p`` with it.
    ``sub_batches``: the user's count, kept (candidates whole: the cut is planned at 1), or
    ``auto``: each candidate also cut into 2 and 3. ``backend``: the user fixed ``tp.mode``, so
    only the sub-batch count is chosen (stock is simulated, never picked). ``blocks``: the blocks
    a count above 1 cuts (``tp.sub_batch_blocks`` as the user gave it), or None: each of all,
    attention and mlp is a candidate. ``fused`` is left out:
    measured slower than stock (``measured.py``)."""
    spec = hardware_for_device(device)
    needed = ("hidden_size", "ffn_hidden_size", "num_attention_heads", "num_layers", "seq_length")
    if spec is None or any(getattr(args, n, None) is None for n in needed):
        return None
    from .hardware import get_hardware
    from .strategy_ranking import candidates as plan_candidates, make_plan
    from .strategies import CUT_BLOCKS, Strategy

    model, run = _model_and_run(args)
    counts = (1, 2, 3) if sub_batches == "auto" else (1,)
    cuts = (blocks,) if blocks else CUT_BLOCKS
    if backend is not None or fixed_p2p is not None:  # one backend, its decomposition fixed: only the count varies
        name = backend or "p2p"
        chunks, rs = fixed_p2p or (0, "ring")
        shape = dict(chunks=chunks, rs=rs) if name == "p2p" else {}
        allowed = [Strategy("megatron")] + [Strategy(name, sub_batches=n, **shape) for n in counts]
    else:
        allowed = [s for s in plan_candidates(run) if s.sub_batches in counts and not s.allreduce_fusion and (
            s.name == "megatron" or s.name == "p2p" or (s.name == "symm-mem" and symm_mem_usable))]
    allowed += [dataclasses.replace(s, cut=cut) for s in allowed if s.sub_batches > 1 for cut in cuts if cut != "all"]
    if "all" not in cuts:
        allowed = [s for s in allowed if s.sub_batches == 1 or s.cut != "all"]
    from .strategy_ranking import UnbuildableError

    try:
        plan = make_plan(model, run, get_hardware(spec), allowed)
    except UnbuildableError:  # install refuses these first (same rule); never pick for them
        return None
    picks = [r for r in plan.ranked if backend is None or r.strategy.name == backend]
    return (picks[0], plan.stock) if picks else None


def _model_and_run(args):
    """The cost model's ModelSpec and RunSpec for Megatron's ``args``."""
    from .models import ModelSpec, RunSpec

    heads = args.num_attention_heads
    kv = args.num_query_groups if getattr(args, "group_query_attention", False) and args.num_query_groups else heads
    model = ModelSpec("megatron-args", hidden=args.hidden_size, ffn=args.ffn_hidden_size, heads=heads, kv_heads=kv,
                      layers=args.num_layers, vocab=getattr(args, "padded_vocab_size", None) or
                      getattr(args, "vocab_size", None) or 32000, seq=args.seq_length,
                      gated=bool(getattr(args, "swiglu", False)))
    run = RunSpec(tp=args.tensor_model_parallel_size, cp=getattr(args, "context_parallel_size", 1) or 1,
                  pp=getattr(args, "pipeline_model_parallel_size", 1) or 1, seq=args.seq_length,
                  micro_batch=getattr(args, "micro_batch_size", 1) or 1,
                  sequence_parallel=getattr(args, "sequence_parallel", True) is not False)
    return model, run


def predicted_pp_choice(args, device: Optional[str], world_size: Optional[int] = None):
    """What ``--overlap-pp auto`` runs when the cost model can answer: each of our schedules
    and stock 1F1B simulated for the model and pipeline in Megatron's ``args`` on this GPU,
    the data-parallel sync priced as the emulated cluster measures it (Megatron's DDP buckets,
    the distributed optimizer and its overlap flags as given), and the (F, B, W) zb should
    place its weight gradients for (``pp.build.placement_times``); or None without a known GPU,
    the model's dimensions, PP > 1 or the micro-batches per step (``global_batch_size``)."""
    import os

    spec = hardware_for_device(device)
    needed = ("hidden_size", "ffn_hidden_size", "num_attention_heads", "num_layers", "seq_length",
              "global_batch_size")
    pp = getattr(args, "pipeline_model_parallel_size", 1) or 1
    if spec is None or pp < 2 or any(getattr(args, n, None) is None for n in needed):
        return None
    from dataclasses import replace

    from .hardware import get_hardware
    from .pipeline import DPOptions, simulate_schedules

    model, run = _model_and_run(args)
    world = world_size or int(os.environ.get("WORLD_SIZE", "0") or 0)
    dp = getattr(args, "data_parallel_size", None) or (world // (run.tp * run.cp * pp) if world else 0)
    if not dp:
        return None
    m = args.global_batch_size // (run.micro_batch * dp)
    if m < pp:
        return None
    options = DPOptions(distributed_optimizer=bool(getattr(args, "use_distributed_optimizer", False)),
                        overlap_grad_reduce=bool(getattr(args, "overlap_grad_reduce", False)),
                        overlap_param_gather=bool(getattr(args, "overlap_param_gather", False)))
    from ..pp.build import placement_times
    from ..pp.schedule_sim import LinkCost
    from .pipeline import stage_costs

    run = replace(run, dp=dp, micro_batches=m)
    hw = get_hardware(spec)
    costs = stage_costs(model, run, hw, dp_options=options)
    placement = placement_times(costs.times, m, LinkCost(transfer_ms=costs.transfer_ms), costs.dp_ours())
    rows = simulate_schedules(model, run, hw, dp_options=options, placement=placement)
    steps = {"off" if r.label.startswith("stock") else "zb" if r.label.startswith("zb") else "1f1b": r.step_ms
             for r in rows if "in flight" not in r.label}
    out = {"steps_ms": steps, "options": options.describe(), "dp": dp, "microbatches": m, "hardware": spec,
           "placement": placement}
    v = _virtual_chunks(args, pp)
    if v:  # a virtual pipeline: stock interleaved against ours in the same chunks (tune/virtual.py)
        from .virtual import simulate_virtual

        names = {"stock Megatron interleaved": "off", "zb interleaved": "zb", "zbv (ZB-V)": "zbv"}
        rows = [r for r in simulate_virtual(model, run, hw, dp_options=options, chunks=(v,))]
        out["virtual"] = {"chunks": v, "steps_ms": {names[k]: r.step_ms for r in rows for k in names
                                                     if r.label.startswith(k)}}
    return out


def _virtual_chunks(args, pp: int) -> int:
    """Model chunks per stage of Megatron's ``args`` (0: no virtual pipeline)."""
    v = getattr(args, "virtual_pipeline_model_parallel_size", None)
    per = getattr(args, "num_layers_per_virtual_pipeline_stage", None)
    if not v and per:
        v = args.num_layers // (pp * per)
    return int(v or 0)
