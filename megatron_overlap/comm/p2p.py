"""Point-to-point exchanges inside an explicit process group.

Every exchange posts its send and its receive together through ``batch_isend_irecv``, so that
NCCL (which matches P2P calls in order and can deadlock on lone posts) and gloo see the same
pattern. Functions are looked up on ``torch.distributed`` at call time, so a wrapper installed
there (the emulated link) sees our traffic exactly as it sees Megatron's.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist


def global_rank(group: dist.ProcessGroup, group_rank: int) -> int:
    """World rank of ``group_rank`` in ``group`` (P2P calls take world ranks)."""
    return dist.get_global_rank(group, group_rank)


def exchange(
    group: dist.ProcessGroup,
    *,
    send: Optional[torch.Tensor] = None,
    dst: Optional[int] = None,
    recv: Optional[torch.Tensor] = None,
    src: Optional[int] = None,
    tag: int = 0,
) -> tuple[Optional[dist.Work], Optional[dist.Work]]:
    """Post ``send`` to group rank ``dst`` and ``recv`` from group rank ``src`` as one batch.

    Returns ``(send_work, recv_work)``; either is None when that side was not asked for.
    Every wait on them is bounded by the group's timeout.
    """
    ops = []
    if send is not None:
        ops.append(dist.P2POp(dist.isend, send, global_rank(group, dst), group, tag))
    if recv is not None:
        ops.append(dist.P2POp(dist.irecv, recv, global_rank(group, src), group, tag))
    if not ops:
        return None, None
    works = dist.batch_isend_irecv(ops)
    send_work = works[0] if send is not None else None
    recv_work = works[-1] if recv is not None else None
    return send_work, recv_work
