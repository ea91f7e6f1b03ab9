"""No path waits forever: when a peer never sends, every wait in the overlapped ops ends with an
error once the process group's timeout has passed."""

import datetime
import os
import socket
import time

import torch.multiprocessing as mp


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank, port, which, results):
    import torch
    import torch.distributed as dist

    from megatron_overlap.comm.rings import split_pieces
    from megatron_overlap.tp.ag_gemm import ag_gemm
    from megatron_overlap.tp.gemm_rs import gemm_rs

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=3))
    if rank == 1:
        time.sleep(6)  # alive but silent: never joins the ring
        return
    pieces = split_pieces(8, 2)
    t0 = time.monotonic()
    try:
        if which == "ag":
            ag_gemm(torch.randn(8, 2, 16), torch.randn(4, 16), dist.group.WORLD, pieces)
        else:
            gemm_rs(torch.randn(16, 2, 16), torch.randn(4, 16), dist.group.WORLD, pieces)
        results.put(("returned", time.monotonic() - t0))
    except Exception as exc:
        results.put((f"{type(exc).__name__}: {exc}", time.monotonic() - t0))


def test_silent_peer_ends_in_an_error_not_a_hang():
    ctx = mp.get_context("spawn")
    for which in ("ag", "rs"):
        results = ctx.Queue()
        port = _free_port()
        procs = [ctx.Process(target=_rank, args=(r, port, which, results)) for r in range(2)]
        for p in procs:
            p.start()
        message, elapsed = results.get(timeout=60)
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        assert "Timed out" in message or "timeout" in message.lower(), message
        assert 2.5 <= elapsed <= 20, (which, elapsed)
