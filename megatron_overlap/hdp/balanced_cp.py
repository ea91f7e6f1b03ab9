"""megatron-core's ``BalancedCPScheduler`` (``megatron/core/pipeline_parallel/hybrid_cp_schedule.py``,
0.16), re-implemented to return the same groups in a fraction of its time, without torch.

Why: the guard (``guard.py``) plans megatron-core's schedule on every step, and at R = 256 with
thousands of documents its own code took 0.8-1.0 s a step on this machine, most of it in
``next_hdp_group``'s per-placement scans over all R ranks (the load of every candidate group
member by member, the free ranks, ``max`` / ``min`` of every rank's load). The same decisions
come from a few facts of its algorithm, which hold inside one ``next_hdp_group`` call:

* the loads start at 0.0 and a sample's cost ``L^2 / cp`` (> 0) is added to every member of its
  group, so all members of a group carry one float, made by the same additions in the same order:
  the group's load is that one float;
* the free ranks (in no group) all carry 0.0, so its ``sorted(free, key=load)[:needed]`` is the
  lowest-numbered free ranks, which are always a suffix ``range(next_free, R)``; a new group
  (load 0.0) beats any existing one (load > 0), so it is taken whenever enough ranks are free;
* its ``min`` over the groups of one size by load, the first in creation order among ties, is the
  top of a heap of ``(load, gid)``; ``max`` of the loads only grows, ``min`` is 0.0 while a rank is
  free, else the least of the heaps' tops.

Everything else (the buckets, the trim, ``fill_empty_gpus`` with its failures for an R that is not
a power of two) is its code, kept operation for operation so the floats compare alike. Tested for
equality with megatron-core's own on random batches (tests/test_hdp_real.py).
"""

from __future__ import annotations

import heapq
from collections import deque
from math import ceil, log2
from typing import Dict, List, Tuple


class FastBalancedCP:
    """``BalancedCPScheduler``'s interface (``get_groups_and_subsamples``) and results, faster."""

    def __init__(self, max_seq_len_per_rank: int, dp_cp_group):
        self.max_seq_len_per_rank = max_seq_len_per_rank
        self.total_hdp_gpus = dp_cp_group.size()
        self._gpus: Dict[int, int] = {}
        self._work: Dict[int, float] = {}

    def gpus_needed(self, seq_len: int) -> int:
        g = self._gpus.get(seq_len)
        if g is None:
            g = self._gpus[seq_len] = max(1, 2 ** ceil(log2((seq_len / self.max_seq_len_per_rank))))
        return g

    def workload(self, seq_len: int) -> float:
        w = self._work.get(seq_len)
        if w is None:
            w = self._work[seq_len] = (seq_len * seq_len) / self.gpus_needed(seq_len)
        return w

    def make_buckets_equal(self, sample_seqlens: List[Tuple[int, int]]) -> List[deque]:
        """Its ``make_buckets_equal``, line for line (its unused ``remaining_work`` dropped)."""
        k = len({self.gpus_needed(L) for _, L in sample_seqlens})
        total_work = sum([self.workload(s) for _, s in sample_seqlens])
        target = total_work / k
        buckets, cur, cur_work = [], [], 0.0
        remaining_k = k
        n = len(sample_seqlens)
        for i, (sample_id, seq_len) in enumerate(sample_seqlens):
            work = self.workload(seq_len)
            projected = cur_work + work
            if cur and (projected > target * 1.1 or n - i <= remaining_k - len(buckets)):
                buckets.append(deque(cur))
                cur, cur_work = [], 0.0
                remaining_k -= 1
            cur.append((sample_id, seq_len))
            cur_work += work
        if cur:
            buckets.append(deque(cur))
        return buckets

    def _place(self, buckets, total_gpus, delta, state) -> None:
        """Its main loop (module docstring for what replaces the scans)."""
        micro_batches, exec_times, sample_ids, gpu_group_id, group_members, group_size = state
        heaps: Dict[int, list] = {}  # size -> [(load, gid)], every group of that size
        next_free, next_gid, prev_needed, check_balance, gmax = 0, 0, None, False, 0.0
        while buckets:
            chosen = None
            for idx in range(len(buckets)):
                if not buckets[idx]:
                    continue
                needed = self.gpus_needed(buckets[idx][0][1])
                if heaps.get(needed) or total_gpus - next_free >= needed:
                    chosen = idx
                    break
            if chosen is None:
                break
            sample_id, seq_len = buckets[chosen][0]
            if prev_needed is None:
                prev_needed = needed
            cost = self.workload(seq_len)
            if total_gpus - next_free >= needed:  # a new group of the lowest free ranks
                gid, next_gid = next_gid, next_gid + 1
                members = list(range(next_free, next_free + needed))
                next_free += needed
                group_members[gid], group_size[gid] = members, needed
                for r in members:
                    gpu_group_id[r] = gid
                load = 0.0 + cost
            else:
                load, gid = heapq.heappop(heaps[needed])
                members = group_members[gid]
                load = load + cost
            heapq.heappush(heaps.setdefault(needed, []), (load, gid))
            for r in members:
                micro_batches[r].append(seq_len)
                exec_times[r] += cost
                sample_ids[r].append(sample_id)
            gmax = max(gmax, load)
            buckets[chosen].popleft()
            while buckets and not buckets[0]:
                buckets.pop(0)
            if needed < prev_needed:
                check_balance = True
            if check_balance and buckets:
                gmin = 0.0 if next_free < total_gpus else min(h[0][0] for h in heaps.values() if h)
                if gmax - gmin <= delta * gmax:
                    break

    def next_hdp_group(self, sample_seqlens, total_gpus: int, delta: float = 0.05):
        """Its ``next_hdp_group`` with ``strategy="dp"`` (what ``get_groups_and_subsamples`` uses)."""
        if not sample_seqlens:
            return ([[] for _ in range(total_gpus)], [], [0.0 for _ in range(total_gpus)],
                    [[] for _ in range(total_gpus)])
        buckets = self.make_buckets_equal(sample_seqlens)
        micro_batches = [[] for _ in range(total_gpus)]
        exec_times = [0.0 for _ in range(total_gpus)]
        sample_ids = [[] for _ in range(total_gpus)]
        gpu_group_id = [None] * total_gpus
        group_members, group_size = {}, {}
        self._place(buckets, total_gpus, delta,
                    (micro_batches, exec_times, sample_ids, gpu_group_id, group_members, group_size))
        leftovers = [t for b in buckets for t in b]
        self._trim_overload(delta, micro_batches, exec_times, sample_ids, gpu_group_id, group_members,
                            group_size, leftovers)
        total_work_before = sum(len(mb) for mb in micro_batches)
        while any(not micro_batches[i] for i in range(total_gpus)):
            micro_batches, exec_times, sample_ids = self._fill_empty_gpus(
                total_gpus, micro_batches, exec_times, sample_ids, group_members, group_size)
        total_work_after = sum(len(mb) for mb in micro_batches)
        assert total_work_after >= total_work_before, \
            f"Samples were removed: {total_work_before} -> {total_work_after}"
        return micro_batches, leftovers, exec_times, sample_ids

    def _trim_overload(self, delta, micro_batches, exec_times, sample_ids, gpu_group_id, group_members,
                       group_size, leftovers) -> None:
        """Its ``trim_overload``, line for line."""
        while True:
            cur_max = max(exec_times)
            cur_min = min(exec_times)
            cur_slack = cur_max - cur_min
            if cur_slack <= delta * cur_max or cur_min == 0:
                break
            max_r = exec_times.index(cur_max)
            gid = gpu_group_id[max_r]
            members = group_members[gid]
            if not micro_batches[max_r] or len(micro_batches[max_r]) <= 1:
                break
            seq = micro_batches[max_r][-1]
            per_gpu_cost = self.workload(seq)
            proj_times = exec_times[:]
            for r in members:
                proj_times[r] -= per_gpu_cost
            if max(proj_times) - min(proj_times) < cur_slack:
                sample_id_to_remove = sample_ids[max_r][-1]
                for r in members:
                    micro_batches[r].pop()
                    exec_times[r] -= per_gpu_cost
                    sample_ids[r].pop()
                leftovers.append((sample_id_to_remove, seq))
            else:
                break

    def _fill_empty_gpus(self, total_gpus, micro_batches, exec_times, sample_ids, group_members, group_size):
        """Its ``fill_empty_gpus``, one expansion (its loop calls it until no rank is empty)."""
        assert group_size, "There should be at least one group existing, cannot reditribute, "
        min_group_size = min(set(group_size.values()))
        next_power = min(min_group_size * 2, total_gpus)
        gid = next(g for g, size in group_size.items() if size == min_group_size)
        members = group_members[gid]
        needed_count = next_power - min_group_size
        group_start_gpu, group_end_gpu = members[0], members[-1]
        empty_gpu = [idx for idx, work in enumerate(micro_batches) if not work][0]
        assert not all(work for work in micro_batches[empty_gpu: empty_gpu + needed_count]), \
            "Empty GPUs were detected but not enough to expand."
        work_to_push = micro_batches[group_end_gpu + 1: empty_gpu]
        exec_times_to_push = exec_times[group_end_gpu + 1: empty_gpu]
        sample_ids_to_push = sample_ids[group_end_gpu + 1: empty_gpu]
        new_mb = [[]] * len(micro_batches)
        new_times = [0.0] * len(exec_times)
        new_ids = [[]] * len(sample_ids)
        for i in range(group_start_gpu):
            new_mb[i], new_times[i], new_ids[i] = micro_batches[i], exec_times[i], sample_ids[i]
        for i in range(group_start_gpu, group_end_gpu + needed_count + 1):
            new_mb[i] = micro_batches[group_end_gpu]
            L = micro_batches[group_end_gpu][0]
            new_times[i] = (L * L) / next_power
            new_ids[i] = sample_ids[group_end_gpu]
        for i, work in enumerate(work_to_push):
            j = group_end_gpu + needed_count + 1 + i
            new_mb[j], new_times[j], new_ids[j] = work, exec_times_to_push[i], sample_ids_to_push[i]
        group_size[gid] = next_power
        group_members[gid] = list(range(members[0], members[-1] + needed_count + 1))
        for pushed_gid in group_size.keys():
            if pushed_gid > gid:
                group_members[pushed_gid] = [x + needed_count for x in group_members[pushed_gid]]
        return new_mb, new_times, new_ids

    def get_groups_and_subsamples(self, sample_id_seqlens, config):
        """Its ``get_groups_and_subsamples``: (groups of lengths per rank, groups of sample ids per rank)."""
        groups, sample_id_groups = [], []
        sample_id_seqlens = sorted(sample_id_seqlens, key=lambda x: x[1], reverse=True)
        while sample_id_seqlens:
            mb, sample_id_seqlens, _, sample_ids = self.next_hdp_group(sample_id_seqlens, self.total_hdp_gpus)
            groups.append(mb)
            sample_id_groups.append(sample_ids)
        return groups, sample_id_groups
