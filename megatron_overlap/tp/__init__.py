"""Tensor + sequence parallel overlap. No Megatron imports; process groups passed explicitly.

    linear.py        Column/Row autograd functions (forward, dgrad, wgrad as formulas)
    ag_gemm.py       all-gather -> GEMM as a chunked ring, beside its plain-PyTorch reference
    gemm_rs.py       GEMM -> reduce-scatter (ring or all-to-all), beside its reference
    linear_ar.py     the same without sequence parallelism (all-reduces)
    gemm_ar.py       GEMM -> all-reduce piece by piece, beside its reference
    allreduce_fusion.py  CoCoNet's fusion of a Row linear's all-reduce and the bias-dropout-add after it
    sub_batch.py     sub-batches across the ops of a block (``--overlap-tp-sub-batches``)
    wgrad.py         weight gradients with Megatron's ``main_grad`` semantics
    wgrad_store.py   weight-gradient GEMMs held back while a later transfer travels
    linear_plan.py   ``TPPlan`` (plain data) and ``TPPlanner`` (chunk rule, ``auto``, autotune, plan files)
    autotune.py      measured decompositions, plan files
    checks.py        model settings the overlapped linears cannot honour
    backends/        the two primitives per backend: p2p, symm-mem, fused

The modes below are the values of ``OverlapConfig.tp`` (``--overlap-tp``); config imports them.
"""

from __future__ import annotations

from ..comm.tags import STREAM_SIZE
from ..errors import OverlapConfigError

TP_MODES = ("off", "p2p", "symm-mem", "fused", "auto")
RS_ALGOS = ("ring", "a2a")


MAX_CHUNKS = STREAM_SIZE  # a ring tags each of its (step, piece) messages inside one stream


def check_chunks(value) -> int:
    """The rule for ``tp.chunks``: 0 (the plugin chooses) or a positive count, at most what a
    ring can tag; multiples of the TP size and the rows per rank are checked once they are known
    (``checks.check_tp_model``, ``check_chunks_fit``)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise OverlapConfigError("tp.chunks", f"expected a whole number, got {str(value)[:40]!r}")
    if value < 0:
        raise OverlapConfigError(
            "tp.chunks", f"must be 0 (choose automatically) or a positive multiple of the TP size, got {value}")
    if value > MAX_CHUNKS:
        raise OverlapConfigError(
            "tp.chunks", f"{value} exceeds the {MAX_CHUNKS} messages a ring can tell apart; use fewer (a few per "
            "rank is what pays off), or 0 to let the plugin choose")
    return value


def check_chunks_fit(chunks_per_rank: int, rows: int, source: str, where: str, scale: int = 1) -> None:
    """The one rule for how finely a rank's ``rows`` sequence rows may be cut, wherever the count
    comes from (``tp.chunks`` as chunks x TP, a plan file's entry, the autotuner): at most one
    chunk per row. ``scale`` turns the bound back into the source's unit (TP for ``tp.chunks``)."""
    if chunks_per_rank > rows:
        raise OverlapConfigError(
            source, f"{where} cuts each rank's {rows} sequence rows into {chunks_per_rank} chunks, more than one "
            f"per row; use at most {rows * scale} (or 0 to let the plugin choose)")


SUB_BATCH_BLOCKS = ("all", "attention", "mlp")  # the blocks `tp.sub_batches` cuts


def check_sub_batch_blocks(blocks: str, sub_batches) -> str:
    """The rule for ``tp.sub_batch_blocks``: which blocks a cut applies to, so only with a count
    that cuts (above 1, or ``auto``)."""
    if blocks not in SUB_BATCH_BLOCKS:
        raise OverlapConfigError("tp.sub_batch_blocks", f"unknown blocks {blocks!r}; choose one of "
                                 f"{', '.join(SUB_BATCH_BLOCKS)}")
    if blocks != "all" and sub_batches == 1:
        raise OverlapConfigError("tp.sub_batch_blocks", f"{blocks} chooses the blocks `tp.sub_batches` cuts, and "
                                 "`tp.sub_batches` is 1 (every block whole); pass a count of 2 or more (or auto), "
                                 "or drop it")
    return blocks


def check_sub_batches(value, mode: str):
    """The rule for ``tp.sub_batches``: a whole number >= 1 (1: blocks run whole) or ``auto``
    (the cost model chooses at install), more than 1 only with a backend whose GEMMs can be cut
    (not ``fused``)."""
    if value != "auto" and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise OverlapConfigError(
            "tp.sub_batches", f"must be a whole number >= 1 (1: each block runs whole) or auto, got {value!r}")
    if value != 1 and mode == "fused":
        raise OverlapConfigError(
            "tp.sub_batches", "cuts the blocks' GEMMs into sub-batches, and `tp.mode` fused runs each GEMM whole in one "
            "Triton kernel whose tiles wait on the chunks; use `tp.mode` p2p or symm-mem with sub-batches")
    return value

