"""Megatron DDP under ``--overlap-pp`` (patch table in ``install.py``).

**Grad-ready registration -> ``tp.wgrad_store``.** With ``overlap_grad_reduce`` DDP starts a
bucket's reduction once every parameter in it has registered its grad as ready, which its
backward hook does right after the linear's backward returned. A linear whose wgrad GEMM waits
in the installation's ``WgradStore`` has not added into ``main_grad`` yet at that moment: its
registration is held back until that GEMM ran (``WgradStore.after``), so no bucket is reduced
before all its gradients are in. Whether the registration counts is decided when the hook
fires (``is_last_microbatch`` then): a split pipeline runs W passes of earlier micro-batches
after the last one's B has turned grad sync on, and those must not register.

**Buckets on every stage and model chunk (virtual pipelines).** Megatron's DDP gives a
pipeline stage other than the first one bucket ("data-parallel communication on these stages
is not on the critical path"), and Megatron-LM's ``get_model`` gives every model chunk after
the first one bucket too (``disable_bucketing``). Under Megatron's interleaved 1F1B that holds:
the first stage's first chunk ends the step. Under our interleaved schedules (``1f1b``, ``zb``,
``zbv``) every stage ends at about the same time, with some chunk's last gradients; one bucket
for that chunk means its whole reduction waits for its last gradient and then runs exposed.
With ``--overlap-pp-buckets every-chunk`` (the default, ``megatron``, keeps Megatron's), while
such a schedule is installed, a DDP built for a virtual pipeline keeps its configured
``bucket_size`` on every stage and for every chunk, and the schedule lets each chunk's buckets
leave as they fill (``vschedules``). The bytes reduced and gathered are the same; only their
cut into collectives changes. Kept as Megatron builds it: non-virtual pipelines, DDP without
``overlap_grad_reduce`` (one bucket by design), ``--overlap-param-gather-with-optimizer-step``
(Megatron-LM asks for one bucket there), and megatron-core versions whose DDP takes a
precomputed parameter layout (0.19+: ``full_param_layout``), where the cut is made before the
DDP sees it (a notice says so). ``checkpoint_notice``: the distributed optimizer's default
checkpoint format follows the buckets.
"""

from __future__ import annotations

import functools
import inspect


def patch(inst) -> None:
    from megatron.core.distributed import param_and_grad_buffer

    cls = param_and_grad_buffer._ParamAndGradBucketGroup
    original = cls.__dict__["register_grad_ready"]
    store = inst.wgrad

    @functools.wraps(original)
    def register_grad_ready(self, param, *args, **kwargs):
        if not self.is_last_microbatch:
            return original(self, param, *args, **kwargs)  # does nothing now, as it would later
        store.after(param, lambda: original(self, param, *args, **kwargs))

    inst.set_attr(cls, "register_grad_ready", register_grad_ready)


def buckets_patchable() -> str:
    """Why this megatron-core's DDP cannot keep buckets on every stage ('' when it can)."""
    from megatron.core.distributed import distributed_data_parallel, param_and_grad_buffer

    ddp = inspect.signature(distributed_data_parallel.DistributedDataParallel.__init__).parameters
    buf = list(inspect.signature(param_and_grad_buffer._ParamAndGradBuffer.__init__).parameters)
    if "full_param_layout" in ddp or "param_layout" in buf:
        return "its DDP takes the distributed optimizer's parameter layout precomputed, with the buckets cut"
    if "disable_bucketing" not in ddp or buf[6:7] != ["bucket_size"]:
        return "its DDP and gradient buffers take other arguments than megatron-core 0.16's"
    return ""


def patch_buckets(inst, keep_single: bool = False) -> None:
    """Keep ``bucket_size`` on every stage and chunk of a virtual pipeline (module docstring);
    ``keep_single``: Megatron-LM's ``--overlap-param-gather-with-optimizer-step`` is on (leave
    Megatron's buckets)."""
    from megatron.core.distributed import distributed_data_parallel, param_and_grad_buffer

    if keep_single:
        inst.notice_once("pp.buckets", "`pp.buckets` every-chunk: Megatron's DDP buckets kept (one per model chunk on "
                                       "stages > 0): --overlap-param-gather-with-optimizer-step asks for one bucket")
        return
    why = buckets_patchable()
    if why:
        inst.notice_once("pp.buckets", "`pp.mode` with virtual pipelines keeps Megatron's DDP buckets (one per model "
                                       f"chunk on stages > 0): megatron-core's {why}")
        return
    ddp_cls = distributed_data_parallel.DistributedDataParallel
    buf_cls = param_and_grad_buffer._ParamAndGradBuffer
    ddp_init, buf_init = ddp_cls.__dict__["__init__"], buf_cls.__dict__["__init__"]
    state = {"on": 0}

    @functools.wraps(ddp_init)
    def ddp_init_everywhere(self, config, ddp_config, module, disable_bucketing=False, *args, **kwargs):
        if (getattr(config, "virtual_pipeline_model_parallel_size", None) or 1) <= 1 or \
                not ddp_config.overlap_grad_reduce:  # one bucket by design there
            return ddp_init(self, config, ddp_config, module, disable_bucketing, *args, **kwargs)
        state["on"] += 1
        try:
            ddp_init(self, config, ddp_config, module, False, *args, **kwargs)
        finally:
            state["on"] -= 1
        inst.calls["pp.buckets_everywhere"] += 1

    @functools.wraps(buf_init)
    def buf_init_everywhere(self, ddp_config, param_dtype, grad_dtype, params, group, bucket_size, *args, **kwargs):
        if state["on"] and bucket_size is None and ddp_config.overlap_grad_reduce:
            bucket_size = ddp_config.bucket_size  # None too without overlap_grad_reduce: one bucket, as stock
        return buf_init(self, ddp_config, param_dtype, grad_dtype, params, group, bucket_size, *args, **kwargs)

    inst.set_attr(ddp_cls, "__init__", ddp_init_everywhere)
    inst.set_attr(buf_cls, "__init__", buf_init_everywhere)


def checkpoint_notice(pp, args) -> str:
    """What to tell a user whose checkpoints follow the buckets (module docstring), or ''."""
    virtual = ((getattr(args, "virtual_pipeline_model_parallel_size", None) or 1) > 1
               or bool(getattr(args, "num_layers_per_virtual_pipeline_stage", None)))  # validated later
    ours = pp.mode in ("1f1b", "zb", "zbv") and pp.buckets == "every-chunk"
    if not (virtual and ours and getattr(args, "use_distributed_optimizer", False)):
        return ""
    if getattr(args, "overlap_param_gather_with_optimizer_step", False):
        return ""
    if not (getattr(args, "load", None) or getattr(args, "save", None)):
        return ""
    if getattr(args, "dist_ckpt_optim_fully_reshardable", False) or getattr(args, "ckpt_format", "") == "fsdp_dtensor":
        return ""
    return ("`pp.buckets` every-chunk: DDP buckets on every stage and model chunk; the distributed optimizer's "
            "checkpointed state follows the buckets (torch_dist's default dp_reshardable, and the legacy torch "
            "format), so a checkpoint saved with Megatron's buckets (without `pp.mode`, or with "
            "`pp.buckets` megatron) resumes only with `pp.buckets` megatron, and one saved now only "
            "with every-chunk (Megatron checks the bucket sizes); --ckpt-format torch_dist with "
            "--dist-ckpt-optim-fully-reshardable saves a layout either can load")
