"""The plan autotuner (--overlap-tp-autotune) and plan files (--overlap-tp-plan-file)."""

import json

import torch

import pytest

from megatron_overlap.tp.autotune import PlanChoice, candidates, load_plan_file
from megatron_overlap.errors import OverlapConfigError

from . import gpt_rank_fns, tune_rank_fns


def test_choices_round_trip_and_candidates():
    for text in ("c0t-ring", "c2-a2a", "c4-ring"):
        assert PlanChoice.parse(text).key() == text
    with pytest.raises(ValueError, match="not a plan choice"):
        PlanChoice.parse("two chunks")
    assert [c.key() for c in candidates(2, 100, 1)] == ["c0t-ring", "c1-ring", "c2-ring", "c4-ring"]
    assert len(candidates(4, 3, 1)) == 6  # 4 chunks do not fit 3 rows; ring and a2a for TP > 2


def test_plan_file_formats_and_errors(tmp_path):
    good = tmp_path / "plan.json"
    good.write_text(json.dumps({"default": "c2-ring", "column|x": {"choice": "c0t-a2a", "timings_s": {}}}))
    plans = load_plan_file(str(good))
    assert plans["default"] == PlanChoice(2, False, "ring") and plans["column|x"].rs == "a2a"
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"default": "fast"}))
    with pytest.raises(OverlapConfigError, match="^--overlap-tp-plan-file: .*entry 'default' is not a plan choice"):
        load_plan_file(str(bad))


def test_every_rank_agrees_and_the_cache_is_reused(pool4, tmp_path):
    results = pool4.run(tune_rank_fns.plan_tuner_agreement, str(tmp_path))
    assert len({r["first"] for r in results}) == 1, results
    assert results[0]["first"] == results[0]["expected"], results
    assert all(r["second"] == r["first"] and r["measured"] == r["candidates"] == 8 for r in results), results


def test_autotuned_and_planned_layers_match_stock(pool4, tmp_path):
    tuned = pool4.run(tune_rank_fns.autotuned_layers_match_stock, 2, ["--overlap-tp", "p2p", "--overlap-tp-autotune"],
                      str(tmp_path / "cache"))
    for r in tuned:
        assert r["worst"] <= 1e-6 and r["entries"] == 2, r  # fc1 and fc2: one cached pick each
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"default": "c2-ring"}))
    planned = pool4.run(tune_rank_fns.autotuned_layers_match_stock, 2, ["--overlap-tp", "p2p", "--overlap-tp-plan-file", str(plan)],
                        str(tmp_path / "unused"))
    for r in planned:
        assert r["worst"] <= 1e-6 and r["pieces"] == [2] and r["entries"] == 0, r


def test_auto_asks_the_cost_model_on_a_known_gpu():
    import argparse

    from megatron_overlap.tune.auto import hardware_for_device, predicted_choice

    assert hardware_for_device("NVIDIA H100 80GB HBM3") == "h100-sxm"
    assert hardware_for_device("NVIDIA A100-PCIE-40GB") == "a100-pcie"
    assert hardware_for_device("cpu") is None and hardware_for_device(None) is None
    args = argparse.Namespace(hidden_size=8192, ffn_hidden_size=28672, num_attention_heads=64, group_query_attention=True,
                              num_query_groups=8, num_layers=80, seq_length=8192, swiglu=True, padded_vocab_size=128256,
                              tensor_model_parallel_size=8, context_parallel_size=1, pipeline_model_parallel_size=1,
                              micro_batch_size=1)
    best, stock = predicted_choice(args, "NVIDIA H100 80GB HBM3", symm_mem_usable=False)
    assert best.strategy.name == "p2p" and best.step_ms < stock.step_ms  # fused/symm-mem not offered here
    best, _ = predicted_choice(args, "NVIDIA H100 80GB HBM3", symm_mem_usable=True)
    assert best.strategy.name in ("p2p", "symm-mem")
    assert predicted_choice(args, "cpu", True) is None


def test_agreement_tensors_go_to_the_groups_device(monkeypatch):
    """NCCL reduces CUDA tensors only: under a NCCL group the agreement's tensor must be made on
    the current CUDA device. On a CPU-only torch that shows as the error of making it there,
    raised before any collective; with CUDA, as the tensors reaching all_reduce on cuda:0. A CPU
    tensor reaching all_reduce fails the test either way."""
    import torch.distributed as dist

    from megatron_overlap.comm import agree
    from megatron_overlap.tune.cache import DiskCache, choose

    reduced = []
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(dist, "all_reduce", lambda t, op=None, group=None, async_op=False: reduced.append(t.device))
    assert agree.group_device(object()) == torch.device("cuda", 0)
    agreement = agree.GroupAgreement(object())
    for call in (lambda: agreement.max([1.0, 2.0]), lambda: agreement.any(True),
                 lambda: choose(DiskCache("t", directory="/nonexistent"), "k", [1, 2], float, agreement)):
        if torch.cuda.is_available():
            call()
        else:
            with pytest.raises((AssertionError, RuntimeError), match="CUDA"):
                call()
    # no tensor ever reached the collective on the wrong device
    assert set(reduced) <= {torch.device("cuda", 0)} and (len(reduced) >= 3) == torch.cuda.is_available(), reduced
    reduced.clear()
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    assert agree.group_device(object()) == torch.device("cpu") and agreement.max([3.0]) == [3.0]
    assert reduced == [torch.device("cpu")]


def _llama70b_args(*flags):
    from .flag_args import megatron_args

    args = megatron_args("--overlap-tp", "auto", *flags, tp=8, seq=8192, heads=64, kv_heads=8)
    args.hidden_size, args.ffn_hidden_size, args.num_layers = 8192, 28672, 80
    args.swiglu, args.padded_vocab_size = True, 128256
    return args


@pytest.mark.parametrize("symm", [False, True], ids=["no-symm-mem", "symm-mem-usable"])
def test_install_resolves_auto_once_from_the_cost_model(monkeypatch, caplog, symm):
    """install() with Megatron's full args on a GPU the cost model knows (an H100 here, by name):
    ``auto`` becomes the cost model's pick, said in one notice, and the installation runs that."""
    import logging

    import megatron_overlap
    from megatron_overlap.integration import linears
    from megatron_overlap.tune.auto import predicted_choice

    monkeypatch.setattr(linears, "_cuda_device_name", lambda: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(linears, "_symm_mem_usable", lambda: symm)
    if symm:  # the installation must be able to build the backend it picked, on this CPU
        from megatron_overlap.tp.backends import symm_mem

        monkeypatch.setattr(symm_mem, "availability", lambda *a, **k: (True, "test"))
    args = _llama70b_args()
    best, stock = predicted_choice(args, "NVIDIA H100 80GB HBM3", symm)
    with caplog.at_level(logging.WARNING, logger="megatron_overlap"):
        inst = megatron_overlap.install(args)
    tp = inst.config.tp
    assert tp.mode == best.strategy.name and inst.requested.tp.mode == "auto"
    if tp.mode == "p2p":
        assert (tp.chunks, tp.rs) == (best.strategy.chunks * 8, best.strategy.rs)
    assert sum("the cost model picks" in r.getMessage() for r in caplog.records) == 1
    assert megatron_overlap.install(args) is inst  # Megatron parses twice: same installation


def test_sub_batches_auto_is_resolved_at_install(monkeypatch, caplog):
    """``--overlap-tp-sub-batches auto``: on a GPU the cost model knows, the count and blocks it
    predicts fastest for the backend asked (``auto`` too); with no answer (this CPU) the blocks run whole,
    said in a notice, never cut on a guess."""
    import logging

    import megatron_overlap
    from megatron_overlap.integration import linears
    from megatron_overlap.tune.auto import predicted_choice

    monkeypatch.setattr(linears, "_cuda_device_name", lambda: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(linears, "_symm_mem_usable", lambda: False)
    from megatron_overlap.tp.backends import symm_mem

    monkeypatch.setattr(symm_mem, "availability", lambda *a, **k: (True, "test"))  # built, never run, here
    picked = {}
    for mode, backend, symm in (("p2p", "p2p", False), ("auto", None, True)):
        monkeypatch.setattr(linears, "_symm_mem_usable", lambda: symm)
        args = _llama70b_args("--overlap-tp-sub-batches", "auto")
        args.overlap_tp, args.micro_batch_size = mode, 1 if backend else 4
        best, _ = predicted_choice(args, "NVIDIA H100 80GB HBM3", symm, sub_batches="auto", backend=backend)
        with caplog.at_level(logging.WARNING, logger="megatron_overlap"):
            inst = megatron_overlap.install(args)
        assert inst.requested.tp.sub_batches == "auto" and inst.config.tp.mode == best.strategy.name
        assert inst.config.tp.sub_batches == best.strategy.sub_batches, best.name
        assert inst.config.tp.sub_batch_blocks == best.strategy.cut, best.name
        picked[mode] = (best.strategy.name, best.strategy.sub_batches, best.strategy.cut)
        megatron_overlap.uninstall()
    # the cost model's picks for these two (TP=8, seq 8192 on an H100): 2 sub-batches of the attention blocks
    # only, p2p at micro-batch 1 and symm-mem at micro-batch 4, 0.1% and 0.2% ahead of their whole blocks (every
    # backend's backward re-gathers each Column's input early, whole: every block cut in 2 is slower there)
    assert picked == {"p2p": ("p2p", 2, "attention"), "auto": ("symm-mem", 2, "attention")}, picked
    assert any("--overlap-tp-sub-batches auto: the cost model picks 2 (attention blocks) for p2p" in r.getMessage()
               for r in caplog.records)
    monkeypatch.setattr(linears, "_cuda_device_name", lambda: None)
    monkeypatch.setattr(symm_mem, "availability", lambda *a, **k: (False, "no CUDA here"))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="megatron_overlap"):
        inst = megatron_overlap.install(_llama70b_args("--overlap-tp-sub-batches", "auto"))
    assert inst.config.tp.sub_batches == 1 and inst.config.tp.mode == "p2p"
    assert any("--overlap-tp-sub-batches auto: the cost model has no answer here (no GPU it knows" in r.getMessage()
               for r in caplog.records)
    megatron_overlap.uninstall()


def test_auto_honours_an_explicit_decomposition(monkeypatch, caplog):
    """``auto`` with ``--overlap-tp-chunks`` / ``-rs`` given: the user's values are kept and only
    a backend that takes them (p2p), or stock, is chosen; never symm-mem, never an error about a
    backend the user did not ask for."""
    import logging

    import megatron_overlap
    from megatron_overlap.integration import linears

    monkeypatch.setattr(linears, "_cuda_device_name", lambda: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(linears, "_symm_mem_usable", lambda: True)
    with caplog.at_level(logging.WARNING, logger="megatron_overlap"):
        inst = megatron_overlap.install(_llama70b_args("--overlap-tp-chunks", "16", "--overlap-tp-rs", "a2a"))
    tp = inst.config.tp
    assert tp.mode in ("p2p", "off")
    if tp.mode == "p2p":
        assert (tp.chunks, tp.rs) == (16, "a2a")
    assert any("kept" in r.getMessage() or "unused" in r.getMessage() for r in caplog.records)
    megatron_overlap.uninstall()
    # no cost model (a CPU here): the explicit values still go to p2p
    monkeypatch.setattr(linears, "_cuda_device_name", lambda: None)
    inst = megatron_overlap.install(_llama70b_args("--overlap-tp-bidirectional"))
    assert inst.config.tp.mode == "p2p" and inst.config.tp.bidirectional


def test_fresh_cache_autotune_leaves_training_untouched(pool4, tmp_path):
    """Dropout on: a run that measures every shape (empty cache) trains exactly like one
    that does not autotune, and like one that reads the cache the first run wrote; the
    measurements draw from a private generator, never the default one dropout uses."""
    flags = ["--overlap-tp", "p2p"]
    plain = pool4.run(gpt_rank_fns.gpt_losses_with_dropout, 2, 3, flags, str(tmp_path / "none"))
    fresh = pool4.run(gpt_rank_fns.gpt_losses_with_dropout, 2, 3, flags + ["--overlap-tp-autotune"], str(tmp_path / "c"))
    cached = pool4.run(gpt_rank_fns.gpt_losses_with_dropout, 2, 3, flags + ["--overlap-tp-autotune"], str(tmp_path / "c"))
    stock = pool4.run(gpt_rank_fns.gpt_losses_with_dropout, 2, 3, [], str(tmp_path / "none"))
    for p, f, c, s in zip(plain, fresh, cached, stock):
        assert f["entries"] > 0 and p["entries"] == 0, (p, f)  # the fresh run measured and wrote the cache
        assert f["losses"] == p["losses"] == c["losses"] == s["losses"], (p, f, c, s)
    assert len({tuple(r["losses"]) for r in plain}) == 1  # one loss per step, the same on every rank
    # dropout is on: the losses differ from a run without it (so the RNG stream is in play)
    no_dropout = pool4.run(gpt_rank_fns.gpt_losses, 2, 3, flags, False)
    assert no_dropout[0] != plain[0]["losses"]
