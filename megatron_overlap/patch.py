"""All monkey-patches of Megatron live here, behind ``install()`` / ``uninstall()``.

| upstream name (megatron.core.tensor_parallel)                | replaced by       | can go when |
|--------------------------------------------------------------|-------------------|-------------|
| ``layers.linear_with_grad_accumulation_and_async_allreduce`` | ``_column_linear`` | Megatron's ColumnParallelLinear takes a pluggable AG-GEMM |
| (and its re-export ``tensor_parallel.<same name>``)          |                    | |
| ``layers.RowParallelLinear.forward``                         | ``_row_forward``  | Megatron's RowParallelLinear takes a pluggable GEMM-RS |
| ``DotProductAttention.__init__`` / ``.forward`` (``megatron.core.transformer.dot_product_attention``) | ``_attention_init`` / ``_attention_forward`` (``--overlap-cp``) | Megatron's local attention supports CP |

``ColumnParallelLinear._forward_impl`` looks the module-level function up at call time, so
replacing it there reaches every Column layer. RowParallelLinear runs its GEMM and its
reduce-scatter in two calls, so fusing them needs its ``forward``. The classes themselves are
never replaced (layer specs import them by name). Everything that is not an SP layer with
TP > 1 and a trainable weight (frozen weights, MoE experts with explicit communication,
0.19's GTP-sharded weights) goes to the original code untouched.
"""

from __future__ import annotations

import functools
import itertools
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import torch
import torch.distributed as dist

from . import compat
from .comm.rings import split_pieces
from .config import ModelContext, OverlapConfig, check_cp_model, check_model, chunks_per_rank, tp_overlap_applies
from .errors import OverlapConfigError
from .ops.backends import P2PBackend, TPBackend, refuse
from .ops.linear import ColumnParallelSP, PrefetchRegistry, RowParallelSP, TPPlan

logger = logging.getLogger("megatron_overlap")

_LINEAR_FN = "linear_with_grad_accumulation_and_async_allreduce"


def _is_rank_zero() -> bool:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    # Megatron parses its args before torch.distributed starts; torchrun/SLURM set RANK.
    return os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")) == "0"


def _notice(message: str):
    if _is_rank_zero():
        logger.warning("megatron-overlap: %s", message)


@dataclass
class Installation:
    """What is patched, with which config, and the per-run state the patched code needs."""

    config: OverlapConfig
    context: ModelContext
    originals: list = field(default_factory=list)  # (owner, name, original object)
    plans: dict = field(default_factory=dict)
    prefetch: PrefetchRegistry = field(default_factory=PrefetchRegistry)
    noticed: set = field(default_factory=set)
    backend: TPBackend = field(default_factory=P2PBackend)
    tuner: Optional[object] = None  # autotune.PlanTuner when --overlap-autotune / --overlap-plan

    def notice_once(self, key: str, message: str):
        if key not in self.noticed:
            self.noticed.add(key)
            _notice(message)

    def set_attr(self, owner: Any, name: str, value: Any):
        self.originals.append((owner, name, owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)))
        setattr(owner, name, value)

    def plan_for(self, group: dist.ProcessGroup, shard_rows: int, x: torch.Tensor) -> TPPlan:
        """The plan of a layer whose TP group is ``group`` and whose shard has ``shard_rows``
        sequence rows (``x`` is its input); checks the model settings and the backend the first
        time a shape, dtype and device are seen."""
        size = group.size()
        batch = _batch(x)
        key = (id(group), size, shard_rows, batch, x.dtype, x.device)
        plan = self.plans.get(key)
        if plan is None:
            self.backend.check(x)
            check_model(
                self.config,
                ModelContext(tp_size=size, sequence_parallel=True, seq_length=shard_rows * size),
            )
            chunks = chunks_per_rank(self.config, size, shard_rows, batch)
            # chosen chunks are tapered (short first/last); chunks the user set are uniform
            plan = self._make_plan(chunks, not self.config.tp_chunks, self.config.rs_algo, shard_rows)
            self.plans[key] = plan
        return plan

    def tuned(self, plan: TPPlan, kind: str, x: torch.Tensor, weight: torch.Tensor, group, shard_rows: int) -> TPPlan:
        """The plan the autotuner or the plan file gives this linear, once per shape."""
        if self.tuner is None or self.backend.name == "symm-mem":
            return plan
        key = ("tuned", kind, id(group), shard_rows, _batch(x), tuple(weight.shape), x.dtype, x.device)
        if key not in self.plans:
            make = lambda c: self._make_plan(  # noqa: E731
                chunks_per_rank(self.config, group.size(), shard_rows, _batch(x)) if c.chunks == 0 else c.chunks,
                c.taper, "a2a" if self.backend.name == "fused" else c.rs, shard_rows)
            choice = self.tuner.choose(kind, x, weight, group, shard_rows, self.backend, make)
            self.plans[key] = plan if choice is None else make(choice)
        return self.plans[key]

    def _make_plan(self, chunks: int, taper: bool, rs: str, shard_rows: int) -> TPPlan:
        return TPPlan(
            pieces=split_pieces(shard_rows, chunks, self.config.tp_bidirectional, taper=taper),
            rs_algo=rs,
            prefetch=self.prefetch,
            backend=self.backend,
        )


# The one piece of module state: what install() patched, so uninstall() can restore it.
_installation: Optional[Installation] = None


def is_installed() -> bool:
    return _installation is not None


def active_config() -> Optional[OverlapConfig]:
    return _installation.config if _installation is not None else None


def install(args_or_config: Union[OverlapConfig, Any]) -> OverlapConfig:
    """Apply the patches the flags ask for; return the config in force.

    ``args_or_config``: Megatron's parsed args, a namespace holding only the plugin's flags
    (from a parser filled by :func:`add_overlap_args`), or an :class:`OverlapConfig`. Settings
    the args do not carry (TP size, sequence parallelism) are checked when a patched layer
    first runs. Installing again with the same arguments changes nothing (Megatron parses its
    arguments several times per run); with other arguments it replaces the config; with
    overlap off it uninstalls.
    """
    global _installation
    config = OverlapConfig.from_args(args_or_config)
    is_full_megatron_args = hasattr(args_or_config, "tensor_model_parallel_size")
    context = (
        ModelContext.from_megatron_args(args_or_config) if is_full_megatron_args else ModelContext()
    )
    if not config.enabled and not config.trace_dir and not config.cp_enabled and not config.hdp:
        check_cp_model(config, context)  # CP > 1 on the local path needs --overlap-cp
        uninstall()  # nothing to patch, nothing to check: also no Megatron version needed
        return config
    compat.check_megatron_version()
    check_model(config, context)
    check_cp_model(config, context)

    if _installation is not None:
        if _installation.config == config and _installation.context == context:
            return config
        uninstall()
    tp_on = tp_overlap_applies(config, context)
    if config.enabled and not tp_on:
        _notice(
            f"--overlap-tp {config.tp} has nothing to overlap with tensor-parallel size 1; "
            "running stock Megatron"
        )
    cp_on = (config.cp_enabled and (context.cp_size is None or context.cp_size > 1)) or config.hdp
    if not tp_on and not config.trace_dir and not cp_on:
        return config

    if tp_on and config.tp == "auto" and not (config.autotune or config.plan_file) and is_full_megatron_args:
        config = _auto_from_cost_model(config, args_or_config)
        tp_on = config.enabled
    inst = Installation(config=config, context=context)
    if tp_on:
        if config.autotune or config.plan_file:
            from .autotune import PlanTuner, load_plan_file

            inst.tuner = PlanTuner(config.autotune, load_plan_file(config.plan_file) if config.plan_file else None)
        _patch_linears(inst)
    _patch_attention(inst, forward=cp_on)
    if config.trace_dir:
        _patch_train_step(inst)
    _installation = inst
    return config


def _auto_from_cost_model(config: OverlapConfig, args) -> OverlapConfig:
    """``--overlap-tp auto`` with Megatron's args on a GPU the cost model knows: its pick."""
    from .autotune import predicted_choice
    from .ops import symm_mem

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    picked = predicted_choice(args, device, symm_mem.availability()[0])
    if picked is None:
        return config
    best, stock = picked
    speedup = stock.step_ms / best.step_ms
    strategy = best.strategy
    if strategy.name == "megatron":
        _notice("--overlap-tp auto: the cost model predicts stock Megatron fastest here; running stock")
        return config.replace(tp="off")
    _notice(f"--overlap-tp auto: the cost model picks {best.name} ({best.flags}; predicted {speedup:.2f}x over stock)")
    if strategy.name == "symm-mem":
        return config.replace(tp="symm-mem")
    return config.replace(tp="p2p", tp_chunks=strategy.chunks * args.tensor_model_parallel_size, tp_rs=strategy.rs)


def _patch_linears(inst: Installation) -> None:
    if compat.transformer_engine_version() is not None:
        _notice(
            "Transformer Engine is installed: megatron-overlap patches Megatron's local "
            "ColumnParallelLinear/RowParallelLinear only (--transformer-impl local); TE's linears "
            "are left as they are"
        )
    inst.backend = make_backend(resolve_backend(inst.config))
    from megatron.core import tensor_parallel
    from megatron.core.tensor_parallel import layers

    original = layers.__dict__[_LINEAR_FN]
    column = _column_linear(inst, original)
    inst.set_attr(layers, _LINEAR_FN, column)
    if getattr(tensor_parallel, _LINEAR_FN, None) is original:
        inst.set_attr(tensor_parallel, _LINEAR_FN, column)
    inst.set_attr(layers.RowParallelLinear, "forward", _row_forward(inst, layers.RowParallelLinear.__dict__["forward"]))
    _notice(f"TP overlap on ({inst.backend.name}): {' '.join(inst.config.as_flags())}")


def _patch_attention(inst: Installation, forward: bool) -> None:
    """``--overlap-cp`` / ``--hdp`` (``forward``): Megatron's local ``DotProductAttention`` runs
    context-parallel attention when its config has CP > 1 (its own ``__init__`` asserts CP == 1,
    so it runs with CP set to 1 for the duration of the call), or under an HDP ring context;
    layers with CP == 1 keep the stock code. Without them only ``__init__`` is wrapped, and only
    where Megatron would assert: CP > 1 gets an error that names ``--overlap-cp``."""
    from megatron.core.transformer import dot_product_attention as dpa

    cls = dpa.DotProductAttention
    inst.set_attr(cls, "__init__", _attention_init(inst, cls.__dict__["__init__"]))
    if not forward:
        return
    inst.set_attr(cls, "forward", _attention_forward(inst, cls.__dict__["forward"]))
    if compat.transformer_engine_version() is not None:
        _notice("Transformer Engine is installed: --overlap-cp patches Megatron's local attention "
                "only (--transformer-impl local); TE's attention keeps its own context parallelism")
    _notice(f"context-parallel attention on: {' '.join(inst.config.as_flags()[2:])}")


def _attention_init(inst: Installation, original):
    import inspect

    signature = inspect.signature(original)

    @functools.wraps(original)
    def __init__(self, config, *args, **kwargs):
        cp = getattr(config, "context_parallel_size", 1)
        if cp <= 1:
            return original(self, config, *args, **kwargs)
        check_cp_model(inst.config, ModelContext(cp_size=cp, transformer_impl="local"))
        bound = signature.bind(self, config, *args, **kwargs).arguments
        dropout = bound.get("attention_dropout")
        dropout = config.attention_dropout if dropout is None else dropout
        if dropout:
            raise OverlapConfigError(
                "--attention-dropout", f"context-parallel attention (--overlap-cp) runs without attention "
                f"dropout; got {dropout}. Set --attention-dropout 0")
        if getattr(config, "softmax_type", "vanilla") != "vanilla" or getattr(config, "window_size", None):
            raise OverlapConfigError(
                "--overlap-cp", "context-parallel attention supports the vanilla softmax without a sliding "
                f"window; got softmax_type={config.softmax_type!r}, window_size={config.window_size!r}")
        config.context_parallel_size = 1  # Megatron's local attention asserts CP == 1
        try:
            original(self, config, *args, **kwargs)
        finally:
            config.context_parallel_size = cp
        pg = bound.get("pg_collection")
        group = getattr(pg, "cp", None) if pg is not None else None
        if group is None:
            from megatron.core import parallel_state

            group = parallel_state.get_context_parallel_group()
        if group.size() != cp:
            raise OverlapConfigError(
                "--context-parallel-size", f"the context-parallel group has {group.size()} ranks, the config says {cp}")
        from .cp.attention import check_cp_config

        check_cp_config(inst.config.cp, cp, self.num_attention_heads_per_partition,
                        self.num_query_groups_per_partition, inst.config.cp_a2a_size)
        scale = self.softmax_scale
        if config.apply_query_key_layer_scaling:  # stock: scores / coeff, then softmax(x * coeff)
            scale *= self.layer_number
        # "overlap": False waits for each ring block before computing (the demo's baseline only)
        self._overlap_cp = dict(mode=inst.config.cp, group=group, scale=scale, a2a_size=inst.config.cp_a2a_size,
                                overlap=True)

    return __init__


def _attention_forward(inst: Installation, original):
    @functools.wraps(original)
    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None, **kwargs):
        from .cp import context

        ring = context.current()
        if ring is None and inst.config.hdp:
            inst.notice_once(
                "hdp-no-ring",
                "--hdp is on, but this attention runs outside an HDP micro-batch: plain data parallelism, "
                "no HDP. Feed the model through megatron_overlap.hdp.runtime (HdpDataIterator + forward_step, "
                "or forward_backward); pretrain_gpt.py's own iterator is not wrapped automatically")
        if ring is not None:  # --hdp: the micro-batch's own ring (or one rank), packed layout
            if attention_bias is not None:
                raise OverlapConfigError("--hdp", "hybrid data parallelism takes no attention bias")
            from .cp.attention import cp_attention

            scale = self.softmax_scale * (self.layer_number if self.config.apply_query_key_layer_scaling else 1)
            return cp_attention(query, key, value, mode="ring",
                                causal=_is_causal(attn_mask_type or self.attn_mask_type, ring.packed),
                                group=ring.group, ranks=ring.ranks, softmax_scale=scale,
                                packed=ring.packed if ring.packed is not None else packed_seq_params)
        cp = getattr(self, "_overlap_cp", None)
        if cp is None:
            return original(self, query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                            attention_bias=attention_bias, packed_seq_params=packed_seq_params, **kwargs)
        if attention_bias is not None:
            raise OverlapConfigError("--overlap-cp", "context-parallel attention takes no attention bias")
        from .cp.attention import cp_attention

        return cp_attention(query, key, value, mode=cp["mode"], causal=_is_causal(attn_mask_type or self.attn_mask_type, packed_seq_params),
                            group=cp["group"], softmax_scale=cp["scale"], packed=packed_seq_params,
                            a2a_size=cp["a2a_size"], overlap=cp["overlap"])

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
        "--overlap-cp", f"context-parallel attention supports causal and unmasked attention, not {mask_type.name} "
        "(with packed sequences, document boundaries come from cu_seqlens)")


def _patch_train_step(inst: Installation) -> None:
    """``--overlap-trace``: Megatron-LM's ``training.train_step`` (looked up by ``train()`` at
    call time) is wrapped so the chosen iterations are profiled. Without Megatron-LM's
    training loop (megatron-core only), the user's loop calls :class:`trace.StepTracer`."""
    try:
        from megatron.training import training
    except ImportError:
        _notice(
            "--overlap-trace: no Megatron-LM training loop here (megatron.training); wrap your "
            "iterations in megatron_overlap.trace.StepTracer(...).step(i) instead"
        )
        return
    from .trace import StepTracer

    tracer = StepTracer(inst.config.trace_dir, inst.config.trace_iterations)
    original = training.__dict__["train_step"]
    calls = itertools.count()

    @functools.wraps(original)
    def train_step(*args, **kwargs):
        tracer.rank = dist.get_rank() if dist.is_initialized() else 0
        with tracer.step(next(calls)):
            return original(*args, **kwargs)

    inst.set_attr(training, "train_step", train_step)


def resolve_backend(config: OverlapConfig) -> str:
    """``auto`` -> ``symm-mem`` where PyTorch's symmetric memory runs, else ``p2p``. ``fused`` is
    never picked automatically until it has been validated on GPUs (see README)."""
    if config.tp != "auto":
        return config.tp
    from .ops import symm_mem

    return "symm-mem" if symm_mem.availability()[0] else "p2p"


def make_backend(name: str) -> TPBackend:
    """The backend object; refuses (naming --overlap-tp) one that cannot run on this machine."""
    if name == "p2p":
        return P2PBackend()
    if name == "symm-mem":
        from .ops import symm_mem

        ok, why = symm_mem.availability()
        if not ok:
            refuse("symm-mem", why)
        return symm_mem.SymmMemBackend()
    if name == "fused":
        from .ops import fused

        ok, why = fused.availability()
        if not ok:
            refuse("fused", why)
        if fused.interpreting():
            return fused.FusedBackend()  # fixed tile config: interpreter timings mean nothing
        from .kernels.tuning import ConfigChooser

        return fused.FusedBackend(configs=ConfigChooser())
    raise ValueError(f"unknown TP-overlap backend {name!r}")


def uninstall() -> None:
    """Restore every patched Megatron attribute to the exact object it was. Idempotent."""
    global _installation
    inst, _installation = _installation, None
    if inst is None:
        return
    for owner, name, original in reversed(inst.originals):
        setattr(owner, name, original)
    inst.originals.clear()


def _column_linear(inst: Installation, original):
    signature = compat.linear_signature(original)

    @functools.wraps(original)  # also copies the `.warned` attribute Megatron reads back
    def linear(*args, **kwargs):
        call = compat.LinearCall(signature, args, kwargs)
        if call.allreduce_dgrad:
            # Only a Column layer with TP > 1 and sequence parallelism off asks for this.
            size = compat.default_tp_group(call.tp_group).size()
            check_model(inst.config, ModelContext(tp_size=size, sequence_parallel=False))
        if not call.sequence_parallel:
            return original(*args, **kwargs)
        group = compat.default_tp_group(call.tp_group)
        if group is None or group.size() == 1:
            inst.notice_once("tp1", "tensor-parallel size 1: nothing to overlap, stock path")
            return original(*args, **kwargs)
        if call.gtp_remat_size > 1:
            inst.notice_once("gtp", "GTP-sharded weights (gtp_remat_size > 1) run Megatron's stock path")
            return original(*args, **kwargs)
        x = call.input
        plan = inst.tuned(inst.plan_for(group, x.shape[0], x), "column", x, call.weight, group, x.shape[0])
        return ColumnParallelSP.apply(
            x,
            call.weight,
            call.bias,
            call.gradient_accumulation_fusion,
            call.grad_output_buffer,
            call.wgrad_deferral_limit,
            group,
            plan,
        )

    return linear


def _row_forward(inst: Installation, original):
    @functools.wraps(original)
    def forward(self, input_):
        group = self.tp_group
        if (
            group is None
            or group.size() == 1
            or self.explicit_expert_comm
            or not self.weight.requires_grad
        ):
            return original(self, input_)
        if not self.sequence_parallel:
            check_model(inst.config, ModelContext(tp_size=group.size(), sequence_parallel=False))
        if getattr(self, "gtp_remat_size", 1) > 1:
            inst.notice_once("gtp", "GTP-sharded weights (gtp_remat_size > 1) run Megatron's stock path")
            return original(self, input_)
        _check_cpu_offloading(self, input_)
        rows = input_.shape[0] // group.size()
        plan = inst.tuned(inst.plan_for(group, rows, input_), "row", input_, self.weight, group, rows)
        output_ = RowParallelSP.apply(
            input_, self.weight, self.gradient_accumulation_fusion, group, plan
        )
        if not self.skip_bias_add:
            output = (output_ + self.bias) if self.bias is not None else output_
            output_bias = None
        else:
            output = output_
            output_bias = self.bias
        return output, output_bias

    return forward


def _batch(x: torch.Tensor) -> int:
    """Tokens per sequence row: the product of the dims between sequence and features."""
    batch = 1
    for dim in x.shape[1:-1]:
        batch *= dim
    return batch


def _check_cpu_offloading(layer, input_):
    """Megatron's own check in RowParallelLinear.forward, kept on the patched path."""
    context = getattr(layer.config, "_cpu_offloading_context", None)
    if context is None or context.inside_context is not True:
        return
    from megatron.core.tensor_parallel import layers

    if not layers.HAVE_TE:
        assert layer.config.cpu_offloading is False, "CPU Offloading cannot be enabled while TE is not present"
    else:
        input_.activation_offloading = layer.config.cpu_offloading_activations
