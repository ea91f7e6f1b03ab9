"""``install()`` / ``uninstall()``: every monkey-patch of Megatron is applied and undone here.

| upstream name                                                   | replaced in          | can go when |
|-----------------------------------------------------------------|----------------------|-------------|
| ``tensor_parallel.layers.linear_with_grad_accumulation_and_async_allreduce`` (and its re-export ``tensor_parallel.<same name>``) | ``linears.py`` (Column -> ``tp``: + SP ``linear.py``, without SP ``linear_ar.py``) | Megatron's ColumnParallelLinear takes a pluggable AG-GEMM and dgrad all-reduce |
| ``tensor_parallel.layers.RowParallelLinear.forward``            | ``linears.py`` (Row -> ``tp``: + SP ``linear.py``, without SP ``linear_ar.py``) | Megatron's RowParallelLinear takes a pluggable GEMM-RS / GEMM-AR |
| ``transformer.dot_product_attention.DotProductAttention.__init__`` / ``.forward`` | ``attention.py`` (``--overlap-cp``, ``--overlap-hdp`` -> ``cp``) | Megatron's local attention supports CP |
| ``distributed.param_and_grad_buffer._ParamAndGradBucketGroup.register_grad_ready`` | ``ddp.py`` (TP overlap: a parameter is ready once its held-back wgrad GEMM ran) | Megatron's DDP learns of wgrads computed after the backward hook |
| ``tensor_parallel.mappings._ReduceScatterToSequenceParallelRegion.backward`` | ``embedding_grad.py`` (TP overlap: the embedding's grad all-gather travels while the held-back wgrads run) | Megatron's SP region runs caller work during its gather |
| ``megatron.training.training.train_step``                       | ``training.py`` (``--overlap-trace``) | Megatron-LM's loop takes a profiler hook |
| ``transformer.torch_norm.WrappedTorchNorm.__new__``            | ``norms.py`` (no apex: the torch norm under sequence parallelism, its params marked ``sequence_parallel``) | Megatron's torch norm accepts sequence parallelism |
| ``megatron.training.training.get_forward_backward_func`` (``--overlap-hdp``)  | ``hdp_loop.py`` (each schedule call runs as an HDP step: the script's batches cut into documents, planned, its forward step in the ring context) | Megatron-LM's loop takes a pluggable data planner |
| ``tensor_parallel.random.CheckpointFunction.forward``, ``CheckpointWithoutOutput.checkpoint`` (``--overlap-hdp``) | ``hdp.py`` (the function saved for recomputation runs in the HDP ring of its forward) | Megatron's checkpoints carry the caller's context |
| ``parallel_state.initialize_model_parallel`` (``--overlap-hdp``) | ``hdp.py`` (HDP's own communicator over the data-parallel ranks made right after Megatron's groups) | Megatron makes a group for a plugin's traffic |
| ``get_batch_on_this_tp_rank`` (core_v0.16 ``megatron.training.utils``, 0.19 ``megatron.core.utils``, and every module that bound it by name, the script's ``__main__`` included; ``--overlap-hdp``) | ``hdp_loop.py`` (during an HDP step each TP rank reads its own copy of the planned micro-batch instead of a fixed-shape broadcast) | Megatron-LM's get_batch broadcasts variable shapes |
| ``transformer.mlp.MLP.forward``, ``transformer.attention.Attention.forward``, ``DotProductAttention.forward`` (``--overlap-tp-sub-batches`` > 1) | ``sub_batches.py`` (the blocks cut into row parts) | Megatron's layers take a sub-batch schedule |
| ``transformer.transformer_layer.TransformerLayer._forward_attention``, ``._forward_pre_mlp_layernorm`` (``--overlap-tp-allreduce-fusion``, no sequence parallelism) | ``allreduce_fusion.py`` (the attention output's all-reduce + bias-dropout-add as reduce-scatter, shard-wise work, all-gather into the pre-MLP norm and fc1) | Megatron's layer fuses its all-reduce with the bias-dropout-add |
| ``pipeline_parallel.get_forward_backward_func`` (also in ``pipeline_parallel.schedules`` and ``megatron.training.training``, which bind it by name) | ``schedules.py`` (``--overlap-pp`` -> ``pp``) | Megatron takes a pluggable pipeline schedule |
| ``distributed.DistributedDataParallel.__init__``, ``distributed.param_and_grad_buffer._ParamAndGradBuffer.__init__`` (``--overlap-pp`` 1f1b / zb / zbv with ``--overlap-pp-buckets every-chunk``; it changes virtual pipelines only) | ``ddp.py`` (DDP buckets on every stage and model chunk) | Megatron's DDP buckets every stage and chunk of an interleaved pipeline |
| ``transformer.transformer_layer.get_transformer_layer_offset``, ``parallel_state.is_pipeline_last_stage``, ``pipeline_parallel.utils.is_pp_last_stage`` (wherever bound by name), ``megatron.training.training.train_step`` and ``evaluate`` (``--overlap-pp zbv``) | ``vplacement.py`` (the V's layer offsets and last stage; stage 0's losses sent to the last rank) | Megatron builds a V placement and logs from the stage that computed the loss |

The linears' function is also patched, without TP overlap, under ``--overlap-pp zb`` at TP = 1 (weight
gradients deferred to W). ``ColumnParallelLinear._forward_impl`` looks the module-level function up at call time, so
replacing it there reaches every Column layer. RowParallelLinear runs its GEMM and its
reduce-scatter in two calls, so fusing them needs its ``forward``. The classes themselves are
never replaced (layer specs import them by name).

No module state: ``install()`` returns the :class:`Installation` it made, and each object it
puts into Megatron carries that installation (``MARK``), so ``uninstall()`` and
``find_installation()`` read what is installed off Megatron itself.
"""

from __future__ import annotations

import collections
import logging
import math
import os
import sys
from typing import Any, Optional, Union

from ..config import ModelContext, OverlapConfig
from ..errors import OverlapConfigError
from ..cp.checks import check_cp_model
from ..cp.ring import RingOptions
from ..pp.checks import pp_schedule_applies
from ..tp.checks import tp_overlap_applies
from ..tp.sub_batch import ScratchPool
from . import compat

logger = logging.getLogger("megatron_overlap")

MARK = "__megatron_overlap__"

# Where the patches above live: (module, attribute path). find_installation() looks here.
PATCH_POINTS = (
    ("megatron.core.tensor_parallel.layers", "linear_with_grad_accumulation_and_async_allreduce"),
    ("megatron.core.tensor_parallel.layers", "RowParallelLinear.forward"),
    ("megatron.core.transformer.dot_product_attention", "DotProductAttention.__init__"),
    ("megatron.core.transformer.dot_product_attention", "DotProductAttention.forward"),
    ("megatron.core.distributed.param_and_grad_buffer", "_ParamAndGradBucketGroup.register_grad_ready"),
    ("megatron.training.training", "train_step"),
    ("megatron.core.pipeline_parallel.schedules", "get_forward_backward_func"),
    ("megatron.training.training", "get_forward_backward_func"),
)  # (norms.py's WrappedTorchNorm.__new__ is never patched alone, and a class hands back the bare function)


def _is_rank_zero() -> bool:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    # Megatron parses its args before torch.distributed starts; torchrun/SLURM set RANK.
    return os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")) == "0"


def notice(message: str) -> None:
    """One line on rank 0's log (backticked config fields become flags, as in errors)."""
    from ..errors import render

    if _is_rank_zero():
        logger.warning("megatron-overlap: %s", render(message))


class Installation:
    """What one ``install()`` patched, with which config, and the per-run state the patched code
    needs: the TP planner (``tp``), the wgrad-input prefetch registry, the ring options of CP
    attention (``RingOptions(overlap=False)``: every transfer waited, the benchmarks' baseline),
    the notices already given and the shapes already checked."""

    def __init__(self, config: OverlapConfig, context: ModelContext, requested: Optional[OverlapConfig] = None,
                 ring_options: Optional[RingOptions] = None):
        from ..tp.linear import PrefetchRegistry

        self.config = config  # in force (``auto`` resolved)
        self.requested = requested or config  # as asked (re-installs with the same flags are no-ops)
        self.context = context
        self.ring_options = ring_options or RingOptions()
        self.tp = None  # tp.linear_plan.TPPlanner while TP overlap runs
        self.tp_overlap = False  # whether the linears run TP overlap
        self.keep_single_bucket = False  # Megatron-LM's --overlap-param-gather-with-optimizer-step (ddp.py)
        self.pp_observer = None  # (stage, action, start, end) after each pipeline action (benchmarks)
        # (F, B, W) zb places its weight gradients for (None: all equal); from the cost model at
        # install when it knows the model and GPU (``pp.build.placement_times``)
        self.pp_times = None
        # how often each patched path took over a call (tests and diagnostics: proof it ran)
        self.calls = collections.Counter()
        self.wgrad = None  # tp.wgrad_store.WgradStore while TP overlap runs
        self.prefetch = PrefetchRegistry()
        self.sub_batch = None  # tp.sub_batch.SubBatches while a sub-batched block runs its forward
        # token rows of each micro-batch of the schedule call in flight when they vary (an HDP step,
        # hdp_loop.py): the pipeline executor sends each micro-batch's own shape (schedules.py)
        self.microbatch_rows = None
        self.attention_block = None  # the Attention whose core attention is being cut (sub_batches.py)
        self.projected = None  # (context rows, projection, bias) between a cut core attention and linear_proj
        self.scratch = ScratchPool()  # the sub-batch cut's whole-tensor buffers, reused call to call
        self.fusion = None  # allreduce_fusion.Request while a fused attention block runs (--overlap-tp-allreduce-fusion)
        self.served: dict = {}  # id(norm output) -> (it, fc1 weight, fc1 GEMM output) computed while it was gathered
        self.served_norm = None  # the fused block whose pre-MLP norm was computed ahead (allreduce_fusion.py)
        self.checked: set = set()
        self.sites: dict = {}  # (id(weight), shape) -> "layer 3 linear_fc1 (column, ...)": wait messages (sites.py)
        self._noticed: set = set()
        self._saved: list = []  # (owner, name, original object, ours)
        self.closers: list = []  # called once at uninstall: what a patch started (helper processes)
        self.complete = True  # False once uninstall ran (some patch may be held under a foreign wrapper)

    @property
    def patched(self) -> bool:
        return bool(self._saved)

    def notice_once(self, key: str, message: str) -> None:
        if key not in self._noticed:
            self._noticed.add(key)
            notice(message)

    def set_attr(self, owner: Any, name: str, value: Any) -> None:
        """Replace ``owner.name`` by ``value``, remembering the exact object it was."""
        self._saved.append((owner, name, _get(owner, name), value))
        setattr(value, MARK, self)
        setattr(owner, name, value)

    def uninstall(self) -> list:
        """Restore every patched attribute to the exact object it was. Idempotent. A patch that
        someone else has wrapped (or replaced) since is left in place, with ours under it, and
        said in a warning: restoring the original would drop their wrapper too. Returns those
        (``module.attribute`` names); a later ``uninstall()``, once theirs is gone, restores ours."""
        kept = []
        self.complete = False  # from now on only what another wrapper holds may remain
        closers, self.closers = self.closers, []
        for close in closers:
            close()
        for entry in reversed(self._saved):
            owner, name, original, ours = entry
            if _get(owner, name) is ours:
                setattr(owner, name, original)
            else:
                kept.append(entry)
        self._saved = kept[::-1]
        names = [f"{getattr(o, '__module__', '')}.{getattr(o, '__qualname__', getattr(o, '__name__', o))}.{n}"
                 for o, n, _, _ in self._saved]
        if names:
            logger.warning("megatron-overlap: uninstall left %s in place: another wrapper was put over "
                           "megatron-overlap's patch there after install, and removing ours would remove it too; "
                           "remove that wrapper first, then uninstall again", ", ".join(names))
        return names


def _get(owner: Any, name: str) -> Any:
    """The object at ``owner.name`` itself (a class's own ``__dict__`` entry, not a bound or inherited one)."""
    return owner.__dict__.get(name) if isinstance(owner, type) else getattr(owner, name, None)


def find_installation() -> Optional[Installation]:
    """The installation whose patches are in Megatron now, or None."""
    for module_name, path in PATCH_POINTS:
        obj = sys.modules.get(module_name)
        for part in path.split(".") if obj is not None else ():
            obj = getattr(obj, part, None)
        inst = getattr(obj, MARK, None)
        if inst is not None and inst.patched:
            return inst
    return None


def is_installed() -> bool:
    return find_installation() is not None


def active_config() -> Optional[OverlapConfig]:
    """The config in force, read off the installed patches (None: stock Megatron)."""
    inst = find_installation()
    return inst.config if inst is not None else None


def uninstall() -> list:
    """Restore Megatron exactly as it was before ``install()``. Idempotent. Patches another
    wrapper was put over stay, with a warning (``Installation.uninstall``); their names are
    returned."""
    kept, seen = [], set()
    inst = find_installation()
    while inst is not None and id(inst) not in seen:
        seen.add(id(inst))
        kept += inst.uninstall()
        inst = find_installation()
    return kept


def install(args_or_config: Union[OverlapConfig, Any], ring_options: Optional[RingOptions] = None) -> Installation:
    """Apply the patches the flags ask for; return the :class:`Installation` (``.config`` is the
    config in force).

    ``args_or_config``: Megatron's parsed args, a namespace holding only the plugin's flags
    (from a parser filled by ``add_overlap_args``), or an ``OverlapConfig``. Settings the args do
    not carry (TP size, sequence parallelism) are checked when a patched layer first runs.
    Installing again with the same arguments changes nothing (Megatron parses its arguments
    several times per run); with other arguments it replaces the installation; with nothing
    asked it uninstalls. ``ring_options``: how CP attention's ring runs (the lab's waited-ring
    baseline); default: overlapped.
    """
    config = OverlapConfig.from_args(args_or_config)
    full_args = hasattr(args_or_config, "tensor_model_parallel_size")
    context = ModelContext.from_megatron_args(args_or_config) if full_args else ModelContext()
    if config.stock:
        check_cp_model(config.cp, context)  # CP > 1 on the local path needs --overlap-cp
        uninstall()  # nothing to patch, nothing to check: also no Megatron version needed
        return Installation(config, context)
    compat.check_megatron_version()
    from . import preflight

    preflight.validate(config, context, notice)  # stage 1: the whole config against the model
    if full_args and config.comm.timeout_s is not None:  # on every parse: Megatron parses more than once
        _bound_megatron_groups(args_or_config, config.comm.timeout_s)

    current = find_installation()
    if current is not None:
        if current.complete and (current.requested, current.context, current.ring_options) == (
                config, context, ring_options or RingOptions()):
            return current
        kept = uninstall()
        if kept:
            raise RuntimeError(f"megatron-overlap: cannot install over {', '.join(kept)}: a wrapper put there by "
                               "other code holds the previous installation's patch; remove that wrapper first")
    tp_on = tp_overlap_applies(config.tp, context)
    if config.tp.enabled and not tp_on:
        notice(f"`tp.mode` {config.tp.mode} has nothing to overlap with tensor-parallel size 1; running stock "
               "Megatron")
    cp_on = (config.cp.enabled and (context.cp_size is None or context.cp_size > 1)) or config.hdp.enabled
    pp_on = pp_schedule_applies(config.pp, context)
    if config.pp.enabled and not pp_on:
        notice(f"`pp.mode` {config.pp.mode} has no pipeline to schedule with `megatron.pipeline_model_parallel_size` "
               "1; Megatron's schedule runs")
    if not tp_on and not config.trace.enabled and not cp_on and not pp_on:
        return Installation(config, context)

    requested = config
    config, predicted = _resolve(config, context, args_or_config if full_args else None, tp_on, pp_on)  # stage 2
    inst = Installation(config, context, requested, ring_options)
    if predicted is not None and config.pp.mode == "zb":
        inst.pp_times = predicted["placement"]
        notice(f"`pp.mode` zb: weight gradients placed for F/B/W = {'/'.join(f'{x:g}' for x in inst.pp_times)} "
               f"(the cost model's best placement on {predicted['hardware']})")
    inst.tp_overlap = config.tp.enabled and tp_on
    inst.keep_single_bucket = bool(getattr(args_or_config, "overlap_param_gather_with_optimizer_step", False))
    if full_args and pp_on:
        from .ddp import checkpoint_notice

        said = checkpoint_notice(config.pp, args_or_config)
        if said:
            notice(said)
    _apply(inst, cp_on, pp_on)  # stage 3: the patches
    return inst


def _resolve(config: OverlapConfig, context: ModelContext, args, tp_on: bool, pp_on: bool):
    """Stage 2 of install, after the config was validated: every ``auto`` resolved (TP's backend
    and sub-batches, the pipeline schedule, from the cost model where ``args`` are Megatron's
    full arguments), a pipeline mode that does not apply turned off. (config, the cost model's
    pipeline prediction or None)."""
    from . import linears
    from ..pp.checks import resolve_auto as resolve_pp

    if tp_on:
        config = config.replace(tp=linears.resolve_auto(config.tp, args, notice))
    predicted = None
    if pp_on and config.pp.mode in ("auto", "zb") and args is not None:
        from ..tune.auto import predicted_pp_choice

        predicted = predicted_pp_choice(args, linears._cuda_device_name())
        _drop_unrunnable_zbv(predicted, args)
    config = config.replace(pp=resolve_pp(config.pp, config.tp, context, notice, predicted) if pp_on else
                            config.pp.replace(mode="off", explicit=frozenset()))
    return config, predicted


GROUP_MARGIN_S = 5  # Megatron's own ops time out this long after the plugin's named waits


def _bound_megatron_groups(args, timeout_s: float) -> None:
    """``--overlap-timeout-s`` S bounds Megatron's own collectives too, from the second
    iteration on: Megatron-LM's ``--distributed-timeout-seconds-after-init`` (every process group
    it made gets that timeout once the first iteration has run, so the start, which may wait
    long on one rank building datasets, keeps ``--distributed-timeout-minutes``) becomes
    ceil(S) + ``GROUP_MARGIN_S`` where it was unset or longer. A rank blocked in Megatron's
    broadcast, DDP's reductions or the optimizer's collectives with a silent peer then fails by
    that time, and the plugin's own waits (S) still fail first, naming the peer. A training loop
    without that argument (megatron-core only) keeps its groups' timeout; the notice says which
    applies."""
    after_init = getattr(args, "distributed_timeout_seconds_after_init", "absent")
    bound_s = math.ceil(timeout_s) + GROUP_MARGIN_S
    if after_init == "absent":
        notice(f"`comm.timeout_s` {timeout_s:g} bounds the plugin's own waits; this training loop has no "
               "--distributed-timeout-seconds-after-init, so Megatron's collectives keep the process groups' timeout")
        return
    if after_init is not None and after_init <= bound_s:
        return
    args.distributed_timeout_seconds_after_init = bound_s
    notice(f"`comm.timeout_s` {timeout_s:g}: from the second iteration on, Megatron's process groups time out "
           f"after {bound_s} s (--distributed-timeout-seconds-after-init, was "
           f"{'unset' if after_init is None else after_init}); every rank waiting on a silent peer fails by then")


def _drop_unrunnable_zbv(predicted, args) -> None:
    """``auto`` never picks a ZB-V that would be refused at start: not on a megatron-core whose
    placement is not known to patch safely, nor on layers that do not split into 2p equal chunks."""
    virtual = (predicted or {}).get("virtual")
    if not virtual or "zbv" not in virtual.get("steps_ms", {}):
        return
    from . import vplacement

    p = getattr(args, "pipeline_model_parallel_size", 1) or 1
    try:
        vplacement.check_version(compat.check_megatron_version())
        runnable = getattr(args, "num_layers", 0) % (2 * p) == 0 and not getattr(
            args, "pipeline_model_parallel_layout", None) and getattr(
            args, "decoder_first_pipeline_num_layers", None) is None and getattr(
            args, "decoder_last_pipeline_num_layers", None) is None
    except OverlapConfigError:
        runnable = False
    if not runnable:
        virtual["steps_ms"] = {k: v for k, v in virtual["steps_ms"].items() if k != "zbv"}


def _apply(inst: Installation, cp_on: bool, pp_on: bool) -> None:
    """Patch Megatron for the resolved config; on any failure, nothing stays half-installed."""
    from . import attention, ddp, hdp, hdp_loop, linears, norms, schedules, training

    config = inst.config
    try:
        if inst.tp_overlap or config.pp.split:
            linears.patch(inst)
        if pp_on:
            schedules.patch(inst)
            if config.pp.mode in ("1f1b", "zb", "zbv") and config.pp.buckets == "every-chunk":
                ddp.patch_buckets(inst, inst.keep_single_bucket)
        attention.patch(inst, forward=cp_on)
        norms.patch(inst)
        if config.hdp.enabled:
            hdp.patch_recompute(inst)
            hdp.patch_groups(inst)
            hdp_loop.patch(inst)
        if config.trace.enabled:
            training.patch_train_step(inst)
    except BaseException:
        inst.uninstall()  # nothing half-installed
        raise
