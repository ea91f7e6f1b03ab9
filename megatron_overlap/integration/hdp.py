"""Megatron's GPT model and groups -> the ``hdp`` runtime.

:class:`MegatronModel` is the runtime's model adapter (``hdp.runtime``): it refuses the models
the runtime cannot run exactly, gives every row its true RoPE position, checks the patched
attention is installed, and builds Megatron's ``PackedSeqParams`` for the ring context.
:func:`make_runtime` builds an ``HdpRuntime`` from the config of ``--overlap-hdp`` (explicitly passed:
nothing is read back from an installation), over a communicator of HDP's own (:func:`own_group`).
:func:`patch_groups` makes that communicator beside Megatron's groups; :func:`patch_recompute`
makes Megatron's activation checkpoints keep the ring of the forward for its recomputation.

RoPE. Megatron builds ``rotary_pos_emb`` for positions 0..S-1 and rotates row i by entry i; for
a shard, whose rows sit at positions x c .. and (2n-1-x) c .., that would be wrong. While
:meth:`MegatronModel.positions` is entered, a forward pre-hook asks the model's
``RotaryEmbedding`` for ``max(position) + 1`` positions and a forward hook gathers its output at
each row's true position, ``emb[pos[i]]``, so Megatron's unfused ``apply_rotary_pos_emb`` (sbhd:
row i gets ``emb[i]``) rotates every row exactly as the whole sequence would. YaRN and
multimodal RoPE (other output shapes) and multi-latent attention are refused.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from typing import Optional

import torch
import torch.distributed as dist

from ..errors import OverlapConfigError


def _unwrap(model):
    while hasattr(model, "module") and isinstance(getattr(model, "module"), torch.nn.Module):
        model = model.module
    return model


def _rotary_modules(model) -> list:
    from megatron.core.models.common.embeddings.rotary_pos_embedding import (
        MultimodalRotaryEmbedding,
        RotaryEmbedding,
    )

    found = []
    for m in model.modules():
        if isinstance(m, MultimodalRotaryEmbedding) or (isinstance(m, RotaryEmbedding) and type(m) is not RotaryEmbedding):
            raise OverlapConfigError(
                "megatron.position_embedding_type",
                f"`hdp.enabled` gives each row its true position for plain RoPE (rope) or learned absolute positions; "
                f"{type(m).__name__} is not supported. Use `megatron.position_embedding_type` rope or learned_absolute")
        if isinstance(m, RotaryEmbedding):
            found.append(m)
    return found


@contextlib.contextmanager
def true_positions(model, position_ids: torch.Tensor, positions: Optional[int] = None):
    """While entered, the model's ``RotaryEmbedding`` returns one entry per row, at the row's
    true position (``emb[position_ids[i]]``) instead of positions 0..S-1. ``positions``: how
    many positions to build (max + 1; read from ``position_ids`` when not given, a device sync)."""
    modules = _rotary_modules(model)
    if not modules:
        yield
        return
    pos = position_ids.reshape(-1).long()
    need = positions if positions is not None else (int(pos.max()) + 1 if pos.numel() else 1)

    def pre(module, args, kwargs):
        if "max_seq_len" in kwargs:
            kwargs = dict(kwargs, max_seq_len=need)
        else:
            args = (need,) + tuple(args[1:])
        offset = kwargs.get("offset", args[1] if len(args) > 1 else 0)
        if offset:
            raise OverlapConfigError("hdp.enabled", f"rotary embeddings with an offset ({offset}) are inference-only")
        return args, kwargs

    def post(module, args, kwargs, output):
        return output.index_select(0, pos.to(output.device))

    handles = []
    try:
        for m in modules:
            handles.append(m.register_forward_pre_hook(pre, with_kwargs=True))
            handles.append(m.register_forward_hook(post, with_kwargs=True))
        yield
    finally:
        for h in handles:
            h.remove()


def patch_recompute(inst) -> None:
    """Megatron's activation checkpoints keep the HDP ring (patch table in ``install.py``): the
    function Megatron saves to run again in the backward (``CheckpointFunction``: full
    recompute and selective ``core_attn``; ``CheckpointWithoutOutput``: the other selective
    modules) is bound to the ring in force when the checkpoint was made (``cp.ring_context.keep``),
    so the recomputed attention runs over the same ranks, documents and positions as the
    forward, without reading the ambient context, which the backward no longer has."""
    from megatron.core.tensor_parallel import random as tp_random

    from ..cp import ring_context

    function = tp_random.CheckpointFunction
    forward = function.__dict__["forward"]
    forward = forward.__func__ if isinstance(forward, staticmethod) else forward

    def keep(run_function):
        if ring_context.current() is not None:
            inst.calls["hdp.checkpoint"] += 1
        return ring_context.keep(run_function)

    @functools.wraps(forward)
    def checkpoint_forward(ctx, run_function, *args):
        return forward(ctx, keep(run_function), *args)

    checkpoint_forward.hdp_installation = inst  # installation() reads it back

    inst.set_attr(function, "forward", staticmethod(checkpoint_forward))
    without = tp_random.CheckpointWithoutOutput
    original = without.__dict__["checkpoint"]

    @functools.wraps(original)
    def checkpoint(self, run_function, *args):
        return original(self, keep(run_function), *args)

    inst.set_attr(without, "checkpoint", checkpoint)


def installation():
    """The installation whose HDP patches are in Megatron now (``--overlap-hdp``: the attention,
    the checkpoints of :func:`patch_recompute`, installed and removed together), or None."""
    from megatron.core.tensor_parallel import random as tp_random

    forward = tp_random.CheckpointFunction.__dict__["forward"]
    forward = forward.__func__ if isinstance(forward, staticmethod) else forward
    inst = getattr(forward, "hdp_installation", None)
    return inst if inst is not None and inst.patched else None


def patch_groups(inst) -> None:
    """HDP's communicator (:func:`own_group`) made beside Megatron's groups, not at the first
    step: now, where Megatron's parallel state is up (every rank installs at the same point),
    else right after ``parallel_state.initialize_model_parallel`` builds it (Megatron-LM's
    ``_initialize_distributed``; patch table in ``install.py``). Making a group waits for every
    rank, bounded only by the process groups' timeout; a peer silent at the first step then
    meets the step's own waits, which ``--overlap-timeout-s`` bounds. With CP > 1 nothing is
    made (``--overlap-hdp`` refuses it when it runs)."""
    from megatron.core import parallel_state

    def make() -> None:
        if dist.is_initialized() and parallel_state.model_parallel_is_initialized() and \
                parallel_state.get_context_parallel_world_size() == 1:
            parent = parallel_state.get_data_parallel_group(with_context_parallel=True)
            if parent not in _OWN:
                own_group(parent)
                inst.calls["hdp.groups"] += 1

    make()
    original = parallel_state.__dict__["initialize_model_parallel"]

    @functools.wraps(original)
    def initialize_model_parallel(*args, **kwargs):
        out = original(*args, **kwargs)
        make()
        return out

    inst.set_attr(parallel_state, "initialize_model_parallel", initialize_model_parallel)


class MegatronModel:
    """The HDP runtime's adapter for Megatron's GPT (module docstring). Models that passed the
    checks are remembered (weakly) on this object."""

    def __init__(self):
        self._checked: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # models that passed

    def positions(self, model, position_ids, count):
        return true_positions(model, position_ids, count)

    def require_patched(self) -> None:
        if installation() is None:
            raise OverlapConfigError(
                "hdp.enabled", "the HDP runtime needs the patched attention: call megatron_overlap.install(args) with "
                "`hdp.enabled` first (without it Megatron's attention would treat a ring shard's rows as a whole "
                "sequence)")

    def packed_params(self, layout):
        from megatron.core.packed_seq_params import PackedSeqParams

        longest = max(layout.seq_lens)
        return PackedSeqParams(qkv_format="thd", cu_seqlens_q=layout.cu_seqlens, cu_seqlens_kv=layout.cu_seqlens,
                               cu_seqlens_q_padded=layout.cu_seqlens_padded,
                               cu_seqlens_kv_padded=layout.cu_seqlens_padded, max_seqlen_q=longest,
                               max_seqlen_kv=longest)

    def check(self, model) -> None:
        """Refuse model settings the runtime cannot run exactly (clear errors naming the flag)."""
        if model in self._checked:
            return
        check_model(model)
        self._checked[model] = True


def check_model(model) -> None:
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    inner = _unwrap(model)
    config = getattr(inner, "config", None)
    if config is not None:
        _check_config(config)
    kind = getattr(inner, "position_embedding_type", None)
    if kind not in (None, "rope", "learned_absolute", "none"):
        raise OverlapConfigError(
            "megatron.position_embedding_type", f"`hdp.enabled` supports rope and learned_absolute positions, got {kind!r}")
    _rotary_modules(inner)
    if not any(isinstance(m, DotProductAttention) for m in inner.modules()):
        raise OverlapConfigError(
            "megatron.transformer_impl", "`hdp.enabled` runs its rings through Megatron's local DotProductAttention; "
            "the model has none (Transformer Engine?). Pass `megatron.transformer_impl` local")


def _check_config(config) -> None:
    if getattr(config, "pipeline_model_parallel_size", 1) > 1 and not getattr(config, "variable_seq_lengths", False):
        raise OverlapConfigError(
            "hdp.enabled", "with pipeline parallelism the stages pass HDP's micro-batches on, and their lengths vary: "
            "set the model config's variable_seq_lengths = True (Megatron-LM's training loop gets it for each step)")
    if getattr(config, "context_parallel_size", 1) > 1:
        raise OverlapConfigError("megatron.context_parallel_size", "`hdp.enabled` picks each sequence's ring itself; "
                                 "set 1")
    if getattr(config, "multi_latent_attention", False):
        raise OverlapConfigError("hdp.enabled", "multi-latent attention applies RoPE its own way; not supported")
    if getattr(config, "attention_dropout", 0.0):
        raise OverlapConfigError("megatron.attention_dropout", "`hdp.enabled` ring attention runs without attention "
                                 f"dropout; got {config.attention_dropout}. Set `megatron.attention_dropout` 0")
    if getattr(config, "softmax_type", "vanilla") != "vanilla" or getattr(config, "window_size", None):
        raise OverlapConfigError("hdp.enabled", "ring attention supports the vanilla softmax without a sliding window")


def default_group() -> dist.ProcessGroup:
    """HDP's own communicator (:func:`own_group`) over Megatron's data-parallel ranks when its
    parallel state is up (CP must be 1), else over WORLD's. Collective the first time."""
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return own_group(dist.group.WORLD)
    if parallel_state.get_context_parallel_world_size() > 1:
        raise OverlapConfigError("megatron.context_parallel_size", "`hdp.enabled` merges DP and CP into one group; "
                                 "set CP to 1")
    return own_group(parallel_state.get_data_parallel_group(with_context_parallel=True))


_OWN: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # parent group -> HDP's communicator over its ranks


def own_group(parent: dist.ProcessGroup) -> dist.ProcessGroup:
    """A communicator of HDP's own over the ranks of ``parent``, made once per parent: the
    step's lengths all-gather and row exchange and every ring run on it, never on ``parent``.

    Why: Megatron's DDP reduces the gradient buckets on the data-parallel group, and with
    ``--overlap-grad-reduce`` (and the distributed optimizer's ``--overlap-param-gather``) it
    posts them during the step: each rank in its own last micro-batch's backward. HDP's ranks
    run different numbers of micro-batches, so a rank posts its reductions while a ring peer,
    still in an earlier micro-batch, exchanges attention blocks with it. On one communicator,
    whose operations NCCL runs in the order they were posted, the reduction would wait for the
    peer and the peer for the ring transfer queued behind it: a deadlock. On two communicators
    neither waits for the other; the reductions still run in the same order on every rank.

    Collective over WORLD the first time (every rank calls it, each with its own parent, e.g.
    its data-parallel group; the parents must split the world): the parents' ranks are
    all-gathered and every rank makes every new group, as ``torch.distributed.new_group`` asks.
    The new groups take the parent's timeout. The installation makes it with Megatron's groups
    (:func:`patch_groups`)."""
    found = _OWN.get(parent)
    if found is not None:
        return found
    ranks = tuple(dist.get_process_group_ranks(parent))
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, ranks)
    groups = sorted(set(everyone))
    if sorted(r for g in groups for r in g) != list(range(dist.get_world_size())):
        raise ValueError(f"HDP's groups must split the world's ranks into disjoint groups; the ranks passed {groups}")
    timeout = _timeout(parent)
    for members in groups:  # every rank makes every group, in the same order
        group = dist.new_group(list(members), timeout=timeout)
        if members == ranks:
            found = group
    _OWN[parent] = found
    return found


def _timeout(group):
    """The process group's timeout (Megatron's ``--distributed-timeout-minutes``), None when
    the backend does not say (``new_group`` then takes the default)."""
    from ..comm.agree import group_device

    try:
        return group._get_backend(group_device(group)).options._timeout
    except (AttributeError, RuntimeError):
        return None


def make_runtime(hdp, group: Optional[dist.ProcessGroup] = None, **kwargs):
    """An ``HdpRuntime`` for the config's HDP section ``hdp`` (``OverlapConfig.hdp``) over ``group``
    (default: :func:`default_group`, HDP's own communicator over the data-parallel ranks that share
    this rank's TP rank and pipeline stage; collective over WORLD the first time), with
    the Megatron model adapter and, with TP > 1, rows padded to a multiple of the TP size
    (sequence parallelism splits them; without it the padding is only wasted rows).
    The scheduler's mode follows the pipeline: ``pp`` (every rank the same number of micro-batch
    slots) with more than one stage, else ``dp`` (whole steps balanced).
    ``kwargs`` go to the runtime (``mode``, ``scheduler``, ``cost``, ``device``, ``row_multiple``, ``timeout_s``:
    default, the installed config's ``comm.timeout_s``); ``guard=True`` gives it megatron-core's
    ``BalancedCPScheduler`` as the peer ``hdp.guard`` checks every plan against."""
    from ..hdp.runtime import HdpRuntime

    if not hdp.enabled:
        raise OverlapConfigError("hdp.enabled", "no `hdp.enabled` in this config: the HDP runtime needs it (with "
                                 "`hdp.max_tokens`)")
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        kwargs.setdefault("row_multiple", parallel_state.get_tensor_model_parallel_world_size())
        stages = parallel_state.get_pipeline_model_parallel_world_size()
        kwargs.setdefault("mode", "pp" if stages > 1 else "dp")
        if stages > 1:
            kwargs.setdefault("stages", stages)  # mode pp prices its plans as this pipeline runs them
    if "timeout_s" not in kwargs:  # --overlap-timeout-s of the installation in force bounds the exchange too
        inst = installation()
        kwargs["timeout_s"] = inst.config.comm.timeout_s if inst is not None else None
    if kwargs.pop("guard", False):  # hdp.guard: never more than 1% slower than megatron-core's own plan
        from .baselines import schedule_megatron_balanced

        kwargs["peer"] = schedule_megatron_balanced
    return HdpRuntime(hdp.max_tokens, group if group is not None else default_group(), MegatronModel(), **kwargs)
