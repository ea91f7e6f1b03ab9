"""Virtual pipelines as data: Megatron's interleaved 1F1B exactly as
megatron-core orders its model chunks (checked against Megatron's own
``forward_backward_pipelining_with_interleaving``, run with its compute recorded), interleaved
zero bubble and ZB-V validated over the required ranges, the bubble formulas, ZB-V at 1F1B's
activation memory, and the floor below every schedule."""

import random

import pytest
import torch

from megatron_overlap.errors import OverlapConfigError
from megatron_overlap.pp import build, validate
from megatron_overlap.pp.chunks import interleaved_placement, v_placement
from megatron_overlap.pp.optimal import floor
from megatron_overlap.pp.schedule import POST
from megatron_overlap.pp.schedule_sim import LinkCost, StageTimes, simulate


class _Group:
    def __init__(self, rank, size):
        self._rank, self._size = rank, size

    def rank(self):
        return self._rank

    def size(self):
        return self._size


class _Comm:
    """A P2P communicator that moves nothing: the schedule's compute order is all we record."""

    def __init__(self, group, config, v):
        self.pp_group, self.config, self.virtual_pipeline_model_parallel_size = group, config, v

    def __getattr__(self, name):
        if not name.startswith(("recv", "send")):
            raise AttributeError(name)

        def call(*_a, **_k):
            if name in ("recv_forward", "recv_backward"):
                return torch.zeros(1)
            if name in ("send_forward", "send_backward"):
                return None
            return ((torch.zeros(1), torch.zeros(1)) if "forward_backward" in name else torch.zeros(1)), {}
        return call


def _megatrons_own_order(monkeypatch, p, m, v, rank, group=None):
    from megatron.core.enums import ModelType
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.pipeline_parallel import schedules

    cfg = ModelParallelConfig(pipeline_model_parallel_size=p, virtual_pipeline_model_parallel_size=v,
                              microbatch_group_size_per_vp_stage=group, pipeline_dtype=torch.float32)
    cfg.hidden_size, cfg.fine_grained_activation_offloading = 1, False
    chunks = [torch.nn.Linear(1, 1) for _ in range(v)]
    for c in chunks:
        c.config, c.model_type = cfg, ModelType.encoder_or_decoder
    seen = []

    def forward_step(*_a, **k):
        seen.append(("F", k["vp_stage"], k["current_microbatch"]))
        return torch.tensor([1000.0 * k["vp_stage"] + k["current_microbatch"]]), torch.tensor(1)

    def backward_step(_inp, out, _grad, _model_type, _config):
        x = int(out.item())
        seen.append(("B", x // 1000, x % 1000))
        return torch.zeros(1)

    pg = type("PG", (), {})()
    pg.tp = pg.cp = pg.dp_cp = _Group(0, 1)
    pg.embd = pg.pos_embd = None
    pg.pp = _Group(rank, p)
    zeros = torch.zeros
    monkeypatch.setattr(schedules, "forward_step", forward_step)
    monkeypatch.setattr(schedules, "backward_step", backward_step)
    monkeypatch.setattr(torch, "zeros", lambda *a, device=None, **k: zeros(*a, **k))  # its token count is on cuda
    schedules.forward_backward_pipelining_with_interleaving(
        forward_step_func=None, data_iterator=[iter([])] * v, model=chunks, num_microbatches=m, seq_length=4,
        micro_batch_size=1, p2p_communicator=_Comm(_Group(rank, p), cfg, v), pg_collection=pg)
    monkeypatch.undo()
    return seen


@pytest.mark.parametrize("p,m,v,group", [(2, 4, 2, None), (2, 5, 2, 3), (3, 6, 2, None), (4, 8, 2, None),
                                         (2, 8, 4, None), (4, 12, 2, 6), (3, 3, 4, None)])
def test_megatron_interleaved_is_megatrons_own_order(monkeypatch, p, m, v, group):
    """Every stage's (op, chunk, micro-batch) sequence equals what megatron-core's interleaved
    schedule calls forward_step / backward_step with (groups included: PP2 N3 M5 is its own
    docstring's example)."""
    s = build("megatron", p, m, chunks=v, group=group or 0)
    for rank in range(p):
        assert s.chunk_order(rank) == _megatrons_own_order(monkeypatch, p, m, v, rank, group), rank


def test_every_virtual_schedule_in_range_is_valid_and_within_its_memory():
    """p in 2..8, v in {2, 4}, m in {p, 2p, 4p}: built (validated: order, transfers, matching, no
    deadlock under either backend model, memory bound); ZB-V within 1F1B's peak (p micro-batches
    of a stage) on every stage; stock interleaved at Megatron's warm-up + 1 chunk activations."""
    n = 0
    for p in range(2, 9):
        for v in (2, 4):
            for m in (p, 2 * p, 4 * p):
                for kind in ("megatron", "zb") + (("zbv",) if v == 2 else ()):
                    s = build(kind, p, m, chunks=v)
                    peak = validate(s)["peak_memory"]
                    assert all(x <= b + 1e-9 for x, b in zip(peak, s.memory_bound)), (kind, p, v, m)
                    if kind == "zbv":
                        assert max(peak) <= p + 1e-9
                    if kind == "megatron":
                        warm = [min(2 * (p - r - 1) + (v - 1) * p + 1, m * v) for r in range(p)]
                        assert peak == pytest.approx([w / v for w in warm])
                    n += 1
    assert n == 7 * (3 * 2 + 3 * 3)
    validate(build("1f1b", 4, 8, inflight=6, chunks=2))  # two more in flight per stage
    validate(build("zbv", 3, 6, chunks=2, forward_only=True))


@pytest.mark.parametrize("p,v,m", [(2, 2, 4), (4, 2, 8), (4, 4, 8), (4, 2, 16), (8, 2, 16), (3, 4, 9)])
def test_interleaved_bubble_is_megatrons_formula(p, v, m):
    """Idle over busy time: (p - 1) / (v m) interleaved, (p - 1) / m without (no link cost)."""
    t = [StageTimes(1.0, 2.0, 0.0)]
    for chunks, want in ((v, (p - 1) / (v * m)), (1, (p - 1) / m)):
        r = simulate(build("megatron", p, m, chunks=chunks), t)
        busy = max(r.busy_ms)
        assert (r.step_ms - busy) / busy == pytest.approx(want)


def test_zbv_turns_without_a_transfer_and_reaches_the_floor():
    """The V's turn (virtual stage p - 1 to p, both on the last stage) is a hand-over: no transfer
    to itself, 2 (2p - 2) transfers per micro-batch against interleaved's 2 (2p - 1). Where
    F = B = W, ZB-V is optimal at 1F1B's memory (the CP-SAT floor equals its step), and the floor
    proves a bubble under ~0.37x stock interleaved's impossible there: a 0.25x target cannot be
    met in this model (the last stage waits (p - 1) chunk forwards for its first input)."""
    p, m = 4, 8
    zbv, inter = build("zbv", p, m, chunks=2), build("megatron", p, m, chunks=2)
    for s in range(p):
        assert all(c.peer != s for a in zbv.actions[s] if a.op == POST for c in a.comms)
    sends = lambda sch: sum(1 for s in range(p) for a in sch.actions[s] if a.op == POST for c in a.comms
                            if c.op == "SEND")
    assert sends(zbv) == 2 * (2 * p - 2) * m and sends(inter) == 2 * (2 * p - 1) * m
    t = [StageTimes(1.0, 1.0, 1.0)] * p
    f = floor(t, m, 0.0, placement=v_placement(p), memory=float(p), time_limit_s=20)
    ours, stock = simulate(zbv, t), simulate(inter, t)
    assert f.optimal and ours.step_ms == pytest.approx(f.step_ms)
    assert 0.30 < f.bubble_floor / stock.bubble < 0.40 and ours.bubble / stock.bubble == pytest.approx(
        f.bubble_floor / stock.bubble, abs=1e-6)


def test_the_floor_is_below_every_virtual_schedule():
    """Random F/B/W and links: the proved floor of each placement, at each schedule's own memory
    bound, never above the schedule's simulated step."""
    rng = random.Random(23)
    for p, m in ((2, 4), (3, 3), (2, 6)):
        times = [StageTimes(*(rng.uniform(4, 12) for _ in range(3))) for _ in range(p)]
        link = LinkCost(transfer_ms=rng.uniform(0, 3), latency_ms=0.1)
        for kind, placement in (("megatron", interleaved_placement(p, 2)), ("zb", interleaved_placement(p, 2)),
                                ("zbv", v_placement(p))):
            s = build(kind, p, m, chunks=2, times=tuple(sum(getattr(t, x) for t in times) / p for x in "fbw"))
            f = floor(times, m, link.transfer_ms, link.latency_ms, memory=list(s.memory_bound),
                      split=kind != "megatron", placement=placement, time_limit_s=5)
            assert f.bound_ms <= simulate(s, times, link).step_ms + 1e-6, (kind, p, m)


def test_bad_virtual_pipelines_are_refused_with_the_reason():
    with pytest.raises(OverlapConfigError, match="zbv places exactly 2 model chunks on each stage.*has 4"):
        build("zbv", 4, 8, chunks=4)
    with pytest.raises(ValueError, match="m must be a multiple of 4"):
        build("megatron", 4, 3, chunks=2)
    with pytest.raises(ValueError, match="last group of 2, fewer than the 4 stages.*multiple of 4"):
        build("zb", 4, 6, chunks=2)
    with pytest.raises(ValueError, match="p <= g <= m"):
        build("megatron", 2, 4, chunks=2, group=5)


def test_plan_ranks_stock_interleaved_and_ours_with_memory_per_stage():
    from megatron_overlap.tune.hardware import get_hardware
    from megatron_overlap.tune.models import RunSpec, get_model
    from megatron_overlap.tune.strategy_ranking import format_plan, make_plan
    from megatron_overlap.tune.published import published_rows

    plan = make_plan(get_model("llama3-70b"), RunSpec(tp=8, pp=4, dp=2, seq=8192, micro_batch=1, micro_batches=16,
                                                      phase="train"), get_hardware("h100-sxm"))
    rows = {r.label: r for r in plan.pipeline}
    for label in ("stock Megatron 1F1B", "stock Megatron interleaved v=2", "stock Megatron interleaved v=4",
                  "zb interleaved v=2", "zbv (ZB-V)"):
        assert label in rows
    assert rows["stock Megatron interleaved v=2"].flags == "--num-layers-per-virtual-pipeline-stage 10"
    assert rows["zb interleaved v=2"].flags == "--overlap-pp zb --num-layers-per-virtual-pipeline-stage 10"
    assert rows["zbv (ZB-V)"].flags == "--overlap-pp zbv --num-layers-per-virtual-pipeline-stage 10"
    # memory per stage: ZB-V at 1F1B's, interleaved above it (Megatron's warm-up holds more)
    assert rows["zbv (ZB-V)"].peak_activation_gb == pytest.approx(rows["stock Megatron 1F1B"].peak_activation_gb)
    assert rows["stock Megatron interleaved v=2"].peak_activation_gb > rows["stock Megatron 1F1B"].peak_activation_gb
    text = format_plan(plan)
    best = text.splitlines()[-1]
    assert best.startswith("best schedule: zb interleaved v=2") and "--overlap-pp zb" in best
    virtual = [r for r in published_rows() if r["system"] in ("ZB-V", "Megatron-LM interleaved 1F1B")]
    assert len(virtual) == 3 and all(r["error"] is None or abs(r["error"]) < 0.05 for r in virtual)


def test_zbv_patches_megatrons_placement_and_restores_it_exactly():
    """While `--overlap-pp zbv` is installed Megatron's layer offset and last-stage predicate are
    the V's; uninstall puts back the very same functions."""
    import megatron_overlap
    from megatron.core import parallel_state
    from megatron.core.transformer import transformer_block, transformer_layer

    from megatron_overlap.config import OverlapConfig, PPConfig
    from megatron_overlap.integration.vplacement import v_offset

    before = (transformer_layer.get_transformer_layer_offset, transformer_block.get_transformer_layer_offset,
              parallel_state.is_pipeline_last_stage, parallel_state.is_pipeline_first_stage)
    megatron_overlap.install(OverlapConfig(pp=PPConfig(mode="zbv")))
    try:
        assert transformer_layer.get_transformer_layer_offset is not before[0]
        assert transformer_block.get_transformer_layer_offset is transformer_layer.get_transformer_layer_offset
        assert parallel_state.is_pipeline_last_stage is not before[2]
        assert parallel_state.is_pipeline_first_stage is before[3]  # the V starts where Megatron's does
    finally:
        megatron_overlap.uninstall()
    assert (transformer_layer.get_transformer_layer_offset, transformer_block.get_transformer_layer_offset,
            parallel_state.is_pipeline_last_stage, parallel_state.is_pipeline_first_stage) == before
    cfg = type("C", (), dict(pipeline_model_parallel_size=4, num_layers=16))()
    assert [v_offset(cfg, c, s) for s in range(4) for c in (0, 1)] == [0, 14, 2, 12, 4, 10, 6, 8]


def test_zbv_bad_input_is_refused_with_the_reason():
    import argparse

    from megatron_overlap.config import ModelContext, PPConfig, TPConfig
    from megatron_overlap.integration.vplacement import check_config, check_version
    from megatron_overlap.pp.checks import check_pp_model

    zbv = PPConfig(mode="zbv")
    with pytest.raises(OverlapConfigError, match="exactly 2 model chunks on each stage.*has 4 per stage"):
        check_pp_model(zbv, TPConfig(), ModelContext(pp_size=4, virtual_pp_size=4))
    with pytest.raises(OverlapConfigError, match="no virtual pipeline"):
        check_pp_model(zbv, TPConfig(), ModelContext(pp_size=4))
    with pytest.raises(OverlapConfigError, match="tied ones would have to be one parameter"):
        check_pp_model(zbv, TPConfig(), ModelContext(pp_size=4, virtual_pp_size=2, tied_embeddings=True))
    megatron = dict(pipeline_model_parallel_size=4, virtual_pipeline_model_parallel_size=2,
                    untie_embeddings_and_output_weights=True)
    for where in ("save", "load", "pretrained_checkpoint"):  # the legacy format names the chunks' layers locally
        ctx = ModelContext.from_megatron_args(argparse.Namespace(**megatron, ckpt_format="torch", **{where: "/ckpt"}))
        with pytest.raises(OverlapConfigError, match="--ckpt-format torch saves each chunk under its local layer names.*"
                                                     "use --ckpt-format torch_dist"):
            check_pp_model(zbv, TPConfig(), ctx)
    for fmt, where in (("torch_dist", "save"), ("torch", None)):  # distributed checkpoints; none at all
        check_pp_model(zbv, TPConfig(), ModelContext.from_megatron_args(
            argparse.Namespace(**megatron, ckpt_format=fmt, **({where: "/ckpt"} if where else {}))))
    with pytest.raises(OverlapConfigError, match="megatron-core 0.16.x; this is 0.17.0.*use --overlap-pp zb"):
        check_version((0, 17, 0))
    check_version((0, 16, 1))
    cfg = dict(pipeline_model_parallel_size=4, num_layers=12, pipeline_model_parallel_layout=None,
               num_layers_in_first_pipeline_stage=None, num_layers_in_last_pipeline_stage=None,
               account_for_embedding_in_pipeline_split=False, account_for_loss_in_pipeline_split=False)
    with pytest.raises(OverlapConfigError, match="12 layers into 2 x 4 equal chunks.*not a multiple of 8"):
        check_config(type("C", (), cfg)())
    with pytest.raises(OverlapConfigError, match="custom pipeline layout or first/last"):
        check_config(type("C", (), dict(cfg, num_layers=16, num_layers_in_first_pipeline_stage=2))())


def test_auto_on_a_virtual_pipeline_picks_from_the_cost_model_stock_interleaved_included():
    """``--overlap-pp auto`` with a virtual pipeline (Llama-3-70B's shape on H100, TP=8 x PP=4 x
    DP=2, v=2, 16 micro-batches): the cost model's stock interleaved, interleaved zb and ZB-V; the
    fastest runs, said with its predicted gain; where stock interleaved is predicted fastest it
    runs and the notice says none of ours wins; ZB-V only at 2 chunks; without a prediction zb."""
    import argparse

    from megatron_overlap.config import ModelContext, PPConfig, TPConfig
    from megatron_overlap.pp.checks import resolve_auto
    from megatron_overlap.tune.auto import predicted_pp_choice

    args = argparse.Namespace(
        hidden_size=8192, ffn_hidden_size=28672, num_attention_heads=64, num_query_groups=8, group_query_attention=True,
        num_layers=80, seq_length=8192, swiglu=True, padded_vocab_size=128256, tensor_model_parallel_size=8,
        pipeline_model_parallel_size=4, context_parallel_size=1, micro_batch_size=1, global_batch_size=32,
        use_distributed_optimizer=True, overlap_grad_reduce=True, overlap_param_gather=True,
        num_layers_per_virtual_pipeline_stage=10)
    got = predicted_pp_choice(args, "NVIDIA H100 80GB HBM3", world_size=64)
    virtual = got["virtual"]
    assert virtual["chunks"] == 2 and set(virtual["steps_ms"]) == {"off", "zb", "zbv"}
    ctx, tp, notes = ModelContext(pp_size=4, virtual_pp_size=2, tp_size=8), TPConfig(mode="p2p"), []
    picked = resolve_auto(PPConfig(mode="auto"), tp, ctx, notes.append, got)
    best = min(virtual["steps_ms"], key=virtual["steps_ms"].get)
    assert picked.mode == best != "off" and "over stock interleaved" in notes[-1]
    slow = dict(got, virtual=dict(virtual, steps_ms={"off": 1.0, "zb": 1.2, "zbv": 1.1}))
    assert resolve_auto(PPConfig(mode="auto"), tp, ctx, notes.append, slow).mode == "off"
    assert "Megatron's interleaved schedule runs" in notes[-1] and "none of ours is predicted faster" in notes[-1]
    four = dict(got, virtual=dict(virtual, chunks=4, steps_ms={"off": 1.0, "zb": 0.9, "zbv": 0.5}))
    assert resolve_auto(PPConfig(mode="auto"), tp, ModelContext(pp_size=4, virtual_pp_size=4), notes.append,
                        four).mode == "zb"
    assert resolve_auto(PPConfig(mode="auto"), tp, ctx, notes.append).mode == "zb"
    fast_v = dict(got, virtual=dict(virtual, steps_ms={"off": 1.0, "zb": 0.9, "zbv": 0.5}))
    assert resolve_auto(PPConfig(mode="auto"), tp, ctx, notes.append, fast_v).mode == "zbv"
    legacy = ModelContext(pp_size=4, virtual_pp_size=2, tp_size=8, legacy_checkpoint=True)  # --ckpt-format torch
    assert resolve_auto(PPConfig(mode="auto"), tp, legacy, notes.append, fast_v).mode == "zb"
    # a ZB-V that would be refused at start is never a candidate: 78 layers do not split into 2 x 4 chunks
    from megatron_overlap.integration.install import _drop_unrunnable_zbv

    kept, dropped = dict(got, virtual=dict(virtual)), dict(got, virtual=dict(virtual))
    _drop_unrunnable_zbv(kept, args)
    _drop_unrunnable_zbv(dropped, argparse.Namespace(**dict(vars(args), num_layers=78)))
    assert "zbv" in kept["virtual"]["steps_ms"] and set(dropped["virtual"]["steps_ms"]) == {"off", "zb"}
