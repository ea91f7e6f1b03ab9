"""Virtual pipelines through Megatron's own training step: the tiny GPT as PP=2 x
VPP=2 (two model chunks per stage in Megatron's interleaved placement, each in its own Megatron
DDP; PP=2 x DP=2 in the 4-rank pool) and PP=4 x VPP=2, Megatron's interleaved 1F1B against our
interleaved ``1f1b`` and ``zb`` from the same start; m in {p, 2p, 3p} (PP=4: p, 3p); DDP with
overlap_grad_reduce off and
on (then each chunk's ``start_grad_sync`` is the ``grad_sync_func``, as Megatron-LM sets it).

Tolerance 1e-6 (the required one); expected and seen: bit-identical (0.0), because the same forward
and backward ops run on the same tensors and every weight gradient accumulates in micro-batch
order per chunk as stock's. Megatron's P2P as Megatron-LM configures it with a virtual pipeline
(overlapped, not batched): batched at PP=2 its schedule's step pairs an activation with a
gradient (both go to the one other rank) and its own losses move (``lab/virtual_gpt.py``)."""

import pytest
import torch

from . import pp_rank_fns

TOL = 1e-6


@pytest.mark.parametrize("overlap_grad_reduce", [False, True], ids=["ddp-sync", "ddp-overlap"])
@pytest.mark.parametrize("p, ms", [(2, (2, 4, 6)), (4, (4, 12))], ids=["pp2-dp2", "pp4"])
def test_interleaved_1f1b_and_zb_train_like_megatrons_interleaved(pool4, overlap_grad_reduce, p, ms):
    v = 2
    runs = [(mode, m) for m in ms for mode in ("off", "1f1b", "zb")]
    results = pool4.run(pp_rank_fns.vpp_runs, p, v, overlap_grad_reduce, runs, 3)
    for rank, per_run in enumerate(results):
        for m in ms:
            stock = per_run[f"off/{m}"]
            for mode in ("1f1b", "zb"):
                ours = per_run[f"{mode}/{m}"]
                assert ours["calls"].get(f"pp.{mode}.interleaved") == 3, (rank, mode, ours["calls"])
                for a, b in zip(ours["losses"], stock["losses"]):
                    assert abs(a - b) <= TOL * abs(b), (rank, mode, m, ours["losses"], stock["losses"])
                worst = max(pp_rank_fns.rel(x, y) for x, y in zip(ours["grads"], stock["grads"]))
                assert worst <= TOL, (rank, mode, m, worst)
                if mode == "zb":
                    assert ours["ran"] > 0, rank  # the weight gradients waited for W
        assert len({tuple(per_run[f"off/{m}"]["losses"]) for m in ms}) == len(ms)  # real, different runs


def test_distributed_optimizer_with_overlapped_gathers_keeps_the_numerics(pool4):
    """PP=2 x VPP=2 x DP=2, Megatron's distributed optimizer (Adam, clipping) with
    overlap_grad_reduce and overlap_param_gather, align_param_gather (each chunk's gather launched
    by the schedule): losses, every gradient buffer after one step and every parameter after the
    last bit-identical to Megatron's interleaved 1F1B. The buckets: stock's on stage 0's first
    chunk only (one per chunk elsewhere), and so ours by default; with ``--overlap-pp-buckets
    every-chunk`` on every stage and chunk (``ddp.py``), each sent by DDP's hook as it fills (a
    step after the first), once, and the data-parallel gradients (gathered from the shards, which
    the other cut places elsewhere) within 1e-6. The gathers: stock dispatches a
    chunk's bucket groups in their order (bucket 0 holds the chunk's last layers, so its first
    forward waits for all of them); ours last first, the order the forward needs them."""
    runs = [("off", 4, "megatron"), ("1f1b", 4, "every-chunk"), ("zb", 4, "every-chunk"), ("zb", 4, "megatron")]
    for rank, per_run in enumerate(pool4.run(pp_rank_fns.vpp_runs_distopt, 2, 2, runs, 3)):
        stock = per_run["off/4/megatron"]
        plain = per_run["zb/4/megatron"]  # the default: Megatron's buckets, ours only reorders the gathers
        assert sorted(plain["gathers"]) == sorted(stock["gathers"]) and plain["losses"] == stock["losses"], rank
        assert plain["params"] and all(torch.equal(x, y) for x, y in zip(plain["params"], stock["params"])), rank
        chunk0 = [k for c, k in stock["gathers"] if c == 0]
        assert chunk0 == sorted(chunk0) and (len(chunk0) > 1) == (rank < 2), (rank, stock["gathers"])  # bucketed on stage 0
        assert [k for c, k in stock["gathers"] if c == 1] == [0], (rank, stock["gathers"])
        for mode in ("1f1b", "zb"):
            ours = per_run[f"{mode}/4/every-chunk"]
            groups = {c: sorted(k for cc, k in ours["gathers"] if cc == c) for c in (0, 1)}
            assert all(len(g) > 1 and g == list(range(len(g))) for g in groups.values()), (rank, mode, groups)
            assert ours["gathers"] == [(c, k) for c in (0, 1) for k in reversed(groups[c])], (rank, mode, ours["gathers"])
            assert sorted(ours["reduces"]) == [(c, k, True) for c in (0, 1) for k in groups[c]], (rank, mode, ours)
            assert ours["calls"].get("pp.buckets_everywhere") == 2 and ours["calls"].get("pp.buckets_streamed"), ours
            for a, b in zip(ours["losses"], stock["losses"]):
                assert abs(a - b) <= TOL * abs(b), (rank, mode, ours["losses"], stock["losses"])
            for name in ("grads", "params"):
                worst = max(pp_rank_fns.rel(x, y) for x, y in zip(ours[name], stock[name]))
                assert worst <= TOL, (rank, mode, name, worst)
        assert stock["losses"][0] != stock["losses"][-1]  # it trains


@pytest.mark.parametrize("m", [2, 4])
def test_zbv_trains_like_the_same_model_as_one_stage(pool4, m):
    """``--overlap-pp zbv``: the tiny GPT (8 layers) as PP=2 x VPP=2 in a V (stage 0: layers 0-1 and
    6-7, the loss; stage 1: layers 2-5), x DP=2, against the same model built as one stage with
    the same weights, fed every replica's micro-batches: step 0's loss within 1e-6 and every
    gradient within 1e-6 (seen: ~1e-7; the one-stage reference sums 2m micro-batches' gradients
    in one buffer where DDP averages two replicas' sums: fp32 reordering). Distributed
    checkpointing sees the V's chunks at their global layer offsets under the same keys as the
    stock layout's, so a checkpoint keeps Megatron's numbering in either layout."""
    for rank, r in enumerate(pool4.run(pp_rank_fns.zbv_vs_one_stage, m)):
        assert abs(r["loss"] - r["ref_loss"]) <= TOL * abs(r["ref_loss"]), (rank, r["loss"], r["ref_loss"])
        assert r["worst"] <= TOL, (rank, r["worst"])
        assert r["calls"].get("pp.zbv.interleaved") == 1 and r["calls"].get("pp.zbv.offset", 0) > 0, r["calls"]
        stage = rank // 2  # Megatron's order: the data-parallel pairs (0, 1) and (2, 3) are stages 0 and 1
        assert r["checkpoint"]["layers"] == ([[0, 1], [6, 7]] if stage == 0 else [[2, 3], [4, 5]]), (rank, r)
        assert r["stock_checkpoint"]["layers"] == ([[0, 1], [4, 5]] if stage == 0 else [[2, 3], [6, 7]]), rank
        assert r["checkpoint"]["keys"] == r["stock_checkpoint"]["keys"] and r["checkpoint"]["keys"]
        assert ("decoder.final_layernorm.weight" in r["names"]) == (stage == 0)  # the V ends on stage 0


def test_zbv_checkpoint_loads_into_megatrons_interleaved_layout_and_back(pool4, tmp_path):
    """Checkpoints under ``zbv`` keep Megatron's whole-model layer numbers: the tiny GPT (8 layers)
    at PP=2 x VPP=2 x DP=2, every parameter set from its global name, saved under the V with
    Megatron's distributed checkpointing (``torch_dist``, fully parallel over DP; written in the
    rank process, ``lab/dist_ckpt.py``) and loaded into Megatron's interleaved layout, which holds
    other layers on each chunk: every parameter there then holds its global layer's values; and a
    checkpoint saved in that layout loads back into the V the same way."""
    for name in ("zbv", "stock"):
        (tmp_path / name).mkdir()
    results = pool4.run(pp_rank_fns.zbv_checkpoint_round_trip, str(tmp_path))
    for rank, r in enumerate(results):
        stage = rank // 2
        assert r["offset_calls"] > 0, r  # the V's offsets were Megatron's lookups, patched
        assert r["zbv"]["layers"] == ([[0, 1], [6, 7]] if stage == 0 else [[2, 3], [4, 5]]), (rank, r["zbv"])
        assert r["stock"]["layers"] == ([[0, 1], [4, 5]] if stage == 0 else [[2, 3], [6, 7]]), (rank, r["stock"])
        assert r["stock_before"] == r["stock_checked"] and r["zbv_before"] == r["zbv_checked"] > 0, r  # not yet held
        assert r["stock_from_zbv"] == [], (rank, r["stock_from_zbv"])
        assert r["zbv_from_stock"] == [], (rank, r["zbv_from_stock"])
    keys = {layout: set().union(*(r[layout]["all_keys"] for r in results)) for layout in ("zbv", "stock")}
    assert keys["zbv"] == keys["stock"] and {"embedding.word_embeddings.weight", "output_layer.weight",
                                              "decoder.final_layernorm.weight"} <= keys["zbv"]
    for name in ("zbv", "stock"):
        assert (tmp_path / name / "metadata.json").is_file() and list((tmp_path / name).glob("*.distcp"))
