"""The plugin's one configuration object, built from parsed command-line flags.

Pure Python: nothing here imports Megatron or touches process groups. Checks that need the
model (TP size, sequence parallelism, sequence length) live in :func:`check_model`, which runs
at install time when Megatron's arguments are at hand and again when a patched layer first
runs, so both entry points fail with the same message.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional

from .errors import OverlapConfigError

TP_MODES = ("off", "p2p", "symm-mem", "fused", "auto")
RS_ALGOS = ("ring", "a2a")
CP_MODES = ("off", "ring", "a2a", "hybrid")
HDP_MODES = ("dp", "pp")

# Flags that only mean something when --overlap-tp is on. Their argparse default is None so
# that an explicit value given with overlap off can be told apart from "not given".
_TP_DEPENDENT = {
    "overlap_tp_chunks": "--overlap-tp-chunks",
    "overlap_tp_rs": "--overlap-tp-rs",
    "overlap_tp_bidirectional": "--overlap-tp-bidirectional",
    "overlap_autotune": "--overlap-autotune",
    "overlap_plan": "--overlap-plan",
}


@dataclass(frozen=True)
class OverlapConfig:
    """What the user asked the plugin to do. Frozen and validated on construction."""

    tp: str = "off"
    """TP+SP overlap backend: ``off`` (stock Megatron), ``p2p`` (chunked P2P rings, any
    device and backend), ``symm-mem`` (PyTorch's symmetric-memory fused ops, CUDA), ``fused``
    (our Triton kernels), ``auto`` (``symm-mem`` where it runs, else ``p2p``)."""

    tp_chunks: int = 0
    """Chunks each overlapped all-gather / reduce-scatter is cut into along the sequence,
    counted over the whole TP group (a multiple of the TP size). 0 lets the plugin choose."""

    tp_rs: str = "ring"
    """Reduce-scatter algorithm after a GEMM: ``ring`` (partial sums travel the ring and
    accumulate) or ``a2a`` (each partial goes straight to its owner, which reduces locally)."""

    tp_bidirectional: bool = False
    """Split every chunk in two halves that travel the ring in opposite directions."""

    autotune: bool = False
    """Measure each linear shape's candidate decompositions at its first run (``--overlap-autotune``)."""

    plan_file: Optional[str] = None
    """Decompositions to load (``--overlap-plan``)."""

    trace_dir: Optional[str] = None
    """Directory for per-rank Chrome traces of the chosen iterations (``--overlap-trace``)."""

    trace_iterations: frozenset = frozenset({3})
    """Iterations to trace, counted from 0 in this run."""

    cp: str = "off"
    """Context-parallel attention for Megatron's local ``DotProductAttention``: ``off`` (stock,
    which refuses CP > 1), ``ring`` (K/V blocks travel a P2P ring while the block in hand is
    attended), ``a2a`` (Ulysses all-to-all), ``hybrid`` (a2a in groups of ``cp_a2a_size``, ring
    across)."""

    cp_a2a_size: Optional[int] = None
    """All-to-all group size U of ``--overlap-cp hybrid`` (divides the CP size)."""

    hdp: bool = False
    """Hybrid data parallelism (``--hdp``): one DP x CP group; every sequence gets the fewest
    ranks that hold it (a ring over an explicit rank list), work balanced across ranks."""

    hdp_max_tokens: Optional[int] = None
    """Tokens one rank holds in one micro-batch (``--hdp-max-tokens-per-rank``), padding included."""

    hdp_mode: str = "dp"
    """``dp``: balance each rank's total work per step; ``pp``: sequences of similar length share
    a micro-batch index on every rank (for pipelines)."""

    explicit: frozenset = field(default_factory=frozenset, compare=False, repr=False)
    """Names of the fields the user set explicitly (used only for conflict messages)."""

    def __post_init__(self):
        if self.tp not in TP_MODES:
            raise OverlapConfigError(
                "--overlap-tp", f"unknown mode {self.tp!r}; choose one of {', '.join(TP_MODES)}"
            )
        if self.tp_rs not in RS_ALGOS:
            raise OverlapConfigError(
                "--overlap-tp-rs", f"unknown algorithm {self.tp_rs!r}; choose ring or a2a"
            )
        if isinstance(self.tp_chunks, bool) or not isinstance(self.tp_chunks, int):
            raise OverlapConfigError(
                "--overlap-tp-chunks", f"expected a whole number, got {self.tp_chunks!r}"
            )
        if self.tp_chunks < 0:
            raise OverlapConfigError(
                "--overlap-tp-chunks",
                f"must be 0 (choose automatically) or a positive multiple of the TP size, "
                f"got {self.tp_chunks}",
            )
        if "overlap_trace_iters" in self.explicit and not self.trace_dir:
            raise OverlapConfigError(
                "--overlap-trace-iters", "has no effect without --overlap-trace DIR; add it, or drop the iterations"
            )
        if self.cp not in CP_MODES:
            raise OverlapConfigError("--overlap-cp", f"unknown mode {self.cp!r}; choose one of {', '.join(CP_MODES)}")
        if self.cp_a2a_size is not None:
            if self.cp != "hybrid":
                raise OverlapConfigError(
                    "--overlap-cp-a2a-size",
                    f"only applies to --overlap-cp hybrid (got --overlap-cp {self.cp}); drop it or use hybrid",
                )
            if isinstance(self.cp_a2a_size, bool) or not isinstance(self.cp_a2a_size, int) or self.cp_a2a_size < 1:
                raise OverlapConfigError("--overlap-cp-a2a-size", f"must be a positive whole number, got {self.cp_a2a_size!r}")
        if self.cp == "hybrid" and self.cp_a2a_size is None:
            raise OverlapConfigError(
                "--overlap-cp-a2a-size",
                "--overlap-cp hybrid needs --overlap-cp-a2a-size U: all-to-all inside groups of U "
                "consecutive context-parallel ranks, a ring across the groups",
            )
        if self.hdp_mode not in HDP_MODES:
            raise OverlapConfigError("--hdp-mode", f"unknown mode {self.hdp_mode!r}; choose dp or pp")
        if not self.hdp and ("hdp_max_tokens" in self.explicit or "hdp_mode" in self.explicit):
            raise OverlapConfigError(
                "--hdp-max-tokens-per-rank" if "hdp_max_tokens" in self.explicit else "--hdp-mode",
                "only applies with --hdp; add --hdp, or drop it")
        if self.hdp:
            if self.hdp_max_tokens is None:
                raise OverlapConfigError(
                    "--hdp-max-tokens-per-rank",
                    "--hdp needs the tokens one rank may hold in a micro-batch (--hdp-max-tokens-per-rank C, "
                    "e.g. your --seq-length): longer sequences are sharded over ceil(L / C) ranks")
            if isinstance(self.hdp_max_tokens, bool) or not isinstance(self.hdp_max_tokens, int) or self.hdp_max_tokens <= 0:
                raise OverlapConfigError("--hdp-max-tokens-per-rank", f"must be a positive number of tokens, got {self.hdp_max_tokens!r}")
            if self.cp_enabled:
                raise OverlapConfigError(
                    "--overlap-cp", "--hdp chooses a ring for every sequence itself; drop --overlap-cp (and keep "
                    "--context-parallel-size 1)")
        if self.autotune and self.plan_file:
            raise OverlapConfigError(
                "--overlap-plan", "and --overlap-autotune both choose the decompositions; pass one of them"
            )
        if self.tp == "symm-mem":
            given = sorted(_TP_DEPENDENT[name] for name in self.explicit if name in _TP_DEPENDENT)
            if given:
                raise OverlapConfigError(
                    given[0],
                    "--overlap-tp symm-mem runs PyTorch's fused ops, which choose their own "
                    f"chunking and reduce-scatter; drop {', '.join(given)} or use --overlap-tp p2p",
                )
        if self.tp == "fused" and "overlap_tp_rs" in self.explicit and self.tp_rs != "a2a":
            raise OverlapConfigError(
                "--overlap-tp-rs",
                "the fused backend reduce-scatters as all-to-all + local reduce (a2a); drop "
                "--overlap-tp-rs ring, or use --overlap-tp p2p for a ring",
            )
        if self.tp == "off":
            given = sorted(_TP_DEPENDENT[name] for name in self.explicit if name in _TP_DEPENDENT)
            if given:
                raise OverlapConfigError(
                    given[0],
                    f"{', '.join(given)} only apply to TP overlap, which is off; "
                    f"add --overlap-tp p2p (or auto), or drop {'them' if len(given) > 1 else 'it'}",
                )

    @property
    def enabled(self) -> bool:
        return self.tp != "off"

    @property
    def cp_enabled(self) -> bool:
        return self.cp != "off"

    @property
    def rs_algo(self) -> str:
        """The reduce-scatter algorithm in force (the fused backend's is always a2a)."""
        return "a2a" if self.tp == "fused" else self.tp_rs

    def as_flags(self) -> list[str]:
        """The command-line flags that reproduce this config."""
        flags = ["--overlap-tp", self.tp]
        if self.hdp:
            flags += ["--hdp", "--hdp-max-tokens-per-rank", str(self.hdp_max_tokens), "--hdp-mode", self.hdp_mode]
        if self.cp_enabled:
            flags += ["--overlap-cp", self.cp]
            if self.cp == "hybrid":
                flags += ["--overlap-cp-a2a-size", str(self.cp_a2a_size)]
        if self.trace_dir:
            flags += ["--overlap-trace", self.trace_dir,
                      "--overlap-trace-iters", ",".join(str(i) for i in sorted(self.trace_iterations))]
        if self.enabled:
            if self.tp == "symm-mem":
                return flags
            flags += ["--overlap-tp-chunks", str(self.tp_chunks), "--overlap-tp-rs", self.rs_algo]
            if self.tp_bidirectional:
                flags.append("--overlap-tp-bidirectional")
            if self.autotune:
                flags.append("--overlap-autotune")
            if self.plan_file:
                flags += ["--overlap-plan", self.plan_file]
        return flags

    @classmethod
    def from_args(cls, args: Any) -> "OverlapConfig":
        """Build from an argparse namespace (Megatron's full args, or only our flags)."""
        if isinstance(args, OverlapConfig):
            return args
        if not hasattr(args, "overlap_tp"):
            raise TypeError(
                "megatron_overlap: the arguments carry no --overlap-tp; build the parser with "
                "megatron_overlap.add_overlap_args (or pass it as Megatron's extra_args_provider)"
            )
        explicit = {name for name in _TP_DEPENDENT if getattr(args, name, None) is not None}
        if getattr(args, "hdp_max_tokens_per_rank", None) is not None:
            explicit.add("hdp_max_tokens")
        if getattr(args, "hdp_mode", None) is not None:
            explicit.add("hdp_mode")
        iterations = getattr(args, "overlap_trace_iters", None)
        if iterations is not None:
            explicit.add("overlap_trace_iters")
            try:
                from .trace import parse_iterations

                iterations = parse_iterations(iterations)
            except ValueError as exc:
                raise OverlapConfigError("--overlap-trace-iters", str(exc)) from None
        values = dict(
            tp=args.overlap_tp,
            tp_chunks=_default(getattr(args, "overlap_tp_chunks", None), 0),
            tp_rs=_default(getattr(args, "overlap_tp_rs", None), "ring"),
            tp_bidirectional=bool(getattr(args, "overlap_tp_bidirectional", None) or False),
            trace_dir=getattr(args, "overlap_trace", None),
            autotune=bool(getattr(args, "overlap_autotune", None) or False),
            plan_file=getattr(args, "overlap_plan", None),
            cp=getattr(args, "overlap_cp", None) or "off",
            cp_a2a_size=getattr(args, "overlap_cp_a2a_size", None),
            hdp=bool(getattr(args, "hdp", False)),
            hdp_max_tokens=getattr(args, "hdp_max_tokens_per_rank", None),
            hdp_mode=getattr(args, "hdp_mode", None) or "dp",
        )
        if iterations is not None:
            values["trace_iterations"] = iterations
        return cls(**values, explicit=frozenset(explicit))

    def replace(self, **changes) -> "OverlapConfig":
        return dataclasses.replace(self, **changes)


def _default(value, default):
    return default if value is None else value


@dataclass(frozen=True)
class ModelContext:
    """The parts of the model's parallel setup that decide whether overlap can run.

    ``None`` means unknown: programmatic installs learn these when a layer first runs.
    """

    tp_size: Optional[int] = None
    sequence_parallel: Optional[bool] = None
    transformer_impl: Optional[str] = None
    tp_comm_overlap: bool = False
    seq_length: Optional[int] = None
    micro_batch_size: Optional[int] = None
    cp_size: Optional[int] = None
    heads: Optional[int] = None
    kv_heads: Optional[int] = None
    packed: bool = False  # variable-length packed batches (THD): lengths checked per batch
    pp_size: Optional[int] = None

    @classmethod
    def from_megatron_args(cls, args: argparse.Namespace) -> "ModelContext":
        return cls(
            tp_size=getattr(args, "tensor_model_parallel_size", None),
            sequence_parallel=getattr(args, "sequence_parallel", None),
            transformer_impl=getattr(args, "transformer_impl", None),
            tp_comm_overlap=bool(getattr(args, "tp_comm_overlap", False)),
            seq_length=getattr(args, "seq_length", None),
            micro_batch_size=getattr(args, "micro_batch_size", None),
            cp_size=getattr(args, "context_parallel_size", None),
            heads=getattr(args, "num_attention_heads", None),
            kv_heads=(getattr(args, "num_query_groups", None) if getattr(args, "group_query_attention", False)
                      else getattr(args, "num_attention_heads", None)),
            packed=bool(getattr(args, "reset_attention_mask", False)),
            pp_size=getattr(args, "pipeline_model_parallel_size", None),
        )


def tp_overlap_applies(config: OverlapConfig, ctx: ModelContext) -> bool:
    """True when the patched path will run; False when stock Megatron runs (TP=1 or off)."""
    return config.enabled and (ctx.tp_size is None or ctx.tp_size > 1)


def check_model(config: OverlapConfig, ctx: ModelContext) -> None:
    """Refuse model settings the overlapped linears cannot honour. Unknown fields pass."""
    if not config.enabled:
        return
    if ctx.tp_size is not None and ctx.tp_size < 1:
        raise OverlapConfigError(
            "--tensor-model-parallel-size", f"must be positive, got {ctx.tp_size}"
        )
    if ctx.transformer_impl == "transformer_engine":
        raise OverlapConfigError(
            "--transformer-impl",
            "Transformer Engine's linears are not patched by megatron-overlap yet, so "
            f"--overlap-tp {config.tp} would do nothing there. Pass --transformer-impl local "
            "(Megatron's own ColumnParallelLinear/RowParallelLinear), or drop --overlap-tp and "
            "use TE's --tp-comm-overlap instead",
        )
    if ctx.tp_comm_overlap:
        raise OverlapConfigError(
            "--overlap-tp",
            "conflicts with Megatron's --tp-comm-overlap (Transformer Engine userbuffers); "
            "choose one of the two",
        )
    if ctx.tp_size is None or ctx.tp_size == 1:
        return
    if ctx.sequence_parallel is False:
        raise OverlapConfigError(
            "--overlap-tp",
            f"overlaps the all-gather / reduce-scatter of sequence parallelism, but "
            f"--sequence-parallel is off with TP={ctx.tp_size}; add --sequence-parallel",
        )
    if config.tp_chunks and config.tp_chunks % ctx.tp_size:
        raise OverlapConfigError(
            "--overlap-tp-chunks",
            f"{config.tp_chunks} is not a multiple of the tensor-parallel size {ctx.tp_size}; "
            f"use {ctx.tp_size}, {2 * ctx.tp_size}, {4 * ctx.tp_size}, ... or 0 to let the "
            "plugin choose",
        )
    if ctx.seq_length is not None:
        if ctx.seq_length % ctx.tp_size:
            raise OverlapConfigError(
                "--seq-length",
                f"{ctx.seq_length} is not divisible by the tensor-parallel size "
                f"{ctx.tp_size}, which sequence parallelism needs",
            )
        rows = ctx.seq_length // ctx.tp_size
        if config.tp_chunks and config.tp_chunks // ctx.tp_size > rows:
            raise OverlapConfigError(
                "--overlap-tp-chunks",
                f"cuts each rank's {rows} sequence rows (seq-length {ctx.seq_length} / TP "
                f"{ctx.tp_size}) into {config.tp_chunks // ctx.tp_size} chunks; use "
                f"--overlap-tp-chunks <= {rows * ctx.tp_size} (or 0 to let the plugin choose)",
            )


def check_hdp_model(config: OverlapConfig, ctx: ModelContext) -> None:
    """Refuse model settings the ``--hdp`` runtime cannot honour. Unknown fields pass."""
    if not config.hdp:
        return
    if ctx.cp_size is not None and ctx.cp_size > 1:
        raise OverlapConfigError(
            "--context-parallel-size",
            f"--hdp merges data and context parallelism into one group and picks each sequence's ring "
            f"itself; set --context-parallel-size 1 (got {ctx.cp_size})")
    if ctx.pp_size is not None and ctx.pp_size > 1:
        hint = ("--hdp-mode pp orders micro-batches for pipelines in the scheduler and `bench hdp`, but the "
                "runtime does not drive Megatron's pipeline schedules yet") if config.hdp_mode == "pp" else (
                "--hdp-mode dp balances whole steps and would let pipeline stages drift apart; --hdp-mode pp is "
                "the pipeline mode (scheduler and `bench hdp` only so far)")
        raise OverlapConfigError(
            "--hdp", f"with --pipeline-model-parallel-size {ctx.pp_size} is not supported: {hint}. "
            "Use --pipeline-model-parallel-size 1 with --hdp")
    if ctx.transformer_impl == "transformer_engine":
        raise OverlapConfigError(
            "--hdp", "runs its rings through Megatron's local attention; pass --transformer-impl local")
    if ctx.tp_size is not None and ctx.tp_size > 1:
        raise OverlapConfigError(
            "--hdp", f"with --tensor-model-parallel-size {ctx.tp_size} is not supported yet: the runtime shards "
            "sequences across data-parallel ranks only. Use TP 1 with --hdp")


def check_cp_model(config: OverlapConfig, ctx: ModelContext) -> None:
    """Refuse context-parallel settings the local attention cannot honour. Unknown fields pass;
    the same checks run again when a patched attention layer is built."""
    check_hdp_model(config, ctx)
    cp = ctx.cp_size
    if cp is None or cp <= 1:
        if config.cp_enabled and cp == 1:
            _notice_cp_size_one(config)
        return
    if ctx.transformer_impl == "transformer_engine":
        if config.cp_enabled:
            raise OverlapConfigError(
                "--overlap-cp",
                "patches Megatron's local DotProductAttention, but --transformer-impl "
                "transformer_engine runs TE's attention, which does context parallelism itself "
                "(--cp-comm-type); pass --transformer-impl local, or drop --overlap-cp",
            )
        return
    if not config.cp_enabled:
        if ctx.transformer_impl == "local":
            raise OverlapConfigError(
                "--overlap-cp",
                f"--context-parallel-size {cp} with --transformer-impl local: Megatron's local "
                "attention has no context parallelism (it asserts CP == 1). Add --overlap-cp ring "
                "(any head count), a2a or hybrid, or use Transformer Engine",
            )
        return
    from .cp.attention import check_cp_config

    tp = ctx.tp_size or 1
    heads = ctx.heads // tp if ctx.heads is not None and ctx.heads % tp == 0 else None
    kv = ctx.kv_heads // tp if ctx.kv_heads is not None and ctx.kv_heads % tp == 0 else None
    seq = None if ctx.packed else ctx.seq_length
    if heads is None or kv is None:  # heads unknown: check the rest, heads at the layer
        if config.cp == "hybrid":
            from .cp.hybrid import check_hybrid_size

            check_hybrid_size(cp, config.cp_a2a_size)
        if seq is not None:
            from .cp.attention import check_seq_length

            check_seq_length(seq, cp)
        return
    check_cp_config(config.cp, cp, heads, kv, config.cp_a2a_size, seq)


def _notice_cp_size_one(config: OverlapConfig) -> None:
    import logging

    logging.getLogger("megatron_overlap").info(
        "--overlap-cp %s with --context-parallel-size 1: nothing to do, stock attention", config.cp)


def chunks_per_rank(config: OverlapConfig, tp_size: int, rows_per_rank: int, batch: int = 1) -> int:
    """Chunks of each rank's shard (before the bidirectional halving).

    ``--overlap-tp-chunks N`` gives N / TP uniform chunks. With 0 the plugin picks one chunk per
    ~256 tokens of the rank's shard (``rows_per_rank * batch``) plus one, between 1 and 5, and
    tapers them (first and last half-size, see ``split_pieces``): finer chunks shorten the
    pipeline's fill and drain, coarser ones pay less per message and run larger GEMMs. Chosen
    on the MLP benchmark (BENCHMARKS.md); the cost-model issue replaces this rule with a search.
    """
    if config.tp_chunks:
        return config.tp_chunks // tp_size
    tokens = rows_per_rank * batch
    return max(1, min(5, tokens // 256 + 1))
