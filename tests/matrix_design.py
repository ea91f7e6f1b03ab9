"""The configuration matrix: every plugin feature crossed with the partner flags users launch it
with, through Megatron-LM's own ``pretrain_gpt.py`` (``test_config_matrix.py`` runs it;
``scripts/config_matrix.py`` prints its table for docs/config-matrix.md).

The design. Partner flags are the Megatron flags a production (Llama-style) run carries beside
ours. For every feature, the runs are a pairwise covering design over the partner flags switched
on: every pair of partner flags that can be on together is on together in at least one run of
that feature (``covering``), with Megatron's own implications added (``--overlap-param-gather``
needs the distributed optimizer and ``--overlap-grad-reduce``). The only partner flags that
exclude each other are the two recompute granularities, so each feature gets two runs: every
partner flag on, with selective recompute in one and full recompute in the other. Each feature
alone (no partner flag) is tested in ``test_pretrain_gpt.py``.

Every run trains 6 iterations (the parameter gathers, evaluations and the checkpoint change
state after the first), evaluates after iterations 2, 4 and 6, saves a checkpoint
(``--ckpt-format torch_dist``, Megatron-LM's default) after 3 and 6, and is compared with:

- the reference (stock Megatron in the same layout, or the layout named per feature), the same
  flags, the same iterations: training losses as Megatron logs them, validation losses as
  printed;
- resumed: the checkpoint of iteration 3 loaded and iterations 4-6 trained again, the plugin's
  resumed run against stock's resumed run, and its first loss against the uninterrupted run's
  (the weights came back exactly). Not against the uninterrupted run itself: stock
  megatron-core 0.16.1 without Transformer Engine or apex (``torch.optim.Adam``) does not
  resume the distributed optimizer exactly (``lab/megatron_lm_cpu.py``,
  ``_adam_step_in_initial_state``).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Dict, FrozenSet, List, Tuple

from .pretrain_gpt_runs import NO_DROPOUT, TP2, packed

ITERATIONS, SAVE_AT = 6, 3

# name -> (flags, what it is): the partner flags, in a fixed order
PARTNERS: Dict[str, Tuple[tuple, str]] = {
    "distopt": (("--use-distributed-optimizer",), "the distributed optimizer"),
    "grad-reduce": (("--overlap-grad-reduce",), "overlapped gradient reduce-scatter"),
    "param-gather": (("--overlap-param-gather",), "overlapped parameter all-gather (forward pre-hooks)"),
    "selective": (("--recompute-granularity", "selective"), "selective recompute"),
    "full": (("--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"),
             "full recompute, every layer"),
    "bf16": (("--bf16",), "bf16 parameters and compute (fp32 main parameters and gradients)"),
    "untied": (("--untie-embeddings-and-output-weights",), "untied embedding and output weights"),
    "llama": (("--group-query-attention", "--num-query-groups", "2", "--swiglu", "--position-embedding-type", "rope",
               "--no-rope-fusion", "--normalization", "RMSNorm"), "GQA (2 groups), SwiGLU, RoPE, RMSNorm"),
    "clip-grad": (("--clip-grad", "1.0"), "gradient clipping at norm 1"),
    "mb1": (("--micro-batch-size", "1"), "micro-batch 1, the global batch by accumulation"),
    "eval": (("--eval-iters", "1", "--eval-interval", "2"), "an evaluation every 2 iterations"),
    "ckpt": ((), "checkpoint save (torch_dist, iterations 3 and 6) and resume from iteration 3"),
}
EXCLUSIVE = {frozenset(("selective", "full"))}  # one recompute granularity per run
IMPLIES = {"param-gather": ("distopt", "grad-reduce")}  # Megatron-LM's validate_args asserts them


@dataclass(frozen=True)
class Feature:
    """One plugin feature: its layout and flags, and what it is compared with.

    ``ranks``/``layout``: the plugin's run; ``ref_ranks``/``ref_layout``: the reference (stock
    Megatron); ``rel``: the relative tolerance of the loss comparison by dtype (0: bit-identical),
    with ``why`` when not 0."""
    name: str
    ranks: int
    layout: tuple
    plugin: tuple
    ref_ranks: int
    ref_layout: tuple
    rel: Dict[str, float] = field(default_factory=lambda: {"fp32": 0.0, "bf16": 0.0})
    why: str = ""
    calls: Tuple[str, ...] = ()  # patched calls that must have run (the plugin took over)
    data: str = "mock"  # or "packed": documents of mixed lengths (tests/pretrain_gpt_runs.py)
    resume_vs_stock: str = ""  # why the resumed run is not compared with stock's resume (empty: it is)


_TP2_NO_SP = ("--tensor-model-parallel-size", "2")  # TP without --sequence-parallel: the all-reduce path
_PP = ("--pipeline-model-parallel-size", "2", "--global-batch-size", "8")
_VPP = ("--num-layers", "4", "--pipeline-model-parallel-size", "2", "--global-batch-size", "8",
        "--num-layers-per-virtual-pipeline-stage", "1", "--lab-init-by-layer")
_CP_MERGE = ("the attention of each query block is merged over the key/value blocks in another order "
             "(online softmax over ring steps, or heads exchanged): rounding differs from one-rank attention "
             "(measured at most 7e-5 in bf16, 2026-12-04)")
_FEWER_RANKS = ("the reference runs on fewer ranks, so its distributed optimizer holds another number of parameters "
                "per rank, and stock's own resume is inexact here by an error that grows with that number "
                "(lab/megatron_lm_cpu.py: Adam's loaded step, one tensor shared by every parameter's state, is "
                "incremented once per parameter)")

FEATURES: Tuple[Feature, ...] = (
    Feature("tp-p2p", 4, TP2, ("--overlap-tp", "p2p"), 4, TP2, calls=("tp.column", "tp.row")),
    Feature("tp-a2a", 4, TP2, ("--overlap-tp", "p2p", "--overlap-tp-rs", "a2a"), 4, TP2,
            calls=("tp.column", "tp.row")),
    Feature("tp-sub-batches", 4, TP2, ("--overlap-tp", "p2p", "--overlap-tp-sub-batches", "2"), 4, TP2,
            rel={"fp32": 1e-6, "bf16": 1e-4},
            why="Megatron-LM's linears have biases by default, and fc1's is added inside the activation once "
                "per sub-batch, so its gradient is summed per part (a few ulp); without biases the cut is stock's "
                "bits (tests/test_pretrain_gpt.py)",
            calls=("tp.sub_batches",)),
    Feature("tp-no-sp", 4, _TP2_NO_SP, ("--overlap-tp", "p2p"), 4, _TP2_NO_SP, calls=("tp.column_ar", "tp.row_ar")),
    Feature("tp-no-sp-fusion", 4, _TP2_NO_SP, ("--overlap-tp", "p2p", "--overlap-tp-allreduce-fusion"), 4,
            _TP2_NO_SP, calls=("tp.column_ar", "tp.row_ar", "tp.fusion")),
    Feature("cp-ring", 4, ("--context-parallel-size", "2"), ("--overlap-cp", "ring"), 2, (),
            rel={"fp32": 1e-6, "bf16": 2e-4}, why=_CP_MERGE, resume_vs_stock=_FEWER_RANKS, calls=("cp.ring",)),
    Feature("cp-a2a", 4, ("--context-parallel-size", "2"), ("--overlap-cp", "a2a"), 2, (),
            rel={"fp32": 1e-6, "bf16": 2e-4}, why=_CP_MERGE, resume_vs_stock=_FEWER_RANKS, calls=("cp.a2a",)),
    Feature("cp-hybrid", 4, ("--context-parallel-size", "4"), ("--overlap-cp", "hybrid", "--overlap-cp-a2a-size", "2"),
            1, (), rel={"fp32": 1e-6, "bf16": 2e-4}, why=_CP_MERGE, resume_vs_stock=_FEWER_RANKS, calls=("cp.hybrid",)),
    Feature("hdp", 2, (), ("--overlap-hdp", "--overlap-hdp-max-tokens-per-rank", "64"), 2, (),
            rel={"fp32": 1e-6, "bf16": 1e-4}, data="packed",
            why="the same mean over every token of a step, summed per document and ring instead of per sample row "
                "(measured at most 1.5e-5 in bf16, 2026-12-04)",
            calls=("hdp.step", "hdp.ring")),
    Feature("pp-1f1b", 4, _PP, ("--overlap-pp", "1f1b"), 4, _PP, calls=("pp.1f1b",)),
    Feature("pp-zb", 4, _PP, ("--overlap-pp", "zb"), 4, _PP, calls=("pp.zb",)),
    Feature("vpp-1f1b", 4, _VPP, ("--overlap-pp", "1f1b"), 4, _VPP, calls=("pp.1f1b.interleaved",)),
    Feature("vpp-zb", 4, _VPP, ("--overlap-pp", "zb"), 4, _VPP, calls=("pp.zb.interleaved",)),
    Feature("vpp-zbv", 4, _VPP, ("--overlap-pp", "zbv"), 4, _VPP, rel={"fp32": 5e-5, "bf16": 5e-5},
            why="--clip-grad: the gradient norm is summed per stage and then over stages, and the V holds other "
                "layers on each stage, so the clip factor differs in its last bits (measured at most 1.4e-5; "
                "bit-identical without clipping, test_pretrain_gpt.py)",
            resume_vs_stock="stock's own resume is inexact here (lab/megatron_lm_cpu.py) by an error that grows with "
                            "the number of parameters each rank holds (Adam's loaded step, one tensor shared by every "
                            "parameter's state, is incremented once per parameter), and the V puts other layers on "
                            "each rank",
            calls=("pp.zbv.interleaved",)),
    Feature("timeout", 4, TP2 + ("--pipeline-model-parallel-size", "2", "--global-batch-size", "8"),
            ("--overlap-tp", "p2p", "--overlap-pp", "zb", "--overlap-timeout-s", "60"), 4,
            TP2 + ("--pipeline-model-parallel-size", "2", "--global-batch-size", "8"),
            calls=("tp.column", "pp.zb")),
)

# Partner flags a feature cannot take, with the reason (refused by the plugin with a message
# that names both; tests/test_config_matrix.py checks each message).
UNSUPPORTED: Dict[Tuple[str, str], str] = {}


def _allowed(feature: str, block: FrozenSet[str]) -> bool:
    if any(pair <= block for pair in EXCLUSIVE):
        return False
    return not any((feature, p) in UNSUPPORTED for p in block)


def _close(block: set) -> set:
    for flag, needs in IMPLIES.items():
        if flag in block:
            block.update(needs)
    return block


def covering(feature: str) -> List[FrozenSet[str]]:
    """A pairwise covering of the partner flags for ``feature`` (module docstring): greedy, each
    block grown flag by flag (in ``PARTNERS`` order) while it stays allowed, until every allowed
    pair is in some block. Deterministic."""
    names = [p for p in PARTNERS if (feature, p) not in UNSUPPORTED]
    pairs = {frozenset(pq) for pq in itertools.combinations(names, 2)
             if _allowed(feature, frozenset(_close(set(pq))))}
    blocks: List[FrozenSet[str]] = []
    while pairs:
        seed = min(pairs, key=lambda pq: sorted(names.index(x) for x in pq))
        block = _close(set(seed))
        for name in names:
            trial = _close(block | {name})
            if _allowed(feature, frozenset(trial)):
                block = trial
        block = frozenset(block)
        blocks.append(block)
        pairs = {pq for pq in pairs if not pq <= block}
    return blocks


@dataclass(frozen=True)
class Row:
    feature: Feature
    partners: FrozenSet[str]

    @property
    def id(self) -> str:
        recompute = "selective" if "selective" in self.partners else "full" if "full" in self.partners else "none"
        return f"{self.feature.name}-{recompute}"

    @property
    def dtype(self) -> str:
        return "bf16" if "bf16" in self.partners else "fp32"

    def partner_flags(self) -> tuple:
        flags = [*NO_DROPOUT, "--train-iters", str(ITERATIONS)]  # Llama-style: no dropout
        if self.feature.data == "packed":  # with a validation split (80/20)
            flags = [*(a if a != "100,0,0" else "80,20,0" for a in packed()), *flags]
        for name in PARTNERS:
            if name in self.partners:
                flags += PARTNERS[name][0]
        return tuple(flags)


def rows() -> List[Row]:
    return [Row(f, block) for f in FEATURES for block in covering(f.name)]


def markdown_table() -> str:
    """The matrix as docs/config-matrix.md shows it."""
    names = list(PARTNERS)
    lines = ["| run | layout (plugin / reference ranks) | " + " | ".join(names) + " | losses vs reference |",
             "|---|---|" + "---|" * len(names) + "---|"]
    for row in rows():
        f = row.feature
        tol = f.rel[row.dtype]
        cells = ["x" if n in row.partners else "" for n in names]
        compare = "bit-identical" if tol == 0 else f"rel. {tol:g}"
        lines.append(f"| `{row.id}` | {f.ranks} / {f.ref_ranks} | " + " | ".join(cells) + f" | {compare} |")
    return "\n".join(lines)
