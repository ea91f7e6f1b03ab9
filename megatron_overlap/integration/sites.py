"""Names for where a wait happens: which transformer layer and which linear a patched call
serves, for the messages of ``comm.waits`` ("layer 3 linear_fc1 forward").

Megatron's linear function is called with tensors only, so the first time a weight is seen the
caller's frames are read (once per weight, cached on the installation): the nearest ``self``
that is a linear module is the linear, the module above it that holds it names it (``linear_qkv``),
the nearest with a ``layer_number`` (``TransformerLayer``, attention) gives the layer. Nothing is
changed on the modules; a miss only makes the label vaguer.
"""

from __future__ import annotations

import sys

_MAX_FRAMES = 40


def layer_label(layer_number=None, name: str = "") -> str:
    return " ".join(part for part in (f"layer {layer_number}" if layer_number is not None else "", name) if part)


def from_frames(start: int = 2, module=None) -> str:
    """``layer N <linear>`` from the calling frames (``module``: the linear itself, when known):
    the linear is the first ``self`` with a weight and a TP group, its name the attribute its
    parent module holds it under (``linear_fc1``), the layer the first ``layer_number`` above."""
    linear, name, layer = module, "", None
    frame = sys._getframe(start)
    for _ in range(_MAX_FRAMES):
        if frame is None:
            break
        owner = frame.f_locals.get("self")
        if owner is not None and owner is not linear:
            if linear is None and hasattr(owner, "weight") and hasattr(owner, "tp_group"):
                linear = owner
            elif linear is not None and not name:
                name = next((key for key, child in getattr(owner, "_modules", {}).items() if child is linear), "")
            number = getattr(owner, "layer_number", None)
            if isinstance(number, int):
                layer = number
                break
        frame = frame.f_back
    return layer_label(layer, name or (type(linear).__name__ if linear is not None else "linear"))


def label_for_weight(inst, weight, kind: str, module=None) -> str:
    """The label of the linear owning ``weight`` (a ``column`` or ``row`` linear; ``module``: the
    linear, when the caller has it), cached on the installation by the weight's identity and
    shape: the frames are read once per weight."""
    key = (id(weight), tuple(weight.shape))
    label = inst.sites.get(key)
    if label is None:  # frame 2: the patched call that asks (0: from_frames, 1: here)
        label = inst.sites[key] = f"{from_frames(2, module)} ({kind}, weight {'x'.join(map(str, weight.shape))})"
    return label
