"""Rank functions of tests/test_tp_allreduce.py: tensor parallelism without sequence parallelism
(the all-reduce path, ``tp/linear_ar.py``, and the all-reduce fusion)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from .rank_fns import _install, _rel, _run_layer, _tp_group, _use_reference_symm_mem


def _no_sp_layers(tp: int, fusion: bool = False):
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    from megatron_overlap.lab import tiny_gpt

    spec = tiny_gpt.TinyGPT(hidden=96, ffn=200, heads=8, kv_heads=2)
    config = tiny_gpt.transformer_config(spec, tp, sequence_parallel=False, add_bias_linear=True,
                                         gradient_accumulation_fusion=fusion)
    init = torch.nn.init.normal_
    qkv_out = spec.hidden + 2 * spec.kv_heads * (spec.hidden // spec.heads)  # GQA: 8 query heads, 2 KV groups
    return {
        "qkv(column,gqa)": ColumnParallelLinear(spec.hidden, qkv_out, config=config, init_method=init, bias=True),
        "fc1(column,swiglu)": ColumnParallelLinear(spec.hidden, 2 * spec.ffn, config=config, init_method=init,
                                                   bias=True),
        "fc2(row)": RowParallelLinear(spec.ffn, spec.hidden, config=config, init_method=init, bias=True,
                                      input_is_parallel=True, skip_bias_add=False),
    }


def ops_vs_reference(seed: int) -> list:
    """``gemm_ar`` against one GEMM + the stock all-reduce, TP 2 and 4, odd rows, several cuts."""
    from megatron_overlap.comm.rings import split_pieces
    from megatron_overlap.tp.gemm_ar import gemm_ar, gemm_ar_reference

    rows = []
    for size in (2, 4):
        group = _tp_group(size)
        gen = torch.Generator().manual_seed(seed * 1000 + dist.get_rank())
        for chunks, taper in ((1, False), (3, False), (5, True), (27, False)):
            x = torch.randn(27, 3, 50, generator=gen)
            w = torch.randn(40, 50, generator=gen)
            ours, ref = gemm_ar(x, w, group, split_pieces(27, chunks, taper=taper)), gemm_ar_reference(x, w, group)
            rows.append(dict(size=size, chunks=chunks, taper=taper, rel=_rel(ours, ref), equal=torch.equal(ours, ref)))
    return rows


def layer_parity(tp: int, backend: str, seed: int, fusion: bool = False) -> list:
    """Stock Megatron Column/Row linears without SP vs the overlapped ones: output, input grad,
    weight grad (``main_grad`` under gradient-accumulation fusion), bias grad; odd rows (27; 28
    for symm-mem, whose all-reduce is a reduce-scatter and an all-gather)."""
    from megatron_overlap.lab import tiny_gpt

    if backend == "symm-mem":
        _use_reference_symm_mem()
    tiny_gpt.init_parallel(tp, seed=seed)
    layers = _no_sp_layers(tp, fusion)
    gen = torch.Generator().manual_seed(seed * 7 + dist.get_rank())
    rows_s, b = (28 if backend == "symm-mem" else 27), 3
    variants = [["--overlap-tp", backend]]
    if backend == "p2p":
        variants += [["--overlap-tp", "p2p", "--overlap-tp-chunks", str(tp)],
                     ["--overlap-tp", "p2p", "--overlap-tp-chunks", str(2 * tp)]]
    out = []
    for name, layer in layers.items():
        column = "column" in name
        x = torch.randn(rows_s, b, layer.input_size if column else layer.input_size_per_partition, generator=gen)
        dy = torch.randn(rows_s, b, layer.output_size_per_partition if column else layer.output_size, generator=gen)
        _install([])
        stock = _run_layer(layer, x, dy, fusion)
        for flags in variants:
            _install(flags)
            from megatron_overlap.integration.install import find_installation

            ours = _run_layer(layer, x, dy, fusion)
            calls = dict(find_installation().calls)
            for key in stock:
                out.append(dict(layer=name, flags=" ".join(flags), tensor=key, rel=_rel(ours[key], stock[key]),
                                equal=torch.equal(ours[key], stock[key]), calls=calls))
    _install([])
    return out


def gpt_no_sp(tp: int, steps: int, flags: list, **overrides) -> dict:
    """The tiny GPT (SwiGLU, GQA 8/2, RMSNorm) without sequence parallelism, trained ``steps``
    steps under ``flags``: losses, the first step's gradients (``main_grad``), the patched calls.
    Dropout draws from the default generator, seeded the same for every run."""
    from .rank_fns import gpt_losses_and_grads

    torch.manual_seed(1234)
    return gpt_losses_and_grads(tp, steps, flags, False, sequence_parallel=False, **overrides)


def gpt_no_sp_vs_stock(tp: int, steps: int, variants: list, **overrides) -> list:
    """``gpt_no_sp`` of stock and of each variant: per variant the losses' and gradients' worst
    relative difference from stock, whether all are bit-identical, and the calls."""
    stock = gpt_no_sp(tp, steps, [], **overrides)
    out = []
    for flags in variants:
        ours = gpt_no_sp(tp, steps, flags, **overrides)
        grads = {k: _rel(ours["grads"][k], stock["grads"][k]) for k in stock["grads"]}
        out.append(dict(flags=" ".join(flags), losses=ours["losses"], stock_losses=stock["losses"],
                        loss_rel=max(abs(a - b) / abs(b) for a, b in zip(ours["losses"], stock["losses"])),
                        grad_rel=max(grads.values()), worst=max(grads, key=grads.get),
                        equal=ours["losses"] == stock["losses"] and all(
                            torch.equal(ours["grads"][k], stock["grads"][k]) for k in stock["grads"]),
                        calls=ours["calls"]))
    return out


def mlp_link_no_sp(tp: int) -> dict:
    """Megatron's MLP block (GeLU, bias) without SP on the emulated link, stock and ours: bytes per
    fwd+bwd step by op (both all-reduce; the same bytes), and on a slow link the time stock
    spends blocked: the link delays stock's own all-reduces (mappings.py and layers.py call
    ``torch.distributed.all_reduce`` at call time)."""
    import time

    import torch.nn.functional as F
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLP, MLPSubmodules

    from megatron_overlap.lab import tiny_gpt
    from megatron_overlap.lab.emulated_link import EmulatedLink, LinkSpec

    tiny_gpt.init_parallel(tp)
    config = tiny_gpt.transformer_config(tiny_gpt.TinyGPT(), tp, sequence_parallel=False, add_bias_linear=True,
                                         gated_linear_unit=False, activation_func=F.gelu)
    mlp = MLP(config, MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear))
    x = torch.randn(32, 2, 96, requires_grad=True)
    out = {"expected": 2 * int(2 * (tp - 1) / tp * x.nbytes)}  # fc2's forward and fc1's dgrad all-reduce
    variants = (("stock", []), ("ours", ["--overlap-tp", "p2p", "--overlap-tp-chunks", str(2 * tp)]),
                ("sub", ["--overlap-tp", "p2p", "--overlap-tp-sub-batches", "2"]))
    spec = LinkSpec(bandwidth_GBps=0.002, latency_us=0.0)  # ~24 ms per step's bytes at TP=2: far above the compute
    for mode, flags in variants:
        _install(flags)
        with EmulatedLink(LinkSpec(bandwidth_GBps=1e4, latency_us=0.0)) as link:
            y, bias = mlp(x)
            (y + bias).sum().backward()  # warm
            link.spec = spec
            link.reset()
            dist.barrier()
            t0 = time.perf_counter()
            y, bias = mlp(x)
            (y + bias).sum().backward()
            step = time.perf_counter() - t0
            stats = link.reset()
        out[mode] = dict(bytes=stats.total_bytes, by_op=dict(stats.bytes_by_op), calls=dict(stats.calls_by_op),
                         blocked_s=stats.blocked_s, step_s=step, transfer_s=stats.total_bytes / (spec.bandwidth_GBps * 1e9))
    _install([])
    return out
