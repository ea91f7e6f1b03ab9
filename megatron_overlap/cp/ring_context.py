"""The ring of the micro-batch in hand, when something other than Megatron's CP group decides it.

Hybrid data parallelism (``--overlap-hdp``) gives every sequence its own ring: an ordered list of ranks
inside one parent group (no communicator per ring), chosen per micro-batch by the scheduler. The
HDP runtime enters :func:`ring` around each micro-batch's forward and backward; the patched
``DotProductAttention`` (``integration.attention._attention_forward``) then runs
``cp.attention.cp_attention`` over that ring, with the micro-batch's packed layout, instead of
Megatron's fixed CP group. A ring of one rank is a local micro-batch (packed documents, no
communication).

The backward of ring attention communicates too: autograd runs ``cp_attention``'s backward with
the ring it saw in the forward, so only a forward reads this. A forward that activation
recomputation runs again inside the backward (Megatron's ``tensor_parallel.checkpoint``) runs in
the ring its first run saw: the plugin's checkpoint wrapper captures it with the function
Megatron saves for the recomputation (:func:`keep`, ``integration/hdp.py``).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
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


@contextlib.contextmanager
def entered(context: Optional[RingContext]):
    """Run the enclosed code in ``context`` (as :func:`current` returned it; None: no ring)."""
    token = _current.set(context)
    try:
        yield
    finally:
        _current.reset(token)


def keep(function):
    """``function`` bound to the ring in force now: wherever and whenever it is called (a
    recomputation in the backward), it runs in that ring. Unchanged where no ring is entered."""
    context = current()
    if context is None:
        return function

    @functools.wraps(function)
    def in_ring(*args, **kwargs):
        with entered(context):
            return function(*args, **kwargs)

    return in_ring
