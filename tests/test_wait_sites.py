"""Failures that say where: with ``--overlap-timeout-s 2`` and the process groups'
timeout at 60 s, a peer frozen (alive, silent) or killed in a TP ring, a CP ring, an HDP ring,
the HDP exchange and a pipeline transfer ends the survivor's wait within the flag's seconds +
10 s, with an error naming the op, the layer or micro-batch and the peer rank. Cheap on purpose:
one 2-rank group per case, one tiny layer, all cases at once, the ranks forked from this process
(tests/test_timeouts.py's approach)."""

import datetime
import os
import time

import torch.multiprocessing as mp

OVERLAP_TIMEOUT_S = 2
PG_TIMEOUT_S = 60  # what the overlap timeout must beat: a wait that ran into it fails the time bound below
CASES = ("tp_freeze", "cp_kill", "hdp_ring_freeze", "hdp_exchange_freeze", "pp_freeze")


def _setup(which: str):
    """Every rank: Megatron's groups (the 60 s timeout), the plugin with the 2 s bound, a model."""
    import megatron_overlap
    from megatron_overlap.lab import cpu_shims, tiny_gpt

    cpu_shims.apply()
    if which.startswith("pp"):
        from megatron_overlap.config import CommConfig, OverlapConfig, PPConfig
        from megatron_overlap.lab.pipeline_gpt import PipelineGPT, PipelineTrainer

        tiny_gpt.init_parallel(1, pp=2, timeout_minutes=PG_TIMEOUT_S / 60)  # the trainer finds these groups
        trainer = PipelineTrainer(PipelineGPT(pp=2), overlap_grad_reduce=True)
        return megatron_overlap.install(OverlapConfig(pp=PPConfig(mode="zb"),
                                                      comm=CommConfig(timeout_s=OVERLAP_TIMEOUT_S))), trainer
    tp, cp = (2, 1) if which.startswith("tp") else (1, 2) if which.startswith("cp") else (1, 1)
    tiny_gpt.init_parallel(tp, cp=cp, timeout_minutes=PG_TIMEOUT_S / 60)
    flags = {"tp": ["--overlap-tp", "p2p"], "cp": ["--overlap-cp", "ring"],
             "hd": ["--overlap-hdp", "--overlap-hdp-max-tokens-per-rank", "16"]}[which[:2]]
    inst = megatron_overlap.install(megatron_overlap.overlap_parser().parse_args(
        flags + ["--overlap-timeout-s", str(OVERLAP_TIMEOUT_S)]))
    spec = tiny_gpt.TinyGPT(num_layers=1, hidden=32, ffn=64, heads=4, kv_heads=2, seq=16, micro_batch=1)
    if which.startswith("hdp"):
        from tests.hdp_rank_fns import build_model

        return inst, build_model("rope", 32)
    return inst, tiny_gpt.build(spec, tp, context_parallel_size=cp)


def _hdp_step(inst, rank):
    import torch

    from megatron_overlap.hdp.samples import Sample
    from megatron_overlap.integration.hdp import make_runtime

    runtime = make_runtime(inst.config.hdp)
    length = 24 if rank == 0 else 4  # 24 > 16 tokens: a ring over both ranks
    return runtime.step([Sample(torch.arange(length) % 50, torch.arange(length) % 50, torch.ones(length))])


def _survivor(which, inst, model, step):
    """What rank 0 runs while rank 1 is frozen or dead."""
    import torch

    if which.startswith("tp") or which.startswith("cp"):
        rows = 16 // 2  # the sequence split over the 2 ranks (TP: sequence parallelism; CP: zigzag shards)
        return model.decoder(hidden_states=torch.randn(rows, 1, 32), attention_mask=None)
    if which == "hdp_exchange_freeze":
        return _hdp_step(inst, 0)
    if which == "pp_freeze":
        return model.step(0)  # the pipeline trainer
    from megatron_overlap.hdp.runtime import default_forward

    ring = next(mb for mb in step.microbatches if len(mb.ring) > 1)
    with ring.context(model):
        return default_forward(model, ring)


def _rank(rank, store_path, which, results):
    import torch.distributed as dist

    try:
        # a file store: a port picked free can be taken by another process before the store listens
        store = dist.FileStore(store_path, 2)
        dist.init_process_group("gloo", rank=rank, world_size=2, store=store,
                                timeout=datetime.timedelta(seconds=PG_TIMEOUT_S))
        inst, model = _setup(which)
        step = _hdp_step(inst, rank) if which == "hdp_ring_freeze" else None
        dist.barrier()
    except Exception as exc:  # a broken setup fails the test with its reason, not a hang
        if rank == 0:
            results.put((which, f"setup failed: {type(exc).__name__}: {exc}", 0.0))
        return
    if rank == 1:
        if which.endswith("kill"):
            os._exit(1)  # dead: its sockets close
        time.sleep(OVERLAP_TIMEOUT_S + 15)  # frozen: alive, never answers
        return
    t0 = time.monotonic()
    try:
        _survivor(which, inst, model, step)
        results.put((which, "returned", time.monotonic() - t0))
    except Exception as exc:
        results.put((which, f"{type(exc).__name__}: {exc}", time.monotonic() - t0))


def test_a_frozen_or_dead_peer_ends_the_wait_in_the_timeout_naming_op_layer_and_peer(tmp_path):
    import megatron.core.models.gpt  # noqa: F401  (imported once here, inherited by the forked ranks)
    import torch.distributed as dist

    ctx = mp.get_context("spawn" if dist.is_initialized() or not hasattr(os, "fork") else "fork")
    results = ctx.Queue()
    procs = []
    for which in CASES:
        store_path = str(tmp_path / f"store-{which}")
        procs += [ctx.Process(target=_rank, args=(r, store_path, which, results)) for r in range(2)]
    for p in procs:
        p.start()
    got = {}
    for _ in CASES:
        which, message, elapsed = results.get(timeout=180)
        got[which] = (message, elapsed)
    for p in procs:  # every survivor has answered: the frozen peers need not sleep on
        if p.is_alive():
            p.kill()
        p.join(timeout=30)
    for which, (message, elapsed) in got.items():
        assert elapsed <= OVERLAP_TIMEOUT_S + 10, (which, elapsed, message)  # not the group's 60 s
        executor = "RuntimeError: megatron-overlap pipeline stage 0: "  # the executor's wrapper, as before
        assert message.startswith(executor if which == "pp_freeze" else "WaitError: megatron-overlap"), (which, message)
        assert "group rank 1 (world rank 1)" in message, (which, message)  # the peer
        if which.endswith("freeze"):
            assert f"never answered within {OVERLAP_TIMEOUT_S} s (--overlap-timeout-s)" in message, (which, message)
            assert elapsed >= OVERLAP_TIMEOUT_S * 0.8, (which, elapsed)
    tp, cp = got["tp_freeze"][0], got["cp_kill"][0]
    assert "tp.ring_all_gather: step 1 piece 0 receive" in tp and "[layer 1 linear_qkv (column" in tp, tp
    assert "ring attention forward: K/V step 1 piece 0 receive" in cp and "[layer 1 core attention forward]" in cp, cp
    assert "failed" in cp, cp  # a dead peer: the transport's error, quoted, not a timeout
    ring = got["hdp_ring_freeze"][0]
    assert "ring attention forward" in ring and "HDP micro-batch 0 (ring [0, 1])" in ring, ring
    assert "layer 1 core attention forward" in ring, ring
    exchange = got["hdp_exchange_freeze"][0]
    assert "HDP lengths all-gather" in exchange and "[HDP step]" in exchange, exchange
    pp = got["pp_freeze"][0]  # stage 0's first wait on stage 1: the activation of micro-batch 0 it sent
    assert "SEND act 0 ->1 did not complete" in pp and "[pipeline stage 0 WAIT SEND act 0 ->1]" in pp, pp
