"""Rank functions of tests/test_tp_allreduce.py: tensor parallelism without sequence parallelism
(the all-reduce path, ``tp/linear_ar.py``, and the all-reduce fusion)."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from .rank_helpers import install, reference_symm_mem, rel, run_layer, tp_group


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
        group = tp_group(size)
        gen = torch.Generator().manual_seed(seed * 1000 + dist.get_rank())
        for chunks, taper in ((1, False), (3, False), (5, True), (27, False)):
            x = torch.randn(27, 3, 50, generator=gen)
            w = torch.randn(40, 50, generator=gen)
            ours, ref = gemm_ar(x, w, group, split_pieces(27, chunks, taper=taper)), gemm_ar_reference(x, w, group)
            rows.append(dict(size=size, chunks=chunks, taper=taper, rel=rel(ours, ref), equal=torch.equal(ours, ref)))
    return rows


def layer_parity(tp: int, backend: str, seed: int, fusion: bool = False) -> list:
    """Stock Megatron Column/Row linears without SP vs the overlapped ones: output, input grad,
    weight grad (``main_grad`` under gradient-accumulation fusion), bias grad; odd rows (27; 28
    for symm-mem, whose all-reduce is a reduce-scatter and an all-gather; its composition with the
    reference ops, put back after)."""
    with reference_symm_mem() if backend == "symm-mem" else contextlib.nullcontext():
        return _layer_parity(tp, backend, seed, fusion)


def _layer_parity(tp: int, backend: str, seed: int, fusion: bool) -> list:
    from megatron_overlap.lab import tiny_gpt

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
        install([])
        stock = run_layer(layer, x, dy, fusion)
        for flags in variants:
            install(flags)
            from megatron_overlap.integration.install import find_installation

            ours = run_layer(layer, x, dy, fusion)
            calls = dict(find_installation().calls)
            for key in stock:
                out.append(dict(layer=name, flags=" ".join(flags), tensor=key, rel=rel(ours[key], stock[key]),
                                equal=torch.equal(ours[key], stock[key]), calls=calls))
    install([])
    return out


def gpt_no_sp(tp: int, steps: int, flags: list, **overrides) -> dict:
    """The tiny GPT (SwiGLU, GQA 8/2, RMSNorm) without sequence parallelism, trained ``steps``
    steps under ``flags``: losses, the first step's gradients (``main_grad``), the patched calls.
    Dropout draws from the default generator, seeded the same for every run."""
    from .gpt_rank_fns import gpt_losses_and_grads

    torch.manual_seed(1234)
    return gpt_losses_and_grads(tp, steps, flags, False, sequence_parallel=False, **overrides)


def gpt_no_sp_vs_stock(tp: int, steps: int, variants: list, **overrides) -> list:
    """``gpt_no_sp`` of stock and of each variant: per variant the losses' and gradients' worst
    relative difference from stock, whether all are bit-identical, and the calls. A variant with
    ``symm-mem`` runs its composition with stock collectives (``rank_helpers.reference_symm_mem``)."""
    with reference_symm_mem() if any("symm-mem" in flags for flags in variants) else contextlib.nullcontext():
        return _gpt_no_sp_vs_stock(tp, steps, variants, **overrides)


def _gpt_no_sp_vs_stock(tp: int, steps: int, variants: list, **overrides) -> list:
    stock = gpt_no_sp(tp, steps, [], **overrides)
    out = []
    for flags in variants:
        ours = gpt_no_sp(tp, steps, flags, **overrides)
        grads = {k: rel(ours["grads"][k], stock["grads"][k]) for k in stock["grads"]}
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
        install(flags)
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
    install([])
    return out


def fusion_op_vs_reference(seed: int, p: float = 0.1) -> list:
    """``RowAllReduceBDA`` (reduce-scatter, bias + dropout + residual on the shard, all-gather)
    against stock's ops: ``residual + F.dropout(AR(x @ w^T) + bias)``, forward and backward
    (``autograd`` through the stock ops), from the same generator state; and that state after
    both (the fused op draws what stock draws). Every rank of the group must hold the same
    residual and gradient (replicated, as without SP)."""
    import torch.nn.functional as F

    from megatron_overlap.comm.rings import split_pieces
    from megatron_overlap.tp.allreduce_fusion import RowAllReduceBDA
    from megatron_overlap.tp.backends.p2p import P2PBackend
    from megatron_overlap.tp.linear import TPComm, WgradOptions
    from megatron_overlap.tp.linear_plan import TPPlan

    out = []
    for size in (2, 4):
        group = tp_group(size)
        lead = dist.get_process_group_ranks(group)[0]
        shared = torch.Generator().manual_seed(seed + lead)  # replicated tensors: the same on the group
        mine = torch.Generator().manual_seed(seed * 31 + dist.get_rank())
        s, b, k, n = 7, 3, 20, 24  # 7 rows per rank: odd
        x = torch.randn(s * size, b, k, generator=mine)
        w = torch.randn(n, k, generator=mine)
        bias, residual = torch.randn(n, generator=shared), torch.randn(s * size, b, n, generator=shared)
        dy = torch.randn(s * size, b, n, generator=shared)
        for chunks in (1, 3):
            comm = TPComm(group, TPPlan(pieces=split_pieces(s, chunks)), P2PBackend())
            leaves = [t.clone().requires_grad_() for t in (x, w, bias, residual)]
            torch.manual_seed(seed)
            ref = leaves[3] + F.dropout(_ReduceRef.apply(leaves[0], leaves[1], group) + leaves[2], p=p, training=True)
            ref.backward(dy)
            after_ref = torch.rand(1).item()
            ours_leaves = [t.clone().requires_grad_() for t in (x, w, bias, residual)]
            torch.manual_seed(seed)
            ours = RowAllReduceBDA.apply(*ours_leaves, p, True, WgradOptions(), comm, None)
            ours.backward(dy)
            after_ours = torch.rand(1).item()
            row = dict(size=size, chunks=chunks, rng_same=after_ref == after_ours, out_rel=rel(ours, ref),
                       out_equal=torch.equal(ours, ref))
            for name, a, c in zip(("x", "w", "bias", "residual"), ours_leaves, leaves):
                row[f"{name}_rel"], row[f"{name}_equal"] = rel(a.grad, c.grad), torch.equal(a.grad, c.grad)
            out.append(row)
    return out


class _ReduceRef(torch.autograd.Function):
    """Stock's Row linear without SP: GEMM then the all-reduce; backward the identity's."""

    @staticmethod
    def forward(ctx, x, w, group):
        from megatron_overlap.tp.gemm_ar import gemm_ar_reference

        ctx.save_for_backward(x, w)
        return gemm_ar_reference(x, w, group)

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        g2, x2 = grad.reshape(-1, grad.shape[-1]), x.reshape(-1, x.shape[-1])
        return grad.matmul(w), g2.t().matmul(x2), None


def fusion_reasons(tp: int) -> dict:
    """Why a layer of the tiny GPT (no SP) runs its attention block unfused, for each setting the
    fusion cannot honour (set on the built modules one at a time), and how each ran."""
    from megatron_overlap.integration.allreduce_fusion import stock_reason
    from megatron_overlap.integration.install import find_installation
    from megatron_overlap.lab import tiny_gpt

    tiny_gpt.init_parallel(tp)
    layer = tiny_gpt.build(tiny_gpt.TinyGPT(), tp, sequence_parallel=False, hidden_dropout=0.1).decoder.layers[0]
    out = {}
    install(["--overlap-tp", "p2p", "--overlap-tp-allreduce-fusion"])
    try:
        inst = find_installation()
        out["plain"] = stock_reason(inst, layer)
        layer.config.bias_dropout_fusion = True
        out["compiled_bda"] = stock_reason(inst, layer)
        layer.eval()
        out["compiled_bda_eval"] = stock_reason(inst, layer)
        layer.train()
        layer.config.bias_dropout_fusion = False
        layer.recompute_pre_mlp_layernorm = True
        out["recompute_norm"] = stock_reason(inst, layer)
        layer.recompute_pre_mlp_layernorm = False
    finally:
        install([])
    install(["--overlap-tp", "p2p", "--overlap-tp-allreduce-fusion", "--overlap-tp-sub-batches", "2"])
    try:
        out["sub_batches"] = stock_reason(find_installation(), layer)
    finally:
        install([])
    tiny_gpt.init_parallel(tp)
    sp_layer = tiny_gpt.build(tiny_gpt.TinyGPT(), tp).decoder.layers[0]
    install(["--overlap-tp", "p2p"])
    try:
        out["sequence_parallel"] = stock_reason(find_installation(), sp_layer)
    finally:
        install([])
    return out


def traced_waits_no_sp(tp: int) -> dict:
    """One fwd+bwd of Megatron's MLP without SP under ``torch.profiler`` with the plugin: the
    all-reduce path's waits are the plugin's marked waits (what ``--overlap-trace`` and
    ``megatron-overlap report`` count as exposed communication), one per all-reduced piece."""
    import torch.nn.functional as F
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLP, MLPSubmodules
    from torch.profiler import profile

    from megatron_overlap.integration.install import find_installation
    from megatron_overlap.lab import tiny_gpt
    from megatron_overlap.trace.markers import WAIT

    tiny_gpt.init_parallel(tp)
    config = tiny_gpt.transformer_config(tiny_gpt.TinyGPT(), tp, sequence_parallel=False, add_bias_linear=True,
                                         gated_linear_unit=False, activation_func=F.gelu)
    mlp = MLP(config, MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear))
    x = torch.randn(32, 2, 96, requires_grad=True)
    install(["--overlap-tp", "p2p", "--overlap-tp-chunks", str(2 * tp)])
    try:
        with profile() as prof:
            y, bias = mlp(x)
            (y + bias).sum().backward()
        plans = list(find_installation().tp.plans().values())
    finally:
        install([])
    return {"waits": sum(1 for e in prof.events() if e.name == WAIT), "pieces": sum(len(p.pieces) for p in plans)}


def autotuned_no_sp(tp: int, cache_dir: str) -> dict:
    """``--overlap-tp-autotune`` without SP: the all-reduce path's piece counts measured per shape on
    the real group (cache keys of kind ``column_ar`` / ``row_ar``), results still stock's."""
    import glob
    import json
    import os

    from megatron_overlap.integration.install import find_installation
    from megatron_overlap.lab import tiny_gpt

    os.environ["MEGATRON_OVERLAP_CACHE"] = f"{cache_dir}/rank{dist.get_rank()}"
    try:
        tiny_gpt.init_parallel(tp)
        layers = _no_sp_layers(tp)
        gen = torch.Generator().manual_seed(3)  # replicated inputs: the same on every rank
        worst, kinds = 0.0, set()
        for name in ("fc1(column,swiglu)", "fc2(row)"):
            layer, column = layers[name], "column" in name
            x = torch.randn(24, 3, layer.input_size if column else layer.input_size_per_partition, generator=gen)
            dy = torch.randn(24, 3, layer.output_size_per_partition if column else layer.output_size, generator=gen)
            install([])
            stock = run_layer(layer, x, dy, False)
            install(["--overlap-tp", "p2p", "--overlap-tp-autotune"])
            ours = run_layer(layer, x, dy, False)
            kinds |= {key[0] for key in find_installation().tp.plans()}
            worst = max(worst, max(rel(ours[k], stock[k]) for k in stock))
        install([])
        entries = []
        for path in glob.glob(f"{cache_dir}/rank{dist.get_rank()}/tp_plans.json"):
            entries = sorted(k.split("|")[0] for k in json.load(open(path)))
        return {"worst": worst, "kinds": sorted(kinds), "entries": entries}
    finally:
        os.environ.pop("MEGATRON_OVERLAP_CACHE", None)


def symm_mem_odd_rows_error(tp: int) -> str:
    """symm-mem without SP on 27 rows (its all-reduce is a reduce-scatter: they must split)."""
    from megatron_overlap.lab import tiny_gpt

    tiny_gpt.init_parallel(tp)
    layer = _no_sp_layers(tp)["fc2(row)"]
    with reference_symm_mem():
        install(["--overlap-tp", "symm-mem"])
        try:
            layer(torch.randn(27, 3, layer.input_size_per_partition))
        except Exception as exc:  # the message is what the test checks
            return f"{type(exc).__name__}: {exc}"
        finally:
            install([])
    return "no error"
