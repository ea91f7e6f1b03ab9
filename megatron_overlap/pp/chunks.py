"""Virtual pipelines as data: ``v`` model chunks per stage, the compute orders that run them and
their transfers.

Placements (virtual stage j -> (stage, chunk)):

    interleaved  Megatron's: j on stage j mod p, chunk j // p (``--num-layers-per-virtual-
                 pipeline-stage``); the activation of virtual stage p - 1 goes from the last
                 stage back to stage 0
    v            ZB-V's (Qi et al., "Pipeline Parallelism with Controllable Memory", 2024): two
                 chunks, stage s holds virtual stages s and 2p - 1 - s; the turn at the last
                 stage is a hand-over between its two chunks (no transfer) and the loss sits on
                 stage 0

Orders (per stage, (op, chunk, mb)):

    ``megatron_order``  ``forward_backward_pipelining_with_interleaving`` of megatron-core
                 0.16: its schedule table (groups of ``microbatch_group_size_per_vp_stage``
                 micro-batches, every chunk in turn), its warm-up count
                 ``2 (p - s - 1) + (v - 1) g`` (``get_pp_rank_microbatches``), then one forward
                 and one backward in turn, the backward's chunks mirrored (v - 1 - chunk);
                 ``extra`` more warm-up forwards on every stage: more in flight
    ``split_chunks``    the same forwards and backwards with each backward split into B and W,
                 W placed by list scheduling where the stage would wait (interleaved zero
                 bubble)
    ``v_order``        ZB-V by list scheduling in simulated time: a ready B first, then a
                 forward of chunk 1, then one of chunk 0 while the stage's memory (a pending W
                 counting ``w_share``) leaves room for it and for the chunk-1 forwards of every
                 micro-batch it holds, else a W; at most ``cap`` (1F1B's p micro-batches of
                 the stage's layers) held

Transfers (``chunked_actions``): between two chunks of one stage none; between stages every
stage posts its transfers in one order shared by all stages, the order they are produced in a reference run
of the compute orders (ties broken alike everywhere), each as early as that order allows (a
send once produced, a receive once every earlier transfer of the stage is posted), and waits
for each just before use. One shared order keeps both backend models deadlock-free: the
earliest unfinished transfer is always posted, and at the head of the executing batch, at both
ends (``validate`` checks it anyway).
"""

from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

from .schedule import ACT, GRAD, B, F, RECV, SEND, W, Action, Comm, compute, post, wait

Order = List[Tuple[str, int, int]]  # (op, chunk, mb)


def interleaved_placement(stages: int, chunks: int) -> Tuple[Tuple[int, int], ...]:
    return tuple((j % stages, j // stages) for j in range(stages * chunks))


def v_placement(stages: int) -> Tuple[Tuple[int, int], ...]:
    return tuple((j, 0) for j in range(stages)) + tuple((stages - 1 - j, 1) for j in range(stages))


def check_interleaved(stages: int, microbatches: int, group: int) -> None:
    """Megatron's own refusals (``forward_backward_pipelining_with_interleaving``), said first."""
    p, m, g = stages, microbatches, group
    if not p <= g <= m:
        raise ValueError(f"an interleaved pipeline of {p} stages runs micro-batches in groups of g = {g} per model "
                         f"chunk (microbatch_group_size_per_vp_stage, default p): Megatron needs p <= g <= m, and "
                         f"there are {m} micro-batches" + (f" (with the default g = p, m must be a multiple of {p})"
                                                           if g == p else ""))
    if 0 < m % g < p:
        raise ValueError(f"{m} micro-batches in groups of {g} leave a last group of {m % g}, fewer than the {p} "
                         f"stages: Megatron's interleaved schedule refuses it (dependency bubbles); make m a multiple "
                         f"of {g}" + (f" (the stages, {p})" if g == p else ""))


def schedule_table(microbatches: int, chunks: int, group: int) -> List[Tuple[int, int]]:
    """Megatron's ``get_schedule_table``: (mb, chunk) of each virtual micro-batch in order."""
    out = []
    for lo in range(0, microbatches, group):
        hi = microbatches if lo + group >= microbatches else lo + group
        out += [(mb, c) for c in range(chunks) for mb in range(lo, hi)]
    return out


def megatron_warmup(stages: int, microbatches: int, chunks: int, stage: int, group: int, extra: int = 0) -> int:
    return min(microbatches * chunks, 2 * (stages - stage - 1) + (chunks - 1) * group + extra)


def megatron_order(stages: int, microbatches: int, chunks: int, stage: int, group: int = 0, extra: int = 0) -> Order:
    g = group or stages
    table = schedule_table(microbatches, chunks, g)
    fwd = [(F, c, mb) for mb, c in table]
    bwd = [(B, chunks - 1 - c, mb) for mb, c in table]
    warm = megatron_warmup(stages, microbatches, chunks, stage, g, extra)
    order = fwd[:warm]
    for j in range(len(fwd) - warm):
        order += [fwd[warm + j], bwd[j]]
    return order + bwd[len(fwd) - warm:]


def successor(placement, rank_chunk, op, mb):
    """The (stage, op, chunk, mb) made ready by ``op`` of ``mb`` on ``rank_chunk``."""
    j = placement.index(rank_chunk)
    if op == F:
        if j + 1 < len(placement):
            return (*placement[j + 1][:1], F, placement[j + 1][1], mb)
        return (rank_chunk[0], B, rank_chunk[1], mb)
    if j > 0:
        return (placement[j - 1][0], B, placement[j - 1][1], mb)
    return None


def timeline(orders: Sequence[Order], placement, times=(1.0, 1.0, 1.0)) -> Dict[Tuple[int, str, int, int], float]:
    """End of every compute action when each stage runs ``orders`` as soon as its inputs are
    there (no transfer time): the reference run that orders the transfers."""
    dur = dict(zip((F, B, W), times))
    mbs = {mb for o in orders for _op, _c, mb in o}
    ready = {(s, F, c, mb): 0.0 for s, c in placement[:1] for mb in mbs}
    ptr, clock, end = [0] * len(orders), [0.0] * len(orders), {}
    while any(ptr[s] < len(o) for s, o in enumerate(orders)):
        moved = False
        for s, o in enumerate(orders):
            while ptr[s] < len(o):
                op, c, mb = o[ptr[s]]
                key = (s, op, c, mb)
                if op == W:
                    at = end[(s, B, c, mb)]
                elif key in ready:
                    at = ready[key]
                else:
                    break
                clock[s] = end[key] = max(clock[s], at) + dur[op]
                nxt = successor(placement, (s, c), op, mb) if op != W else None
                if nxt is not None:
                    ready[nxt] = end[key]
                ptr[s] += 1
                moved = True
        if not moved:
            raise RuntimeError(f"compute orders deadlock (a bug in the generator: report it): {ptr}")
    return end


def chunked_actions(orders: Sequence[Order], placement, stage: int, forward_only: bool = False,
                    end=None) -> List[Action]:
    """Stage ``stage``'s actions for the compute ``orders`` of all stages (module docstring);
    ``end``: their ``timeline``, when the caller has it."""
    s = stage
    end = timeline(orders, placement) if end is None else end
    mine = []  # every transfer of this stage as (reference time, producer, kind, mb, chunk, Comm seen from s)
    for r, o in enumerate(orders):
        for op, c, mb in o:
            if op == W:
                continue
            nxt = successor(placement, (r, c), op, mb)
            if nxt is None or nxt[0] == r or s not in (r, nxt[0]):
                continue
            kind = ACT if op == F else GRAD
            comm = Comm(SEND, kind, mb, nxt[0], c, nxt[2]) if r == s else Comm(RECV, kind, mb, r, nxt[2], c)
            mine.append((end[(r, op, c, mb)], r, kind, mb, c, comm))
    mine.sort(key=lambda x: x[:5])  # one order shared by all stages: both ends of every transfer see the same one
    queue = [x[-1] for x in mine]
    produced, out, ptr = set(), [], [0]

    def flush():
        batch = []
        while ptr[0] < len(queue):
            comm = queue[ptr[0]]
            if comm.op == SEND and (comm.kind, comm.chunk, comm.mb) not in produced:
                break
            batch.append(comm)
            ptr[0] += 1
        if batch:
            out.append(post(*batch))

    flush()
    for op, c, mb in orders[s]:
        out.extend(wait(x) for x in _inputs(placement, s, op, c, mb))
        out.append(compute(op, mb, c))
        if op in (F, B):
            produced.add((ACT if op == F else GRAD, c, mb))
        flush()
    sends = [x for a in out if a.comms and a.op != "WAIT" for x in a.comms]
    out.extend(wait(x) for x in sends if x.op == SEND and (x.kind == GRAD or forward_only))
    return out


def _inputs(placement, s, op, c, mb) -> List[Comm]:
    """What compute (op, c, mb) of stage ``s`` waits for: its activation's receive (F), its
    activation's send and its gradient's receive (B), from other stages only."""
    j = placement.index((s, c))
    prev = placement[j - 1] if j else None
    nxt = placement[j + 1] if j + 1 < len(placement) else None
    if op == F and prev is not None and prev[0] != s:
        return [Comm(RECV, ACT, mb, prev[0], c, prev[1])]
    if op == B and nxt is not None and nxt[0] != s:
        return [Comm(SEND, ACT, mb, nxt[0], c, nxt[1]), Comm(RECV, GRAD, mb, nxt[0], c, nxt[1])]
    return []
