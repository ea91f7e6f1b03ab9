"""Megatron's torch norm under sequence parallelism (patch table in ``install.py``).

Without apex, Megatron's local spec builds its layer norms with ``WrappedTorchNorm``, which
asserts ``not config.sequence_parallel``: ``--transformer-impl local --sequence-parallel`` (what
TP overlap needs) cannot build a model. A norm over the hidden dimension is per token, so on a
sequence shard it computes what it computes on the whole sequence; what sequence parallelism
adds is that its weight and bias gradients, each a sum over this rank's tokens only, are summed
over the TP group. Megatron does that for every parameter marked ``sequence_parallel``
(``finalize_model_grads``), as apex's ``FusedLayerNorm`` marks its own. So while the plugin is
installed, ``WrappedTorchNorm`` builds the torch norm as usual and marks its parameters; one
notice says so. With apex present the local spec uses ``FusedLayerNorm`` and this changes
nothing.
"""

from __future__ import annotations

import copy
from typing import Callable, Optional

NOTICE = ("torch norm under sequence parallelism (no apex): per-token, the same math as apex's FusedLayerNorm; its "
          "parameters are marked sequence_parallel so Megatron sums their gradients over TP, as apex's are")


def sequence_parallel_new(build: Callable, on_build: Optional[Callable[[], None]] = None) -> Callable:
    """A ``WrappedTorchNorm.__new__`` that runs ``build`` (the original) as usual and, under
    sequence parallelism, on a copy of the config without it, marking the norm's parameters
    ``sequence_parallel``; ``on_build`` runs after each such build. The lab's stock runs of
    ``pretrain_gpt.py`` use it too (apex's math, without the plugin)."""

    def __new__(cls, config, *args, **kwargs):
        if not getattr(config, "sequence_parallel", False):
            return build(cls, config, *args, **kwargs)
        plain = copy.copy(config)
        plain.sequence_parallel = False
        norm = build(cls, plain, *args, **kwargs)
        for param in norm.parameters():
            param.sequence_parallel = True
        if on_build is not None:
            on_build()
        return norm

    return __new__


def original_new(cls) -> Callable:
    """The bare function behind ``cls.__new__`` (a class keeps it wrapped in a staticmethod)."""
    original = cls.__dict__["__new__"]
    return original.__func__ if isinstance(original, staticmethod) else original


def patch(inst) -> None:
    try:
        from megatron.core.transformer.torch_norm import WrappedTorchNorm
    except ImportError:  # a megatron-core without it: nothing to do
        return
    new = sequence_parallel_new(original_new(WrappedTorchNorm), lambda: inst.notice_once("sp-torch-norm", NOTICE))
    inst.set_attr(WrappedTorchNorm, "__new__", staticmethod(new))
