"""``megatron-overlap bench hdp``: the schedulers on the same full batches, scored by the same
cost model and step simulator, and a second time by megatron-core's own model. Simulated.

    static              fixed CP size from the longest sequence, greedy token packing (baselines.py)
    megatron_balanced   megatron-core's BalancedCPScheduler, unmodified (baselines.py)
    hdp_fewest          ours, every sequence on the fewest ranks that hold it (``spread=False``)
    hdp                 ours (scheduler.py): rings spread for balance where the step gets shorter,
                        guarded (hdp/guard.py): megatron-core's plan, run as one phase, where ours
                        would be more than 1% slower than it under either model (``--no-guard``: ours)

Batches: ``--lengths-file F`` (one token count per line, ``#`` starts a comment; with
``--batch-tokens T`` its sequences are cut, in file order, into full batches of at least T tokens,
without it a blank line ends a full batch, and a file without blank lines is refused: a list of
document lengths is not one step), ``--corpus packages`` (real lengths from this machine:
``corpus.py``, read again reshuffled until it gives ``--steps`` batches), or a built-in distribution,
drawn with a fixed seed (``--seed``), ``--steps`` batches of ``--batch-tokens`` tokens each
(default 8 x R x C: 8 micro-batches of C tokens per rank on average; the last sequence drawn
may overshoot the budget):

    heavy-tailed   lognormal, median 2048 tokens, sigma 1.8, clipped to [64, --max-len]:
                   most sequences are short; about 6% exceed 32K and hold about 55-60% of the
                   tokens, about 0.4% are clipped to 256K (the shape of long-context
                   pre-training data; an assumption of this benchmark, not fitted to a dataset)
    uniform        every length in [64, --max-len] equally likely

``--max-len`` (default 262144) is lowered to the longest sequence R ranks of C tokens hold
(C, or R x 2 floor(C/2) on a ring of all R).

Scores, per scheduler, over the steps::

    imbalance              mean over steps of  max_r work_r / mean_r work_r   (busy time, waits excluded)
    step_time_ms           mean over steps of the simulated step (simulate.py: ring peers wait for
                           each other, phases end with a barrier), with ``--micro-batch-overhead-ms``
                           per micro-batch added (hdp plans without it: the home-field bias shows)
    vs_bound               mean over steps of step / ``simulate.lower_bound_ms``
    square_vs_bound        the same plans scored by megatron-core's own model (L^2 / cp per rank, no
                           linears, no communication: ``cost.SquareWorkload``) against its bound
    moved_tokens           mean over steps of the tokens that leave the rank that loaded them
                           (sequence i is loaded by rank i mod R, as Megatron's sampler deals them)
    cp_comm_bytes          mean over steps of the bytes all ranks send through rings (Plan.cp_comm_bytes)
    microbatches_per_rank  min and max over ranks and steps of non-empty micro-batches

The cost model: ``HdpCostModel.named(--hardware, --model)``, by default an H100 SXM (989 TFLOPS
bf16, NVLink within 8-GPU nodes, 50 GB/s per GPU across) running Llama-3-8B whole (TP = 1). Our
scheduler plans with the model it is scored by: the second scoring, with megatron-core's model,
is the baseline's home ground.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from typing import Dict, List, Sequence

from ..tune.hardware import HARDWARE
from ..tune.models import MODELS
from ..errors import OverlapConfigError
from ..hdp.cost import HdpCostModel
from ..hdp.scheduler import CAPACITY_FIELD, MODES
from .hdp_batches import DISTRIBUTIONS, draw_batches, load_batches, max_len_for, read_lengths_file  # noqa: F401

SCHEDULER_NAMES = ("static", "megatron_balanced", "hdp_fewest", "hdp")


def _shape(note: str) -> str:
    """A note with its numbers (and lists of numbers) blanked out."""
    return re.sub(r"\d+(?:, \d+)*", "#", note)


def score(plans, cost, errors: Sequence[str] = (), bounds: Sequence[float] = (), homes=None,
          square=None, square_bounds: Sequence[float] = ()) -> Dict:
    """The scores of one scheduler's plans (module docstring). ``errors``: the steps it could not
    plan (megatron-core's scheduler failing); scores are over the others, None when none is left.
    ``bounds``: per step, ``simulate.lower_bound_ms`` under ``cost``; ``homes``: per step, the
    rank that loaded each sequence; ``square`` (megatron-core's own model) and its bounds score
    the same plans a second time. ``notes``: the first step's notes, then any note of a later step
    that says something else (not only other numbers)."""
    from ..hdp.simulate import simulate

    imb, step, comm, mbs, notes, vs_bound, moved, sq_step, sq_bound = [], [], [], [], [], [], [], [], []
    for k, plan in enumerate(plans):
        imb.append(plan.imbalance(cost))
        step.append(simulate(plan, cost).step_ms)
        comm.append(plan.cp_comm_bytes(cost))
        mbs.extend(plan.microbatches_per_rank())
        if bounds:
            vs_bound.append(step[-1] / bounds[k])
        if homes:
            moved.append(plan.moved_tokens(homes[k]))
        if square is not None:
            sq_step.append(simulate(plan, square).step_ms)
            sq_bound.append(sq_step[-1] / square_bounds[k])
        for note in plan.notes:
            if _shape(note) not in {_shape(x) for x in notes}:
                notes.append(note)
    n = len(plans)
    mean = (lambda xs: sum(xs) / len(xs) if xs else None)  # noqa: E731
    out = {
        "imbalance": mean(imb),
        "imbalance_max": max(imb) if n else None,
        "step_time_ms": mean(step),
        "vs_bound": mean(vs_bound),
        "vs_bound_max": max(vs_bound) if vs_bound else None,
        "moved_tokens": mean(moved),
        "square_step": mean(sq_step),
        "square_vs_bound": mean(sq_bound),
        "cp_comm_bytes": mean(comm),
        "microbatches_per_rank": {"min": min(mbs), "max": max(mbs)} if n else None,
        "per_step": {"step_ms": step, "bound_ms": list(bounds), "square_ms": sq_step,
                     "square_bound_ms": list(square_bounds)},
        "steps": n,
        "notes": notes,
    }
    if errors:
        out["failed_steps"] = len(errors)
        out["error"] = errors[0][:500]
    return out


def schedule(name: str, seq_lens, ranks: int, capacity_tokens: int, cost=None, **kwargs):
    """Plan of scheduler ``name`` (``SCHEDULER_NAMES``): ours (``hdp``; ``hdp_fewest``: without
    spreading) and the static baseline from ``hdp``, megatron-core's own through
    ``integration.baselines``."""
    from ..hdp import schedule as schedule_ours

    if name == "megatron_balanced":
        from ..integration.baselines import schedule_megatron_balanced

        return schedule_megatron_balanced(seq_lens, ranks, capacity_tokens, cost)
    if name == "hdp_fewest":
        return schedule_ours("hdp", seq_lens, ranks, capacity_tokens, cost, spread=False, **kwargs)
    return schedule_ours(name, seq_lens, ranks, capacity_tokens, cost, **kwargs)


def loading_ranks(count: int, ranks: int) -> List[int]:
    """Which rank loads sequence i: ``i mod R``, as Megatron's data-parallel sampler deals out a
    full batch at micro-batch size 1 (rank r gets samples r, r + R, ...)."""
    return [i % ranks for i in range(count)]


def run(batches: Sequence[Sequence[int]], ranks: int, capacity_tokens: int, cost: HdpCostModel,
        mode: str = "dp", progress: bool = True, overhead_ms: float = 0.0, guard: bool = True, bar=None) -> Dict:
    """Schedule every batch with each scheduler (planned with ``cost``), validate every plan,
    score them with ``cost`` plus ``overhead_ms`` per micro-batch and with megatron-core's own
    model (``SquareWorkload``). A batch megatron-core's scheduler fails on is counted in its
    ``failed_steps`` (baselines.py). ``guard``: the ``hdp`` row is our plan or megatron-core's,
    whichever ``hdp.guard`` keeps under the scoring models (its planning time includes
    megatron-core's). ``bar``: a progress bar to advance instead of one of its own."""
    import contextlib
    import dataclasses

    from ..hdp.bound_tradeoff import for_both
    from ..hdp.guard import guarded

    from tqdm import tqdm

    from ..hdp.baselines import MegatronSchedulerError
    from ..hdp.cost import SquareWorkload
    from ..hdp.simulate import lower_bound_ms

    homes = [loading_ranks(len(lens), ranks) for lens in batches]
    scoring = dataclasses.replace(cost, microbatch_overhead_ms=overhead_ms)
    square = SquareWorkload(gpus_per_node=cost.gpus_per_node)
    bounds = [lower_bound_ms(lens, ranks, capacity_tokens, scoring) for lens in batches]
    from ..hdp.simulate import granularity_bound

    granularity = [granularity_bound(lens, ranks, capacity_tokens, scoring) for lens in batches]
    square_bounds = [lower_bound_ms(lens, ranks, capacity_tokens, square) for lens in batches]
    plans = {name: [] for name in SCHEDULER_NAMES}
    errors = {name: [] for name in SCHEDULER_NAMES}
    seconds = {name: 0.0 for name in SCHEDULER_NAMES}
    kept = {name: [] for name in SCHEDULER_NAMES}  # the steps each scheduler planned
    try:  # megatron-core's first call imports it: not planning time
        schedule("megatron_balanced", [1], 1, max(1, capacity_tokens))
    except MegatronSchedulerError:
        pass
    own = bar is None
    bar = bar or tqdm(total=len(batches) * len(SCHEDULER_NAMES), desc="bench hdp: scheduling", unit="plan",
                      disable=not progress, delay=1.0, file=sys.stderr)
    per_step = {name: [] for name in SCHEDULER_NAMES}
    with (bar if own else contextlib.nullcontext()):
        for k, lens in enumerate(batches):
            peer = None
            for name in SCHEDULER_NAMES:
                extra = {"mode": mode, "home": homes[k]} if name.startswith("hdp") else {}
                t0 = time.perf_counter()
                try:
                    plan = schedule(name, list(lens), ranks, capacity_tokens, cost, **extra)
                except MegatronSchedulerError as exc:
                    errors[name].append(str(exc))
                    plan = None
                if name == "megatron_balanced":
                    peer, peer_s = plan, time.perf_counter() - t0
                if name == "hdp" and guard:  # what the runtime runs: ours, or megatron-core's where ours is slower
                    plan = guarded(for_both(plan, cost, scoring, mode, homes[k]) if plan else plan, peer, scoring)
                    seconds[name] += peer_s  # the runtime plans megatron-core's too
                per_step[name].append(time.perf_counter() - t0 + (peer_s if name == "hdp" and guard else 0.0))
                seconds[name] += time.perf_counter() - t0
                if plan is not None:
                    plan.validate()
                    plans[name].append(plan)
                    kept[name].append(k)
                bar.update()
    out = {}
    for name in SCHEDULER_NAMES:
        ks = kept[name]
        out[name] = score(plans[name], scoring, errors[name], [bounds[k] for k in ks], [homes[k] for k in ks],
                          square, [square_bounds[k] for k in ks])
        out[name]["schedule_ms"] = 1e3 * seconds[name] / len(batches)
        out[name]["schedule_ms_max"] = 1e3 * max(per_step[name])
        out[name]["per_step"]["batch"] = ks
        out[name]["guard_kept_megatron"] = sum(any(n.startswith("guard:") for n in p.notes) for p in plans[name])
        out[name]["per_step"]["imbalance"] = [p.imbalance(scoring) for p in plans[name]]
        out[name]["per_step"]["granularity_bound"] = [granularity[k] for k in ks]
    return out


def format_table(result: Dict) -> str:
    cfg = result["config"]
    lines = [
        f"HDP bench: {cfg['source']}, {cfg['steps']} steps, {cfg['sequences']} sequences "
        f"({cfg['tokens'] / 1e6:.1f}M tokens), R={cfg['ranks']}, C={cfg['max_tokens_per_rank']}, "
        f"{cfg['hardware']} / {cfg['model']}, hdp mode {cfg['mode']} (simulated)",
        f"{'scheduler':<19}{'imbalance':>10}{'step ms':>10}{'vs static':>10}{'vs bound':>9}{'sq. vs bnd':>11}"
        f"{'moved Mtok':>11}{'CP GB/step':>11}{'mb/rank':>9}{'sched ms':>9}",
    ]
    base = result["schedulers"]["static"]["step_time_ms"]
    for name, s in result["schedulers"].items():
        if s["steps"] == 0:
            lines.append(f"{name:<19}{'failed on every step (see notes)':>40}")
            continue
        mb = s["microbatches_per_rank"]
        lines.append(f"{name:<19}{s['imbalance']:>10.3f}{s['step_time_ms']:>10.0f}{base / s['step_time_ms']:>9.2f}x"
                     f"{s['vs_bound']:>8.2f}x{s['square_vs_bound']:>10.2f}x{s['moved_tokens'] / 1e6:>11.2f}"
                     f"{s['cp_comm_bytes'] / 1e9:>11.1f}{str(mb['min']) + '-' + str(mb['max']):>9}"
                     f"{s['schedule_ms']:>9.0f}")
    lines.append(f"step ms: simulated with our cost model plus {cfg['microbatch_overhead_ms']:g} ms per micro-batch "
                 f"(hdp plans with the model, without the overhead); vs bound: step / lower bound "
                 f"(simulate.lower_bound_ms); sq. vs bnd: the same plans scored with megatron-core's own model "
                 f"(L^2 / cp, no communication) against its bound; moved: tokens leaving the rank that loaded them "
                 f"(rank i mod R loads sequence i), per step")
    hdp = result["schedulers"].get("hdp", {}).get("per_step", {})
    if hdp.get("imbalance"):
        lines.append("per batch, hdp's imbalance / the granularity bound (simulate.granularity_bound: the longest "
                     "sequence at its best spread over the even share of the least work; 1.000 = the batch allows "
                     "perfect balance): " + ", ".join(f"{i:.3f} / {g:.3f}" for i, g in
                                                       zip(hdp["imbalance"], hdp["granularity_bound"])))
    for name, s in result["schedulers"].items():
        if s.get("failed_steps"):
            lines.append(f"  {name}: failed on {s['failed_steps']} of {cfg['steps']} steps: {s['error'][:200]}")
        for note in s["notes"]:
            lines.append(f"  {name}: {note}")
    return "\n".join(lines)


def add_hdp_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--lengths-file", default="", metavar="F",
                        help="one token count per line, a blank line between full batches "
                             "(default: a built-in distribution)")
    parser.add_argument("--distribution", choices=DISTRIBUTIONS, default="heavy-tailed",
                        help="built-in distribution when no --lengths-file or --corpus is given")
    parser.add_argument("--corpus", choices=("packages", "pile"), default=None,
                        help="real lengths: packages = the installed packages' and the standard library's source "
                             "files concatenated per package on this machine (cli/corpus.py); pile = documents drawn "
                             "from The Pile's published per-component counts and mean sizes (cli/pile_lengths.py; "
                             "the default of --emulate)")
    parser.add_argument("--write-lengths", default="", metavar="F",
                        help="also write the batches to F in the --lengths-file format")
    parser.add_argument("--micro-batch-overhead-ms", dest="microbatch_overhead_ms", type=float, default=1.0,
                        metavar="MS",
                        help="fixed cost of each micro-batch when scoring (not when hdp plans)")
    parser.add_argument("--ranks", type=int, default=None, help="R = DP x CP ranks (default 64; with --emulate 16)")
    parser.add_argument("--overlap-hdp-max-tokens-per-rank", dest="max_tokens_per_rank", type=int, default=32768,
                        metavar="C",
                        help="C: rows one rank holds in a micro-batch (as the training flag)")
    parser.add_argument("--steps", type=int, default=4, help="full batches drawn from the distribution")
    parser.add_argument("--batch-tokens", type=int, default=0, metavar="T",
                        help="tokens per full batch: drawn, dealt from --corpus, or cut from --lengths-file in file "
                             "order (default 8 x R x C; a lengths file without blank lines needs it)")
    parser.add_argument("--max-len", type=int, default=None,
                        help="longest sequence: drawn (default 262144), or where --corpus cuts its documents "
                             "(default: what the R ranks hold)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--mode", choices=MODES, default="dp",
                        help="the scheduler's mode: dp = each rank's work per step balanced (what --overlap-hdp "
                             "runs without a pipeline), pp = also the same micro-batch count on every rank, similar "
                             "lengths per index (what it runs with --pipeline-model-parallel-size > 1)")
    parser.add_argument("--hardware", choices=sorted(HARDWARE), default="h100-sxm")
    parser.add_argument("--model", choices=sorted(MODELS), default="llama3-8b")
    parser.add_argument("--no-guard", action="store_true",
                        help="score our plans as they are (default: hdp.guard keeps megatron-core's where ours would be "
                             "more than 1%% slower under either model)")
    parser.add_argument("--sweep", action="store_true",
                        help="every R of --sweep-ranks x every T = m x R x C of --sweep-multiples, documents cut at "
                             "--max-len (default R x C / 8): time-weighted scores against the bound and megatron-core's "
                             "(cli/bench_hdp_sweep.py)")
    parser.add_argument("--sweep-ranks", default="64,256", metavar="R,R")
    parser.add_argument("--sweep-multiples", default="1,2,4,8", metavar="M,M")
    parser.add_argument("--json", action="store_true", help="print one JSON line after the table")
    parser.add_argument("--no-progress", action="store_true")
    from .bench_hdp_emulate import add_emulate_args

    add_emulate_args(parser)
    from ..args import add_alias

    add_alias(parser, "--max-tokens-per-rank", "--overlap-hdp-max-tokens-per-rank")
    add_alias(parser, "--microbatch-overhead-ms", "--micro-batch-overhead-ms")
    return parser


def hdp_main(args) -> int:
    """One set of batches scheduled and scored (``cli/main.py`` sends ``--emulate`` and ``--sweep`` elsewhere)."""
    R, C = args.ranks, args.max_tokens_per_rank
    try:
        if C <= 0:
            raise OverlapConfigError(CAPACITY_FIELD, f"must be a positive number of tokens, got {C}")
        if R < 1:
            raise ValueError(f"--ranks must be >= 1, got {R}")
        if args.microbatch_overhead_ms < 0:
            raise ValueError(f"--micro-batch-overhead-ms must be >= 0, got {args.microbatch_overhead_ms}")
        batches, source = load_batches(args)
        cost = HdpCostModel.named(args.hardware, args.model)
        if args.write_lengths:
            with open(args.write_lengths, "w") as f:
                f.write(f"# {source}\n" + "\n\n".join("\n".join(map(str, b)) for b in batches) + "\n")
        schedulers = run(batches, R, C, cost, mode=args.mode, progress=not args.no_progress,
                         overhead_ms=args.microbatch_overhead_ms, guard=not args.no_guard)
    except (ValueError, OSError) as exc:
        print(f"bench hdp: {exc}", file=sys.stderr)
        return 2
    result = {
        "schedulers": schedulers,
        "config": {
            "source": source,
            "steps": len(batches),
            "sequences": sum(len(b) for b in batches),
            "tokens": sum(sum(b) for b in batches),
            "ranks": R,
            "max_tokens_per_rank": C,
            "mode": args.mode,
            "hardware": args.hardware,
            "model": args.model,
            "microbatch_overhead_ms": args.microbatch_overhead_ms,
        },
    }
    print(format_table(result))
    if args.json:
        print(json.dumps(result))
    return 0
