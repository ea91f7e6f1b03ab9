"""What the pipeline executors (``schedules.py``, ``vschedules.py``) need of Megatron's state
around a schedule call: the distributed optimizer's first parameter all-gather, DDP's
``no_sync``, the process groups ``finalize_model_grads`` takes, and the model settings the
executors refuse."""

from __future__ import annotations

import contextlib

from ..errors import OverlapConfigError, render


def dispatch_param_gather(model) -> bool:
    """The first parameter bucket's all-gather, dispatched as the step begins (module docstring):
    only where Megatron's DDP would otherwise leave it to the first forward's hook (distributed
    optimizer with ``overlap_param_gather``, not aligned, not overlapped with the optimizer step)
    and only while those hooks are registered. Megatron-LM's loop removes them for the first
    iteration, around every evaluation and checkpoint save (``disable_forward_pre_hook``, the
    parameters then gathered synchronously): a gather dispatched then would have no hook to wait
    for it, and the next step's dispatch would find it still in flight."""
    if not getattr(model, "use_forward_hook", False) or not getattr(model, "remove_forward_pre_hook_handles", None):
        return False
    ddp_config = getattr(model, "ddp_config", None)
    if ddp_config is None or getattr(ddp_config, "align_param_gather", False) or \
            getattr(model, "overlap_param_gather_with_optimizer_step", False):
        return False
    groups = getattr(model, "bucket_groups", None)
    if not groups or groups[-1].param_gather_dispatched:
        return False
    if getattr(groups[-1], "param_gather_handle", None) is not None:
        raise RuntimeError(render(
            "megatron-overlap `pp.mode`: the distributed optimizer's parameter all-gather of the first layers is "
            "still in flight from an earlier step that no forward pre-hook waited for (Megatron DDP's state is not "
            "what the schedule expects: hooks switched off and on outside Megatron-LM's loop?). Re-enable the "
            "hooks with `model.enable_forward_pre_hook()` only after the gathers finished, or drop "
            "`megatron.overlap_param_gather`, or run Megatron's own schedule (`pp.mode` megatron)"))
    groups[-1].start_param_sync()
    return True


def timed_out(exc: BaseException) -> bool:
    """gloo says "Timed out", NCCL's watchdog "Timeout"."""
    text = str(exc).lower()
    return "timed out" in text or "timeout" in text


class GradSync:
    """Megatron's ``no_sync`` around every backward but the last micro-batch's."""

    def __init__(self, config):
        self.func = config.no_sync_func or contextlib.nullcontext
        self.context = None

    def disable(self):
        if self.context is None:
            self.context = self.func()
            self.context.__enter__()

    def enable(self):
        if self.context is not None:
            self.context.__exit__(None, None, None)
            self.context = None


def single(x, name):
    if isinstance(x, list):
        if len(x) != 1:
            raise OverlapConfigError("pp.mode", f"runs non-interleaved pipelines: {name} must be one chunk, got {len(x)}")
        return x[0]
    return x


def refuse_unsupported(config, rows_known: bool = False) -> None:
    """``rows_known``: the micro-batches' lengths vary and the HDP loop gave them (module docstring)."""
    if config.variable_seq_lengths and not rows_known:
        raise OverlapConfigError("pp.mode", "sends shapes known before the step between stages (fixed, or under "
                                 "`hdp.enabled` each micro-batch's planned rows); `megatron.variable_seq_lengths` "
                                 "needs Megatron's own schedule (`pp.mode` megatron)")
    if config.num_microbatches_with_partial_activation_checkpoints is not None:
        raise OverlapConfigError("pp.mode", "does not run Megatron's partial activation checkpointing "
                                 "(`megatron.num_layers_per_virtual_pipeline_stage` aside, "
                                 "`megatron.num_microbatches_with_partial_activation_checkpoints`): unset it or use "
                                 "`pp.mode` megatron")
    if getattr(config, "fine_grained_activation_offloading", False):
        raise OverlapConfigError("pp.mode", "does not run with fine-grained activation offloading; use `pp.mode` megatron")


def default_collection(run):
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection

    pgc = ProcessGroupCollection()
    pgc.tp, pgc.pp, pgc.cp = run.tp_group, run.pp_group, run.cp_group
    pgc.embd = parallel_state.get_embedding_group(check_initialized=False)
    pgc.pos_embd = parallel_state.get_position_embedding_group(check_initialized=False)
    pgc.dp_cp = parallel_state.get_data_parallel_group(with_context_parallel=True, partial_data_parallel=False)
    return pgc
