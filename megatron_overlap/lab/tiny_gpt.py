"""A tiny Llama-style GPT on Megatron's local layer spec, trained on CPU with Megatron's DDP.

Used by the parity tests, the demo and the benchmarks: the same builder and the same training
step serve stock Megatron and the plugin, so the only difference between two runs is whether
``megatron_overlap.install`` was called.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TinyGPT:
    """Model and batch shape. Defaults are odd on purpose (hidden 96, ffn 200, GQA 8/2)."""

    num_layers: int = 2
    hidden: int = 96
    ffn: int = 200
    heads: int = 8
    kv_heads: int = 2
    vocab: int = 512
    seq: int = 64
    micro_batch: int = 2
    swiglu: bool = True
    bias: bool = False
    normalization: str = "RMSNorm"


# Megatron's parallel state per layout (TP, CP, world size), kept after the first init: a
# process that switches layouts (the test pool runs TP=2, TP=4, CP=2, ... over and over) would
# otherwise create a fresh set of process groups each time, and gloo groups are never freed
# (threads and sockets pile up until everything slows down).
_LAYOUTS: dict = {}


def _state_names(parallel_state) -> list:
    return [n for n in vars(parallel_state) if n.startswith("_") and n[1:2].isupper()]


def init_parallel(tp: int, seed: int = 1234, cp: int = 1, pp: int = 1, timeout_minutes: float = None) -> None:
    """(Re)initialise Megatron's parallel state with TP=tp, CP=cp, PP=pp, DP=world/(tp*cp*pp),
    and seed its RNGs. A layout seen before in this process gets its groups back instead of new
    ones. ``timeout_minutes``: the groups' timeout (Megatron's ``distributed_timeout_minutes``)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    key = (tp, cp, pp, dist.get_world_size())
    if key in _LAYOUTS:
        for name, value in _LAYOUTS[key].items():
            setattr(parallel_state, name, value)
    else:
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        kw = {} if timeout_minutes is None else {"distributed_timeout_minutes": timeout_minutes}
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, context_parallel_size=cp,
                                                 pipeline_model_parallel_size=pp, **kw)
        _LAYOUTS[key] = {name: getattr(parallel_state, name) for name in _state_names(parallel_state)}
    model_parallel_cuda_manual_seed(seed)


class _SPNorm:
    """Megatron's torch norm built with sequence parallelism off (it refuses SP, because apex's
    norm is the SP one) and its params marked ``sequence_parallel`` so their grads are
    all-reduced over TP like apex's would be (the plugin's own builder, used as a layer spec)."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **kwargs):
        from megatron.core.transformer.torch_norm import WrappedTorchNorm

        from ..integration.norms import original_new, sequence_parallel_new

        build = sequence_parallel_new(original_new(WrappedTorchNorm))
        return build(WrappedTorchNorm, config, hidden_size, eps, **kwargs)


def transformer_config(spec: TinyGPT, tp: int, sequence_parallel: bool = True, **overrides):
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    values = dict(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden,
        ffn_hidden_size=spec.ffn,
        num_attention_heads=spec.heads,
        num_query_groups=spec.kv_heads,
        tensor_model_parallel_size=tp,
        sequence_parallel=sequence_parallel and tp > 1,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        add_bias_linear=spec.bias,
        gated_linear_unit=spec.swiglu,
        activation_func=F.silu if spec.swiglu else F.gelu,
        normalization=spec.normalization,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
    )
    values.update(overrides)
    return TransformerConfig(**values)


def build(spec: TinyGPT, tp: int, sequence_parallel: bool = True, **config_overrides):
    """A GPTModel on the local spec (Megatron's own Column/RowParallelLinear); with
    ``pipeline_model_parallel_size`` > 1 in the overrides, this rank's stage of it."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    config = transformer_config(spec, tp, sequence_parallel, **config_overrides)
    pp = config.pipeline_model_parallel_size
    layer = get_gpt_layer_local_spec(normalization=spec.normalization)
    layer.submodules.input_layernorm = _SPNorm
    layer.submodules.pre_mlp_layernorm = _SPNorm
    block = TransformerBlockSubmodules(layer_specs=[layer] * (spec.num_layers // pp), layer_norm=_SPNorm)
    return GPTModel(
        config=config,
        transformer_layer_spec=block,
        vocab_size=spec.vocab,
        max_sequence_length=spec.seq,
        position_embedding_type="rope",
        share_embeddings_and_output_weights=False,
        pre_process=parallel_state.is_pipeline_first_stage() if pp > 1 else True,
        post_process=parallel_state.is_pipeline_last_stage() if pp > 1 else True,
    )


def wrap_ddp(model, overlap_grad_reduce: bool, bucket_size: Optional[int] = 4096, distributed_optimizer: bool = False):
    """Megatron's DistributedDataParallel around ``model`` (fp32 grads in ``main_grad``);
    ``distributed_optimizer``: its buffers for Megatron's distributed optimizer, with the
    parameter all-gather overlapped with the next forward (``overlap_param_gather``)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=overlap_grad_reduce,
        use_distributed_optimizer=distributed_optimizer,
        overlap_param_gather=distributed_optimizer and overlap_grad_reduce,
        bucket_size=bucket_size,
    )
    return DistributedDataParallel(model.config, ddp_config, model)


def batch(spec: TinyGPT, step: int, seed: int = 7):
    """A deterministic synthetic batch for this data-parallel rank (its context-parallel share of
    it under CP): tokens follow a noisy affine rule so the loss has something to learn."""
    from megatron.core import parallel_state

    dp_rank = parallel_state.get_data_parallel_rank()
    gen = torch.Generator().manual_seed(seed * 100003 + step * 101 + dp_rank)
    start = torch.randint(0, spec.vocab, (spec.micro_batch, 1), generator=gen)
    stride = 1 + start % 2  # next = previous + 1 or + 2 (the parity of the first token says which)
    pos = torch.arange(spec.seq + 1)
    seq = (start + stride * pos) % spec.vocab
    noise = torch.rand(seq.shape, generator=gen) < 0.1
    seq = torch.where(noise, torch.randint(0, spec.vocab, seq.shape, generator=gen), seq)
    tokens, labels = seq[:, :-1].contiguous(), seq[:, 1:].contiguous()
    position_ids = pos[:-1].unsqueeze(0).expand(spec.micro_batch, -1).contiguous()
    mask = torch.triu(torch.ones(1, 1, spec.seq, spec.seq, dtype=torch.bool), diagonal=1)
    if parallel_state.get_context_parallel_world_size() > 1:
        # Megatron's own zigzag slicing (chunks i and 2*CP-1-i of every sequence)
        import inspect

        from megatron.core.utils import get_batch_on_this_cp_rank

        extra = {"is_hybrid_cp": False} if "is_hybrid_cp" in inspect.signature(get_batch_on_this_cp_rank).parameters \
            else {}  # megatron-core 0.19 asks whether its own hybrid CP runs
        sliced = get_batch_on_this_cp_rank(
            {"tokens": tokens, "labels": labels, "position_ids": position_ids, "attention_mask": mask}, **extra
        )
        tokens, labels, position_ids, mask = (sliced[k] for k in ("tokens", "labels", "position_ids", "attention_mask"))
    return tokens, labels, position_ids, mask


def train_step(ddp_model, spec: TinyGPT, step: int, lr: float = 1e-2) -> float:
    """One step: forward, per-token loss averaged over the global batch, backward, Megatron's
    ``finalize_model_grads`` (DDP's grad sync, then the gradients of ``sequence_parallel``
    parameters, the norms', summed over TP, as Megatron-LM's loop does), plain SGD on
    ``main_grad``. Returns the global mean loss."""
    from megatron.core import parallel_state
    from megatron.core.distributed import finalize_model_grads

    tokens, labels, position_ids, mask = batch(spec, step)
    ddp_model.zero_grad_buffer()
    losses = ddp_model(tokens, position_ids, mask, labels=labels)  # [b, s] per-token losses
    loss = losses.float().mean()
    # DDP averages grads over DP; the loss is a mean per rank, so the result is the global mean.
    loss.backward()
    finalize_model_grads([ddp_model])
    with torch.no_grad():
        for param in ddp_model.module.parameters():
            param.add_(param.main_grad, alpha=-lr)
    reported = loss.detach().clone()
    group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    dist.all_reduce(reported, group=group)
    return reported.item() / dist.get_world_size(group)


def train(spec: TinyGPT, tp: int, steps: int, overlap_grad_reduce: bool = False,
          on_step: Optional[Callable[[int, float], None]] = None, cp: int = 1, **config_overrides) -> list[float]:
    """Build, wrap in DDP and train ``steps`` steps; the losses, identical on every rank."""
    init_parallel(tp, cp=cp)
    if cp > 1:
        config_overrides.setdefault("context_parallel_size", cp)
    model = build(spec, tp, **config_overrides)
    ddp_model = wrap_ddp(model, overlap_grad_reduce)
    losses = []
    for step in range(steps):
        losses.append(train_step(ddp_model, spec, step))
        if on_step is not None:
            on_step(step, losses[-1])
    return losses
