"""The TP plan and backend of one patched linear (``TPComm``), checked the first time its
shape is seen: what ``linears.py`` and ``allreduce_fusion.py`` both hand their linears."""

from __future__ import annotations

from ..config import ModelContext
from ..tp.checks import check_tp_model
from ..tp.linear import TPComm
from ..tp.linear_plan import AR_KINDS, tokens_per_row


def linear_comm(inst, kind: str, group, x, weight, shard_rows: int, sub=None, sequence_parallel=None) -> TPComm:
    """The TP plan and backend of one linear; the first time a shape, dtype and device are
    seen, the model settings and the backend are checked (a programmatic install learns them
    only now). The all-reduce kinds (``column_ar``, ``row_ar``: no sequence parallelism) pass
    the whole sequence's rows as ``shard_rows``."""
    size = group.size()
    sp = kind not in AR_KINDS if sequence_parallel is None else sequence_parallel  # the fusion: RS plan, no SP
    key = (id(group), size, shard_rows, tokens_per_row(x), x.dtype, x.device, sp)
    if key not in inst.checked:
        if not sp and inst.wgrad is not None:
            # the all-reduce path: a layer's last dgrad all-reduce (QKV's) has only its own GEMMs and
            # the held weight gradients to hide behind, so up to one layer's may wait (3 linears per
            # sub-batch and QKV's), each keeping its two inputs until it runs (measured, BENCHMARKS.md)
            parts = inst.config.tp.sub_batches if isinstance(inst.config.tp.sub_batches, int) else 1
            inst.wgrad.limit = max(inst.wgrad.limit, 3 * parts + 1)
        inst.tp.backend.check(x)
        check_tp_model(inst.config.tp, ModelContext(tp_size=size, sequence_parallel=sp,
                                                    seq_length=shard_rows * size if kind not in AR_KINDS else shard_rows))
        inst.checked.add(key)
    return TPComm(group, inst.tp.plan(kind, x, weight, group, shard_rows), inst.tp.backend, inst.prefetch, inst.wgrad,
                  sub)
