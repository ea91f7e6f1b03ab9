"""Megatron's local ``DotProductAttention`` -> ``cp`` (patch table in ``install.py``).

``--overlap-cp`` / ``--overlap-hdp``: the class runs context-parallel attention when its config has
CP > 1 (its own ``__init__`` asserts CP == 1, so it runs with CP set to 1 for the duration of
the call), or under an HDP ring context (``cp.ring_context``); layers with CP == 1 keep the stock
code. Without them only ``__init__`` is wrapped, and only where Megatron would assert: CP > 1
gets an error that names ``--overlap-cp``.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Optional

from ..comm import waits
from ..config import ModelContext
from ..cp.checks import check_cp_model
from ..errors import OverlapConfigError
from . import compat, sites


@dataclass(frozen=True)
class CPLayer:
    """What a patched attention layer learned when it was built: the mode, its CP group, the
    softmax scale Megatron's attention would use, the hybrid all-to-all size."""

    mode: str
    group: object
    scale: float
    a2a_size: Optional[int] = None


ATTRIBUTE = "megatron_overlap_cp"  # the CPLayer of a patched layer built with CP > 1


def patch(inst, forward: bool) -> None:
    from megatron.core.transformer import dot_product_attention as dpa

    cls = dpa.DotProductAttention
    inst.set_attr(cls, "__init__", _attention_init(inst, cls.__dict__["__init__"]))
    if not forward:
        return
    inst.set_attr(cls, "forward", _attention_forward(inst, cls.__dict__["forward"]))
    if compat.transformer_engine_version() is not None:
        inst.notice_once("te-attention", "Transformer Engine is installed: `cp.mode` patches Megatron's local "
                         "attention only (`megatron.transformer_impl` local); TE's attention keeps its own context parallelism")
    inst.notice_once("cp-on", f"context-parallel attention on: {' '.join(inst.config.as_flags()[2:])}")


def _attention_init(inst, original):
    signature = inspect.signature(original)

    @functools.wraps(original)
    def __init__(self, config, *args, **kwargs):
        cp = getattr(config, "context_parallel_size", 1)
        if cp <= 1:
            return original(self, config, *args, **kwargs)
        check_cp_model(inst.config.cp, ModelContext(cp_size=cp, transformer_impl="local"))
        bound = signature.bind(self, config, *args, **kwargs).arguments
        _check_attention_config(config, bound.get("attention_dropout"))
        config.context_parallel_size = 1  # Megatron's local attention asserts CP == 1
        try:
            original(self, config, *args, **kwargs)
        finally:
            config.context_parallel_size = cp
        group = _cp_group(bound.get("pg_collection"))
        if group.size() != cp:
            raise OverlapConfigError(
                "megatron.context_parallel_size", f"the context-parallel group has {group.size()} ranks, the config "
                f"says {cp}")
        from ..cp.attention import check_cp_config

        check_cp_config(inst.config.cp.mode, cp, self.num_attention_heads_per_partition,
                        self.num_query_groups_per_partition, inst.config.cp.a2a_size)
        scale = self.softmax_scale
        if config.apply_query_key_layer_scaling:  # stock: scores / coeff, then softmax(x * coeff)
            scale *= self.layer_number
        setattr(self, ATTRIBUTE, CPLayer(inst.config.cp.mode, group, scale, inst.config.cp.a2a_size))

    return __init__


def _check_attention_config(config, dropout) -> None:
    dropout = config.attention_dropout if dropout is None else dropout
    if dropout:
        raise OverlapConfigError(
            "megatron.attention_dropout", f"context-parallel attention (`cp.mode`) runs without attention dropout; "
            f"got {dropout}. Set `megatron.attention_dropout` 0")
    if getattr(config, "softmax_type", "vanilla") != "vanilla" or getattr(config, "window_size", None):
        raise OverlapConfigError(
            "cp.mode", "context-parallel attention supports the vanilla softmax without a sliding window; got "
            f"softmax_type={config.softmax_type!r}, window_size={config.window_size!r}")


def _cp_group(pg_collection):
    group = getattr(pg_collection, "cp", None) if pg_collection is not None else None
    if group is None:
        from megatron.core import parallel_state

        group = parallel_state.get_context_parallel_group()
    return group


def _attention_forward(inst, original):
    @functools.wraps(original)
    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None, **kwargs):
        from ..cp import ring_context
        from ..cp.attention import cp_attention

        ring = ring_context.current()
        if ring is None and inst.config.hdp.enabled:
            inst.notice_once(
                "hdp-no-ring",
                "`hdp.enabled` is on, but this attention runs outside an HDP micro-batch: plain data parallelism, "
                "no HDP. Megatron-LM's training loop (pretrain_gpt.py) is wrapped by the plugin; a loop of your own "
                "feeds the model through megatron_overlap.hdp.runtime (HdpDataIterator + forward_step, or "
                "forward_backward)")
        mask_type = attn_mask_type or self.attn_mask_type
        if ring is not None:  # --overlap-hdp: the micro-batch's own ring (or one rank), packed layout
            if attention_bias is not None:
                raise OverlapConfigError("hdp.enabled", "hybrid data parallelism takes no attention bias")
            scale = self.softmax_scale * (self.layer_number if self.config.apply_query_key_layer_scaling else 1)
            inst.calls["hdp.attention"] += 1
            with waits.at(sites.layer_label(self.layer_number, "core attention forward"),
                          timeout_s=inst.config.comm.timeout_s):
                return cp_attention(query, key, value, mode="ring", causal=_is_causal(mask_type, ring.packed),
                                    group=ring.group, ranks=ring.ranks, softmax_scale=scale,
                                    packed=ring.packed if ring.packed is not None else packed_seq_params)
        layer: Optional[CPLayer] = getattr(self, ATTRIBUTE, None)
        if layer is None:
            return original(self, query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                            attention_bias=attention_bias, packed_seq_params=packed_seq_params, **kwargs)
        if attention_bias is not None:
            raise OverlapConfigError("cp.mode", "context-parallel attention takes no attention bias")
        options = inst.ring_options
        inst.calls[f"cp.{layer.mode}"] += 1
        with waits.at(sites.layer_label(self.layer_number, "core attention forward"),
                      timeout_s=inst.config.comm.timeout_s):
            return cp_attention(query, key, value, mode=layer.mode, causal=_is_causal(mask_type, packed_seq_params),
                                group=layer.group, softmax_scale=layer.scale, packed=packed_seq_params,
                                a2a_size=layer.a2a_size, overlap=options.overlap, kernel=options.kernel,
                                work=options.work)

    return forward


def _is_causal(mask_type, packed) -> bool:
    """Causal or no mask; the mask tensor itself is not read (as with Transformer Engine): under
    CP each rank holds zigzag chunks, and the causal structure follows from their positions;
    with packed sequences the padding is known from ``cu_seqlens``."""
    from megatron.core.transformer.enums import AttnMaskType

    if mask_type in (AttnMaskType.causal, AttnMaskType.causal_bottom_right, AttnMaskType.padding_causal):
        return True
    if mask_type == AttnMaskType.no_mask or (mask_type == AttnMaskType.padding and packed is not None):
        return False
    raise OverlapConfigError(
        "cp.mode", f"context-parallel attention supports causal and unmasked attention, not {mask_type.name} "
        "(with packed sequences, document boundaries come from cu_seqlens)")
