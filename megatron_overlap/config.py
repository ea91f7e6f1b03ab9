"""The plugin's one configuration object, built from parsed command-line flags by one adapter
(:meth:`OverlapConfig.from_args`).

``OverlapConfig`` is frozen and made of one small section per area (``tp``, ``cp``, ``hdp``,
``pp``, ``trace``, ``comm``); each section validates itself on construction, the whole checks
what crosses sections. The modes come from the areas that own them. Pure Python: nothing here
imports Megatron or touches process groups. Checks that need the model (TP size, sequence
length, heads, ...) live in the areas (``tp.checks``, ``cp.checks``, ``hdp.checks``,
``pp.checks``) and take a :class:`ModelContext` (``model_context.py``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from . import rules
from .args import flag_for
from .model_context import MEGATRON_PP_FLAGS, ModelContext  # noqa: F401  (re-exported: its home was here)
from .cp import CP_MODES
from .errors import OverlapConfigError
from .pp import BUCKETS as PP_BUCKETS, MODES as PP_MODES
from .tp import MAX_CHUNKS, RS_ALGOS, TP_MODES, check_chunks, check_sub_batch_blocks, check_sub_batches


class _Section:
    def replace(self, **changes):
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class TPConfig(_Section):
    """TP + SP overlap of Megatron's Column/Row linears."""

    mode: str = "off"
    """``off`` (stock Megatron), ``p2p`` (chunked P2P rings, any device and backend), ``symm-mem``
    (PyTorch's symmetric-memory fused ops, CUDA), ``fused`` (our Triton kernels), ``auto``
    (resolved once, at install, into one of the three)."""

    chunks: int = 0
    """Chunks each overlapped all-gather / reduce-scatter is cut into along the sequence, counted
    over the whole TP group (a multiple of the TP size). 0 lets the plugin choose."""

    rs: str = "ring"
    """Reduce-scatter after a GEMM: ``ring`` (partial sums travel the ring and accumulate) or
    ``a2a`` (each partial goes straight to its owner, which reduces locally)."""

    bidirectional: bool = False
    """Split every chunk in two halves that travel the ring in opposite directions."""

    autotune: bool = False
    """Measure each linear shape's candidate decompositions at its first run."""

    plan_file: Optional[str] = None
    """Decompositions to load."""

    sub_batches: Union[int, str] = 1
    """Sub-batches each attention and MLP block's rows are cut into (``tp/sub_batch.py``); 1: whole;
    ``auto``: resolved once, at install, from the cost model (1 where it has no answer)."""

    sub_batch_blocks: str = "all"
    """The blocks ``sub_batches`` cuts: ``all``, ``attention`` (the MLP blocks run whole, per-op)
    or ``mlp``; with ``sub_batches`` ``auto``, resolved with it."""

    allreduce_fusion: bool = False
    """Without sequence parallelism: the attention block's projection all-reduce, bias, dropout and
    residual add as reduce-scatter, elementwise work on each rank's shard, all-gather feeding the
    next norm and GEMM (``tp/allreduce_fusion.py``)."""

    explicit: frozenset = field(default_factory=frozenset, compare=False, repr=False)
    """Names of the fields above the user set (conflict messages only)."""

    DEPENDENT = ("chunks", "rs", "bidirectional", "autotune", "plan_file")  # meaningless with mode off
    ALL = DEPENDENT + ("sub_batches", "sub_batch_blocks", "allreduce_fusion")

    def __post_init__(self):
        if self.mode not in TP_MODES:
            raise OverlapConfigError("tp.mode", f"unknown mode {self.mode!r}; choose one of {', '.join(TP_MODES)}")
        if self.rs not in RS_ALGOS:
            raise OverlapConfigError("tp.rs", f"unknown algorithm {self.rs!r}; choose ring or a2a")
        check_chunks(self.chunks)
        if self.bidirectional and 2 * self.chunks > MAX_CHUNKS:  # each chunk travels as two halves
            raise OverlapConfigError("tp.chunks", f"{self.chunks} with `tp.bidirectional` travel as {2 * self.chunks} "
                                     f"halves, more than the {MAX_CHUNKS} messages a ring can tell apart; use at most "
                                     f"{MAX_CHUNKS // 2}")
        check_sub_batches(self.sub_batches, self.mode)
        check_sub_batch_blocks(self.sub_batch_blocks, self.sub_batches)
        if self.autotune and self.plan_file:
            raise OverlapConfigError("tp.plan_file", "and `tp.autotune` both choose the decompositions; pass one of them")
        given = self.given(*self.DEPENDENT)
        if self.mode == "symm-mem" and given:
            raise OverlapConfigError(
                given[0], "`tp.mode` symm-mem runs PyTorch's fused ops, which choose their own chunking and "
                f"reduce-scatter; drop {_refs(given)} or use `tp.mode` p2p")
        if self.mode == "fused" and "rs" in self.explicit and self.rs != "a2a":
            raise OverlapConfigError(
                "tp.rs", "the fused backend reduce-scatters as all-to-all + local reduce (a2a); drop `tp.rs` ring, "
                "or use `tp.mode` p2p for a ring")
        given = self.given(*self.ALL)
        if self.mode == "off" and given:
            raise OverlapConfigError(
                given[0], f"{_refs(given)} only appl{'y' if len(given) > 1 else 'ies'} to TP overlap, which is off; add `tp.mode` p2p (or auto), or "
                f"drop {'them' if len(given) > 1 else 'it'}")

    def given(self, *names: str) -> list:
        """The fields among ``names`` the user set, as ``tp.<name>``, ordered by flag."""
        return sorted((f"tp.{n}" for n in names if n in self.explicit), key=flag_for)

    @property
    def enabled(self) -> bool:
        return self.mode != "off"

    @property
    def rs_algo(self) -> str:
        """The reduce-scatter algorithm in force (the fused backend's is always a2a)."""
        return "a2a" if self.mode == "fused" else self.rs

    def flags(self) -> list:
        sub = [flag_for("tp.sub_batches"), str(self.sub_batches)] if self.sub_batches != 1 else []
        sub += [flag_for("tp.sub_batch_blocks"), self.sub_batch_blocks] if self.sub_batch_blocks != "all" else []
        sub += [flag_for("tp.allreduce_fusion")] if self.allreduce_fusion else []
        if self.mode in ("off", "symm-mem"):
            return [] if self.mode == "off" else sub
        out = sub + [flag_for("tp.chunks"), str(self.chunks), flag_for("tp.rs"), self.rs_algo]
        out += [flag_for("tp.bidirectional")] if self.bidirectional else []
        out += [flag_for("tp.autotune")] if self.autotune else []
        return out + ([flag_for("tp.plan_file"), self.plan_file] if self.plan_file else [])


@dataclass(frozen=True)
class CPConfig(_Section):
    """Context-parallel attention on Megatron's local ``DotProductAttention``."""

    mode: str = "off"
    """``off`` (stock, which refuses CP > 1), ``ring`` (K/V blocks travel a P2P ring while the block
    in hand is attended), ``a2a`` (Ulysses all-to-all), ``hybrid`` (a2a in groups of ``a2a_size``,
    ring across)."""

    a2a_size: Optional[int] = None
    """All-to-all group size U of ``hybrid`` (divides the CP size)."""

    def __post_init__(self):
        if self.mode not in CP_MODES:
            raise OverlapConfigError("cp.mode", f"unknown mode {self.mode!r}; choose one of {', '.join(CP_MODES)}")
        if self.a2a_size is not None:
            if self.mode != "hybrid":
                raise OverlapConfigError(
                    "cp.a2a_size", f"only applies to `cp.mode` hybrid (got `cp.mode` {self.mode}); drop it or use hybrid")
            rules.whole_number(self.a2a_size, "cp.a2a_size", 1, rules.MAX_COUNT, "a positive whole number")
        if self.mode == "hybrid" and self.a2a_size is None:
            raise OverlapConfigError(
                "cp.a2a_size", "`cp.mode` hybrid needs `cp.a2a_size` U: all-to-all inside groups of U consecutive "
                "context-parallel ranks, a ring across the groups")

    @property
    def enabled(self) -> bool:
        return self.mode != "off"

    def flags(self) -> list:
        if not self.enabled:
            return []
        out = [flag_for("cp.mode"), self.mode]
        return out + ([flag_for("cp.a2a_size"), str(self.a2a_size)] if self.mode == "hybrid" else [])


@dataclass(frozen=True)
class HDPConfig(_Section):
    """Hybrid data parallelism: one DP x CP group, a ring per sequence, work balanced. Its
    scheduler's mode is not a setting: under a pipeline every rank runs the same number of
    micro-batches (``pp``), without one whole steps are balanced (``dp``); ``integration/hdp.py``
    reads the pipeline size."""

    enabled: bool = False
    max_tokens: Optional[int] = None
    """Tokens one rank holds in one micro-batch, padding included (C)."""

    explicit: frozenset = field(default_factory=frozenset, compare=False, repr=False)

    def __post_init__(self):
        if not self.enabled and "max_tokens" in self.explicit:
            raise OverlapConfigError("hdp.max_tokens", "only applies with `hdp.enabled`; add `hdp.enabled`, or drop it")
        if not self.enabled:
            return
        if self.max_tokens is None:
            raise OverlapConfigError(
                "hdp.max_tokens", "`hdp.enabled` needs the tokens one rank may hold in a micro-batch (`hdp.max_tokens` "
                "C, e.g. your `megatron.seq_length`): longer sequences are sharded over ceil(L / C) ranks")
        rules.whole_number(self.max_tokens, "hdp.max_tokens", 1, rules.MAX_COUNT, "a positive number of tokens")

    def flags(self) -> list:
        if not self.enabled:
            return []
        return [flag_for("hdp.enabled"), flag_for("hdp.max_tokens"), str(self.max_tokens)]


@dataclass(frozen=True)
class PPConfig(_Section):
    """The pipeline schedule (``pp``)."""

    mode: str = "off"
    """``off`` (Megatron's own schedule; ``--overlap-pp megatron``, and ``megatron`` is taken here
    too), ``1f1b`` (same order, transfers asynchronous), ``zb`` (backward split into B and W,
    ZB-H1), ``zbv`` (ZB-V: two model chunks per stage in a V, split), ``auto`` (``zb`` where W can
    be deferred, else ``1f1b``)."""

    max_inflight: Optional[int] = None
    """Micro-batches the first stage forwards before its first backward (None: the PP size)."""

    memory_budget_gb: Optional[float] = None
    """Activation memory per stage; sets ``max_inflight`` to what fits."""

    buckets: str = "megatron"
    """Megatron DDP's gradient buckets with a virtual pipeline: ``megatron`` (Megatron's: one
    bucket per chunk but stage 0's first) or ``every-chunk`` (its bucket size on every stage and
    model chunk, each bucket sent as it fills; ``integration/ddp.py``)."""

    explicit: frozenset = field(default_factory=frozenset, compare=False, repr=False)

    def __post_init__(self):
        if self.mode == "megatron":  # the flag's name for Megatron's schedule
            object.__setattr__(self, "mode", "off")
        if self.mode not in PP_MODES:
            raise OverlapConfigError("pp.mode", f"unknown mode {self.mode!r}; choose one of megatron, "
                                     f"{', '.join(m for m in PP_MODES if m != 'off')}")
        if self.buckets not in PP_BUCKETS:
            raise OverlapConfigError("pp.buckets", f"unknown layout {self.buckets!r}; choose one of "
                                     f"{', '.join(PP_BUCKETS)}")
        if self.mode == "off" and "buckets" in self.explicit:
            raise OverlapConfigError("pp.buckets", "only applies to `pp.mode` 1f1b, zb, zbv or auto with a virtual "
                                     "pipeline; add one, or drop it")
        given = [f"pp.{n}" for n in ("max_inflight", "memory_budget_gb") if n in self.explicit]
        if self.mode == "off" and given:
            raise OverlapConfigError(given[0], f"{_refs(given)} only apply to `pp.mode` 1f1b, zb or auto; add one, or "
                                     f"drop {'them' if len(given) > 1 else 'it'}")
        if len(given) == 2:
            raise OverlapConfigError("pp.memory_budget_gb", "and `pp.max_inflight` both set the micro-batches in "
                                     "flight; pass one of them")
        if self.max_inflight is not None:
            rules.whole_number(self.max_inflight, "pp.max_inflight", 2, rules.MAX_COUNT,
                               "a whole number (at least the PP size)")
        if self.memory_budget_gb is not None:  # inf / nan refused here, not by a conversion at the first step
            rules.positive_finite(self.memory_budget_gb, "pp.memory_budget_gb", "GB", rules.MAX_GB)

    @property
    def enabled(self) -> bool:
        return self.mode != "off"

    @property
    def split(self) -> bool:
        """Whether the backward is split into B and W (``auto`` is resolved at install)."""
        return self.mode in ("zb", "zbv")

    def flags(self) -> list:
        if not self.enabled:
            return []
        out = [flag_for("pp.mode"), self.mode]
        if self.max_inflight is not None:
            out += [flag_for("pp.max_inflight"), str(self.max_inflight)]
        if self.memory_budget_gb is not None:
            out += [flag_for("pp.memory_budget_gb"), f"{self.memory_budget_gb:g}"]
        if self.buckets != "megatron":
            out += [flag_for("pp.buckets"), self.buckets]
        return out


@dataclass(frozen=True)
class TraceConfig(_Section):
    """Per-rank Chrome traces of chosen iterations."""

    dir: Optional[str] = None
    iterations: rules.IterationSet = rules.IterationSet(((3, 3),))
    """Iterations to trace, counted from 0 in this run (ranges, never expanded)."""

    explicit: frozenset = field(default_factory=frozenset, compare=False, repr=False)

    def __post_init__(self):
        if not isinstance(self.iterations, rules.IterationSet):  # a set of ints from the Python API
            object.__setattr__(self, "iterations", rules.IterationSet.of(self.iterations))
        if not self.iterations.ranges:
            raise OverlapConfigError("trace.iterations", "is empty; name at least one iteration, e.g. 3")
        if "iterations" in self.explicit and not self.dir:
            raise OverlapConfigError(
                "trace.iterations", "has no effect without `trace.dir` DIR; add it, or drop the iterations")

    @property
    def enabled(self) -> bool:
        return bool(self.dir)

    def flags(self) -> list:
        if not self.dir:
            return []
        return [flag_for("trace.dir"), self.dir, flag_for("trace.iterations"), self.iterations.text()]


@dataclass(frozen=True)
class CommConfig(_Section):
    """The plugin's own waits (``comm.waits``)."""

    timeout_s: Optional[float] = None
    """Seconds any one of them may take before the run ends naming the peer (None: the process
    group's timeout bounds them)."""

    def __post_init__(self):
        if self.timeout_s is not None:
            rules.positive_finite(self.timeout_s, "comm.timeout_s", "seconds", rules.MAX_TIMEOUT_S)

    def flags(self) -> list:
        return [] if self.timeout_s is None else [flag_for("comm.timeout_s"), f"{self.timeout_s:g}"]


@dataclass(frozen=True)
class OverlapConfig:
    """What the user asked the plugin to do: one validated section per area."""

    tp: TPConfig = TPConfig()
    cp: CPConfig = CPConfig()
    hdp: HDPConfig = HDPConfig()
    pp: PPConfig = PPConfig()
    trace: TraceConfig = TraceConfig()
    comm: CommConfig = CommConfig()

    def __post_init__(self):
        if self.comm.timeout_s is not None and not (self.tp.enabled or self.cp.enabled or self.hdp.enabled
                                                    or self.pp.enabled):
            raise OverlapConfigError(
                "comm.timeout_s", "bounds the waits of the plugin's communication, and nothing of it is on; add "
                "`tp.mode`, `cp.mode`, `hdp.enabled` or `pp.mode`, or drop it")
        if self.hdp.enabled and self.cp.enabled:
            raise OverlapConfigError(
                "cp.mode", "`hdp.enabled` chooses a ring for every sequence itself; drop `cp.mode` (and keep "
                "`megatron.context_parallel_size` 1)")

    @property
    def stock(self) -> bool:
        """Nothing asked of the plugin: no patch, no check."""
        return not (self.tp.enabled or self.cp.enabled or self.hdp.enabled or self.pp.enabled or self.trace.enabled)

    def as_flags(self) -> list:
        """The command-line flags that reproduce this config."""
        return ([flag_for("tp.mode"), self.tp.mode] + self.hdp.flags() + self.cp.flags() + self.pp.flags()
                + self.trace.flags() + self.tp.flags() + self.comm.flags())

    def replace(self, **sections) -> "OverlapConfig":
        return dataclasses.replace(self, **sections)

    @classmethod
    def from_args(cls, args: Any) -> "OverlapConfig":
        """Build from an argparse namespace (Megatron's full args, or only our flags)."""
        if isinstance(args, OverlapConfig):
            return args
        if not hasattr(args, "overlap_tp"):
            raise TypeError("megatron_overlap: the arguments carry no --overlap-tp; build the parser with "
                            "megatron_overlap.add_overlap_args (or pass it as Megatron's extra_args_provider)")
        get = lambda name: getattr(args, name, None)  # noqa: E731
        tp_dests = dict(chunks="overlap_tp_chunks", rs="overlap_tp_rs", bidirectional="overlap_tp_bidirectional",
                        autotune="overlap_tp_autotune", plan_file="overlap_tp_plan_file",
                        sub_batches="overlap_tp_sub_batches", sub_batch_blocks="overlap_tp_sub_batch_blocks",
                        allreduce_fusion="overlap_tp_allreduce_fusion")
        tp = TPConfig(mode=args.overlap_tp, chunks=_default(get("overlap_tp_chunks"), 0),
                      sub_batches=_default(get("overlap_tp_sub_batches"), 1),
                      sub_batch_blocks=_default(get("overlap_tp_sub_batch_blocks"), "all"),
                      rs=_default(get("overlap_tp_rs"), "ring"), bidirectional=bool(get("overlap_tp_bidirectional")),
                      autotune=bool(get("overlap_tp_autotune")), plan_file=get("overlap_tp_plan_file"),
                      allreduce_fusion=bool(get("overlap_tp_allreduce_fusion")),
                      explicit=frozenset(n for n, dest in tp_dests.items() if get(dest) is not None))
        hdp = HDPConfig(enabled=bool(get("overlap_hdp")), max_tokens=get("overlap_hdp_max_tokens_per_rank"),
                        explicit=frozenset({"max_tokens"} if get("overlap_hdp_max_tokens_per_rank") is not None
                                           else ()))
        pp = PPConfig(mode=get("overlap_pp") or "off", max_inflight=get("overlap_pp_max_inflight"),
                      memory_budget_gb=get("overlap_pp_memory_budget"), buckets=get("overlap_pp_buckets") or "megatron",
                      explicit=frozenset(n for n, dest in (("max_inflight", "overlap_pp_max_inflight"),
                                                           ("memory_budget_gb", "overlap_pp_memory_budget"),
                                                           ("buckets", "overlap_pp_buckets"))
                                         if get(dest) is not None))
        return cls(tp=tp, cp=CPConfig(mode=get("overlap_cp") or "off", a2a_size=get("overlap_cp_a2a_size")),
                   hdp=hdp, pp=pp, trace=_trace_from_args(get("overlap_trace"), get("overlap_trace_iters")),
                   comm=CommConfig(timeout_s=get("overlap_timeout_s")))


def _trace_from_args(directory, iterations) -> TraceConfig:
    if iterations is None:
        return TraceConfig(dir=directory)
    parsed = rules.iterations(iterations, "trace.iterations")
    return TraceConfig(dir=directory, iterations=parsed, explicit=frozenset({"iterations"}))


def _refs(fields: list) -> str:
    return ", ".join(f"`{f}`" for f in fields)


def _default(value, default):
    return default if value is None else value
