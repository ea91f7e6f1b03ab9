"""The hardening findings, one test each: every input checked at start by one rule, refused naming
its flag, file or variable and what would work; caches that cannot hurt a run; the planner only
recommending what Megatron builds; commands checking their arguments before any rank starts;
uninstall leaving a neighbour's wrapper in place. (The waits that say where: test_wait_sites.py;
what "bit-identical" holds for: test_bit_identical.py; the fuzz test: test_fuzz_inputs.py.)"""

import json
import logging
import math
import multiprocessing
import os
import time
import tracemalloc
from pathlib import Path

import pytest

import megatron_overlap
from megatron_overlap import OverlapConfig, OverlapConfigError

from .flag_args import megatron_args, parse, parser_error


def install_error(*flags, **megatron) -> OverlapConfigError:
    with pytest.raises(OverlapConfigError) as info:
        megatron_overlap.install(megatron_args(*flags, **megatron))
    assert not megatron_overlap.is_installed()
    return info.value


# --------------------------------------------------------------------------- flags
def test_a_trace_range_is_parsed_in_constant_time_and_memory(capsys):
    """Finding: `--overlap-trace-iters 2-100000000` took 11.7 GB and 12.6 s on every rank."""
    tracemalloc.start()
    t0 = time.perf_counter()
    config = OverlapConfig.from_args(parse("--overlap-trace", "/tmp/t", "--overlap-trace-iters", "0,2-100000000,7"))
    wide = OverlapConfig.from_args(parse("--overlap-trace", "/tmp/t", "--overlap-trace-iters", "5-1000000000000"))
    elapsed, (_, peak) = time.perf_counter() - t0, tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert elapsed < 0.5 and peak < 1 << 20, (elapsed, peak)  # not 11.7 GB and 12.6 s
    its = config.trace.iterations
    assert its.ranges == ((0, 0), (2, 100000000)) and 3 in its and 1 not in its and 10**8 + 1 not in its
    assert len(wide.trace.iterations) == 10**12 - 4 and config.trace.flags()[-1] == "0,2-100000000"
    assert OverlapConfig.from_args(parse(*config.as_flags())) == config  # round trip, still ranges
    for bad, words in (("3-1", "first <= last"), ("1-" + "9" * 30, "within 0 .."),
                       (",".join(["1"] * 65), "1 to 64 parts"), ("x" * 300, "at most 256 characters")):
        with pytest.raises(OverlapConfigError, match=f"^--overlap-trace-iters: .*{words}"):
            OverlapConfig.from_args(parse("--overlap-trace", "/tmp/t", "--overlap-trace-iters", bad))


@pytest.mark.parametrize("value", ["inf", "nan", "0", "1e400"])
def test_a_memory_budget_that_is_not_a_finite_number_is_refused_while_parsing(capsys, value):
    """Finding: `--overlap-pp-memory-budget inf` failed at the first step converting NaN."""
    err = parser_error(capsys, "--overlap-pp", "zb", "--overlap-pp-memory-budget", value)
    assert "argument --overlap-pp-memory-budget: must be a positive, finite number of GB" in err
    from megatron_overlap.config import PPConfig

    with pytest.raises(OverlapConfigError, match="^--overlap-pp-memory-budget: must be a positive, finite"):
        PPConfig(mode="zb", memory_budget_gb=math.inf, explicit=frozenset({"memory_budget_gb"}))


def test_counts_are_bounded_where_they_are_parsed(capsys):
    assert "--overlap-tp-chunks: 70000 exceeds the 65536 messages a ring" in parser_error(
        capsys, "--overlap-tp", "p2p", "--overlap-tp-chunks", "70000")
    assert "--overlap-tp-chunks: expected a whole number, got '1e9'" in parser_error(
        capsys, "--overlap-tp", "p2p", "--overlap-tp-chunks", "1e9")
    assert "--overlap-pp-max-inflight: must be a whole number of micro-batches in 2 .." in parser_error(
        capsys, "--overlap-pp", "1f1b", "--overlap-pp-max-inflight", "1")
    assert "--overlap-cp-a2a-size: expected a whole number of ranks, got '2.5'" in parser_error(
        capsys, "--overlap-cp", "hybrid", "--overlap-cp-a2a-size", "2.5")
    with pytest.raises(OverlapConfigError, match="^--overlap-tp-chunks: 40000 with --overlap-tp-bidirectional travel "
                       "as 80000 halves"):
        megatron_overlap.config.TPConfig(mode="p2p", chunks=40000, bidirectional=True)


def test_the_timeout_flag_is_checked_against_what_it_bounds(capsys):
    assert "--overlap-timeout-s: must be a positive, finite number of seconds, got inf" in parser_error(
        capsys, "--overlap-tp", "p2p", "--overlap-timeout-s", "inf")
    err = install_error("--overlap-timeout-s", "30", tp=2)
    assert err.flag == "--overlap-timeout-s" and "nothing of it is on; add --overlap-tp" in str(err)
    err = install_error("--overlap-tp", "p2p", "--overlap-timeout-s", "600", tp=2, distributed_timeout_minutes=10)
    assert err.flag == "--overlap-timeout-s" and "not below the process groups' timeout" in str(err)
    assert "--distributed-timeout-minutes = 600 s" in str(err) and "pass less than 600" in str(err)
    inst = megatron_overlap.install(megatron_args("--overlap-tp", "p2p", "--overlap-timeout-s", "60", tp=2,
                                                  distributed_timeout_minutes=10))
    assert inst.config.comm.timeout_s == 60 and "--overlap-timeout-s 60" in " ".join(inst.config.as_flags())


def test_megatron_settings_named_in_messages_are_flags_megatron_has():
    """Finding: Megatron's `--overlap-p2p-communication-warmup-flush` was named
    `--overlap-p2p-comm-warmup-flush`. Every Megatron setting a message of ours names is a flag of
    Megatron-LM's own parser (tests/data/megatron_lm_parser_flags.txt) or says it is a config field."""
    import re

    from megatron_overlap.args import flag_for
    from megatron_overlap.model_context import MEGATRON_PP_FLAGS

    data = Path(__file__).parent / "data"
    real = {line for line in (data / "megatron_lm_parser_flags.txt").read_text().split() if line.startswith("--")}
    fields = {f"megatron.{n}" for n in MEGATRON_PP_FLAGS}
    for path in Path(megatron_overlap.__file__).parent.rglob("*.py"):
        text = path.read_text()
        fields |= set(re.findall(r"`(megatron\.[a-z0-9_]+)`", text))
        fields |= set(re.findall(r"\"(megatron\.[a-z0-9_]+)\"", text))
    fields -= {"megatron.core", "megatron.training"}  # module names
    assert len(fields) > 15
    for field in sorted(fields):
        flag = flag_for(field)
        assert flag in real or flag.startswith("TransformerConfig."), (field, flag)
    assert flag_for("megatron.overlap_p2p_comm_warmup_flush") == "--overlap-p2p-communication-warmup-flush"
    assert "--overlap-p2p-comm-warmup-flush" not in (data / "megatron_flags.txt").read_text().splitlines()


# --------------------------------------------------------------------------- files and directories
def test_a_plan_file_of_the_wrong_shape_is_refused_naming_the_file(tmp_path):
    """Findings: a plan file holding `[]` ended in AttributeError; non-UTF-8 bytes, deep nesting."""
    for content, words in ((b"[]", "holds a JSON list; a plan file is an object"),
                           (b"\xff\xfe{}", "cannot read"), (b"[" * 100000, "cannot read"),
                           (json.dumps({"default": 3}).encode(), "entry 'default' is not a plan choice"),
                           (json.dumps({"default": "c99999999-ring"}).encode(), "more chunks than the 65536")):
        path = tmp_path / "plan.json"
        path.write_bytes(content)
        err = install_error("--overlap-tp", "p2p", "--overlap-tp-plan-file", str(path), tp=2)
        assert err.flag == "--overlap-tp-plan-file" and str(path) in str(err) and words in str(err), str(err)


def test_a_plan_file_is_held_to_the_flags_rule_at_install_and_at_the_first_step(tmp_path):
    """Finding: `{"default": "c1000-ring"}` ran one-row chunks 4x slower while
    `--overlap-tp-chunks 2000` was refused. Both now refused by the one rule, naming their source."""
    err = install_error("--overlap-tp", "p2p", "--overlap-tp-chunks", "2000", tp=4, seq=64)
    assert err.flag == "--overlap-tp-chunks" and "more than one per row; use at most 64" in str(err)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"default": "c1000-ring"}))
    err = install_error("--overlap-tp", "p2p", "--overlap-tp-plan-file", str(path), tp=4, seq=64)
    assert err.flag == "--overlap-tp-plan-file" and f"{path}: entry 'default' (c1000-ring) cuts each rank's 16 sequence " \
        "rows into 1000 chunks, more than one per row; use at most 16" in str(err)
    keyed = {"column|rows8xb2|k96n32|float32|tp2|cpu-2cpu|p2p|torch|mo": "c9-ring"}
    path.write_text(json.dumps(keyed))
    err = install_error("--overlap-tp", "p2p", "--overlap-tp-plan-file", str(path), tp=2)
    assert "8 sequence rows into 9 chunks" in str(err)
    # a programmatic install knows no rows: the first step checks the entry, with the same words
    from megatron_overlap.tp.autotune import PlanTuner, load_plan_file

    path.write_text(json.dumps({"default": "c1000-ring"}))
    tuner = PlanTuner(False, load_plan_file(str(path)), plan_file=str(path))
    x, weight = __import__("torch").zeros(8, 1, 4), __import__("torch").zeros(4, 4)
    group = type("Group", (), {"size": lambda self: 2})()
    with pytest.raises(OverlapConfigError, match="^--overlap-tp-plan-file: .*'default' \\(c1000-ring\\) cuts each rank's 8 "):
        tuner.choose("column", x, weight, group, 8, type("B", (), {"name": "p2p"})(), None)


def test_a_trace_directory_under_a_file_is_refused_at_install(tmp_path):
    """Finding: `--overlap-trace` under a regular file failed after iteration 3."""
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    for target, words in ((blocker / "traces", "is under the file"), (blocker, "is a file")):
        err = install_error("--overlap-trace", str(target), tp=2)
        assert err.flag == "--overlap-trace" and words in str(err) and "point it at a directory" in str(err)
    assert not (blocker.parent / "traces").exists()  # nothing created by a refusal


def test_trace_iterations_beyond_the_run_get_a_notice_at_start(tmp_path, caplog):
    """Finding: `--overlap-trace-iters 50` in a 5-iteration run traced nothing, silently."""
    with caplog.at_level(logging.WARNING, logger="megatron_overlap"):
        megatron_overlap.install(megatron_args("--overlap-trace", str(tmp_path), "--overlap-trace-iters", "50",
                                               tp=2, train_iters=5))
    assert "--overlap-trace-iters 50: this run has 5 iterations (--train-iters, counted from 0 here), so nothing " \
        "will be traced; pick iterations below 5" in caplog.text
    caplog.clear()
    megatron_overlap.uninstall()
    with caplog.at_level(logging.WARNING, logger="megatron_overlap"):
        megatron_overlap.install(megatron_args("--overlap-trace", str(tmp_path), "--overlap-trace-iters", "3", tp=2,
                                               train_iters=5))
    assert "nothing will be traced" not in caplog.text


def test_a_cache_variable_that_is_not_a_directory_is_refused_naming_it(tmp_path, monkeypatch):
    """Finding: MEGATRON_OVERLAP_CACHE pointing at a file gave a raw NotADirectoryError."""
    blocker = tmp_path / "cache_file"
    blocker.write_text("x")
    for value in (str(blocker), str(blocker / "sub")):
        monkeypatch.setenv("MEGATRON_OVERLAP_CACHE", value)
        err = install_error("--overlap-tp", "p2p", "--overlap-tp-autotune", tp=2)
        assert err.flag == "MEGATRON_OVERLAP_CACHE" and str(err).startswith(f"MEGATRON_OVERLAP_CACHE: {value} is")
        assert "point it at a directory" in str(err)


# --------------------------------------------------------------------------- caches
@pytest.mark.parametrize("content", [b"[1, 2]", b'{"k": "c2-ring", "j": {"choice": 4}}', b"\xff\xfe\xfd", b"{"],
                         ids=["list", "string-values", "not-utf8", "truncated"])
def test_a_cache_of_the_wrong_shape_is_ignored_with_one_notice_and_rebuilt(tmp_path, caplog, content):
    """Finding: an autotune cache of the wrong shape crashed the first layer without naming the file."""
    from megatron_overlap.tune.cache import DiskCache, choose

    cache = DiskCache("tp_plans", directory=str(tmp_path))
    Path(cache.path).write_bytes(content)
    with caplog.at_level(logging.WARNING, logger="megatron_overlap"):
        assert choose(cache, "k", ["a", "b"], {"a": 2.0, "b": 1.0}.get) == ("b", False)  # measured, not crashed
        assert choose(cache, "k", ["a", "b"], lambda c: 1 / 0) == ("b", True)  # rebuilt: the next start hits it
    notices = [r.getMessage() for r in caplog.records if cache.path in r.getMessage()]
    assert len(notices) == 1 and "ignored (rebuilt on the next write)" in notices[0], notices
    assert json.loads(Path(cache.path).read_text())["k"]["choice"] == "b"


def _hammer(directory: str, writer: int, entries: int) -> None:
    from megatron_overlap.tune.cache import DiskCache

    cache = DiskCache("tp_plans", directory=directory)
    for i in range(entries):
        cache.put(f"writer{writer}|entry{i}", {"choice": "c1-ring"})


def test_concurrent_writers_lose_no_entry_and_leave_no_temporary_file(tmp_path):
    """Finding: two processes writing the cache at once lost 121 of 400 entries; killed writers
    left *.tmp files behind. Four writers x 100 entries at once, a stale file of a dead writer."""
    from megatron_overlap.tune.cache import DiskCache

    stale = tmp_path / "tp_plans.json.424242.tmp"
    stale.write_text("{half a write")
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_hammer, args=(str(tmp_path), w, 100)) for w in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
        assert p.exitcode == 0
    data = json.loads(Path(DiskCache("tp_plans", directory=str(tmp_path)).path).read_text())
    assert len(data) == 400 and {f"writer{w}|entry{i}" for w in range(4) for i in range(100)} == set(data)
    assert not list(tmp_path.glob("*.tmp"))


# --------------------------------------------------------------------------- planner, auto, commands
def test_plan_refuses_a_tp_size_megatron_cannot_build(capsys):
    """Finding: `plan --model llama3-8b --hardware h100-sxm --tp 3 --seq 8190` recommended symm-mem."""
    from megatron_overlap.cli.main import main

    with pytest.raises(SystemExit) as info:
        main(["plan", "--model", "llama3-8b", "--hardware", "h100-sxm", "--tp", "3", "--seq", "8190"])
    assert str(info.value) == ("plan: --tp: Megatron cannot build llama3-8b at TP=3 CP=1: 32 query heads do not split "
                               "over TP=3; TP must divide them (32 query heads, 8 key/value heads; TP sizes that "
                               "build: 1, 2, 4, 8)")
    with pytest.raises(SystemExit, match="^plan: --seq: .*sequence 8190 does not split over TP=4"):
        main(["plan", "--model", "llama3-8b", "--tp", "4", "--seq", "8190"])
    with pytest.raises(SystemExit, match="^plan: --heads must be a whole number >= 1, got 0"):
        main(["plan", "--model", "llama3-8b", "--heads", "0"])


def test_auto_and_install_apply_the_same_rule():
    from megatron_overlap.tune.auto import predicted_choice

    args = megatron_args("--overlap-tp", "auto", tp=3, seq=8190, heads=32, kv_heads=8)
    args.hidden_size, args.ffn_hidden_size, args.num_layers = 4096, 14336, 32
    assert predicted_choice(args, "NVIDIA H100 80GB HBM3", True) is None  # never a pick for it
    err = install_error("--overlap-tp", "auto", tp=3, seq=8190, heads=32, kv_heads=8)
    assert err.flag == "--tensor-model-parallel-size" and "32 query heads do not split over TP=3" in str(err)
    assert "TP sizes that split the heads: 1, 2, 4, 8" in str(err)
    err = install_error("--overlap-cp", "ring", tp=4, cp=2, seq=12)
    assert err.flag == "--seq-length" and "each CP rank's 6 rows do not split over TP=4" in str(err), str(err)


@pytest.mark.parametrize("argv, words", [
    (["demo", "--cp", "3"], "demo: --seq: the tiny GPT (8 heads, 2 key/value heads, seq 1024) cannot be built: "
                            "sequence 1024 does not cut into 2 x CP = 6 equal chunks"),
    (["demo", "--ranks", "0"], "demo: --ranks must be a whole number >= 1, got 0"),
    (["demo", "--tp", "3", "--ranks", "3"], "demo: --tp: the tiny GPT (8 heads, 2 key/value heads, seq 1024) cannot"),
    (["demo", "--comm-ratio", "nan"], "demo: --comm-ratio must be a finite number > 0, got nan"),
    (["demo", "--pp", "0"], "demo --pp: --pp must be a whole number >= 2, got 0"),
    (["demo", "--pp", "2", "--hidden", "0"], "demo --pp: --hidden must be a whole number >= 1, got 0"),
    (["demo", "--pp", "2", "--hidden", "100"], "demo --pp: --hidden 100 must be a multiple of the pipeline model's 8 "
                                               "heads"),
    (["bench", "mlp", "--tp", "1"], "bench mlp: --tp must be a whole number >= 2, got 1"),
    (["bench", "attention", "--kv-heads", "0"], "bench attention: --kv-heads must be a whole number >= 1"),
    (["bench", "pp", "--steps", "0"], "bench pp: --steps must be a whole number >= 1, got 0"),
    (["floor", "--times", "1/1/1", "--stages", "2", "--transfer-ms", "inf"], "floor: --transfer-ms must be a finite"),
], ids=["demo-cp-3", "demo-world-0", "demo-tp-3", "demo-nan", "demo-pp-0", "demo-pp-hidden-0",
        "demo-pp-hidden-100", "bench-mlp-tp-1", "bench-attention-kv-0",
        "bench-pp-steps-0", "floor-inf"])
def test_commands_refuse_bad_arguments_before_any_rank_starts(monkeypatch, argv, words):
    """Finding: `demo --cp 3` and `demo --ranks 0` (then `--world 0`) failed with a shape error or IndexError after
    the ranks had started."""
    from megatron_overlap.cli.main import main
    from megatron_overlap.lab import rank_pool

    def no_ranks(*args, **kwargs):
        raise AssertionError("a rank pool started")

    monkeypatch.setattr(rank_pool, "RankPool", no_ranks)
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert words in str(info.value), str(info.value)


# --------------------------------------------------------------------------- neighbours
def test_uninstall_keeps_a_wrapper_placed_over_our_patch(caplog):
    """Finding: uninstall silently removed a wrapper someone else put over one of our patches."""
    import functools

    from megatron.core.tensor_parallel import layers

    stock = layers.RowParallelLinear.__dict__["forward"]
    megatron_overlap.install(megatron_args("--overlap-tp", "p2p", tp=2))
    ours = layers.RowParallelLinear.__dict__["forward"]

    @functools.wraps(ours)
    def theirs(self, *args, **kwargs):
        return ours(self, *args, **kwargs)

    layers.RowParallelLinear.forward = theirs
    try:
        with caplog.at_level(logging.WARNING, logger="megatron_overlap"):
            kept = megatron_overlap.uninstall()
        assert kept == ["megatron.core.tensor_parallel.layers.RowParallelLinear.forward"]
        assert layers.RowParallelLinear.__dict__["forward"] is theirs and theirs.__wrapped__ is ours  # both kept
        assert "uninstall left megatron.core.tensor_parallel.layers.RowParallelLinear.forward in place" in caplog.text
        fn = "linear_with_grad_accumulation_and_async_allreduce"
        assert not hasattr(layers.__dict__[fn], "__megatron_overlap__")  # the rest was restored
        with pytest.raises(RuntimeError, match="cannot install over .*RowParallelLinear.forward: a wrapper"):
            megatron_overlap.install(megatron_args("--overlap-tp", "p2p", "--overlap-tp-chunks", "4", tp=2))
    finally:
        layers.RowParallelLinear.forward = ours  # their wrapper removed (as the warning asks) ...
    assert megatron_overlap.uninstall() == []  # ... and ours goes too
    assert layers.RowParallelLinear.__dict__["forward"] is stock and not megatron_overlap.is_installed()


def test_the_fused_kernels_flag_waits_follow_the_timeout_and_name_layer_and_peer():
    """The flag waits of the fused backend's kernels: capped at about --overlap-timeout-s' worth of
    spins, and a flag never raised names the chunk, the peer that owns it and the layer."""
    import torch

    from megatron_overlap.comm import waits
    from megatron_overlap.kernels.ag_gemm import spin_limit
    from megatron_overlap.tp.backends import make_backend

    backend = make_backend("fused", timeout_s=2.0)  # the interpreter here; the same object on a GPU
    assert backend.max_spins == spin_limit(2.0) < spin_limit(300.0) == make_backend("fused").max_spins
    error = torch.tensor([3], dtype=torch.int32)  # the kernel gave up on chunk 2 (code = index + 1)
    with waits.at("layer 3 linear_fc1 (column, weight 8x8) forward"):
        with pytest.raises(RuntimeError, match=r"^fused ag_gemm: chunk 2 \(group rank 1's piece 0\) \[layer 3 "
                           r"linear_fc1 \(column, weight 8x8\) forward\] never arrived within 2000000 spins"):
            backend._watch(error, "ag_gemm", lambda c: f"chunk {c} (group rank {c // 2}'s piece {c % 2})",
                           torch.device("cpu"))
