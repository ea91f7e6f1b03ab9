"""Megatron DDP's gradient buckets, as data: which parameters share a reduction, in the order
the backward fills them. Pure Python; the simulator and the cost model price the data-parallel
sync from it, the emulated cluster checks its real DDP against it.

megatron-core 0.16-0.19 (``distributed/param_and_grad_buffer.py``, ``_ParamAndGradBuffer``):
parameters are taken in reverse registration order (roughly the backward's); a bucket is
closed after the parameter that brings it to ``bucket_size`` elements or more; what is left
forms the last bucket. ``DistributedDataParallel`` sets ``bucket_size`` to ``max(40M, 1M x
DP)`` by default, and to None (one bucket) without ``overlap_grad_reduce`` and on every
pipeline stage but the first ("data-parallel communication on these stages is not on the
critical path"). Padding (the distributed optimizer rounds bucket ends up to a multiple of the
DP size) is left out: it moves a bucket by at most DP x 128 elements.
"""

from __future__ import annotations

from typing import List, Optional, Sequence


def default_bucket_size(dp: int) -> int:
    """Megatron DDP's ``bucket_size`` when the config leaves it None."""
    return max(40_000_000, 1_000_000 * dp)


def stage_bucket_size(dp: int, stage: int, overlap_grad_reduce: bool = True,
                      bucket_size: Optional[int] = None) -> Optional[int]:
    """The bucket size DDP uses on pipeline stage ``stage`` (None: one bucket)."""
    if not overlap_grad_reduce or stage > 0:
        return None
    return bucket_size if bucket_size is not None else default_bucket_size(dp)


def buckets(param_numels: Sequence[int], bucket_size: Optional[int]) -> List[int]:
    """Elements per bucket, in the order the backward fills them (bucket 0 first), for
    parameters of ``param_numels`` elements in registration order (the model's)."""
    if any(n < 0 for n in param_numels):
        raise ValueError(f"parameter sizes must be >= 0, got {list(param_numels)}")
    out: List[int] = []
    current = 0
    for n in reversed(list(param_numels)):
        current += n
        if bucket_size is not None and current >= bucket_size:
            out.append(current)
            current = 0
    if current or not out:
        out.append(current)
    return out
