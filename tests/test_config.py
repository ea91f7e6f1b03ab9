"""Flags, the config object, and every invalid configuration: each gives one clear error that
names the flag to change."""

import argparse
import sys
from pathlib import Path

import pytest
import torch

import megatron_overlap
from megatron_overlap import OverlapConfig, OverlapConfigError, add_overlap_args, overlap_parser
from megatron_overlap.config import ModelContext, TPConfig
from megatron_overlap.tp.checks import check_tp_model
from megatron_overlap.tp.linear_plan import chunks_per_rank

from .flag_args import megatron_args, parse, parser_error

MEGATRON_FLAGS = {
    line.strip()
    for line in (Path(__file__).parent / "data" / "megatron_flags.txt").read_text().splitlines()
    if line.startswith("--")
}


HDP = ["--overlap-hdp", "--overlap-hdp-max-tokens-per-rank", "64"]


def test_flag_set_is_pinned():
    from megatron_overlap.args import DEPRECATED

    parser = add_overlap_args(argparse.ArgumentParser())
    added = {opt for action in parser._actions for opt in action.option_strings} - {"-h", "--help"}
    assert added == set(megatron_overlap.FLAGS) | set(DEPRECATED)
    assert all(flag.startswith("--overlap-") for flag in megatron_overlap.FLAGS)  # one prefix
    assert set(DEPRECATED) == {"--overlap-autotune", "--overlap-plan", "--hdp", "--hdp-max-tokens-per-rank",
                               "--hdp-mode"}
    assert set(megatron_overlap.FLAGS) == {
        "--overlap-tp",
        "--overlap-tp-chunks",
        "--overlap-tp-rs",
        "--overlap-tp-bidirectional",
        "--overlap-tp-sub-batches",
        "--overlap-tp-sub-batch-blocks",  # which blocks the sub-batches cut
        "--overlap-tp-allreduce-fusion",  # CoCoNet's transformation without sequence parallelism
        "--overlap-tp-autotune",  # was --overlap-autotune (TP only)
        "--overlap-tp-plan-file",  # was --overlap-plan (TP only, not the plan command)
        "--overlap-trace",
        "--overlap-trace-iters",
        "--overlap-cp",
        "--overlap-cp-a2a-size",
        "--overlap-hdp",  # was --hdp
        "--overlap-hdp-max-tokens-per-rank",  # was --hdp-max-tokens-per-rank; --hdp-mode is derived
        "--overlap-pp",
        "--overlap-pp-max-inflight",
        "--overlap-pp-memory-budget",
        "--overlap-pp-buckets",  # DDP buckets on every stage and chunk of a virtual pipeline
        "--overlap-timeout-s",  # bounds the plugin's own waits (docs/failures.md)
    }


def test_no_flag_collides_with_megatron():
    from megatron_overlap.args import DEPRECATED

    assert len(MEGATRON_FLAGS) > 500  # the list is real, not empty
    for flag in megatron_overlap.FLAGS + tuple(DEPRECATED):
        assert flag not in MEGATRON_FLAGS
        # Megatron parses with allow_abbrev=False, but no Megatron flag may start with ours
        # either, or a user's typo would silently pick the other one. One known exception,
        # checked below: --overlap-cp is a prefix of Megatron's --overlap-cpu-optimizer-d2h-h2d.
        prefixed = {m for m in MEGATRON_FLAGS if m.startswith(flag) and m != flag}
        assert prefixed <= ({"--overlap-cpu-optimizer-d2h-h2d"} if flag == "--overlap-cp" else set()), flag
    # and our dests do not shadow a field Megatron reads from args
    megatron_dests = {m[2:].replace("-", "_") for m in MEGATRON_FLAGS}
    parser = add_overlap_args(argparse.ArgumentParser())
    ours = {a.dest for a in parser._actions if a.option_strings and a.dest not in ("help", argparse.SUPPRESS)}
    assert not ours & megatron_dests


# every old spelling still works, does what its new name does, and warns once (rank 0)
@pytest.mark.parametrize("old,new", [
    (["--overlap-tp", "p2p", "--overlap-autotune"], ["--overlap-tp", "p2p", "--overlap-tp-autotune"]),
    (["--overlap-tp", "p2p", "--overlap-plan", "p.json"], ["--overlap-tp", "p2p", "--overlap-tp-plan-file", "p.json"]),
    (["--hdp", "--overlap-hdp-max-tokens-per-rank", "64"], HDP),
    (["--overlap-hdp", "--hdp-max-tokens-per-rank", "64"], HDP),
    (HDP + ["--hdp-mode", "pp"], HDP),
    (["--overlap-pp", "off"], ["--overlap-pp", "megatron"]),
], ids=["overlap-autotune", "overlap-plan", "hdp", "hdp-max-tokens-per-rank", "hdp-mode", "overlap-pp-off"])
def test_deprecated_spellings_do_what_the_new_ones_do_and_warn_once(old, new, monkeypatch):
    import warnings

    from megatron_overlap.args import DEPRECATED

    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("SLURM_PROCID", raising=False)
    name = next(f for f in old if f in DEPRECATED) if any(f in DEPRECATED for f in old) else "--overlap-pp off"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")  # Python's default for FutureWarning: once per message and place
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the new spelling warns of nothing
            assert OverlapConfig.from_args(parse(*new)) is not None
        # parsed here, so the warning's place is this file; Megatron parses several times
        configs = [OverlapConfig.from_args(overlap_parser().parse_args(list(old))) for _ in range(3)]
    assert configs[0] == configs[2] == OverlapConfig.from_args(parse(*new))
    texts = [str(w.message) for w in caught if issubclass(w.category, FutureWarning)]
    assert len(texts) == 1, texts
    replacement = DEPRECATED.get(name, "--overlap-pp megatron")
    if replacement is None:
        assert texts[0] == ("megatron-overlap: --hdp-mode is deprecated and ignored: HDP's mode follows "
                            "--pipeline-model-parallel-size (every rank the same micro-batch count with a pipeline, "
                            "whole steps balanced without one)")
    else:
        assert texts[0] == f"megatron-overlap: {name} is deprecated; use {replacement}"
    assert caught[0].filename == __file__  # pointed at the code that parsed, not at argparse


def test_deprecated_spellings_warn_on_rank_zero_only(monkeypatch):
    import warnings

    monkeypatch.setenv("RANK", "3")  # torchrun's, before torch.distributed starts
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert OverlapConfig.from_args(parse("--hdp", "--hdp-max-tokens-per-rank", "64")).hdp.enabled
    assert not caught


def test_help_describes_every_parallelism_and_hides_the_old_spellings():
    text = overlap_parser().format_help()
    for words in ("--overlap-tp ", "--overlap-cp ", "--overlap-hdp ", "--overlap-pp {megatron,1f1b,zb,zbv,auto}",
                  "megatron (default): Megatron's own schedule"):
        assert words in text, words
    for old in ("--overlap-autotune", "--overlap-plan ", "--hdp ", "--hdp-mode", " off: Megatron"):
        assert old not in text, old


def test_overlap_cp_never_turns_on_megatrons_cpu_optimizer_flag():
    parser = argparse.ArgumentParser(allow_abbrev=False)  # as Megatron builds it
    parser.add_argument("--overlap-cpu-optimizer-d2h-h2d", action="store_true")
    add_overlap_args(parser)
    args = parser.parse_args(["--overlap-cp", "ring"])
    assert args.overlap_cp == "ring" and args.overlap_cpu_optimizer_d2h_h2d is False
    # without the plugin the flag is refused loudly, never taken as an abbreviation
    bare = argparse.ArgumentParser(allow_abbrev=False)
    bare.add_argument("--overlap-cpu-optimizer-d2h-h2d", action="store_true")
    with pytest.raises(SystemExit):
        bare.parse_args(["--overlap-cp", "ring"])


def test_usable_as_extra_args_provider():
    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument("--tensor-model-parallel-size", type=int, default=1)
    parser = add_overlap_args(parser)  # Megatron: parser = extra_args_provider(parser)
    args = parser.parse_args(["--tensor-model-parallel-size", "8", "--overlap-tp", "p2p"])
    assert args.tensor_model_parallel_size == 8 and args.overlap_tp == "p2p"


def test_defaults_and_round_trip():
    config = OverlapConfig.from_args(parse())
    assert config == OverlapConfig() and not config.tp.enabled
    config = OverlapConfig.from_args(
        parse("--overlap-tp", "p2p", "--overlap-tp-chunks", "16", "--overlap-tp-rs", "a2a", "--overlap-tp-bidirectional")
    )
    tp = config.tp
    assert (tp.mode, tp.chunks, tp.rs, tp.bidirectional) == ("p2p", 16, "a2a", True)
    assert OverlapConfig.from_args(parse(*config.as_flags())) == config
    from megatron_overlap.tp.backends import resolve_backend, symm_mem

    # symm-mem where PyTorch's symmetric memory runs (never without CUDA), else p2p
    auto = resolve_backend(OverlapConfig.from_args(parse("--overlap-tp", "auto")).tp)
    assert auto == ("symm-mem" if symm_mem.availability()[0] else "p2p")
    assert auto == "p2p" or torch.cuda.is_available()
    assert TPConfig(mode="fused").rs_algo == "a2a" and TPConfig(mode="p2p").rs_algo == "ring"
    with pytest.raises(Exception):
        config.tp = TPConfig()  # frozen
    with pytest.raises(Exception):
        config.tp.mode = "off"  # frozen too


def test_default_chunk_rule():
    config = TPConfig(mode="p2p")
    assert chunks_per_rank(config, 2, 1024) == 5  # one per 256 tokens plus one, at most 5
    assert chunks_per_rank(config, 2, 256, batch=2) == 3
    assert chunks_per_rank(config, 8, 16) == 1
    assert chunks_per_rank(TPConfig(mode="p2p", chunks=12), 4, 1024) == 3


def test_pieces_cover_the_shard_exactly():
    from megatron_overlap.comm.rings import split_pieces

    for rows in (1, 2, 13, 100, 1024):
        for chunks in (1, 2, 3, 5, 8):
            for bidir in (False, True):
                for taper in (False, True):
                    pieces = split_pieces(rows, chunks, bidir, taper)
                    covered = sorted(r for p in pieces for r in range(p.start, p.stop))
                    assert covered == list(range(rows)), (rows, chunks, bidir, taper)
                    assert all(p.rows > 0 and p.direction in (1, -1) for p in pieces)
    assert [p.rows for p in split_pieces(1024, 5, taper=True)] == [128, 256, 256, 256, 128]


# --------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    "flags,kwargs,flag,words",
    [
        # without sequence parallelism: what the all-reduce path cannot run
        (["--overlap-tp", "fused"], dict(sp=False), "--overlap-tp", "hide nothing; use --overlap-tp p2p"),
        (["--overlap-tp", "p2p", "--overlap-tp-bidirectional"], dict(sp=False), "--overlap-tp-bidirectional",
         "no ring to split"),
        (["--overlap-tp", "p2p", "--overlap-tp-rs", "a2a"], dict(sp=False), "--overlap-tp-rs",
         "add --overlap-tp-allreduce-fusion"),
        (["--overlap-tp", "p2p", "--overlap-tp-allreduce-fusion"], {}, "--overlap-tp-allreduce-fusion",
         "--sequence-parallel is on"),
        (["--overlap-tp", "p2p", "--overlap-tp-allreduce-fusion"], dict(sp=False, seq=66), "--seq-length",
         "which --overlap-tp-allreduce-fusion needs"),
        (["--overlap-tp", "p2p", "--overlap-tp-chunks", "128"], dict(sp=False, seq=64), "--overlap-tp-chunks",
         "use at most 64"),
        (["--overlap-tp", "p2p"], dict(sp=False, impl="transformer_engine"), "--transformer-impl",
         "--transformer-impl local"),
        (["--overlap-tp-allreduce-fusion"], {}, "--overlap-tp-allreduce-fusion", "only applies to TP overlap"),
        (["--overlap-tp", "p2p", "--overlap-tp-chunks", "6"], {}, "--overlap-tp-chunks", "not a multiple"),
        (["--overlap-tp", "p2p"], dict(impl="transformer_engine"), "--transformer-impl", "--transformer-impl local"),
        (["--overlap-tp", "p2p"], dict(tp_comm_overlap=True), "--overlap-tp", "--tp-comm-overlap"),
        (["--overlap-tp", "p2p"], dict(seq=66), "--seq-length", "not divisible"),
        (["--overlap-tp", "p2p", "--overlap-tp-chunks", "128"], dict(seq=64), "--overlap-tp-chunks", "use at most 64"),
        (["--overlap-tp", "p2p"], dict(tp=0), "--tensor-model-parallel-size", "positive"),
        (["--overlap-tp-rs", "a2a"], {}, "--overlap-tp-rs", "only applies to TP overlap"),
        (["--overlap-tp-bidirectional"], {}, "--overlap-tp-bidirectional", "only applies to TP overlap"),
        (["--overlap-tp", "off", "--overlap-tp-chunks", "8"], {}, "--overlap-tp-chunks", "--overlap-tp p2p"),
        (["--overlap-tp-sub-batches", "2"], {}, "--overlap-tp-sub-batches", "only applies to TP overlap"),
        (["--overlap-tp", "fused", "--overlap-tp-sub-batches", "2"], {}, "--overlap-tp-sub-batches",
         "runs each GEMM whole"),
        (["--overlap-tp", "fused", "--overlap-tp-sub-batches", "auto"], {}, "--overlap-tp-sub-batches",
         "runs each GEMM whole"),
        (["--overlap-tp", "p2p", "--overlap-tp-sub-batch-blocks", "attention"], {}, "--overlap-tp-sub-batch-blocks",
         "attention chooses the blocks --overlap-tp-sub-batches cuts, and --overlap-tp-sub-batches is 1"),
        (["--overlap-trace-iters", "3"], {}, "--overlap-trace-iters", "without --overlap-trace"),
        (["--overlap-tp-autotune"], {}, "--overlap-tp-autotune", "only applies to TP overlap"),
        (["--overlap-tp", "p2p", "--overlap-tp-autotune", "--overlap-tp-plan-file", "p.json"], {},
         "--overlap-tp-plan-file", "pass one of them"),
        (["--overlap-tp", "p2p", "--overlap-tp-plan-file", "/nonexistent/plan.json"], {}, "--overlap-tp-plan-file",
         "cannot read"),
        (["--overlap-trace", "/tmp/t", "--overlap-trace-iters", "x"], {}, "--overlap-trace-iters", "expected e.g."),
        ([], dict(tp=1, cp=2), "--overlap-cp", "--overlap-cp ring"),
        (["--overlap-tp", "p2p"], dict(tp=2, cp=2), "--overlap-cp", "asserts CP == 1"),
        (["--overlap-cp", "ring"], dict(tp=1, cp=4, seq=100), "--seq-length", "2 x context-parallel size = 8"),
        (["--overlap-cp", "a2a"], dict(tp=1, cp=4, kv_heads=2), "--overlap-cp", "--overlap-cp ring"),
        (["--overlap-cp", "a2a"], dict(tp=2, cp=2, kv_heads=2), "--overlap-cp", "1 key/value heads"),
        (["--overlap-cp", "hybrid", "--overlap-cp-a2a-size", "3"], dict(tp=1, cp=4), "--overlap-cp-a2a-size", "dividing"),
        (["--overlap-cp", "hybrid"], dict(tp=1, cp=4), "--overlap-cp-a2a-size", "needs --overlap-cp-a2a-size"),
        (["--overlap-cp", "ring", "--overlap-cp-a2a-size", "2"], {}, "--overlap-cp-a2a-size", "only applies to --overlap-cp hybrid"),
        (["--overlap-cp", "ring"], dict(tp=1, cp=2, impl="transformer_engine"), "--overlap-cp", "--transformer-impl local"),
        (["--overlap-hdp"], dict(tp=1), "--overlap-hdp-max-tokens-per-rank", "--overlap-hdp needs"),
        (["--overlap-hdp-max-tokens-per-rank", "64"], dict(tp=1), "--overlap-hdp-max-tokens-per-rank",
         "only applies with --overlap-hdp"),
        (HDP + ["--overlap-cp", "ring"], dict(tp=1), "--overlap-cp", "drop --overlap-cp"),
        (HDP, dict(tp=1, cp=2), "--context-parallel-size", "--context-parallel-size 1"),
        (HDP + ["--overlap-pp", "zbv"], dict(tp=1, pp=2, virtual_pipeline_model_parallel_size=2), "--overlap-pp",
         "and --overlap-hdp runs under non-interleaved pipelines only (its loop reads one data iterator per stage"),
        (HDP, dict(tp=1, pp=2, virtual_pipeline_model_parallel_size=2), "--overlap-hdp", "non-interleaved pipelines only"),
        (HDP, dict(tp=4, world_size=6), "--tensor-model-parallel-size",
         "the world of 6 ranks does not split into TP groups of 4 x pipeline stages of 1"),
        (HDP, dict(tp=1, hybrid_context_parallel=True), "--overlap-hdp",
         "--overlap-hdp: and Megatron's --hybrid-context-parallel both regroup"),
        (["--overlap-pp", "zbv"], dict(tp=1, pp=2, virtual_pipeline_model_parallel_size=4), "--overlap-pp",
         "zbv places exactly 2 model chunks on each stage"),
        (["--overlap-pp", "zbv"], dict(tp=1, pp=2), "--overlap-pp", "this run has no virtual pipeline"),
        (["--overlap-pp", "zb"], dict(tp=1, pp=2, delay_wgrad_compute=True), "--delay-wgrad-compute",
         "choose one of the two"),
        (["--overlap-pp", "1f1b"], dict(tp=1, pp=2, overlap_p2p_comm_warmup_flush=True),
         "--overlap-p2p-communication-warmup-flush", "which --overlap-pp 1f1b replaces"),
        (["--overlap-pp", "zb"], dict(tp=1, pp=2, impl="transformer_engine"), "--overlap-pp",
         "has not been tested, so it is refused"),
        (["--overlap-pp", "zb"], dict(tp=2, pp=2), "--overlap-pp", "add --overlap-tp p2p"),
        (["--overlap-pp", "1f1b", "--overlap-pp-max-inflight", "2"], dict(tp=1, pp=4), "--overlap-pp-max-inflight",
         "below the 4 pipeline stages"),
        (["--overlap-pp-max-inflight", "4"], dict(tp=1, pp=2), "--overlap-pp-max-inflight", "only apply to --overlap-pp"),
        (["--overlap-pp", "zb", "--overlap-pp-max-inflight", "4", "--overlap-pp-memory-budget", "8"], dict(tp=1, pp=2),
         "--overlap-pp-memory-budget", "pass one of them"),
        (["--overlap-pp-buckets", "megatron"], dict(tp=1, pp=2), "--overlap-pp-buckets",
         "only applies to --overlap-pp 1f1b, zb, zbv or auto with a virtual pipeline"),
    ],
    ids=[
        "no-sp-fused", "no-sp-bidirectional", "no-sp-rs-without-fusion", "fusion-with-sp", "fusion-seq-not-split",
        "no-sp-chunks-over-rows", "no-sp-te-linears", "fusion-without-tp-overlap",
        "chunks-not-multiple-of-tp",
        "te-linears",
        "conflicts-with-tp-comm-overlap",
        "seq-not-divisible-by-tp",
        "more-chunks-than-rows",
        "zero-tp-size",
        "rs-without-overlap",
        "bidirectional-without-overlap",
        "chunks-without-overlap",
        "sub-batches-without-overlap",
        "sub-batches-with-fused",
        "auto-sub-batches-with-fused",
        "sub-batch-blocks-without-a-cut",
        "trace-iters-without-trace",
        "autotune-without-overlap",
        "autotune-and-plan",
        "missing-plan-file",
        "bad-trace-iters",
        "cp-on-local-path-without-overlap-cp",
        "cp-with-tp-overlap-only",
        "cp-seq-not-multiple-of-2cp",
        "cp-a2a-gqa-heads",
        "cp-a2a-heads-after-tp",
        "cp-hybrid-size-not-dividing",
        "cp-hybrid-without-size",
        "cp-a2a-size-without-hybrid",
        "cp-with-te-attention",
        "hdp-without-capacity",
        "hdp-capacity-without-hdp",
        "hdp-with-overlap-cp",
        "hdp-with-cp-size",
        "hdp-with-zbv",
        "hdp-with-virtual-pipeline",
        "hdp-tp-not-dividing-the-world",
        "hdp-with-megatrons-hybrid-context-parallel",
        "pp-zbv-four-chunks",
        "pp-zbv-without-virtual-pipeline",
        "pp-with-megatron-delay-wgrad",
        "pp-with-megatron-warmup-flush",
        "pp-zb-with-te",
        "pp-zb-tp-without-overlap",
        "pp-inflight-below-stages",
        "pp-inflight-without-pp",
        "pp-budget-and-inflight",
        "pp-buckets-without-pp",
    ],
)
def test_invalid_configurations_name_the_flag(flags, kwargs, flag, words):
    with pytest.raises(OverlapConfigError) as info:
        megatron_overlap.install(megatron_args(*flags, **kwargs))
    assert info.value.flag == flag
    assert str(info.value).startswith(flag + ":")
    assert words in str(info.value)
    assert not megatron_overlap.is_installed()


def test_parser_rejects_bad_values_naming_the_flag(capsys):
    assert "argument --overlap-tp-chunks: must be 0" in parser_error(capsys, "--overlap-tp-chunks", "-2")
    assert "argument --overlap-tp-chunks: expected a whole number" in parser_error(capsys, "--overlap-tp-chunks", "x")
    assert "argument --overlap-tp: invalid choice" in parser_error(capsys, "--overlap-tp", "fast")
    assert "argument --overlap-tp-rs: invalid choice" in parser_error(capsys, "--overlap-tp-rs", "tree")
    assert "argument --overlap-tp-sub-batch-blocks: invalid choice: 'qkv' (choose from 'all', 'attention', 'mlp')" in \
        parser_error(capsys, "--overlap-tp-sub-batch-blocks", "qkv")
    assert "argument --overlap-tp-sub-batches: expected a whole number >= 1 or auto, got 'two'" in parser_error(
        capsys, "--overlap-tp-sub-batches", "two")
    # refused while parsing, before install (they were refused at install before)
    assert "argument --overlap-tp-sub-batches: must be a whole number >= 1 or auto in 1 .." in parser_error(
        capsys, "--overlap-tp", "p2p", "--overlap-tp-sub-batches", "0")
    assert "argument --overlap-hdp-max-tokens-per-rank: must be a whole number of tokens in 1 .." in parser_error(
        capsys, "--overlap-hdp", "--overlap-hdp-max-tokens-per-rank", "0")
    assert "argument --overlap-pp: invalid choice: 'fast' (choose from megatron, 1f1b, zb, zbv, auto)" in parser_error(
        capsys, "--overlap-pp", "fast")
    assert "argument --overlap-pp-memory-budget: must be a positive, finite number of GB, got -1.0" in parser_error(
        capsys, "--overlap-pp", "zb", "--overlap-pp-memory-budget", "-1")


def test_config_object_validates_on_its_own():
    with pytest.raises(OverlapConfigError, match="^--overlap-tp: unknown mode 'fast'"):
        TPConfig(mode="fast")
    with pytest.raises(OverlapConfigError, match="^--overlap-tp-chunks: must be 0"):
        TPConfig(mode="p2p", chunks=-4)
    with pytest.raises(OverlapConfigError, match="^--overlap-tp-chunks: expected a whole number"):
        TPConfig(mode="p2p", chunks=2.5)
    with pytest.raises(OverlapConfigError, match="^--overlap-tp-rs: unknown algorithm"):
        TPConfig(mode="p2p", rs="tree")


def test_install_rejects_foreign_arguments():
    with pytest.raises(TypeError, match="add_overlap_args"):
        megatron_overlap.install(argparse.Namespace(lr=1.0))


def test_unknown_fields_pass_until_the_layer_runs():
    # programmatic install: nothing about the model is known yet, nothing is refused yet
    check_tp_model(TPConfig(mode="p2p", chunks=6), ModelContext())
    with pytest.raises(OverlapConfigError, match="not a multiple"):
        check_tp_model(TPConfig(mode="p2p", chunks=6), ModelContext(tp_size=4))


def test_adding_the_flags_twice_is_harmless():
    parser = add_overlap_args(add_overlap_args(argparse.ArgumentParser()))
    assert parser.parse_args(["--overlap-tp", "p2p"]).overlap_tp == "p2p"


def test_overlap_off_needs_no_megatron(monkeypatch):
    from megatron_overlap.integration import compat

    monkeypatch.setattr(compat, "megatron_core_version", lambda: None)
    assert not megatron_overlap.install(parse()).config.tp.enabled  # no MegatronVersionError


def test_pp_flags_with_pp_1_are_a_notice_and_stock_runs(caplog):
    import logging

    with caplog.at_level(logging.WARNING, logger="megatron_overlap"):
        inst = megatron_overlap.install(megatron_args("--overlap-pp", "zb", tp=1, pp=1))
    assert not megatron_overlap.is_installed() and not inst.patched
    assert "no pipeline to schedule with --pipeline-model-parallel-size 1" in caplog.text


def test_pp_auto_resolves_to_what_can_run(caplog):
    import logging

    with caplog.at_level(logging.WARNING, logger="megatron_overlap"):
        inst = megatron_overlap.install(megatron_args("--overlap-pp", "auto", tp=1, pp=2))
        assert inst.config.pp.mode == "zb" and inst.requested.pp.mode == "auto"
        megatron_overlap.uninstall()
        inst = megatron_overlap.install(megatron_args("--overlap-pp", "auto", tp=1, pp=2, impl="transformer_engine"))
        assert inst.config.pp.mode == "1f1b"
    assert "--overlap-pp auto: zb" in caplog.text and "--overlap-pp auto: 1f1b (no B/W split" in caplog.text


def test_memory_budget_below_one_or_p_microbatches_is_refused():
    from megatron_overlap.pp.memory import inflight_for_budget, layer_activation_bytes

    per = 4 * layer_activation_bytes(seq=4096, micro_batch=1, hidden=8192, heads=64, tp=8)  # 4 layers
    # 4096 x 8192 x (34 + 5 x 64 x 4096 / 8192) / 8 bytes per layer: 0.81 GB, 3.25 GB for 4
    assert per == pytest.approx(4 * 4096 * 8192 * (34 + 160) / 8)
    assert inflight_for_budget(50.0, 4, 16, per) == 15
    assert inflight_for_budget(100.0, 4, 16, per) == 16  # no more than there are
    with pytest.raises(OverlapConfigError, match="^--overlap-pp-memory-budget: is 1 GB, below one micro-batch"):
        inflight_for_budget(1.0, 4, 16, per)
    with pytest.raises(OverlapConfigError, match="3 micro-batch.*holds 4 on its first stage even in 1F1B"):
        inflight_for_budget(10.0, 4, 16, per)


def test_hdp_installs_with_what_long_context_runs_need():
    """--overlap-hdp with DDP's overlapped gradient reduction and the distributed optimizer's
    overlaps, and HDP under a pipeline with our pipeline schedules, install (they were refused: the
    runs are in tests/test_pretrain_gpt.py); ZB-V and virtual pipelines are still refused, naming
    both flags (test_invalid_configurations_name_the_flag)."""
    hdp = ("--overlap-hdp", "--overlap-hdp-max-tokens-per-rank", "64")
    for flags, megatron in [
        (hdp, dict(overlap_grad_reduce=True, use_distributed_optimizer=True, overlap_param_gather=True)),
        (hdp + ("--overlap-pp", "1f1b"), dict(pp=2, overlap_grad_reduce=True)),
        (hdp + ("--overlap-pp", "zb"), dict(pp=2, recompute_granularity="full")),
    ]:
        try:
            inst = megatron_overlap.install(megatron_args(*flags, tp=1, **megatron))
            assert inst.config.hdp.enabled and inst.patched, flags
            assert inst.config.pp.mode == (flags[-1] if "--overlap-pp" in flags else "off"), flags
        finally:
            megatron_overlap.uninstall()


def test_hdp_through_megatron_lms_loop_checks_what_the_script_path_needs(monkeypatch):
    """With Megatron-LM's training loop importable, --overlap-hdp wraps its schedule lookup. The script
    path (a plain data iterator) refuses, at its first schedule call and naming the flag, samples
    without document marks and a model without per-token loss (TP > 1 runs: tests/test_pretrain_gpt.py);
    a loop that hands in an HdpDataIterator is left alone."""
    import types

    import torch

    from megatron_overlap.hdp.runtime import HdpDataIterator

    training = types.ModuleType("megatron.training.training")
    training.get_forward_backward_func = lambda *a, **k: (lambda **kw: "ran")
    package = types.ModuleType("megatron.training")
    package.training = training
    monkeypatch.setitem(sys.modules, "megatron.training", package)
    monkeypatch.setitem(sys.modules, "megatron.training.training", training)

    class Model(torch.nn.Module):
        def __init__(self, per_token):
            super().__init__()
            self.config = types.SimpleNamespace(calculate_per_token_loss=per_token)

    def first_call(per_token=True, **megatron):
        args = megatron_args(*HDP, **megatron)
        inst = megatron_overlap.install(args)  # installs: an own loop may still drive the runtime
        assert getattr(training.get_forward_backward_func, "__megatron_overlap__", None) is inst
        schedule = training.get_forward_backward_func()
        try:
            with pytest.raises(OverlapConfigError) as info:
                schedule(forward_step_func=None, data_iterator=iter([]), model=[Model(per_token)], num_microbatches=1)
            own = HdpDataIterator.__new__(HdpDataIterator)
            assert schedule(forward_step_func=None, data_iterator=own, model=[Model(per_token)],
                            num_microbatches=1) == "ran"
        finally:
            megatron_overlap.uninstall()
        return info.value

    marked = dict(reset_attention_mask=True, reset_position_ids=True)
    err = first_call(tp=1, reset_attention_mask=False, reset_position_ids=True)
    assert err.flag == "--reset-attention-mask" and "HDP has nothing to balance" in str(err)
    assert "marks the documents only with --reset-attention-mask and --reset-position-ids" in str(err)
    err = first_call(per_token=False, tp=1, **marked)
    assert err.flag == "--calculate-per-token-loss" and "needs calculate_per_token_loss" in str(err)
    assert not hasattr(training.get_forward_backward_func, "__megatron_overlap__")
