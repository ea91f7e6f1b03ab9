"""No path waits forever: when a peer never sends, every wait of every multi-rank path ends
with an error once the process group's timeout has passed (TP rings, CP ring and all-to-all,
the HDP exchange, the emulated link's waits, a pipeline stage's P2P and the data-parallel
gradient sync under ``--overlap-pp``). The fused kernels' own waits: tests/test_kernels.py."""

import datetime
import os
import socket
import time

import torch.multiprocessing as mp

TIMEOUT_S = 3
CASES = ("ag", "rs", "cp_ring", "cp_a2a", "hdp_exchange", "link", "pp_p2p", "pp_dp_sync", "pp_vpp_p2p")
WORLD = {"pp_dp_sync": 4}  # PP=2 x DP=2; the others run on 2 ranks
# (silent rank, the rank that reports): pp_dp_sync's rank 3 is stage 1 of replica 1, so rank 2
# (stage 1 of replica 0) meets it only in the data-parallel gradient sync
ROLES = {"pp_dp_sync": (3, 2)}


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


def _pipeline(which: str):
    """Every rank builds the pipeline (group creation is collective); --overlap-pp zb installed."""
    import megatron_overlap
    from megatron_overlap.config import OverlapConfig, PPConfig
    from megatron_overlap.lab import cpu_shims
    from megatron_overlap.lab.pipeline_gpt import PipelineGPT, PipelineTrainer

    cpu_shims.apply()
    from megatron_overlap.lab import tiny_gpt

    tiny_gpt.init_parallel(1, pp=2, timeout_minutes=TIMEOUT_S / 60)  # Megatron's groups: the same timeout
    if which == "pp_vpp_p2p":  # PP=2 x VPP=2: stage 0's chunk 1 waits for stage 1's chunk 0
        from megatron_overlap.lab.virtual_gpt import VirtualPipelineTrainer

        spec = tiny_gpt.TinyGPT(num_layers=4, hidden=64, ffn=160, heads=4, kv_heads=2, vocab=256, seq=32, micro_batch=2)
        trainer = VirtualPipelineTrainer(PipelineGPT(spec=spec, pp=2), 2, overlap_grad_reduce=True)
        megatron_overlap.install(OverlapConfig(pp=PPConfig(mode="zb")))
        return trainer
    trainer = PipelineTrainer(PipelineGPT(pp=2), overlap_grad_reduce=True)
    megatron_overlap.install(OverlapConfig(pp=PPConfig(mode="zb")))
    return trainer


def _rank(rank, port, which, results):
    import torch.distributed as dist

    world = WORLD.get(which, 2)
    if which.startswith("pp_"):
        import megatron.core  # noqa: F401  (the heavy import before the rendezvous, not inside its timeout)
    # rendezvous on a store with a generous timeout (16 processes start at once on 2 cores), then
    # the process group with the short one every tested wait must honour
    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0, timeout=datetime.timedelta(seconds=120))
    store.add("arrived", 1)
    if rank == 0:
        deadline = time.monotonic() + 120
        while store.add("arrived", 0) < world and time.monotonic() < deadline:
            time.sleep(0.05)
        store.set("go", "1")
    else:
        store.wait(["go"], datetime.timedelta(seconds=120))
    dist.init_process_group("gloo", rank=rank, world_size=world, store=store,
                            timeout=datetime.timedelta(seconds=TIMEOUT_S))
    link = trainer = None
    if which == "link":  # both ranks put the emulated link in place (a collective), then one goes silent
        from megatron_overlap.lab.emulated_link import EmulatedLink, LinkSpec

        link = EmulatedLink(LinkSpec(bandwidth_GBps=1.0)).install()
    if which.startswith("pp_"):
        trainer = _pipeline(which)
        dist.barrier()
    silent, reporter = ROLES.get(which, (1, 0))
    if rank == silent:
        time.sleep(2 * TIMEOUT_S + 2)  # alive but silent: never joins
        return
    if rank != reporter:  # the other ranks of the 4-rank case run the step and stay quiet
        try:
            trainer.step(0)
        except Exception:
            pass
        return
    t0 = time.monotonic()
    try:
        if trainer is not None:
            trainer.step(0)
        else:
            _work(which)
        results.put((which, "returned", time.monotonic() - t0))
    except Exception as exc:
        results.put((which, f"{type(exc).__name__}: {exc}", time.monotonic() - t0))


def test_a_silent_peer_ends_every_path_in_an_error_within_the_timeout():
    import torch.distributed as dist

    # fork: the children inherit this process's imports (spawn re-imports torch and Megatron in 18
    # processes at once on 2 cores, ~1 min); spawn where this process holds a process group itself
    ctx = mp.get_context("spawn" if dist.is_initialized() or not hasattr(os, "fork") else "fork")
    results = ctx.Queue()
    procs = []
    for which in CASES:  # all at once: the ranks mostly sleep, in their waits or in their silence
        port = _free_port()
        procs += [ctx.Process(target=_rank, args=(r, port, which, results)) for r in range(WORLD.get(which, 2))]
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
    # the plain and the virtual executor fail a transfer alike (one core): the stage, the
    # transfer (with its model chunk where there are several) and the flag that bounds the wait
    for which in ("pp_p2p", "pp_vpp_p2p"):
        message = got[which][0]
        assert "pipeline stage 0" in message and "did not complete" in message, (which, message)
        assert "peer stage is silent" in message and "--overlap-timeout-s" in message, (which, message)
    assert "model chunk" in got["pp_vpp_p2p"][0] and "model chunk" not in got["pp_p2p"][0], got
    assert "data-parallel gradient sync" in got["pp_dp_sync"][0], got["pp_dp_sync"]
