"""The two collectives of an HDP step, over one explicit process group G (R ranks).

1. :func:`gather_lengths`: each rank brings its own samples (what its data iterator loaded); the
   ranks all-gather only their lengths and each sample's loss-mask sum (for the total token
   count). Global sample id = position in (rank 0's samples, rank 1's, ...).
2. :func:`exchange_rows`: the plan says which token rows each rank holds (whole short sequences,
   zigzag shards of long ones, ``Shard.ranges``). Rows a rank needs from a sample another rank
   loaded travel in ONE ``all_to_all_single`` of int64 triples (token, label, loss-mask bits), in
   an order both sides derive from the plan, so no index travels with them. Every rank knows the
   whole traffic matrix, so a step where nothing moves skips the collective on all ranks.
   (Each rank reads only its own samples, as Megatron's data iterators already do; the exchange
   costs 3 x 8 bytes per moved token, negligible next to the activations.)

Tensors of the collectives live on the group's device (``comm.agree.group_device``).
"""

from __future__ import annotations

from typing import List, Sequence, Tuple

import torch
import torch.distributed as dist

from ..comm import waits
from ..comm.agree import group_device
from .layout import arange_ranges, doc_order
from .step_plan import Plan
from .samples import Sample


def gather_lengths(samples: Sequence[Sample], group) -> Tuple[tuple, tuple, tuple]:
    """All-gather (length, loss-mask sum) of every rank's samples. Returns (lengths, weights,
    owners) in sample-id order; ``owners[i] = (rank that loaded it, its index there)``."""
    size, dev = dist.get_world_size(group), group_device(group)
    count = torch.tensor([len(samples)], dtype=torch.int64, device=dev)
    counts = [torch.empty_like(count) for _ in range(size)]
    waits.wait(dist.all_gather(counts, count, group=group, async_op=True), "HDP lengths all-gather (sample counts)",
               group)
    counts = [int(c.item()) for c in counts]
    mine = torch.zeros(max(1, max(counts)), 2, dtype=torch.float64)
    for i, s in enumerate(samples):
        mine[i, 0], mine[i, 1] = len(s), float(s.loss_mask.double().sum())
    mine = mine.to(dev)
    parts = [torch.empty_like(mine) for _ in range(size)]
    waits.wait(dist.all_gather(parts, mine, group=group, async_op=True), "HDP lengths all-gather", group)
    lens, weights, owners = [], [], []
    for r, (part, c) in enumerate(zip(parts, counts)):
        part = part.cpu()
        for i in range(c):
            lens.append(int(part[i, 0]))
            weights.append(float(part[i, 1]))
            owners.append((r, i))
    return tuple(lens), tuple(weights), tuple(owners)


def needs(plan: Plan, rank: int) -> List[Tuple[int, Tuple[Tuple[int, int], ...]]]:
    """(seq id, token ranges) that ``rank`` holds, in its canonical order: micro-batches in plan
    order, documents by ``doc_order``, ranges ascending (= the row order)."""
    return [(s.seq_id, s.ranges) for mb in plan.microbatches[rank] if mb for s in doc_order(mb)]


def traffic_matrix(plan: Plan, owners, size: int) -> List[List[int]]:
    """``traffic[src][dst]``: token rows rank ``dst`` needs from samples rank ``src`` loaded."""
    traffic = [[0] * size for _ in range(size)]
    for r in range(size):
        for sid, ranges in needs(plan, r):
            traffic[owners[sid][0]][r] += sum(b - a for a, b in ranges)
    return traffic


def exchange_rows(plan: Plan, samples: Sequence[Sample], owners, group) -> Tuple[List[List[torch.Tensor]], int]:
    """Rows of every document this rank holds, ``[real tokens, 3]`` int64 per document, per
    non-idle micro-batch; and the number of tokens that crossed ranks (all ranks together)."""
    me, size = dist.get_rank(group), dist.get_world_size(group)
    traffic = traffic_matrix(plan, owners, size)
    moved = sum(traffic[s][d] for s in range(size) for d in range(size) if s != d)
    local_rows = [s.rows() for s in samples]
    if moved:
        recv_buf, offsets = _all_to_all(plan, local_rows, owners, traffic, me, group)
    out: List[List[torch.Tensor]] = []
    for mb in plan.microbatches[me]:
        if not mb:
            continue
        docs = []
        for s in doc_order(mb):
            owner, i = owners[s.seq_id]
            if not moved:
                docs.append(local_rows[i][arange_ranges(s.ranges)])
                continue
            docs.append(recv_buf[offsets[owner]:offsets[owner] + s.tokens])
            offsets[owner] += s.tokens
        out.append(docs)
    return out, moved


def _all_to_all(plan, local_rows, owners, traffic, me, group):
    size, dev = len(traffic), group_device(group)
    send = []
    for r in range(size):
        for sid, ranges in needs(plan, r):
            owner, i = owners[sid]
            if owner == me:
                send.extend(local_rows[i][a:b] for a, b in ranges)
    send_buf = (torch.cat(send) if send else torch.zeros(0, 3, dtype=torch.int64)).to(dev)
    recv_buf = torch.empty(sum(traffic[s][me] for s in range(size)), 3, dtype=torch.int64, device=dev)
    work = dist.all_to_all_single(recv_buf.view(-1), send_buf.view(-1),
                                  output_split_sizes=[3 * traffic[s][me] for s in range(size)],
                                  input_split_sizes=[3 * traffic[me][d] for d in range(size)], group=group,
                                  async_op=True)
    senders = [s for s in range(size) if s != me and traffic[s][me]] or [s for s in range(size) if s != me]
    waits.wait(work, "HDP row exchange (all-to-all)", group, peers=senders)
    offsets, acc = [], 0
    for s in range(size):
        offsets.append(acc)
        acc += traffic[s][me]
    return recv_buf.cpu(), offsets
