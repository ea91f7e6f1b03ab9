"""The ring of the micro-batch in hand, when something other than Megatron's CP group decides it.

Hybrid data parallelism (``--overlap-hdp``) gives every sequence its own ring: an ordered list of ranks
inside one parent group (no communicator per ring), chosen per micro-batch by the scheduler. The
HDP runtime enters :func:`ring` around each micro-batch's forward and backward; the patched
``DotProductAttention`` (``patch._attention_forward``) then runs :func:`cp_attention` over that
ring, with the micro-batch's packed layout, instead of Megatron's fixed CP group. A ring of one
rank is a local micro-batch (packed documents, no communication).

The backward of ring attention communicates too: the runtime keeps the context entered until the
micro-batch's backward is done (autograd runs ``cp_attention``'s backward with the ring it saw in
the forward, so only the forward reads this).
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

import torch.distributed as dist


@dataclass(frozen=True)
class RingContext:
    group: dist.ProcessGroup
    ranks: Tuple[int, ...]  # ordered group ranks; position = index
    packed: Optional[object] = None  # PackedSeqParams of this rank's rows (THD), or None


_current: contextvars.ContextVar = contextvars.ContextVar("megatron_overlap_ring", default=None)


@contextlib.contextmanager
def ring(group: dist.ProcessGroup, ranks: Sequence[int], packed=None):
    """Run the attention of the enclosed forward over ``ranks`` of ``group``."""
    token = _current.set(RingContext(group, tuple(int(r) for r in ranks), packed))
    try:
        yield
    finally:
        _current.reset(token)


def current() -> Optional[RingContext]:
    return _current.get()
