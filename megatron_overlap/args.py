"""Command-line flags. ``add_overlap_args`` is usable as Megatron's ``extra_args_provider``."""

from __future__ import annotations

import argparse

from .config import CP_MODES, RS_ALGOS, TP_MODES

# Every flag the plugin adds, pinned by tests/test_flags.py so none appears by accident and
# none collides with Megatron-LM's own.
FLAGS = (
    "--overlap-tp",
    "--overlap-tp-chunks",
    "--overlap-tp-rs",
    "--overlap-tp-bidirectional",
    "--overlap-autotune",
    "--overlap-plan",
    "--overlap-trace",
    "--overlap-trace-iters",
    "--overlap-cp",
    "--overlap-cp-a2a-size",
    "--hdp",
    "--hdp-max-tokens-per-rank",
    "--hdp-mode",
)


def _chunk_count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(
            f"must be 0 (choose automatically) or a positive multiple of the TP size, got {value}"
        )
    return value


def add_overlap_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the plugin's flags to ``parser`` and return it (Megatron's extra_args_provider API).

    Idempotent: a parser that has them already (a patched Megatron fork run through the
    launcher, say) is returned as it is.
    """
    if any("--overlap-tp" in action.option_strings for action in parser._actions):
        return parser
    group = parser.add_argument_group(
        "megatron-overlap", "Hide tensor-parallel communication behind the GEMMs."
    )
    group.add_argument(
        "--overlap-tp",
        choices=TP_MODES,
        default="off",
        help="Overlap the sequence-parallel all-gather/reduce-scatter of Megatron's "
        "ColumnParallelLinear/RowParallelLinear with their GEMMs. off: stock Megatron; "
        "p2p: chunked point-to-point rings (any device and backend); symm-mem: PyTorch's "
        "symmetric-memory fused ops (CUDA); fused: our Triton kernels; auto: symm-mem where it "
        "runs, else p2p. Needs --sequence-parallel and --transformer-impl local.",
    )
    # None defaults: lets the config tell "given with overlap off" (a conflict) from "not given".
    group.add_argument(
        "--overlap-tp-chunks",
        type=_chunk_count,
        default=None,
        metavar="N",
        help="Chunks per overlapped collective, over the whole TP group (a multiple of the TP "
        "size); 0 (default) chooses.",
    )
    group.add_argument(
        "--overlap-tp-rs",
        choices=RS_ALGOS,
        default=None,
        help="Reduce-scatter after a GEMM as a ring of partial sums (ring, default for p2p) or "
        "as all-to-all plus a local reduce (a2a, the only one of --overlap-tp fused).",
    )
    group.add_argument(
        "--overlap-tp-bidirectional",
        action="store_true",
        default=None,
        help="Split each chunk in two halves travelling both ways round the ring.",
    )
    group.add_argument(
        "--overlap-autotune",
        action="store_true",
        default=None,
        help="Measure the candidate decompositions (chunks per rank, reduce-scatter algorithm) of "
        "each distinct linear shape on the real TP group the first time it runs; every rank takes "
        "the same pick; cached on disk (~/.cache/megatron_overlap/tp_plans.json) for the next start.",
    )
    group.add_argument(
        "--overlap-plan",
        default=None,
        metavar="FILE",
        help="Load the decompositions from FILE (the autotuner's cache format: {shape key: "
        "'c4t-ring' | {'choice': ...}}; a 'default' key applies to every other shape).",
    )
    group.add_argument(
        "--overlap-trace",
        default=None,
        metavar="DIR",
        help="Write a per-rank Chrome trace (torch.profiler; opens in Perfetto) of the chosen "
        "iterations to DIR and log their exposed communication; `megatron-overlap report DIR` "
        "draws them. Works with --overlap-tp off too (to see stock Megatron).",
    )
    group.add_argument(
        "--overlap-trace-iters",
        default=None,
        metavar="LIST",
        help="Iterations to trace, counted from 0 in this run: '3', '3,5' or '3-5' (default 3).",
    )
    group.add_argument(
        "--overlap-cp",
        choices=CP_MODES,
        default="off",
        help="Context parallelism for Megatron's local attention (--transformer-impl local, "
        "--context-parallel-size > 1), data sliced as Megatron's get_batch_on_this_cp_rank does. "
        "ring: K/V blocks travel a P2P ring, the block in hand attended meanwhile (any head "
        "count); a2a: all-to-all to heads and back (Ulysses; heads per TP rank divisible by CP); "
        "hybrid: a2a inside groups of --overlap-cp-a2a-size ranks, ring across. off: stock "
        "(which refuses CP > 1 on the local path).",
    )
    group.add_argument(
        "--overlap-cp-a2a-size",
        type=int,
        default=None,
        metavar="U",
        help="All-to-all group size of --overlap-cp hybrid (divides the context-parallel size).",
    )
    group.add_argument(
        "--hdp",
        action="store_true",
        default=False,
        help="Hybrid data parallelism: all data-parallel ranks form one group; each sequence gets the "
        "fewest ranks that hold it (ceil(L / C), a ring over those ranks) and work is balanced across "
        "ranks. Needs --context-parallel-size 1, --transformer-impl local, packed variable-length data.",
    )
    group.add_argument(
        "--hdp-max-tokens-per-rank",
        type=int,
        default=None,
        metavar="C",
        help="Tokens one rank holds in one micro-batch under --hdp (padding included).",
    )
    group.add_argument(
        "--hdp-mode",
        choices=("dp", "pp"),
        default=None,
        help="dp (default): balance each rank's total work per step; pp: sequences of similar length "
        "share a micro-batch index on every rank (scheduler only so far: the runtime refuses PP > 1).",
    )
    return parser


def overlap_parser(prog: str | None = None) -> argparse.ArgumentParser:
    """A parser holding only the plugin's flags, for scripts that build models themselves."""
    return add_overlap_args(argparse.ArgumentParser(prog=prog, allow_abbrev=False))
