"""No path waits forever: when a peer never sends, every wait of every multi-rank path ends
with an error once the process group's timeout has passed (TP rings, CP ring and all-to-all,
the HDP exchange, the emulated link's waits). The fused kernels' own waits: tests/test_kernels.py."""

import datetime
import os
import socket
import time

import torch.multiprocessing as mp

TIMEOUT_S = 3
CASES = ("ag", "rs", "cp_ring", "cp_a2a", "hdp_exchange", "link")


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _work(which: str):
    """What rank 0 runs while rank 1 is alive but silent."""
    import torch
    import torch.distributed as dist

    group = dist.group.WORLD
    if which in ("ag", "rs", "link"):
        from megatron_overlap.comm.rings import split_pieces
        from megatron_overlap.tp.ag_gemm import ag_gemm
        from megatron_overlap.tp.gemm_rs import gemm_rs

        if which == "rs":
            return gemm_rs(torch.randn(16, 2, 16), torch.randn(4, 16), group, split_pieces(8, 2))
        return ag_gemm(torch.randn(8, 2, 16), torch.randn(4, 16), group, split_pieces(8, 2))
    if which.startswith("cp_"):
        from megatron_overlap.cp import cp_attention

        q, k, v = (torch.randn(16, 1, 4, 8) for _ in range(3))
        return cp_attention(q, k, v, mode=which[3:], causal=True, group=group)
    from megatron_overlap.hdp.exchange import exchange_rows
    from megatron_overlap.hdp.samples import Sample
    from megatron_overlap.hdp.scheduler import schedule_hdp

    plan = schedule_hdp([40], 2, 32)  # one 40-token sequence over a ring of the 2 ranks: half of it moves
    sample = Sample(torch.arange(40), torch.arange(40), torch.ones(40))
    return exchange_rows(plan, [sample], ((0, 0),), group)


def _rank(rank, port, which, results):
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=TIMEOUT_S))
    link = None
    if which == "link":  # both ranks put the emulated link in place (a collective), then one goes silent
        from megatron_overlap.lab.emulated_link import EmulatedLink, LinkSpec

        link = EmulatedLink(LinkSpec(bandwidth_GBps=1.0)).install()
    if rank == 1:
        time.sleep(2 * TIMEOUT_S + 2)  # alive but silent: never joins
        return
    t0 = time.monotonic()
    try:
        _work(which)
        results.put((which, "returned", time.monotonic() - t0))
    except Exception as exc:
        results.put((which, f"{type(exc).__name__}: {exc}", time.monotonic() - t0))


def test_a_silent_peer_ends_every_path_in_an_error_within_the_timeout():
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = []
    for which in CASES:  # all at once: the ranks mostly sleep, in their waits or in their silence
        port = _free_port()
        procs += [ctx.Process(target=_rank, args=(r, port, which, results)) for r in range(2)]
    for p in procs:
        p.start()
    got = {}
    for _ in CASES:
        which, message, elapsed = results.get(timeout=120)
        got[which] = (message, elapsed)
    for p in procs:
        p.join(timeout=30)
        if p.is_alive():
            p.kill()
    for which in CASES:
        message, elapsed = got[which]
        assert "Timed out" in message or "timeout" in message.lower(), (which, message)
        # ends once the group's timeout has passed, not much later (one wait, not one per piece)
        assert TIMEOUT_S * 0.8 <= elapsed <= TIMEOUT_S * 4, (which, elapsed)
