"""ZB-V's layer placement (``--overlap-pp zbv``, patch table in ``install.py``): two model chunks
per stage in a V, stage s holding virtual stages s and 2p-1-s (``pp/chunks.py``), which
Megatron's own placement (chunk c of stage s = virtual stage c p + s) does not build. While
``zbv`` is installed:

- ``get_transformer_layer_offset`` (``transformer.transformer_layer``, and the name
  ``transformer.transformer_block`` imported) gives chunk 1 of stage s the offset of virtual
  stage 2p-1-s: the layers keep Megatron's whole-model numbering, so checkpoint keys
  (``sharded_state_dict``) name the same layers as in the stock layout;
- ``parallel_state.is_pipeline_last_stage`` says stage 0 (with ``vp_stage``: its chunk 1), where
  the V puts the model's last layer and the loss, and so does ``pipeline_parallel.utils.
  is_pp_last_stage`` (with ``is_vp_last_stage``, as Megatron-LM's ``get_model`` builds the output
  layer and ``Float16Module`` casts the output); ``is_pipeline_first_stage`` is Megatron's.

Each is replaced wherever Megatron holds it under its name (modules that imported it by name
too) and restored exactly on uninstall. Checked where they are first used (refused with what to
change): uniform layers only (``num_layers`` divisible into 2p chunks; no custom pipeline
layout, no first/last-stage layer counts, no embedding/loss in the split), untied embeddings
(tied ones would need one parameter shared by stage 0's two chunks), megatron-core 0.16.x
(the version whose offset and predicates this was written against; others refused by name).
"""

from __future__ import annotations

import functools
import sys

import torch

from ..errors import OverlapConfigError

PATCHED_VERSIONS = ((0, 16),)


def check_version(version) -> None:
    """``version``: megatron-core's (major, minor, patch)."""
    if tuple(version[:2]) not in PATCHED_VERSIONS:
        raise OverlapConfigError(
            "pp.mode", f"zbv patches Megatron's layer offsets and last-stage predicate, written against megatron-core "
            f"0.16.x; this is {'.'.join(map(str, version))}, where that patch is not known to be safe: use `pp.mode` "
            "zb (interleaved zero bubble in Megatron's own placement)")


def check_config(config) -> None:
    p, layers = config.pipeline_model_parallel_size, config.num_layers
    if getattr(config, "pipeline_model_parallel_layout", None) or config.num_layers_in_first_pipeline_stage \
            is not None or config.num_layers_in_last_pipeline_stage is not None or \
            config.account_for_embedding_in_pipeline_split or config.account_for_loss_in_pipeline_split:
        raise OverlapConfigError("pp.mode", "zbv places uniform chunks in a V; a custom pipeline layout or first/last "
                                 "stage layer counts need Megatron's placement: use `pp.mode` zb")
    if layers % (2 * p):
        raise OverlapConfigError("pp.mode", f"zbv splits the {layers} layers into 2 x {p} equal chunks (a V over {p} "
                                 f"stages): {layers} is not a multiple of {2 * p}")


def v_offset(config, vp_stage, pp_rank) -> int:
    """The first layer (0-based, in the whole model) of chunk ``vp_stage`` on stage ``pp_rank`` in the V."""
    p = config.pipeline_model_parallel_size
    per = config.num_layers // (2 * p)
    return (pp_rank if vp_stage == 0 else 2 * p - 1 - pp_rank) * per


def patch(inst) -> None:
    from megatron.core import parallel_state
    from megatron.core.transformer import transformer_block, transformer_layer

    original_offset = transformer_layer.get_transformer_layer_offset
    original_last = parallel_state.is_pipeline_last_stage

    @functools.wraps(original_offset)
    def get_transformer_layer_offset(config, vp_stage=None, pp_rank=None):
        if vp_stage is None or config.virtual_pipeline_model_parallel_size != 2 or \
                config.pipeline_model_parallel_size < 2:
            return original_offset(config, vp_stage, pp_rank)
        check_config(config)
        if pp_rank is None:
            pp_rank = parallel_state.get_pipeline_model_parallel_rank()
        inst.calls["pp.zbv.offset"] += 1
        return v_offset(config, vp_stage, pp_rank)

    @functools.wraps(original_last)
    def is_pipeline_last_stage(ignore_virtual=True, vp_stage=None):
        if parallel_state.get_virtual_pipeline_model_parallel_world_size() != 2:
            return original_last(ignore_virtual, vp_stage)
        on_stage0 = parallel_state.get_pipeline_model_parallel_rank() == 0
        if ignore_virtual:
            return on_stage0  # the stage holding the model's last layer and the loss
        assert vp_stage is not None, "vp_stage must be passed if virtual pipeline is enabled"
        return on_stage0 and vp_stage == 1

    from megatron.core.pipeline_parallel import utils as pp_utils
    from megatron.core.utils import get_pg_rank

    original_pp_last = pp_utils.is_pp_last_stage

    @functools.wraps(original_pp_last)
    def is_pp_last_stage(pp_group):
        if parallel_state.get_virtual_pipeline_model_parallel_world_size() != 2:
            return original_pp_last(pp_group)
        return get_pg_rank(pp_group) == 0  # with is_vp_last_stage (vp_stage 1): stage 0's chunk 1, the V's end

    for original, ours in ((original_offset, get_transformer_layer_offset), (original_last, is_pipeline_last_stage),
                           (original_pp_last, is_pp_last_stage)):
        _rebind(inst, original, ours)
    _report_losses_on_the_last_stage(inst, parallel_state)
    inst.notice_once("pp-zbv", "pipeline placement: ZB-V (stage s holds virtual stages s and 2p-1-s)")


def _report_losses_on_the_last_stage(inst, parallel_state) -> None:
    """Megatron-LM reduces the loss where ``is_pipeline_last_stage`` says (stage 0 under the V,
    where the loss is computed) but prints it, and writes TensorBoard/W&B, from the last rank
    (``print_rank_last``, ``is_last_rank``), which is on the last stage. ``train_step`` and
    ``evaluate`` are wrapped (where ``train()`` looks them up) so that stage 0's reduced losses
    are sent to the last stage of its pipeline, which returns them as its own, as in stock's
    placement. Without Megatron-LM's training loop (megatron-core only) the user's loop reads
    the losses on stage 0; one notice says so."""
    try:
        from megatron.training import training
    except ImportError:
        inst.notice_once("pp-zbv-loss", "`pp.mode` zbv computes the loss on pipeline stage 0 (the V's end): read it "
                         "there, not on the last stage")
        return
    import torch.distributed as dist

    def relocate(losses):
        """``losses`` on stage 0 (a dict of tensors, or None) -> the same on the last stage."""
        if parallel_state.get_virtual_pipeline_model_parallel_world_size() != 2:
            return losses
        group = parallel_state.get_pipeline_model_parallel_group()
        stage, p = group.rank(), group.size()
        if p < 2 or stage not in (0, p - 1):
            return losses
        if stage == 0:
            payload = [{k: v.detach().cpu() for k, v in (losses or {}).items()}]
            dist.send_object_list(payload, dst=dist.get_global_rank(group, p - 1), group=group)
            inst.calls["pp.zbv.loss_sent"] += 1
            return losses
        payload = [None]
        dist.recv_object_list(payload, src=dist.get_global_rank(group, 0), group=group)
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
        return {k: v.to(device) if device is not None else v for k, v in payload[0].items()}

    original_step, original_eval = training.__dict__["train_step"], training.__dict__["evaluate"]

    @functools.wraps(original_step)
    def train_step(*args, **kwargs):
        out = original_step(*args, **kwargs)
        return (relocate(out[0]), *out[1:])

    @functools.wraps(original_eval)
    def evaluate(*args, **kwargs):
        out = original_eval(*args, **kwargs)
        if out[0] is None:  # the time limit ended the evaluation on every rank
            return out
        return (relocate(out[0]), *out[1:])

    inst.set_attr(training, "train_step", train_step)
    inst.set_attr(training, "evaluate", evaluate)


def _rebind(inst, original, ours) -> None:
    """Put ``ours`` wherever Megatron holds ``original`` under its name: its own module and every
    module that imported it by name (the model builders, Float16Module, the layer specs, the
    training loop), each restored by uninstall."""
    name = original.__name__
    for module_name, module in sorted(sys.modules.items()):
        if module_name.startswith("megatron") and module is not None and module.__dict__.get(name) is original:
            inst.set_attr(module, name, ours)
