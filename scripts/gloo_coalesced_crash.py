"""torch 2.13 / gloo on CPU: many asynchronous coalesced all-gathers outstanding on one process group
while P2P runs on another corrupt the heap ("malloc(): unaligned tcache chunk detected", the rank
aborts). Megatron's distributed optimizer with ``align_param_gather`` (Megatron-LM's default with a
virtual pipeline) dispatches every bucket's all-gather at the step's start, as this does; the
emulated link (``lab/emulated_link.py``) therefore runs such blocks' collectives as separate
asynchronous ops on gloo. Plain torch, no Megatron, no plugin:

    python scripts/gloo_coalesced_crash.py 42 50   # 42 buckets, 50 rounds: aborts (2026-12-03, torch 2.13.0 CPU)
    python scripts/gloo_coalesced_crash.py 2 50    # two outstanding: completes
"""

import os
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def run(rank: int, buckets: int, rounds: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29618")
    dist.init_process_group("gloo", rank=rank, world_size=2)
    dp, pp = dist.new_group([0, 1]), dist.new_group([0, 1])
    bufs = [torch.zeros(6082 if i else 4994, dtype=torch.bfloat16) for i in range(buckets)]
    for _ in range(rounds):
        handles = []
        for b in bufs:
            half = b.numel() // 2
            with dist._coalescing_manager(dp, async_ops=True) as cm:
                dist.all_gather_into_tensor(b, b[rank * half:(rank + 1) * half], group=dp, async_op=True)
            handles.append(cm)
        works, keep = [], []
        for _ in range(8):
            x, y = torch.randn(20000), torch.empty(20000)
            keep.append((x, y))
            peer = 1 - rank
            pair = [dist.isend(x, peer, group=pp), dist.irecv(y, peer, group=pp)]
            works += pair if rank == 0 else pair[::-1]
        time.sleep(0.002)
        for cm in handles:
            cm.wait()
            time.sleep(0.0005)
        for w in works:
            w.wait()
    dist.destroy_process_group()
    print(f"rank {rank}: {rounds} rounds completed")


if __name__ == "__main__":
    mp.spawn(run, args=(int(sys.argv[1]), int(sys.argv[2])), nprocs=2)
