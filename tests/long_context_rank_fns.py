"""Rank functions of tests/test_long_context_lab.py (run on the test pool's gloo ranks)."""

import torch
import torch.distributed as dist


def tier_bytes(node_size: int, nbytes: int) -> dict:
    """Each rank sends ``nbytes`` to the next (a ring) on a two-tier emulated link: what its link
    counted per tier, and the tier a transfer to the next rank is priced at."""
    from megatron_overlap.lab.emulated_link import EmulatedLink
    from megatron_overlap.lab.link_spec import LinkSpec
    from megatron_overlap.tune.two_tier import TwoTierLink

    me, world = dist.get_rank(), dist.get_world_size()
    two_tier = TwoTierLink(node_size=node_size, intra_GBps=100.0, inter_GBps=10.0, intra_latency_us=1.0,
                           inter_latency_us=5.0)
    with EmulatedLink(LinkSpec.two_tier(two_tier, bandwidth_factor=1.0, time_factor=1.0)) as link:
        send = torch.zeros(nbytes, dtype=torch.uint8)
        recv = torch.empty(nbytes, dtype=torch.uint8)
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, send, (me + 1) % world),
                                        dist.P2POp(dist.irecv, recv, (me - 1) % world)])
        for w in works:
            w.wait()
        stats = link.reset()
    return {"bytes_by_tier": dict(stats.bytes_by_tier), "tier": two_tier.tier((me, (me + 1) % world))}
