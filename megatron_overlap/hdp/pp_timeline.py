"""A plan's step in a 1F1B pipeline: what mode ``pp`` plans against.

In HDP's pipeline mode each pipeline stage's DP group runs the same plan (one stage's layers of
every micro-batch), and every DP rank runs Megatron's non-interleaved 1F1B order
(``pp.schedule.one_f_one_b_order``) over the plan's M micro-batch slots. A step is then not the
busiest rank's work (``simulate``) but the 1F1B timeline over the stages::

    F(s, k), B(s, k)   stage s's forward and backward of slot k on DP rank d: the slot's
                       ``Plan.item_ms`` / P (each stage holds 1 / P of the layers), split as
                       the layers split it: linears 1 : 2, attention 1 : bwd_factor, a ring's
                       exposed traffic as its attention; the output layer's linear (vocab x
                       hidden per row) on the last stage only
    F(s, k)            starts when F(s-1, k) ended plus the activation's transfer
    B(s, k)            starts when B(s+1, k) ended plus the gradient's transfer
    a ring             starts when all its peers (of the stage) reach it and ends for all at the
                       slowest peer's end (its peers move in lockstep)
    step_ms            the last op's end, over every stage and DP rank

So a step costs each slot's *largest* cell (the ring peers and, through the next stages, the
DP ranks wait for it), summed along the 1F1B order, plus the warm-up and cool-down bubble:
about ``(P - 1) x`` the forwards of the first slots and the backwards of the last. Transfers:
``rows x hidden x dtype_bytes`` bytes over the inter-node link (the slower tier, where stages
of one pipeline sit on different nodes).

Pure Python, no communication, deterministic. ``lab.hdp_pp_cluster.simulate_pp`` is the
independent check (the lab's own rates per layer, the output layer on the last stage, each
transfer on its real tier), and the emulated cluster measures.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

from .cost import HdpCostModel
from .step_plan import Plan

DEFAULT_STAGES = 4  # P where the caller does not say (the runtime without the pipeline size)


def check_stages(stages) -> int:
    if isinstance(stages, bool) or not isinstance(stages, int) or stages < 1:
        raise ValueError(f"pipeline stages must be a positive integer, got {stages!r}")
    return stages


def head_ms_per_token(cost: HdpCostModel) -> float:
    """The output layer's share of ``linear_ms_per_token`` (forward + backward)."""
    return cost.linear_ms_per_token * 6.0 * cost.vocab * cost.hidden / cost.linear_flops_per_token


def slot_costs(plan: Plan, cost: HdpCostModel, stages: int) -> Tuple[List[List[Tuple[float, float, float]]],
                                                                          List[List[Optional[tuple]]],
                                                                          List[List[int]]]:
    """Per DP rank and slot (padded with empty slots to the longest rank's count): (F, B, the
    last stage's extra forward of the output layer; its backward is twice that) in ms, the ring
    (key, ranks) of the slot (None: local) and its rows."""
    M = max((len(m) for m in plan.microbatches), default=0)
    split_lin = 1.0 / 3.0  # forward share of a linear's forward + backward (1 : 2)
    split_att = 1.0 / (1.0 + cost.attention_bwd_factor)
    head = head_ms_per_token(cost)
    memo: Dict[tuple, Tuple[float, float, float]] = {}
    fb, keys, rows = [], [], []
    for mbs in plan.microbatches:
        row_fb, row_keys, row_rows = [], [], []
        for k in range(M):
            mb = mbs[k] if k < len(mbs) else ()
            key = tuple((s.seq_len, s.rows, s.causal_pairs, s.ring) for s in mb)
            ops = memo.get(key)
            if ops is None:
                n = sum(s.rows for s in mb)
                lin = n * (cost.linear_ms_per_token - head)  # the layers' linears
                rest = plan.item_ms(mb, cost) - n * cost.linear_ms_per_token  # attention, exposed ring, overhead
                f = (lin * split_lin + rest * split_att) / stages
                ops = memo[key] = (f, (lin + rest) / stages - f, n * head * split_lin)
            row_fb.append(ops)
            ring = Plan.ring_of(mb) if mb else ()
            row_keys.append((Plan.ring_key(mb), ring) if ring else None)
            row_rows.append(sum(s.rows for s in mb))
        fb.append(row_fb)
        keys.append(row_keys)
        rows.append(row_rows)
    return fb, keys, rows


def pipeline_step_ms(plan: Plan, cost: HdpCostModel, stages: int = DEFAULT_STAGES) -> float:
    """The step of ``plan`` in a 1F1B pipeline of ``stages`` stages, in ms (module docstring)."""
    from ..pp.schedule import B, F, one_f_one_b_order

    P = check_stages(stages)
    fb, keys, rows = slot_costs(plan, cost, P)
    D = plan.ranks
    M = len(fb[0]) if fb else 0
    if M == 0:
        return 0.0
    hop_ms = cost.inter_latency_us * 1e-3
    per_row_ms = cost.hidden * cost.dtype_bytes / (cost.inter_link_GBps * 1e9) * 1e3
    orders = [one_f_one_b_order(P, M, s, P) for s in range(P)]
    ptr = [[0] * D for _ in range(P)]
    free = [[0.0] * D for _ in range(P)]
    arrive_f = [[[None] * M for _ in range(D)] for _ in range(P)]  # when F(s, k)'s input is at stage s
    arrive_b = [[[None] * M for _ in range(D)] for _ in range(P)]
    for d in range(D):
        for k in range(M):
            arrive_f[0][d][k] = 0.0
            arrive_b[P - 1][d][k] = 0.0
    left = 2 * M * P * D
    while left:
        progressed = False
        for s in range(P):
            order = orders[s]
            for d in range(D):
                while ptr[s][d] < len(order):
                    op, k = order[ptr[s][d]]
                    ready = (arrive_f if op == F else arrive_b)[s][d][k]
                    if ready is None:
                        break
                    key = keys[d][k]
                    if key is None:
                        peers = (d,)
                    else:
                        peers = key[1]
                        if any(ptr[s][e] >= len(order) or order[ptr[s][e]] != (op, k)
                               or (arrive_f if op == F else arrive_b)[s][e][k] is None for e in peers):
                            break
                    start = max(max((arrive_f if op == F else arrive_b)[s][e][k], free[s][e]) for e in peers)
                    last = s == P - 1
                    end = start + max(fb[e][k][0] + (fb[e][k][2] if last else 0.0) if op == F
                                      else fb[e][k][1] + (2 * fb[e][k][2] if last else 0.0) for e in peers)
                    for e in peers:
                        free[s][e] = end
                        ptr[s][e] += 1
                        left -= 1
                        hop = hop_ms + rows[e][k] * per_row_ms
                        if op == F and s < P - 1:
                            arrive_f[s + 1][e][k] = end + hop
                        if op == B and s > 0:
                            arrive_b[s - 1][e][k] = end + hop
                    progressed = True
        if not progressed:
            raise ValueError("the plan's rings deadlock in the 1F1B order (peers hold a ring at different slots)")
    return max(max(f) for f in free)


def static_pp_candidates(lens: Sequence[int], ranks: int, capacity_tokens: int, cost: HdpCostModel) -> List[Plan]:
    """Static CP's own plan for the batch, as a candidate of mode ``pp``: HDP keeps it where no
    plan of its own has a shorter pipeline step."""
    import dataclasses

    from .baselines import schedule_static

    plan = schedule_static(list(lens), ranks, capacity_tokens, cost)
    M = max(len(m) for m in plan.microbatches)  # one slot count (a pipeline runs one): empty slots at the end
    micro = tuple(tuple(m) + ((),) * (M - len(m)) for m in plan.microbatches)
    return [dataclasses.replace(plan, scheduler="hdp", mode="pp", microbatches=micro, phases=None,
                                notes=plan.notes + ("static CP's plan: the shortest 1F1B step of the plans tried",))]
