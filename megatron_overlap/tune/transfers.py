"""Task-graph building blocks of the strategies other than the P2P rings (``strategies.py``):
PyTorch Async TP's copy-engine transfers (``symm-mem``), the fused and Flux kernels, and the
all-reduce path without sequence parallelism (row pieces all-reduced as they are computed;
``symm-mem``'s reduce-scatter then all-gather). ``ctx`` is a ``strategies.Ctx``."""

from __future__ import annotations

from .comm import all_gather_cost, all_reduce_cost, p2p_cost, transfer_cost
from .engine import Graph
from .gemm import elementwise_ms


def copies_consume(g, ctx, name, ready, shard_bytes, gemm_of):
    """Async-TP all-gather: R-1 copy-engine copies of whole shards, a GEMM per shard as it lands."""
    copies = [g.transfer(f"{name} copy", p2p_cost(shard_bytes, ctx.link), ready) for _ in range(ctx.tp - 1)]
    last = g.compute(f"{name} own", gemm_of(ctx.tokens / ctx.tp), ready, contended=True)
    for c in copies:
        last = g.compute(f"{name} shard", gemm_of(ctx.tokens / ctx.tp), [c], contended=True)
    return last


def copies_reduce(g, ctx, name, ready, n_out, partial_of):
    """Async-TP reduce-scatter: a partial per peer pushed by copy engine, then a local reduce."""
    s, copies = ctx.tokens / ctx.tp, []
    for _ in range(ctx.tp - 1):
        p = g.compute(f"{name} partial", partial_of(s), ready, contended=True)
        copies.append(g.transfer(f"{name} copy", p2p_cost(s * n_out * ctx.d, ctx.link), [p]))
    own = g.compute(f"{name} own", partial_of(s), ready, contended=True)
    reduce_ms = elementwise_ms((ctx.tp + 1) * s * n_out * ctx.d, ctx.hw)
    return g.compute(f"{name} reduce", reduce_ms, [own, *copies])


def chunked_all_reduce(g: Graph, ctx: Ctx, name, ready, n_out, gemm_of, after=None):
    """p2p without SP: a GEMM per row piece of the whole sequence, each piece all-reduced by the
    backend's collective as soon as it is computed; ``after(last GEMM)``: work beside the last
    transfers (the Column's wgrad). Returns the task that has waited for every piece; with
    ``ctx.deferred`` (a sub-batch) the wait is appended there and the last compute returned."""
    last, transfers = None, []
    for t in ctx.ar_pieces():
        last = g.compute(f"{name} piece", gemm_of(t), [last] if last is not None else ready, contended=True)
        transfers.append(g.transfer(f"{name} AR", all_reduce_cost(t * n_out * ctx.d, ctx.tp, ctx.link), [last],
                                    sm_comm=ctx.sm))
    if after is not None:
        last = after(last)
    if ctx.deferred is not None:
        ctx.deferred.append((f"{name} AR wait", 0.0, [last, *transfers]))
        return last
    return g.compute(f"{name} wait", 0.0, [last, *transfers])


def reduce_then_gather(g: Graph, ctx: Ctx, name, ready, n_out, partial_of, after=None):
    """symm-mem without SP: its fused reduce-scatter, then an all-gather of the shard (``after``:
    work beside that all-gather)."""
    rs = copies_reduce(g, ctx, name, ready, n_out, partial_of)
    ag = g.transfer(f"{name} AG", all_gather_cost(ctx.tokens * n_out * ctx.d, ctx.tp, ctx.link), [rs], sm_comm=ctx.sm)
    beside = [after(rs)] if after is not None else []
    return g.compute(f"{name} wait", 0.0, [ag, *beside])


def _fill(ctx, gemm_of) -> float:
    return gemm_of(ctx.tokens / (ctx.tp * ctx.strategy.fused_fill_chunks))


def flux_gather(g, ctx, name, ready, total_bytes, gemm_of):
    s = ctx.strategy
    # peers' shards come straight from their owners (no ring): the port pipelines the copies
    ag = g.transfer(f"{name} AG (CE)", transfer_cost(total_bytes * (ctx.tp - 1) / ctx.tp, ctx.link), ready)
    whole, fill = gemm_of(ctx.tokens) * (1 + s.slowdown), _fill(ctx, gemm_of)
    main = g.compute(f"{name} fused", whole - fill, ready)
    return g.compute(f"{name} fused tail", fill, [main, ag])


def flux_reduce(g, ctx, name, ready, n_out, gemm_of, after=None):
    s = ctx.strategy
    whole, fill = gemm_of(ctx.tokens) * (1 + s.slowdown), _fill(ctx, gemm_of)
    head = g.compute(f"{name} fused", fill, ready)
    partials = ctx.tokens * n_out * ctx.d * (ctx.tp - 1) / ctx.tp  # tiles pushed straight to their owners
    rs = g.transfer(f"{name} RS (epilogue)", transfer_cost(partials, ctx.link), [head])
    main = g.compute(f"{name} fused", whole - fill, [head])
    beside = [after(main)] if after is not None else []
    reduce_ms = elementwise_ms((ctx.tp + 1) * ctx.tokens / ctx.tp * n_out * ctx.d, ctx.hw)
    return g.compute(f"{name} reduce", reduce_ms, [main, rs, *beside])


def fused_gather(g, ctx, name, ready, total_bytes, gemm_of):
    if ctx.strategy.name == "flux":
        return flux_gather(g, ctx, name, ready, total_bytes, gemm_of)
    s = ctx.strategy
    # the P2P ring (NCCL, on SMs) fills the gathered buffer; the kernel reads chunks as they land
    ag = g.transfer(f"{name} AG (ring)", transfer_cost(total_bytes * (ctx.tp - 1) / ctx.tp, ctx.link), ready,
                    sm_comm=ctx.sm)
    whole, fill = gemm_of(ctx.tokens) * (1 + s.slowdown), _fill(ctx, gemm_of)
    main = g.compute(f"{name} fused", whole - fill, ready, contended=True)
    return g.compute(f"{name} fused tail", fill, [main, ag])


def fused_reduce(g, ctx, name, ready, n_out, gemm_of, after=None):
    """The GEMM kernel fills every owner's slot; the slots' all-to-all starts when it ends;
    ``after(kernel)`` may add work that runs beside that all-to-all (the column bwd's wgrad)."""
    if ctx.strategy.name == "flux":
        return flux_reduce(g, ctx, name, ready, n_out, gemm_of, after)
    s = ctx.strategy
    main = g.compute(f"{name} fused", gemm_of(ctx.tokens) * (1 + s.slowdown), ready)
    partials = ctx.tokens * n_out * ctx.d * (ctx.tp - 1) / ctx.tp
    rs = g.transfer(f"{name} RS (a2a)", transfer_cost(partials, ctx.link), [main], sm_comm=ctx.sm)
    beside = [after(main)] if after is not None else []
    reduce_ms = elementwise_ms((ctx.tp + 1) * ctx.tokens / ctx.tp * n_out * ctx.d, ctx.hw)
    return g.compute(f"{name} reduce", reduce_ms, [main, rs, *beside])
