"""What the rank functions of every area share (``tests/*_rank_fns.py``): relative error, the
TP-like subgroups (made once per process), installing the plugin from flags, the tiny GPT's three
Megatron linears and one forward and backward through one of them, and the reference
symmetric-memory ops swapped in for a block and put back after it."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """``|a - b| / |b|`` in float64 (``|a - b|`` where b is zero)."""
    denom = b.double().norm().item()
    diff = (a.double() - b.double()).norm().item()
    return diff / denom if denom else diff


GROUPS: dict = {}  # process groups by key, made once per process (gloo groups are never freed)


def tp_group(size: int):
    """A TP-like subgroup of ``size`` consecutive ranks containing this rank (all ranks call
    new_group for every group, as torch requires)."""
    if size in GROUPS:  # created once per process: gloo groups are never freed
        return GROUPS[size]
    world, rank = dist.get_world_size(), dist.get_rank()
    mine = None
    for start in range(0, world, size):
        group = dist.new_group(list(range(start, start + size)))
        if start <= rank < start + size:
            mine = group
    GROUPS[size] = mine
    return mine


def install(flags: list[str]):
    """Stock Megatron (no flags) or the plugin installed from ``flags``, replacing what was installed."""
    import megatron_overlap

    megatron_overlap.uninstall()
    if flags:
        megatron_overlap.install(megatron_overlap.overlap_parser().parse_args(flags))


def tiny_layers(tp: int, fusion: bool, defer: bool = False, dtype=torch.float32):
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    from megatron_overlap.lab import tiny_gpt

    spec = tiny_gpt.TinyGPT(hidden=96, ffn=200, heads=8, kv_heads=2)
    overrides = dict(add_bias_linear=True, gradient_accumulation_fusion=fusion, params_dtype=dtype,
                     bf16=dtype == torch.bfloat16)
    if defer:
        overrides.update(defer_embedding_wgrad_compute=True, wgrad_deferral_limit=0)
    config = tiny_gpt.transformer_config(spec, tp, **overrides)
    init = torch.nn.init.normal_
    head_dim = spec.hidden // spec.heads
    qkv_out = spec.hidden + 2 * spec.kv_heads * head_dim  # GQA: 8 query heads, 2 KV groups
    layers = {
        "qkv(column,gqa)": ColumnParallelLinear(spec.hidden, qkv_out, config=config, init_method=init, bias=True),
        "fc1(column)": ColumnParallelLinear(spec.hidden, spec.ffn, config=config, init_method=init, bias=True),
        "fc2(row)": RowParallelLinear(spec.ffn, spec.hidden, config=config, init_method=init, bias=True,
                                      input_is_parallel=True, skip_bias_add=False),
    }
    return config, layers


def run_layer(layer, x, dy, fusion: bool):
    """fwd+bwd of one layer; returns output and grads (main_grad under fusion, fp32 as DDP's)."""
    x = x.clone().requires_grad_()
    for p in layer.parameters():
        p.grad = None
        if fusion:
            p.main_grad = torch.zeros_like(p, dtype=torch.float32)
            p.grad_added_to_main_grad = False
    out, _ = layer(x)
    out.backward(dy)
    grads = {"output": out.detach().clone(), "input.grad": x.grad.clone()}
    for name, p in layer.named_parameters():
        if fusion and name == "weight":
            grads["weight.main_grad"] = p.main_grad.clone()
            grads["weight.grad_added_to_main_grad"] = torch.tensor(float(p.grad_added_to_main_grad))
        else:
            grads[f"{name}.grad"] = p.grad.clone()
    return grads


@contextlib.contextmanager
def reference_symm_mem():
    """The symm-mem backend's composition on CPU inside the block: PyTorch's fused ops have no CPU
    kernels, so the same two ops are computed with stock collectives (``ReferenceSymmMemOps``).
    The backend reads both names when it is built (at install): install inside the block. The
    module's own availability check and ops are put back after it, so the rest of the run sees
    the real ones."""
    from megatron_overlap.tp.backends import symm_mem

    from .symm_mem_reference import ReferenceSymmMemOps

    saved = symm_mem.availability, symm_mem.TorchSymmMemOps
    symm_mem.availability = lambda *a, **k: (True, "reference ops (test)")
    symm_mem.TorchSymmMemOps = ReferenceSymmMemOps
    try:
        yield
    finally:
        symm_mem.availability, symm_mem.TorchSymmMemOps = saved


def symm_mem_ops_in_use() -> tuple:
    """The names the symm-mem module holds now: its ops class and availability function."""
    from megatron_overlap.tp.backends import symm_mem

    return symm_mem.TorchSymmMemOps.__name__, symm_mem.availability.__name__
