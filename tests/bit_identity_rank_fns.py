"""Rank functions of tests/test_bit_identical.py: the README's MLP block (``megatron-overlap bench
mlp``'s defaults) stock and overlapped, and the tiny GPT's linears at other chunk counts."""

from __future__ import annotations

import torch
import torch.distributed as dist

from .rank_helpers import install, run_layer, tiny_layers


def readme_mlp_block(seed: int) -> dict:
    """The MLP block of README's headline, as ``megatron-overlap bench mlp`` runs it with its
    defaults (Megatron's MLP, hidden 1024, ffn 4096, seq 2048, fp32, TP=2 + SP, the plugin's chunk
    rule, ring reduce-scatter): one forward and backward stock, one overlapped, from the same
    inputs. Per tensor (output, input grad, every parameter grad) whether the bits are equal and
    the relative difference; the pieces per rank the plugin cut. Ranks 2 and 3 (the other TP
    group) build the block and stop: the two groups would compute the same thing."""
    from megatron_overlap.integration.install import find_installation
    from megatron_overlap.lab.mlp_bench import MLPBench, _build

    cfg = MLPBench(seed=seed)
    mlp = _build(cfg)
    if dist.get_rank() >= cfg.tp:
        return {}
    gen = torch.Generator().manual_seed(seed * 7 + dist.get_rank())
    x = torch.randn(cfg.rows, cfg.micro_batch, cfg.hidden, generator=gen)
    dy = torch.randn(cfg.rows, cfg.micro_batch, cfg.hidden, generator=gen)
    flags = ["--overlap-tp", "p2p", "--overlap-tp-chunks", str(cfg.chunks), "--overlap-tp-rs", cfg.rs]
    runs, pieces = {}, None
    for mode in ("stock", "ours"):
        install(flags if mode == "ours" else [])
        mlp.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_()
        out, bias = mlp(xi)
        (out + bias).backward(dy)
        runs[mode] = {"output": (out + bias).detach(), "input.grad": xi.grad}
        runs[mode].update({f"{name}.grad": p.grad.clone() for name, p in mlp.named_parameters()})
        if mode == "ours":
            pieces = sorted({len(plan.pieces) for plan in find_installation().tp.plans().values()})
    install([])
    stock, ours = runs["stock"], runs["ours"]
    return {"pieces": pieces, "tensors": {
        key: (torch.equal(ours[key], stock[key]),
              float((ours[key].double() - stock[key].double()).norm() / stock[key].double().norm()))
        for key in stock}}


def last_bits(seed: int, cases) -> list:
    """Stock Megatron Column/Row linears (TP=2, SP, fp32) against the patched ones for each
    ``(rows per rank, micro-batch, --overlap-tp-chunks, bidirectional)`` of ``cases``: per case
    whether every output and gradient came out equal, and the worst relative difference."""
    from megatron_overlap.lab import tiny_gpt

    tiny_gpt.init_parallel(2, seed=seed)
    _config, layers = tiny_layers(2, fusion=False)
    gen = torch.Generator().manual_seed(seed * 7 + dist.get_rank())
    out = []
    for s, b, chunks, bidir in cases:
        equal, worst = True, 0.0
        for name, layer in layers.items():
            column = "column" in name
            x = torch.randn(s if column else 2 * s, b, layer.input_size if column else layer.input_size_per_partition,
                            generator=gen)
            out_dim = layer.output_size_per_partition if column else layer.output_size
            dy = torch.randn(2 * s if column else s, b, out_dim, generator=gen)
            install([])
            stock = run_layer(layer, x, dy, False)
            install(["--overlap-tp", "p2p", "--overlap-tp-chunks", str(chunks)]
                    + (["--overlap-tp-bidirectional"] if bidir else []))
            ours = run_layer(layer, x, dy, False)
            for key in stock:
                equal &= torch.equal(ours[key], stock[key])
                diff = (ours[key].double() - stock[key].double()).norm() / stock[key].double().norm().clamp_min(1e-30)
                worst = max(worst, float(diff))
        out.append(dict(case=(s, b, chunks, bidir), equal=equal, rel=worst))
    install([])
    return out
