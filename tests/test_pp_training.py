"""Pipeline schedules through Megatron's own training step: the tiny GPT on
the local spec, stock 1F1B against each of ours from the same start, in the 4-rank pool: PP=2
(as PP=2 x DP=2), PP=4, and TP=2 x PP=2 with TP overlap on; m in {p, 2p, 3p+1}; Megatron DDP
with overlap_grad_reduce on and off.

Tolerance 1e-6 (the required one): our schedules run the same forward and backward ops on the same
tensors, with every weight gradient accumulated in micro-batch order as stock does, so in fp32
on CPU they are expected bit-identical (the tests see 0.0); 1e-6 leaves room for a backend that
reorders a reduction, nothing more."""

import pytest

from . import pp_rank_fns

TOL = 1e-6
STEPS = 3  # losses after two optimizer updates, gradients after the first step
LAYOUTS = [(1, 2), (1, 4), (2, 2)]  # (TP, PP) in 4 ranks


def _runs(p):
    out = []
    for m in (p, 2 * p, 3 * p + 1):
        out += [("off", m, None), ("1f1b", m, None), ("1f1b", m, m), ("zb", m, None)]
    return out


@pytest.mark.parametrize("overlap_grad_reduce", [False, True], ids=["ddp-sync", "ddp-overlap"])
@pytest.mark.parametrize("tp, pp", LAYOUTS, ids=["pp2", "pp4", "tp2-pp2"])
def test_every_schedule_trains_like_megatrons_1f1b(pool4, tp, pp, overlap_grad_reduce):
    results = pool4.run(pp_rank_fns.pp_runs, tp, pp, overlap_grad_reduce, _runs(pp), STEPS)
    for rank, per_run in enumerate(results):
        for m in (pp, 2 * pp, 3 * pp + 1):
            stock = per_run[f"off/{m}/None"]
            for key in (f"1f1b/{m}/None", f"1f1b/{m}/{m}", f"zb/{m}/None"):
                ours = per_run[key]
                for a, b in zip(ours["losses"], stock["losses"]):
                    assert abs(a - b) <= TOL * abs(b), (rank, key, ours["losses"], stock["losses"])
                worst = max(pp_rank_fns.rel(x, y) for x, y in zip(ours["grads"], stock["grads"]))
                assert worst <= TOL, (rank, key, worst)
                if key.startswith("zb"):
                    assert ours["ran"] > 0, (rank, key)  # the weight gradients did wait for W
        assert len({tuple(r["losses"]) for r in per_run.values()}) >= 3  # m changes the losses: real runs


@pytest.mark.parametrize("overlap_grad_reduce", [False, True], ids=["ddp-sync", "ddp-overlap"])
def test_sub_batches_under_zero_bubble(pool4, overlap_grad_reduce):
    """TP=2 x PP=2, ZB-H1, each attention and MLP block cut into 2 sub-batches:
    the sub-batches' weight gradients wait for W like any other and the losses and gradients
    stay within 1e-6 of stock 1F1B, the bound of every pipeline test here (the cut itself keeps
    stock's bits, tests/test_training.py)."""
    m = 4
    results = pool4.run(pp_rank_fns.pp_runs, 2, 2, overlap_grad_reduce, [("off", m, None), ("zb", m, None, 2)], 2)
    for rank, per_run in enumerate(results):
        stock, ours = per_run[f"off/{m}/None"], per_run[f"zb/{m}/None/2"]
        for a, b in zip(ours["losses"], stock["losses"]):
            assert abs(a - b) <= TOL * abs(b), (rank, ours["losses"], stock["losses"])
        worst = max(pp_rank_fns.rel(x, y) for x, y in zip(ours["grads"], stock["grads"]))
        assert worst <= TOL, (rank, worst)
        # 2 layers per stage, 4 micro-batches, 2 steps: every attention and MLP block ran cut; W ran the wgrads
        cut = 2 * m * 2
        assert ours["calls"].get("tp.sub_batches") == ours["calls"].get("tp.sub_batches.attention") == cut, \
            (rank, ours["calls"])
        assert ours["ran"] > 0, rank


@pytest.mark.parametrize("tp, pp", [(1, 2), (1, 4)], ids=["pp2", "pp4"])
def test_forward_only_evaluates_like_megatron(pool4, tp, pp):
    """Megatron's evaluation path (forward_only): every schedule runs forwards only, returns
    the same losses as stock and accumulates no gradient."""
    m = 2 * pp + 1
    for rank, per_mode in enumerate(pool4.run(pp_rank_fns.pp_eval, tp, pp, ["off", "1f1b", "zb"], m)):
        stock = per_mode["off"]["loss"]
        assert stock > 0, per_mode
        for mode, r in per_mode.items():
            assert abs(r["loss"] - stock) <= TOL * abs(stock), (rank, mode, per_mode)
            assert not r["grads_touched"], (rank, mode)


def test_data_parallel_sync_in_the_bubbles_keeps_the_numerics(pool4):
    """PP=2 x DP=2, Megatron's distributed optimizer with overlap_grad_reduce and
    overlap_param_gather: our schedules dispatch the first parameter
    all-gather at the step's start, and zb drains its trailing weight gradients layer by layer
    (inside the last B on stage 0, after it on stage 1). Each parameter's weight gradients are
    still added in micro-batch order and the same reduce-scatter and all-gather run, so the
    losses, every gradient buffer after one step and every parameter after the last are
    bit-identical to stock 1F1B (0.0; TOL leaves room for a backend that reorders a reduction)."""
    runs = [(mode, m) for m in (2, 5) for mode in ("off", "1f1b", "zb")]
    for rank, per_run in enumerate(pool4.run(pp_rank_fns.pp_runs_distopt, runs, 3)):
        for m in (2, 5):
            stock = per_run[f"off/{m}"]
            for mode in ("1f1b", "zb"):
                ours = per_run[f"{mode}/{m}"]
                for a, b in zip(ours["losses"], stock["losses"]):
                    assert abs(a - b) <= TOL * abs(b), (rank, mode, m, ours["losses"], stock["losses"])
                for name in ("grads", "params"):
                    worst = max(pp_rank_fns.rel(x, y) for x, y in zip(ours[name], stock[name]))
                    assert worst <= TOL, (rank, mode, m, name, worst)
                calls = ours["calls"]
                assert calls.get("pp.param_gather_at_start") == 3, (rank, mode, calls)  # every step
                if mode == "zb":  # the drain ran, on each stage its way, every step
                    drained = calls.get("pp.drain.bw", 0) + calls.get("pp.drain.w", 0)
                    assert drained == 3 and calls.get("pp.drain.bw" if rank < 2 else "pp.drain.w") == 3, (rank, calls)
        assert stock["losses"][0] != stock["losses"][-1]  # it trains
