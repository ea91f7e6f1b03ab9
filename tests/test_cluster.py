"""The emulated cluster: PP x DP ranks whose compute is a wait of the cost
model's times, with the real executor, Megatron's 1F1B, DDP and distributed optimizer around
them. Checked against the simulator it is meant to reproduce (times, not numerics), and its
command line's refusals."""

import json

import pytest

from megatron_overlap.lab.cluster import ClusterConfig

from .cli_runner import cli

TOLERANCE = 0.05  # the lab check's (BENCHMARKS.md): measured step within 5% of pp/schedule_sim.py


def test_the_emulated_cluster_reproduces_the_simulator(pool4):
    """Llama-3-70B on H100 at PP=2 x DP=2, m=4 (4 ranks of the test pool): stock 1F1B's step
    within 5% of the simulator's prediction on the same F/B/W, link and DDP buckets; ours too;
    zb shorter than stock, as the simulator says; every schedule computes the same losses."""
    from dataclasses import asdict

    from megatron_overlap.cli.bench_cluster import summarize
    from megatron_overlap.lab.cluster import ClusterRanks
    from megatron_overlap.lab.session import RemoteSession

    cfg = ClusterConfig(pp=2, dp=2, microbatches=4, steps=3, warmup=1, exposed=False)  # a median of 3: one late wake-up moves none
    ranks = RemoteSession(pool4, ClusterRanks, asdict(cfg))
    try:
        rounds = ranks.rounds(cfg.warmup, cfg.steps)
    finally:
        ranks.close()
    result = summarize(cfg, rounds, ranks.started, floor_time_s=20)
    modes = result["modes"]
    for mode, r in modes.items():
        assert abs(r["prediction_error"]) <= TOLERANCE, (mode, r["step_ms"], r["predicted_step_ms"])
    assert modes["zb"]["step_ms"] < modes["stock"]["step_ms"]
    assert result["losses_identical"] and len(set(modes["stock"]["loss"])) == cfg.steps  # it trains
    assert modes["zb"]["predicted_step_ms"] < modes["stock"]["predicted_step_ms"]
    assert result["buckets_per_stage"][0] > 1 and result["buckets_per_stage"][1] == 1  # Megatron's
    assert result["floor"]["bound_ms"] <= modes["zb"]["predicted_step_ms"] + 1e-6


def test_emulated_cluster_refuses_what_it_cannot_run():
    from megatron_overlap.cli.bench_cluster import BenchError, check

    with pytest.raises(BenchError, match=r"32 emulated ranks \(PP 16 x DP 2\) is more than this machine holds: "
                                         r"at most 16 \(2 cores x 8 ranks per core"):
        check(ClusterConfig(pp=16, dp=2, microbatches=16), cores=2, memory_gb=24)
    with pytest.raises(BenchError, match=r"at most 10 \(6 GB of memory available"):
        check(ClusterConfig(pp=8, dp=2, microbatches=16), cores=2, memory_gb=6)
    with pytest.raises(BenchError, match=r"no durations for model 'llama4-9000': the cost model knows .*llama3-70b"):
        check(ClusterConfig(model="llama4-9000"), cores=2, memory_gb=24)
    with pytest.raises(BenchError, match=r"no durations for hardware 'b300'"):
        check(ClusterConfig(hardware="b300"), cores=2, memory_gb=24)
    with pytest.raises(BenchError, match=r"--node-size 3 does not divide the 8 ranks into nodes"):
        check(ClusterConfig(node_size=3), cores=2, memory_gb=24)
    with pytest.raises(BenchError, match=r"--ranks 6 is not --pp 4 x --dp 2 = 8"):
        check(ClusterConfig(), ranks=6, cores=2, memory_gb=24)
    with pytest.raises(BenchError, match=r"--micro-batches 2 is below --pp 4"):
        check(ClusterConfig(microbatches=2), cores=2, memory_gb=24)
    from megatron_overlap.lab.link_spec import LinkSpec

    with pytest.raises(ValueError, match="4 ranks per node does not divide 6 ranks"):
        LinkSpec(bandwidth_GBps=1.0, node_size=4, intra_GBps=10.0).check_world(6)


def test_bench_pp_emulate_command_line():
    out = cli("bench", "pp", "--emulate", "--model", "gpt5", "--no-progress")
    assert out.returncode != 0 and "no durations for model 'gpt5'" in out.stderr, out.stderr[-2000:]
    out = cli("bench", "pp", "--emulate", "--node-size", "3", "--no-progress")
    assert out.returncode != 0 and "--node-size 3 does not divide the 8 ranks" in out.stderr, out.stderr[-2000:]
    out = cli("bench", "pp", "--emulate", "--hidden", "64", "--no-progress")
    assert out.returncode != 0 and "--hidden shape the real tiny GPT" in out.stderr
    out = cli("bench", "pp", "--dp", "2", "--no-progress")
    assert out.returncode == 2 and "--dp only apply with --emulate" in out.stderr
    out = cli("bench", "pp", "--emulate", "--vpp", "4", "--schedules", "stock,zbv", "--no-progress")
    assert out.returncode != 0 and "zbv needs exactly 2 model chunks per stage (the V), got --vpp 4" in out.stderr
    out = cli("bench", "pp", "--emulate", "--vpp", "2", "--micro-batches", "6", "--no-progress")
    assert out.returncode != 0 and "--micro-batches 6 is not a multiple of --pp 4" in out.stderr, out.stderr[-2000:]


def test_durations_files_are_checked_naming_what_is_missing(tmp_path):
    from megatron_overlap.cli.bench_cluster import BenchError, check
    from megatron_overlap.lab import durations

    path = tmp_path / "d.json"
    stage = {"f_ms": 10.0, "b_ms": 11.0, "w_ms": 5.0, "layers": 2, "params": [100, 200, 300]}
    durations.write(str(path), [stage, dict(stage)], 4096, {"bandwidth_GBps": 0.01, "latency_us": 20.0}, 4, "test")
    check(ClusterConfig(pp=2, dp=2, microbatches=4, durations=str(path)), cores=2, memory_gb=24)  # fine
    with pytest.raises(BenchError, match=r"has durations for 2 stages, none for stages 2..3 of --pp 4: measure "
                                         r"them with `bench pp --pp 4 --write-durations"):
        check(ClusterConfig(pp=4, dp=2, microbatches=8, durations=str(path)), cores=2, memory_gb=24)
    broken = tmp_path / "b.json"
    durations.write(str(broken), [stage, {k: v for k, v in stage.items() if k != "w_ms"}], 4096,
                    {"bandwidth_GBps": 0.01, "latency_us": 20.0}, 4, "test")
    with pytest.raises(BenchError, match=r"stage 1 has no 'w_ms'"):
        check(ClusterConfig(pp=2, dp=1, microbatches=4, durations=str(broken)), cores=2, memory_gb=24)
    with pytest.raises(BenchError, match=r"cannot read it .* write one with `megatron-overlap bench pp --write-durations"):
        check(ClusterConfig(pp=2, dp=1, microbatches=4, durations=str(tmp_path / "none.json")), cores=2, memory_gb=24)
    (tmp_path / "list.json").write_text("[1, 2]")
    with pytest.raises(BenchError, match=r"not a version-1 durations file"):
        check(ClusterConfig(pp=2, dp=1, microbatches=4, durations=str(tmp_path / "list.json")), cores=2, memory_gb=24)
    blocks = durations.stage_work(durations.read(str(path), 2))
    assert [b.name for b in blocks[0]] == ["embedding", "stage 0 layer 0", "stage 0 layer 1"]
    assert [b.name for b in blocks[1]][-1] == "output layer" and sum(b.f_ms for b in blocks[1]) == 10.0


def test_virtual_pipelines_on_the_emulated_cluster_reproduce_the_simulator(pool4):
    """PP=2 x DP=2 with 2 model chunks per stage, m = 4: Megatron's interleaved 1F1B,
    our interleaved zb and ZB-V over Megatron's chunk DDPs and the distributed optimizer
    (``align_param_gather``, every bucket's gather in flight at once) within 10% of the
    simulator's per-chunk prediction; the same losses (the V's chunks carry the same virtual
    stages' weights); zb ahead of stock as predicted; ZB-V below stock's peak memory; the
    floor below every prediction."""
    from dataclasses import asdict

    from megatron_overlap.cli.bench_cluster import summarize
    from megatron_overlap.lab.cluster import ClusterRanks
    from megatron_overlap.lab.session import RemoteSession

    cfg = ClusterConfig(pp=2, dp=2, microbatches=4, steps=2, warmup=1, exposed=False, vpp=2,
                        modes=("stock", "zb", "zbv-ec"))
    ranks = RemoteSession(pool4, ClusterRanks, asdict(cfg))
    try:
        rounds = ranks.rounds(cfg.warmup, cfg.steps)
    finally:
        ranks.close()
    assert {tuple(d["bucket_chunks"]) for d in ranks.started if d["stage"] == 1} == {(0, 1)}  # stock: one per chunk
    for d in ranks.started:  # every-chunk: several per chunk on every stage (integration/ddp.py), the same elements
        assert d["mode_buckets"]["zb"] == d["mode_buckets"]["stock"]  # the default: Megatron's
        for mode in ("zbv-ec",):  # (the distributed optimizer pads each parameter's start within a bucket)
            numels, chunks = d["mode_buckets"][mode]
            assert all(chunks.count(c) > 1 for c in (0, 1)), (d["stage"], mode, chunks)
            assert d["params"] <= sum(numels) <= 1.02 * d["params"], (d["stage"], mode, sum(numels), d["params"])
    result = summarize(cfg, rounds, ranks.started, floor_time_s=2)  # the bound is all the test reads
    modes = result["modes"]
    for mode, r in modes.items():
        assert abs(r["prediction_error"]) <= 0.10, (mode, r["step_ms"], r["predicted_step_ms"])
    assert result["losses_identical"] and len(set(modes["stock"]["loss"])) == cfg.steps
    assert modes["zb"]["predicted_step_ms"] < modes["stock"]["predicted_step_ms"]
    assert modes["zb"]["step_ms"] < modes["stock"]["step_ms"]
    assert modes["zbv-ec"]["peak_microbatches"] < modes["stock"]["peak_microbatches"]
    assert result["floor"]["bound_ms"] <= min(r["predicted_step_ms"] for r in modes.values()) + 1e-6


def test_emulated_cluster_refuses_virtual_pipelines_it_cannot_run():
    from megatron_overlap.cli.bench_cluster import BenchError, check

    def refused(pattern, **kw):
        with pytest.raises(BenchError, match=pattern):
            check(ClusterConfig(**kw), cores=2, memory_gb=24)

    refused(r"zbv needs exactly 2 model chunks per stage \(the V\), got --vpp 4", vpp=4, modes=("stock", "zbv"))
    refused(r"zbv needs exactly 2 model chunks per stage \(the V\), got --vpp 1", modes=("stock", "zbv"))
    refused(r"--micro-batches 10 is not a multiple of --pp 4: Megatron's interleaved schedule", vpp=2, microbatches=10)
    refused(r"llama3-70b's 80 layers do not divide into --pp 4 x --vpp 3 = 12 model chunks", vpp=3, microbatches=12)
    refused(r"--schedules 1f1b-inflight with --vpp 2: virtual pipelines run stock, 1f1b, zb, zbv", vpp=2,
            modes=("stock", "1f1b-inflight"))
    refused(r"--vpp 0: model chunks per stage must be >= 1", vpp=0)
    refused(r"1f1b-ec/zb-ec/zbv-ec \(ours with every-chunk DDP buckets\) compare bucket layouts of virtual "
            r"pipelines: give --vpp 2", modes=("stock", "zb-ec"))
    refused(r"--bucket-factor 0.0: the DDP bucket size's factor must be a positive number", bucket_factor=0.0)
    refused(r"--bucket-factor nan: the DDP bucket size's factor must be a positive number", bucket_factor=float("nan"))
    check(ClusterConfig(vpp=2, modes=("stock", "zb", "zbv")), cores=2, memory_gb=24)  # the benchmark's: fine


def test_the_simulator_gathers_a_chunks_parameters_in_the_order_dispatched():
    """A chunk's parameter buckets on one data-parallel port, dispatched at the step's start: in
    the order the forward needs them (ours) the chunk's first forward starts once its first
    bucket is in and runs each bucket's share once that one is; in bucket order (stock's
    ``gather_aligned``: the last layers' bucket first) it waits for all of them."""
    from megatron_overlap.pp import build
    from megatron_overlap.pp.schedule_sim import DPSync, StageTimes, simulate

    times = [StageTimes(12.0, 10.0, 10.0)] * 2  # a chunk's forward: 6 ms
    sync = DPSync(reduce_ms=(1.0, 1.0), reduce_chunks=(0, 1), gather_ms=(2.0, 3.0, 4.0, 5.0),
                  gather_chunks=(0, 0, 0, 1), gather_at_start=True)  # chunk 0's three in forward order
    schedule = build("megatron", 2, 2, chunks=2)
    # forward order: in at 2, 5, 9 ms; shares of 6 ms by size (2/9, 3/9, 4/9): 2 -> 3.33, wait to 5
    # -> 7, wait to 9 -> 11.67. Bucket order: the 4 ms bucket (last layers) first, all in at 9 ms.
    for aligned, span, port in ((False, (2.0, 9.0 + 6 * 4 / 9), [(0.0, 2.0), (2.0, 5.0), (5.0, 9.0)]),
                                (True, (9.0, 15.0), [(0.0, 4.0), (4.0, 7.0), (7.0, 9.0)])):
        sim = simulate(schedule, times, dp=[sync.replace(gather_aligned=aligned)] * 2)
        label, start, end = sim.timeline[0][0]
        assert label == "F0" and abs(start - span[0]) < 1e-9 and abs(end - span[1]) < 1e-9, (aligned, sim.timeline[0])
        ag = [(a, b) for op, a, b in sim.dp_spans[0] if op == "AG"]
        assert ag == port + [(9.0, 14.0)], (aligned, ag)  # then chunk 1's


def test_the_simulator_sends_each_bucket_as_its_chunks_last_gradient_fills_it():
    """``DPSync.fill`` (ours: DDP's hooks send each bucket once its gradients are in): a chunk's
    buckets leave during its last W, bucket k after its share of it (bucket 0, the last layers,
    first), one after the other on the port; the stage's reductions end earlier than when all
    leave at the W's end, by as much of the W as the first buckets' share."""
    from megatron_overlap.pp import build
    from megatron_overlap.pp.schedule_sim import DPSync, StageTimes, simulate

    times = [StageTimes(10.0, 10.0, 8.0)] * 2  # a chunk's W: 4 ms
    sync = DPSync(reduce_ms=(1.0, 3.0, 2.0, 2.0), reduce_chunks=(0, 0, 1, 1))
    schedule = build("zb", 2, 4, chunks=2)
    filled, whole = (simulate(schedule, times, dp=[sync.replace(fill=f)] * 2) for f in (True, False))
    for s in range(2):
        spans = filled.timeline[s]
        chunk = [int(x[0].split("@")[1]) if "@" in x[0] else 0 for x in spans]
        last_w = {c: max((x for x, k in zip(spans, chunk) if x[0].startswith("W") and k == c), key=lambda x: x[1])
                  for c in (0, 1)}
        port, want = 0.0, []
        for c, shares in sorted(((c, ((0.25, 1.0), (1.0, 3.0)) if c == 0 else ((0.5, 2.0), (1.0, 2.0)))
                                 for c in (0, 1)), key=lambda cs: last_w[cs[0]][1]):
            _label, a, b = last_w[c]
            for share, ms in shares:
                start = max(a + (b - a) * share, port)
                port = start + ms
                want.append(start)
        got = [a for op, a, _b in filled.dp_spans[s] if op == "RS"]
        assert got == want, (s, got, want)
    assert filled.step_ms < whole.step_ms, (filled.step_ms, whole.step_ms)


def test_the_simulator_dispatches_each_chunks_buckets_after_its_last_gradient():
    """One DDP per chunk: a chunk's buckets leave at the end of its last B (its last W when
    split), or ``sync_delay`` backwards later (Megatron's interleaved stagger), one after the
    other on the stage's data-parallel port; never later than the whole stage's sync after its
    last gradient."""
    from megatron_overlap.pp import build
    from megatron_overlap.pp.schedule_sim import DPSync, StageTimes, simulate

    times = [StageTimes(10.0, 10.0, 10.0)] * 2
    ms = {0: 7.0, 1: 5.0}
    sync = DPSync(reduce_ms=(7.0, 5.0), reduce_chunks=(0, 1))
    for kind, delay in (("megatron", 0), ("megatron", 1), ("zb", 0), ("zb", 1)):
        schedule = build(kind, 2, 4, chunks=2)
        sim = simulate(schedule, times, dp=[sync.replace(sync_delay=delay)] * 2)
        grad = "W" if schedule.split else "B"
        for s in range(2):
            spans = sim.timeline[s]  # (label, start, end) of each compute, in order
            chunk = [int(x[0].split("@")[1]) if "@" in x[0] else 0 for x in spans]
            backwards = [i for i, x in enumerate(spans) if x[0].startswith("B")]
            ready = {}
            for c in (0, 1):
                i = max(i for i, x in enumerate(spans) if x[0].startswith(grad) and chunk[i] == c)
                if delay:
                    k = backwards.index(max(j for j in backwards if chunk[j] == c)) + delay
                    i = max(i, backwards[k] if k < len(backwards) else len(spans) - 1)
                ready[c] = (i, spans[i][2])
            port, want = 0.0, []
            for c in sorted(ready, key=lambda c: ready[c]):
                start = max(ready[c][1], port)
                port = start + ms[c]
                want.append(start)
            got = [a for op, a, _b in sim.dp_spans[s] if op == "RS"]
            assert got == want, (kind, delay, s, got, want)
        whole = simulate(schedule, times, dp=[DPSync(reduce_ms=(7.0, 5.0))] * 2)
        assert sim.step_ms <= whole.step_ms + 1e-9, kind
