"""Sub-batches (``--overlap-tp-sub-batches N``) as task graphs, as ``integration/sub_batches.py``
runs them: blocks of a layer's op list are cut into N row parts, the rest runs whole.

    attention block   [Attention, Linear row]          (CP = 1) forward: part j's attention, then
                      its projection; the parts' reduce-scatters travel while later parts compute
    MLP block         [Linear column, Elementwise, Linear row]   forward: per part fc1, act, fc2

As the code runs them: the first part's all-gathers are the chunked rings, every later part's
is one collective posted while the part before it computes (forward: at that part's fc2;
backward: after its Row dgrad), consumed by one whole GEMM; the reduce-scatters' last adds wait
until every part has run. Backward: the parts in reverse order (autograd runs the last-built
chain first); each MLP part's fc2 starts its fc1's wgrad-input re-gather, and the projection of
the part that runs first starts the QKV input's, whole (the parts' attention backwards move
nothing of their own). A part is the op on T / N tokens: the smaller GEMMs' lower efficiency is ``gemm_ms``'s.
Without sequence parallelism (``ctx.sequence_parallel`` False) no gather is posted ahead: each
part's Row forward and Column dgrad all-reduce their row pieces (``transfers.chunked_all_reduce``),
waited after the last part, and a part's Row backward moves nothing.
Not modelled: per-part launch or Python overhead; ``symm-mem`` parts finish their
reduce-scatters in place (only ``p2p`` defers them).
"""

from __future__ import annotations

import dataclasses

from .comm import all_gather_cost
from .engine import Graph
from .layer_ops import Attention, Elementwise, Linear
from .strategies import Ctx, _ring_gather_consume, linear_bwd, linear_fwd, other_bwd, other_fwd


def blocks(ops: list, cp: int, cut: str = "all") -> list:
    """``ops`` as (kind, ops): "attention" / "mlp" blocks that are cut (those ``cut`` names:
    all, attention or mlp), "whole" ops that are not."""
    out, i = [], 0
    while i < len(ops):
        a, b, c = ops[i], ops[i + 1] if i + 1 < len(ops) else None, ops[i + 2] if i + 2 < len(ops) else None
        if cut != "mlp" and isinstance(a, Attention) and cp == 1 and isinstance(b, Linear) and b.kind == "row":
            out.append(("attention", [a, b]))
            i += 2
        elif cut != "attention" and isinstance(a, Linear) and a.kind == "column" and isinstance(b, Elementwise) and \
                isinstance(c, Linear) and c.kind == "row":
            out.append(("mlp", [a, b, c]))
            i += 3
        else:
            out.append(("whole", [a]))
            i += 1
    return out


def part_ctx(ctx: Ctx, n: int, deferred=None) -> Ctx:
    return dataclasses.replace(ctx, tokens=ctx.tokens / n, rows=max(1, ctx.rows // n), deferred=deferred)


def _part_op(op, n: int):
    if isinstance(op, (Elementwise, Attention)):
        return dataclasses.replace(op, fwd_ms=op.fwd_ms / n, bwd_ms=op.bwd_ms / n)
    return op


def _gather(g, ctx, name, tokens_k, deps):
    return g.transfer(f"{name} AG (posted ahead)", all_gather_cost(tokens_k * ctx.d, ctx.tp, ctx.link), deps,
                      sm_comm=ctx.sm)


def _finish(g, deferred, outs):
    """The parts' deferred reduce-scatter adds, after the last part; the block's output."""
    last = None
    for name, ms, deps in deferred:
        last = g.compute(name, ms, deps + ([last] if last is not None else []))
    return [last] if last is not None else outs


def forward(g: Graph, ctx: Ctx, ops: list, n: int) -> list:
    ready = []
    for kind, block in blocks(ops, ctx.cp, ctx.strategy.cut):
        if kind == "whole":
            op = block[0]
            ready = linear_fwd(g, ctx, op, ready) if isinstance(op, Linear) else other_fwd(g, ctx, op, ready)
            continue
        deferred, outs, ahead = [], [], None
        part = part_ctx(ctx, n, deferred)
        for j in range(n):
            r = ready
            for op in block:
                op = _part_op(op, n)
                if isinstance(op, Linear) and op.kind == "column" and ahead is not None:
                    r = [g.compute(f"{op.name} fwd", part.gemm(part.tokens, op.n / ctx.tp, op.k), [ahead, *r],
                                   contended=True)]
                elif isinstance(op, Linear):
                    if op.kind == "row" and kind == "mlp" and j + 1 < n and ctx.sequence_parallel:  # posted at fc2
                        ahead = _gather(g, part, f"{block[0].name} fwd", part.tokens * block[0].k, r)
                    r = linear_fwd(g, part, op, r)
                else:
                    r = other_fwd(g, part, op, r)
            outs += r
        ready = _finish(g, deferred, outs)
    return ready


def backward(g: Graph, ctx: Ctx, ops: list, n: int) -> list:
    ready, prefetch = [], {}  # prefetch: column name -> (handle, fraction)
    laid = blocks(ops, ctx.cp, ctx.strategy.cut)
    for index in range(len(laid) - 1, -1, -1):
        kind, block = laid[index]
        if kind == "whole":
            op = block[0]
            if not isinstance(op, Linear):
                ready = other_bwd(g, ctx, op, ready)
            elif op.kind == "column":
                handle, fraction = prefetch.pop(op.name, (None, ctx.strategy.prefetch_fraction))
                whole = dataclasses.replace(ctx, strategy=dataclasses.replace(ctx.strategy, prefetch_fraction=fraction))
                ready, _ = linear_bwd(g, whole, op, ready, prefetch=handle)
            else:  # a whole Row starts the Column before it's re-gather, as per-op does
                column = _column_before(laid, index)
                ready, handle = linear_bwd(g, ctx, op, ready, next_column=column)
                if column is not None and handle is not None:
                    prefetch[column.name] = (handle, ctx.strategy.prefetch_fraction)
            continue
        deferred, outs, state = [], [], {"ahead": None}
        part = part_ctx(ctx, n, deferred)
        column = _column_before(laid, index) if kind == "attention" else block[0]
        for j in range(n - 1, -1, -1):
            outs += _part_backward(g, part, kind, block, column, j, n, ready, prefetch, state)
        ready = _finish(g, deferred, outs)
    return ready


def _part_backward(g, part, kind, block, column, j, n, ready, prefetch, state):
    r, handle = ready, None
    for op in reversed(block):
        op = _part_op(op, n)
        if not isinstance(op, Linear):
            r = other_bwd(g, part, op, r)
        elif op.kind == "row" and not part.sequence_parallel:  # no communication in a Row backward without SP
            r, _ = linear_bwd(g, part, op, r)
        elif op.kind == "row":
            last = kind == "attention" and j == n - 1  # the first part to run starts the whole QKV re-gather
            r, handle = _row_backward(g, part, op, r, state, column if kind == "mlp" or last else None,
                                      float(n) if last else part.strategy.prefetch_fraction, j)
            if last and handle is not None:
                prefetch[column.name] = (handle, 1.0)
        else:
            r, _ = linear_bwd(g, part, op, r, prefetch=handle)
    return r


def _row_backward(g, part, op, ready, state, next_column, fraction, j):
    """A part's Row backward: the ring for the first part the backward runs, the gather posted
    by the part before for the others; then the gather of the next part's grad-output, the early
    re-gather of ``next_column``'s input and the wgrad, in the code's order."""
    R, T, d = part.tp, part.tokens, part.d
    dgrad_of = lambda m: part.gemm(m, op.k / R, op.n)  # noqa: E731
    if state["ahead"] is None and part.strategy.name != "p2p":  # symm-mem's own op for the first part
        early = dataclasses.replace(part, strategy=dataclasses.replace(part.strategy, prefetch_fraction=fraction))
        r, handle = linear_bwd(g, early, op, ready, next_column=next_column)
        state["ahead"] = _gather(g, part, f"{op.name} bwd dy", T * op.n, r) if j > 0 else None
        return r, handle
    if state["ahead"] is None:
        r = [_ring_gather_consume(g, part, f"{op.name} bwd dgrad", ready, op.n * d, dgrad_of, part.pieces())[0]]
    else:
        r = [g.compute(f"{op.name} bwd dgrad", dgrad_of(T), [state["ahead"], *ready], contended=True)]
    state["ahead"] = _gather(g, part, f"{op.name} bwd dy", T * op.n, r) if j > 0 else None
    handle = None
    if next_column is not None and fraction > 0:  # every backend's Row starts it (tp/linear.py)
        handle = _gather(g, part, f"{next_column.name} bwd x early", T * fraction * next_column.k, r)
    g.compute(f"{op.name} bwd wgrad", part.gemm(op.n, op.k / R, T), r, contended=True)
    return r, handle


def _column_before(laid, index):
    for kind, block in reversed(laid[:index]):
        for op in reversed(block):
            if isinstance(op, Linear) and op.kind == "column":
                return op
    return None
