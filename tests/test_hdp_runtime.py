"""HDP runtime: on 4 CPU gloo ranks, a tiny GPT (fp32, Megatron's local spec, TP 1,
CP 1) on a batch of short sequences held whole and long ones sharded over rings of 2 and 3 ranks
gives the loss and the gradients of one process computing the mean over all tokens; the plan is
the same on every rank; a one-rank ring runs packed documents; the refusals name the flag."""

import pytest
import torch

from megatron_overlap.errors import OverlapConfigError
from megatron_overlap.hdp import schedule_hdp
from megatron_overlap.hdp.layout import row_layout
from megatron_overlap.hdp.runtime import HdpRuntime
from megatron_overlap.hdp.samples import Sample, as_samples, split_documents

from . import hdp_rank_fns

REL_TOL = 1e-5  # fp32; the sums run in another order than the reference's


@pytest.fixture(scope="module")
def exact_rope(pool4, module_seed):
    return pool4.run(hdp_rank_fns.exactness, module_seed, "rope")


def _check_exact(results):
    for r in results:
        assert abs(r["loss"] - r["ref_loss"]) <= REL_TOL * abs(r["ref_loss"]), r
        worst = max(r["grad_rel"].items(), key=lambda kv: kv[1])
        assert worst[1] <= REL_TOL, worst
        assert r["grad_total_rel"] <= REL_TOL, r["grad_total_rel"]
        worst = max(r["iter_grad_rel"].items(), key=lambda kv: kv[1])
        assert worst[1] <= REL_TOL, ("Megatron-style iterator path", worst)
        assert r["iter_count"] == r["global_tokens"]
        # the normalisation matters on this batch: per-rank means averaged over ranks are off
        assert r["wrong_total_rel"] > 1e-2, r["wrong_total_rel"]


def test_rope_exact_against_one_process(exact_rope):
    _check_exact(exact_rope)
    # the batch exercises what the test claims: rings of 2 and 3 (not a power of two) and
    # sequences held whole; tokens moved between ranks; micro-batch counts differ per rank
    r0 = exact_rope[0]
    assert r0["ring_sizes"] == [2, 2, 3], r0["ring_sizes"]
    assert {n for r in exact_rope for n in r["my_rings"]} == {1, 2, 3}
    assert r0["moved_tokens"] > 0
    assert len({r["microbatches"] for r in exact_rope}) > 1
    assert all(r["iterator_microbatches"] == r["microbatches"] for r in exact_rope)
    assert all(r["own_group"] for r in exact_rope)  # rings and exchange on a communicator of their own


def test_learned_absolute_positions_exact(pool4, seed):
    _check_exact(pool4.run(hdp_rank_fns.exactness, seed, "learned_absolute"))


def test_same_plan_on_every_rank(exact_rope):
    sigs = {r["signature"] for r in exact_rope}
    assert len(sigs) == 1
    lengths = [L for rank in hdp_rank_fns.LENGTHS for L in rank]
    assert exact_rope[0]["lengths"] == lengths  # global ids: rank 0's samples, then rank 1's, ...
    home = [r for r, rank in enumerate(hdp_rank_fns.LENGTHS) for _ in rank]  # who loaded each sequence
    assert repr(schedule_hdp(lengths, 4, hdp_rank_fns.CAPACITY, home=home).microbatches) == sigs.pop()
    moved = [r["moved_tokens"] for r in exact_rope]
    plan = schedule_hdp(lengths, 4, hdp_rank_fns.CAPACITY, home=home)
    assert len(set(moved)) == 1 and moved[0] == plan.moved_tokens(home)  # the exchange moves what the plan says
    assert moved[0] <= schedule_hdp(lengths, 4, hdp_rank_fns.CAPACITY).moved_tokens(home)


def test_tensor_parallel_inside_hdp_is_exact(pool4, seed):
    """TP = 2 x HDP = 2: each HDP rank a TP group (TP-overlap linears, sequence parallelism),
    rings between the groups at the same TP rank; the loss and every gradient of plain DP x TP."""
    results = pool4.run(hdp_rank_fns.exactness_tp, seed)
    for r in results:
        assert abs(r["loss"] - r["ref_loss"]) <= REL_TOL * abs(r["ref_loss"]), r
        worst = max(r["grad_rel"].items(), key=lambda kv: kv[1])
        assert worst[1] <= REL_TOL and r["grad_total_rel"] <= REL_TOL, worst
        assert r["group"] == [r["rank"] % 2, r["rank"] % 2 + 2]  # the DP ranks of one TP rank
        assert r["tp_calls"] > 0 and r["row_multiple"] == 2 and all(rows % 2 == 0 for rows in r["rows"])
        assert 2 in r["my_rings"] and 1 in r["my_rings"], r["my_rings"]  # rings between TP groups, and whole ones
    assert len({r["signature"] for r in results}) == 1  # one plan on all four ranks


def test_pipeline_parallel_hdp_is_exact(pool4, seed):
    """PP = 2 x HDP = 2 (the scheduler's pp mode, chosen by the pipeline size), under Megatron's own 1F1B schedule (variable sequence
    lengths): each stage's HDP group is its data-parallel ranks, rings run between the two
    pipelines at the same stage and index, every rank runs the same number of slots; the loss and
    every gradient of plain DP x PP on the same documents."""
    results = pool4.run(hdp_rank_fns.exactness_pp, seed)
    for r in results:
        assert "error" not in r, r.get("error")
        assert abs(r["loss"] - r["ref_loss"]) <= REL_TOL * abs(r["ref_loss"]), r
        worst = max(r["grad_rel"].items(), key=lambda kv: kv[1])
        assert worst[1] <= REL_TOL and r["grad_total_rel"] <= REL_TOL, worst
        assert r["group"] == ([0, 1] if r["stage"] == 0 else [2, 3]), r  # one stage of both pipelines
        assert 2 in r["my_rings"] and 1 in r["my_rings"], r["my_rings"]
        assert r["planned_for"] == ("pp", 2), r["planned_for"]  # plans priced for this pipeline's 2 stages
        assert r["fixed_shapes"].startswith("OverlapConfigError: --overlap-hdp: with pipeline parallelism") and \
            "variable_seq_lengths = True" in r["fixed_shapes"], r["fixed_shapes"]
    assert len({r["count"] for r in results}) == 1  # one micro-batch count on every stage of every pipeline
    assert len({r["signature"] for r in results}) == 1  # one plan on all four ranks
    assert len({r["loss"] for r in results}) == 1


def test_one_rank_ring_runs_unpadded_packed_documents(pool4, seed):
    for r in pool4.run(hdp_rank_fns.one_rank_ring, seed):
        assert r["pad_unchanged"]
        for causal in (True, False):
            assert max(r[causal].values()) <= REL_TOL, r


def test_runtime_refusals(pool4, seed):
    results = pool4.run(hdp_rank_fns.runtime_errors, seed)
    for r in results:
        kind, _, msg = r["empty"]
        assert kind == "ValueError" and "empty batch" in msg, r["empty"]
        kind, flag, msg = r["too_long"]
        assert kind == "OverlapConfigError" and flag == "--overlap-hdp-max-tokens-per-rank", r["too_long"]
        assert "200 tokens" in msg and "R x C = 128" in msg and "at least 50" in msg, msg
        kind, flag, msg = r["not_installed"]
        assert kind == "OverlapConfigError" and flag == "--overlap-hdp" and "install" in msg, r["not_installed"]
        kind, flag, msg = r["yarn"]
        assert kind == "OverlapConfigError" and flag == "--position-embedding-type" and "yarn" in msg, r["yarn"]
        kind, flag, msg = r["no_local_attention"]
        assert kind == "OverlapConfigError" and flag == "--transformer-impl", r["no_local_attention"]
    assert len({str(r) for r in results}) == 1  # every rank raised the same


# ------------------------------------------------------------------ one process, no ranks
def test_row_layout_zigzag_rows_and_true_positions():
    plan = schedule_hdp([70, 9, 17, 40, 5, 30, 23, 61, 12, 3], 4, 32)
    ring70 = [(r, k, mb) for r, mbs in enumerate(plan.microbatches) for k, mb in enumerate(mbs)
              if mb and mb[0].seq_len == 70]
    assert len(ring70) == 3
    seen = []
    for rank, k, mb in ring70:
        lay = row_layout(mb, k, rank)
        n, x = len(lay.ring), lay.position
        c = -(-70 // (2 * n))  # 12: the sequence padded to 72 rows, chunks of 12
        assert lay.rows == 2 * c and lay.cu_seqlens_padded.tolist() == [0, 2 * n * c]
        want = list(range(x * c, (x + 1) * c)) + list(range((2 * n - 1 - x) * c, (2 * n - x) * c))
        assert lay.pos.tolist() == want
        assert lay.valid.tolist() == [p < 70 for p in want]
        seen += [p for p, ok in zip(want, lay.valid.tolist()) if ok]
    assert sorted(seen) == list(range(70))
    # a micro-batch of sequences held whole: a ring of one rank, no padding, positions restart
    rank, k, mb = next((r, k, mb) for r, mbs in enumerate(plan.microbatches) for k, mb in enumerate(mbs)
                       if len(mb) > 1)
    lay = row_layout(mb, k, rank)
    assert lay.ring == (rank,) and bool(lay.valid.all())
    lens = sorted(((s.seq_id, s.seq_len) for s in mb))
    assert lay.pos.tolist() == [p for _, L in lens for p in range(L)]


def test_as_samples_formats():
    t = torch.arange(10)
    packed = as_samples({"tokens": t[None], "labels": t[None] + 1, "cu_seqlens": torch.tensor([0, 4, 10, -1, -1])})
    assert [len(s) for s in packed] == [4, 6] and packed[1].labels.tolist() == list(range(5, 11))
    rows = as_samples({"tokens": t.view(2, 5), "labels": t.view(2, 5), "loss_mask": torch.ones(2, 5)})
    assert [len(s) for s in rows] == [5, 5]
    mixed = as_samples([{"tokens": t[:3], "labels": t[:3]}, (t[:2], t[:2], torch.tensor([1.0, 0.0]))])
    assert [len(s) for s in mixed] == [3, 2] and mixed[1].loss_mask.tolist() == [1.0, 0.0]
    assert mixed[0].rows()[:, 2].to(torch.int32).view(torch.float32).tolist() == [1.0] * 3  # mask bits round-trip
    with pytest.raises(ValueError, match="cu_seqlens"):
        as_samples({"tokens": t[None], "labels": t[None], "cu_seqlens": torch.tensor([0, 4, 3, 10])})
    with pytest.raises(ValueError, match="1-D of one length"):
        Sample(t, t[:3], torch.ones(10))


def test_runtime_arguments_refused_before_any_communication():
    group = adapter = None  # never reached: the arguments are refused first
    with pytest.raises(OverlapConfigError, match="--overlap-hdp-max-tokens-per-rank"):
        HdpRuntime(0, group, adapter)
    with pytest.raises(ValueError, match="plans in mode dp or pp, not 'tp'"):
        HdpRuntime(32, group, adapter, mode="tp")
    with pytest.raises(ValueError, match="megatron_balanced"):
        HdpRuntime(32, group, adapter, scheduler="megatron_balanced")


def test_row_layout_pads_rows_to_a_multiple_for_tensor_parallelism():
    """TP > 1: a micro-batch's rows padded to a multiple of the TP size with a last document of
    padding only; on a ring every peer gets the same extra rows, an even number (2n chunks)."""
    plan = schedule_hdp([70, 9, 5], 2, 40, spread=False)
    for multiple in (1, 2, 3, 4):
        for rank in range(2):
            for k, mb in enumerate(plan.microbatches[rank]):
                if not mb:
                    continue
                base, padded = row_layout(mb, k, rank), row_layout(mb, k, rank, multiple)
                assert padded.rows % multiple == 0 and padded.rows - base.rows < 2 * multiple
                if len(base.ring) > 1:
                    assert padded.rows % 2 == 0
                assert torch.equal(padded.pos[padded.valid], base.pos[base.valid])  # the real rows unchanged
                assert torch.equal(padded.doc[:base.rows], base.doc) and not padded.valid[base.rows:].any()
                if padded.rows > base.rows:
                    assert padded.seq_ids[-1] == -1 and padded.seq_lens[-1] == 0
                    assert int(padded.cu_seqlens[-1]) == int(base.cu_seqlens[-1])


def test_split_documents_cuts_megatron_rows_where_positions_reset():
    """``--overlap-hdp`` through pretrain_gpt.py: a GPT-dataset row with --reset-position-ids holds its
    documents one after another; each restart of the positions begins a document."""
    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3], [5, 6, 0, 1, 2, 3, 4, 0, 0]])
    tokens = torch.arange(18).view(2, 9)
    mask = torch.ones(2, 9)
    mask[1, 8] = 0
    docs = split_documents(dict(tokens=tokens, labels=tokens + 1, loss_mask=mask, position_ids=pos,
                                attention_mask=None))
    assert [len(d) for d in docs] == [3, 2, 4, 2, 5, 1, 1]
    assert [int(d.tokens[0]) for d in docs] == [0, 3, 5, 9, 11, 16, 17]
    assert torch.equal(docs[-1].loss_mask, torch.zeros(1)) and torch.equal(docs[1].labels, torch.tensor([4, 5]))
    packed = split_documents(dict(tokens=torch.arange(6)[None], labels=torch.arange(6)[None],
                                  cu_seqlens=torch.tensor([0, 2, 6, -1])))
    assert [len(d) for d in packed] == [2, 4]
    with pytest.raises(ValueError, match="without \\['position_ids'\\] cannot be cut into documents"):
        split_documents(dict(tokens=tokens, labels=tokens))
    with pytest.raises(ValueError, match="position_ids \\(2, 8\\) do not match tokens \\(2, 9\\)"):
        split_documents(dict(tokens=tokens, labels=tokens, position_ids=pos[:, :8]))


def test_a_stage_that_reads_no_batch_still_moves_to_the_next_micro_batch():
    """A middle pipeline stage's get_batch returns early without reading: the script-path
    forward step must still run each micro-batch in its own ring context, not the first one's."""
    import contextlib

    from megatron_overlap.integration.hdp_loop import _Batches, _in_ring

    entered = []

    class FakeMicroBatch:
        def __init__(self, k):
            self.k = k
            self.adapter = self

        def check(self, model):
            pass

        @contextlib.contextmanager
        def context(self, model):
            entered.append(self.k)
            yield

    batches = _Batches(iter([{"hdp": FakeMicroBatch(k)} for k in range(3)]))
    step = _in_ring(lambda data_iterator, model: "no batch read")  # a middle stage
    assert [step(batches, None) for _ in range(3)] == ["no batch read"] * 3
    assert entered == [0, 1, 2]
    reads = _in_ring(lambda data_iterator, model: next(data_iterator))  # a stage that reads its batch
    batches = _Batches(iter([{"hdp": FakeMicroBatch(k), **dict.fromkeys(_Batches.KEYS, k)} for k in range(2)]))
    entered.clear()
    assert [step_out["tokens"] for step_out in (reads(batches, None), reads(batches, None))] == [0, 1]
    assert entered == [0, 1]


def test_a_recomputed_forward_runs_in_the_ring_of_its_forward(monkeypatch):
    """Megatron's activation checkpoints re-run a forward inside the backward, where
    the HDP micro-batch's ring context is no longer entered. With --overlap-hdp installed the function
    saved for the recomputation carries the ring of its forward (both checkpoint kinds); stock
    Megatron (uninstalled) recomputes with no ring. Trained through pretrain_gpt.py with
    selective and full recompute: tests/test_pretrain_gpt.py."""
    import argparse

    import megatron_overlap
    from megatron.core.tensor_parallel import random as tp_random

    from megatron_overlap.cp import ring_context

    # the CUDA RNG states Megatron's checkpoints save and restore: none on this CPU
    monkeypatch.setattr(tp_random, "_get_all_rng_states", lambda: ())
    monkeypatch.setattr(tp_random, "_set_all_rng_states", lambda *states: None)

    def rings_seen():
        seen = []

        def layer(x):
            seen.append(ring_context.current())
            return x * 2

        x = torch.ones(3, requires_grad=True)
        with ring_context.ring(None, (0,)):  # an HDP micro-batch's forward
            y = tp_random.checkpoint(layer, False, x)
            kept = tp_random.CheckpointWithoutOutput(fp8=None)  # as Megatron passes config.fp8 when off
            kept.checkpoint(layer, x)
        y.sum().backward()  # recomputes outside the ring, as the schedule's backward does
        kept._recompute(None)
        assert x.grad.tolist() == [2.0] * 3
        return seen

    megatron_overlap.install(megatron_overlap.overlap_parser().parse_args(
        ["--hdp", "--hdp-max-tokens-per-rank", "64"], argparse.Namespace()))
    try:
        seen = rings_seen()
        assert len(seen) == 4 and seen[0] is not None and all(s == seen[0] for s in seen), seen
    finally:
        megatron_overlap.uninstall()
    assert rings_seen()[2:] == [None, None]  # stock: the recomputations ran with no ring
