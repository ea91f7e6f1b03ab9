"""Command-line flags: their types, defaults and help.

``add_overlap_args`` is usable as Megatron's ``extra_args_provider``. Every flag the plugin adds
is in ``_FLAGS``, pinned by tests/test_config.py so none appears by accident and none collides
with Megatron-LM's own. Errors name config fields (``tp.chunks``); the one map from fields to
flags is :mod:`megatron_overlap.flag_names` (a leaf the errors read). Every flag starts
``--overlap-`` and names the parallelism it tunes
(``--overlap-tp-*``, ``--overlap-cp-*``, ``--overlap-hdp-*``, ``--overlap-pp-*``); the old
spellings in ``DEPRECATED`` still work and warn once (:func:`deprecation`). docs/flags.md is
generated from this table (scripts/flags_doc.py).
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

from . import rules
from .cp import CP_MODES
from .errors import OverlapConfigError
from .flag_names import FIELDS, flag_for  # noqa: F401  (flag_for: re-exported, config and the tests read it here)
from .pp import BUCKETS as PP_BUCKETS, MODES as PP_MODES
from .tp import RS_ALGOS, SUB_BATCH_BLOCKS, TP_MODES, check_chunks


def _argparse_rule(rule):
    """An argparse ``type`` from a rule of ``rules`` (or an area's): the same check as the config
    and the file loaders apply, its message reported the argparse way."""

    def parse(text: str):
        try:
            return rule(text)
        except OverlapConfigError as exc:
            raise argparse.ArgumentTypeError(exc.reason) from None

    return parse


def _chunk_count(text: str) -> int:
    """``--overlap-tp-chunks``: TP's own rule (``tp.check_chunks``)."""
    value = text.strip()
    return check_chunks(int(value) if len(value) <= 24 and value.lstrip("+-").isdigit() else text)


def _sub_batch_count(text: str):
    """``--overlap-tp-sub-batches``: a count or ``auto`` (checked by the config layer with the mode)."""
    if text == "auto":
        return text
    return rules.whole_number(text, "tp.sub_batches", 1, rules.MAX_COUNT, "a whole number >= 1 or auto")


def _count(field: str, low: int, what: str):
    return _argparse_rule(lambda text: rules.whole_number(text, field, low, rules.MAX_COUNT, what))


def _amount(field: str, unit: str, high: float):
    return _argparse_rule(lambda text: rules.positive_finite(text, field, unit, high))


# --overlap-pp's choices: the config keeps "off" for Megatron's schedule (``PPConfig.mode``)
PP_CHOICES = ("megatron",) + tuple(m for m in PP_MODES if m != "off")


def _pp_mode(text: str) -> str:
    """``--overlap-pp``: ``megatron`` is Megatron's own schedule (the config's ``off``); ``off``
    is its deprecated spelling."""
    if text == "off":
        deprecation("--overlap-pp off", "--overlap-pp megatron")
        return "off"
    if text not in PP_CHOICES:
        raise argparse.ArgumentTypeError(f"invalid choice: {text!r} (choose from {', '.join(PP_CHOICES)})")
    return "off" if text == "megatron" else text


# None defaults on the flags that depend on another: they let the config tell "given while
# that other flag is off" (a conflict) from "not given".
_OPTIONS = (  # (config field, argparse keywords); the flags: flag_names.FIELDS
    ("tp.mode", dict(
        choices=TP_MODES, default="off",
        help="Overlap the tensor-parallel communication of Megatron's ColumnParallelLinear/RowParallelLinear "
        "with their GEMMs: with --sequence-parallel their all-gather/reduce-scatter; without it their all-reduces "
        "(the Row forward's and the Column dgrad's, each cut into row pieces all-reduced while the next piece "
        "computes). off: stock Megatron; p2p: chunked point-to-point rings (any device and backend); symm-mem: "
        "PyTorch's symmetric-memory fused ops (CUDA; without SP its fused reduce-scatter, then an all-gather); "
        "fused: our Triton kernels (SP only); auto: chosen at start (the cost model on a GPU it knows, else "
        "symm-mem where it runs, else p2p). Needs --transformer-impl local.")),
    ("tp.chunks", dict(
        type=_argparse_rule(_chunk_count), default=None, metavar="N",
        help="Chunks per overlapped collective, over the whole TP group (a multiple of the TP size); 0 "
        "(default) chooses.")),
    ("tp.rs", dict(
        choices=RS_ALGOS, default=None,
        help="Reduce-scatter after a GEMM as a ring of partial sums (ring, default for p2p) or as all-to-all "
        "plus a local reduce (a2a, the only one of --overlap-tp fused).")),
    ("tp.sub_batches", dict(
        type=_argparse_rule(_sub_batch_count), default=None, metavar="N|auto",
        help="Cut each attention and MLP block's rows into N sub-batches run one after another, so one "
        "sub-batch's all-gather / reduce-scatter travels while another's attention or GEMMs compute (Domino-style "
        "workload partitioning; 2 or 3 are the usual choices; default 1: whole). auto: the cost model chooses "
        "N in 1-3 at start on a GPU it knows, else 1. Megatron's local spec; not with --overlap-tp fused. "
        "Without --sequence-parallel each part's all-reduces travel while the next part computes.")),
    ("tp.sub_batch_blocks", dict(
        choices=SUB_BATCH_BLOCKS, default=None,
        help="Which blocks --overlap-tp-sub-batches cuts: all (default), attention (the MLP blocks run whole with "
        "per-op overlap: their cut adds copies and smaller GEMMs for little gain where the link idles mostly "
        "during the core attention) or mlp. With --overlap-tp-sub-batches auto the cost model picks it too.")),
    ("tp.allreduce_fusion", dict(
        action="store_true", default=None,
        help="Without --sequence-parallel: CoCoNet's transformation of the attention block's output. Its "
        "projection's all-reduce, bias, dropout and residual add run as a reduce-scatter overlapped with the "
        "projection's GEMM, the bias, dropout and residual add on each rank's 1/TP of the rows, then an "
        "all-gather whose pieces feed the pre-MLP norm and the fc1 GEMM as they land. The same numbers as "
        "stock (dropout masks drawn whole from the same generator; summation order that of the reduce-scatter, "
        "the same bits at TP=2). Opt-in.")),
    ("tp.bidirectional", dict(
        action="store_true", default=None,
        help="Split each chunk in two halves travelling both ways round the ring.")),
    ("tp.autotune", dict(
        action="store_true", default=None,
        help="TP overlap: measure the candidate decompositions (chunks per rank, reduce-scatter algorithm) of each distinct "
        "linear shape on the real TP group the first time it runs; every rank takes the same pick; cached on "
        "disk (~/.cache/megatron_overlap/tp_plans.json) for the next start.")),
    ("tp.plan_file", dict(
        default=None, metavar="FILE",
        help="TP overlap: load the decompositions from FILE (the autotuner's cache format: {shape key: 'c4t-ring' | "
        "{'choice': ...}}; a 'default' key applies to every other shape).")),
    ("trace.dir", dict(
        default=None, metavar="DIR",
        help="Write a per-rank Chrome trace (torch.profiler; opens in Perfetto) of the chosen iterations to DIR "
        "and log their exposed communication; `megatron-overlap report DIR` draws them. Works with "
        "--overlap-tp off too (to see stock Megatron).")),
    ("trace.iterations", dict(
        default=None, metavar="LIST",
        help="Iterations to trace, counted from 0 in this run: '3', '3,5' or '3-5' (default 3).")),
    ("cp.mode", dict(
        choices=CP_MODES, default="off",
        help="Context parallelism for Megatron's local attention (--transformer-impl local, "
        "--context-parallel-size > 1), data sliced as Megatron's get_batch_on_this_cp_rank does. ring: K/V "
        "blocks travel a P2P ring, the block in hand attended meanwhile (any head count); a2a: all-to-all to "
        "heads and back (Ulysses; heads per TP rank divisible by CP); hybrid: a2a inside groups of "
        "--overlap-cp-a2a-size ranks, ring across. off: stock (which refuses CP > 1 on the local path).")),
    ("cp.a2a_size", dict(
        type=_count("cp.a2a_size", 1, "a whole number of ranks"), default=None, metavar="U",
        help="All-to-all group size of --overlap-cp hybrid (divides the context-parallel size).")),
    ("hdp.enabled", dict(
        action="store_true", default=False,
        help="Hybrid data parallelism: all data-parallel ranks form one group; each sequence gets a ring of "
        "at least the ranks that hold it (ceil(L / C); wider where that shortens the step) and work is balanced "
        "across ranks. With --pipeline-model-parallel-size > 1 every rank runs the same number of micro-batches "
        "(similar lengths at each index) under Megatron's 1F1B or --overlap-pp 1f1b / zb. Needs "
        "--context-parallel-size 1, --transformer-impl local, --calculate-per-token-loss, packed documents "
        "(--reset-attention-mask --reset-position-ids); not with Megatron's --hybrid-context-parallel.")),
    ("hdp.max_tokens", dict(
        type=_count("hdp.max_tokens", 1, "a whole number of tokens"), default=None, metavar="C",
        help="Tokens one rank holds in one micro-batch under --overlap-hdp (padding included).")),
    ("pp.mode", dict(
        type=_pp_mode, default="megatron", metavar="{" + ",".join(PP_CHOICES) + "}",
        help="Pipeline schedule for --pipeline-model-parallel-size > 1. megatron (default): Megatron's own "
        "schedule, nothing patched. Ours: 1f1b: Megatron's order with every stage-to-stage transfer posted early "
        "and waited just before use; zb: zero bubble, each backward split into its input gradient (B) and its "
        "weight gradients (W, run where the stage would wait; ZB-H1's memory); with a virtual pipeline both take "
        "Megatron's interleaved placement; zbv: ZB-V, exactly 2 model chunks per stage in a V (virtual "
        "pipelines only); auto: on a GPU the cost model knows, the faster of 1f1b and zb by it, else zb where the "
        "weight gradients can be deferred, else 1f1b (with a virtual pipeline: the cost model's fastest of "
        "Megatron's interleaved schedule, zb, zbv).")),
    ("pp.max_inflight", dict(
        type=_count("pp.max_inflight", 2, "a whole number of micro-batches"), default=None, metavar="K",
        help="Micro-batches forwarded by the first stage before its first backward, K in [PP size, number of "
        "micro-batches] (default: PP size, as 1F1B); stage s then warms up with max(PP - s, K - 2s). More in "
        "flight give transfers more compute to hide behind and cost activation memory on the first stages; "
        "2 x PP - 1 hides every steady-state transfer.")),
    ("pp.memory_budget_gb", dict(
        type=_amount("pp.memory_budget_gb", "GB", rules.MAX_GB), default=None, metavar="GB",
        help="Activation memory per stage in GB; sets --overlap-pp-max-inflight to the most micro-batches that "
        "fit (estimated from the model shape).")),
    ("pp.buckets", dict(
        choices=PP_BUCKETS, default=None,
        help="Megatron DDP's gradient buckets with a virtual pipeline under --overlap-pp. megatron (default): "
        "Megatron's (each chunk but stage 0's first in one bucket, whose reduction waits for the chunk's last "
        "gradient). every-chunk: DDP's bucket size on every stage and model chunk, each bucket sent as it fills "
        "(less exposed data-parallel time, more collectives). The distributed optimizer's checkpointed state "
        "follows the buckets: resume a checkpoint with the layout it was saved with, or save with "
        "--dist-ckpt-optim-fully-reshardable.")),
    ("comm.timeout_s", dict(
        type=_amount("comm.timeout_s", "seconds", rules.MAX_TIMEOUT_S), default=None, metavar="S",
        help="Bound every wait of the plugin's own communication (TP rings, CP and HDP rings, the HDP exchange, "
        "pipeline transfers, the fused kernels' flag waits) by S seconds, below the process group's timeout: a "
        "silent or dead peer ends the run in S seconds with an error naming the op, the layer or micro-batch "
        "and the peer rank. Default: the process group's timeout bounds them.")),
)

_FLAGS = tuple((FIELDS[field], field, keywords) for field, keywords in _OPTIONS)  # (flag, config field, keywords)
FLAGS = tuple(flag for flag, _field, _kw in _FLAGS)

# Old spellings (renamed to one prefix and one spelling per concept), each still accepted and warning once: old -> new
# (None: ignored, the setting is derived). Pinned by tests/test_config.py.
DEPRECATED = {
    "--overlap-autotune": "--overlap-tp-autotune",
    "--overlap-plan": "--overlap-tp-plan-file",
    "--hdp": "--overlap-hdp",
    "--hdp-max-tokens-per-rank": "--overlap-hdp-max-tokens-per-rank",
    "--hdp-mode": None,
}
DEPRECATED_VALUES = {("--overlap-pp", "off"): "megatron"}  # flag, old value -> new value
_IGNORED_WHY = {
    "--hdp-mode": "HDP's mode follows --pipeline-model-parallel-size (every rank the same micro-batch count with a "
                  "pipeline, whole steps balanced without one)",
}


def deprecation(old: str, new: str | None, why: str = "") -> None:
    """Warn that ``old`` is an old spelling (``new``: what to write instead; None: it is ignored),
    once per process (Python's ``default`` warning filter shows one per message) and on rank 0 only
    (Megatron parses its arguments on every rank, before torch.distributed starts)."""
    if not _rank_zero():
        return
    text = (f"megatron-overlap: {old} is deprecated; use {new}" if new else
            f"megatron-overlap: {old} is deprecated and ignored: {why}")
    frame, level = sys._getframe(1), 2  # attributed to the code that parsed (past argparse and this file)
    while frame is not None and frame.f_code.co_filename in (__file__, argparse.__file__):
        frame, level = frame.f_back, level + 1
    warnings.warn(text, FutureWarning, stacklevel=level)


def _rank_zero() -> bool:
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    return os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")) == "0"


def deprecated_action(base: type, old: str, new: str | None):
    """``base`` (an argparse action class) that first warns that ``old`` is deprecated; with
    ``new`` None it stores nothing."""

    class Deprecated(base):
        spelling = (old, new)  # read by scripts/flags_doc.py

        def __call__(self, parser, namespace, values, option_string=None):
            deprecation(old, new, _IGNORED_WHY.get(old, ""))
            if new is not None:
                super().__call__(parser, namespace, values, option_string)

    return Deprecated


def add_alias(parser: argparse.ArgumentParser, old: str, new: str) -> None:
    """Add ``old`` to ``parser`` as a deprecated spelling of its flag ``new``: the same value in
    the same place, hidden from ``--help``, warning once (the commands' own flags use it too)."""
    action = next(a for a in parser._actions if new in a.option_strings)
    keywords = dict(dest=action.dest, help=argparse.SUPPRESS, default=argparse.SUPPRESS)
    if action.nargs != 0:  # a value: taken the same way
        keywords.update(type=action.type, choices=action.choices, metavar=action.metavar, nargs=action.nargs)
    parser.add_argument(old, action=deprecated_action(type(action), old, new), **keywords)


def add_overlap_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the plugin's flags to ``parser`` and return it (Megatron's extra_args_provider API).

    Idempotent: a parser that has them already (a patched Megatron fork run through the
    launcher, say) is returned as it is.
    """
    if any(FLAGS[0] in action.option_strings for action in parser._actions):
        return parser
    group = parser.add_argument_group("megatron-overlap", "Hide the communication of 4D parallelism behind compute.")
    for flag, _field, keywords in _FLAGS:
        group.add_argument(flag, **keywords)
    for old, new in DEPRECATED.items():
        if new is not None:
            add_alias(group, old, new)
        else:  # ignored: takes its value, stores nothing
            group.add_argument(old, action=deprecated_action(argparse.Action, old, None), help=argparse.SUPPRESS,
                               dest=argparse.SUPPRESS, default=argparse.SUPPRESS, metavar="X")
    return parser


def overlap_parser(prog: str | None = None) -> argparse.ArgumentParser:
    """A parser holding only the plugin's flags, for scripts that build models themselves."""
    return add_overlap_args(argparse.ArgumentParser(prog=prog, allow_abbrev=False))
