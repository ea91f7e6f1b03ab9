"""The plan autotuner (--overlap-autotune) and plan files (--overlap-plan)."""

import json

import torch

import pytest

from megatron_overlap.tp.autotune import PlanChoice, candidates, load_plan_file
from megatron_overlap.errors import OverlapConfigError

from . import rank_fns


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
    with pytest.raises(OverlapConfigError, match="^--overlap-plan: .*entry 'default' is not a plan choice"):
        load_plan_file(str(bad))


def test_every_rank_agrees_and_the_cache_is_reused(pool4, tmp_path):
    results = pool4.run(rank_fns.plan_tuner_agreement, str(tmp_path))
    assert len({r["first"] for r in results}) == 1, results
    assert results[0]["first"] == results[0]["expected"], results
    assert all(r["second"] == r["first"] and r["measured"] == r["candidates"] == 8 for r in results), results


def test_autotuned_and_planned_layers_match_stock(pool4, tmp_path):
    tuned = pool4.run(rank_fns.autotuned_layers_match_stock, 2, ["--overlap-tp", "p2p", "--overlap-autotune"],
                      str(tmp_path / "cache"))
    for r in tuned:
        assert r["worst"] <= 1e-6 and r["entries"] == 2, r  # fc1 and fc2: one cached pick each
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"default": "c2-ring"}))
    planned = pool4.run(rank_fns.autotuned_layers_match_stock, 2, ["--overlap-tp", "p2p", "--overlap-plan", str(plan)],
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
    the current CUDA device. On this CPU-only torch that shows as the error of making it there,
    raised before any collective; a CPU tensor reaching all_reduce fails the test."""
    import torch.distributed as dist

    from megatron_overlap.comm import agree
    from megatron_overlap.tune.cache import DiskCache, choose

    reduced = []
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(dist, "all_reduce", lambda t, op=None, group=None: reduced.append(t.device))
    assert agree.group_device(object()) == torch.device("cuda", 0)
    agreement = agree.GroupAgreement(object())
    for call in (lambda: agreement.max([1.0, 2.0]), lambda: agreement.any(True),
                 lambda: choose(DiskCache("t", directory="/nonexistent"), "k", [1, 2], float, agreement)):
        with pytest.raises((AssertionError, RuntimeError), match="CUDA"):
            call()
    assert reduced == []  # no tensor ever reached the collective on the wrong device
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    assert agree.group_device(object()) == torch.device("cpu") and agreement.max([3.0]) == [3.0]
    assert reduced == [torch.device("cpu")]
