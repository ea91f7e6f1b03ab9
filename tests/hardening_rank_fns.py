"""Rank functions of the issue-25 tests (module-level, so the pool imports them by name)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from .rank_helpers import install, run_layer, tiny_layers


def bit_identity(seed: int, cases) -> list:
    """Stock Megatron Column/Row linears (TP=2, SP, fp32) against the patched ones for each
    ``(rows per rank, micro-batch, --overlap-tp-chunks, bidirectional)`` of ``cases``: per case
    the smallest piece in token rows and whether every output and gradient came out equal."""
    from megatron_overlap.comm.rings import split_pieces
    from megatron_overlap.lab import tiny_gpt

    tiny_gpt.init_parallel(2, seed=seed)
    _config, layers = tiny_layers(2, fusion=False)
    gen = torch.Generator().manual_seed(seed * 7 + dist.get_rank())
    out = []
    for s, b, chunks, bidir in cases:
        pieces = split_pieces(s, chunks // 2, bidir)
        equal, worst, premise = True, 0.0, True
        for name, layer in layers.items():
            premise &= _rows_exact(layer.weight.detach(), [p.rows * b for p in pieces], 2 * s * b, gen)
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
        out.append(dict(case=(s, b, chunks, bidir), min_token_rows=min(p.rows for p in pieces) * b, equal=equal,
                        rel=worst, premise=premise))
    install([])
    return out


def _rows_exact(weight, piece_rows, total_rows, gen) -> bool:
    """Whether this machine's BLAS gives a piece's rows exactly as the whole GEMM does, for
    ``weight``'s shapes in both layouts a TP linear cuts: ``x @ W^T`` (forward, wgrad inputs)
    and ``dy @ W`` (dgrad), every piece size used, at the start and the end of the rows."""
    out_dim, in_dim = weight.shape
    for k, w in ((in_dim, weight.t()), (out_dim, weight)):
        x = torch.randn(total_rows, k, generator=gen)
        whole = x @ w
        for m in set(piece_rows):
            for start in (0, total_rows - m):
                if not torch.equal(x[start:start + m] @ w, whole[start:start + m]):
                    return False
    return True
