"""TP-overlap backends: the two primitives (gather-matmul, matmul-reduce-scatter) each provides.

    base.py       the interface, and what every backend shares
    p2p.py        chunked P2P rings and ``torch.matmul`` per chunk (any device, any backend)
    symm_mem.py   PyTorch's symmetric-memory fused ops (CUDA)
    fused.py      our Triton kernels fed by a P2P transport (``megatron_overlap.kernels``)
"""

from __future__ import annotations

from .base import TPBackend, refuse
from .p2p import P2PBackend
from ..linear_plan import EXPLICIT_SHAPE


def resolve_backend(tp) -> str:
    """``auto`` without a cost-model pick -> ``symm-mem`` where PyTorch's symmetric memory runs,
    else ``p2p``; any other mode is itself. ``auto`` honours an explicit decomposition
    (``--overlap-tp-chunks`` / ``-rs`` / ``-bidirectional``): it then only chooses among backends
    that take it, i.e. ``p2p``. ``fused`` is never picked automatically while the measured
    figures say it is slower than stock (docs/tp-overlap.md)."""
    if tp.mode != "auto":
        return tp.mode
    from . import symm_mem

    if tp.given(*EXPLICIT_SHAPE):
        return "p2p"
    return "symm-mem" if symm_mem.availability()[0] else "p2p"


def make_backend(name: str, timeout_s=None) -> TPBackend:
    """The backend object; refuses (on ``tp.mode``) one that cannot run on this machine.
    ``timeout_s`` (``comm.timeout_s``): the fused kernels' flag waits give up after about as long
    (default 300 s)."""
    if name == "p2p":
        return P2PBackend()
    if name == "symm-mem":
        from . import symm_mem

        ok, why = symm_mem.availability()
        if not ok:
            refuse("symm-mem", why)
        return symm_mem.SymmMemBackend()
    if name == "fused":
        from . import fused

        ok, why = fused.availability()
        if not ok:
            refuse("fused", why)
        bound = {} if timeout_s is None else {"timeout_s": timeout_s}
        if fused.interpreting():
            return fused.FusedBackend(**bound)  # fixed tile config: interpreter timings mean nothing
        from ...kernels.tuning import ConfigChooser

        return fused.FusedBackend(configs=ConfigChooser(), **bound)
    raise ValueError(f"unknown TP-overlap backend {name!r}")


__all__ = ["P2PBackend", "TPBackend", "make_backend", "refuse", "resolve_backend"]
