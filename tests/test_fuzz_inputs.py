"""Fuzz the plugin's inputs: random combinations of our flags, Megatron's arguments,
plan files, trace directories, the cache variable and autotune cache files, hundreds per run
from a fixed seed. Every one is either accepted or refused by argparse or by the plugin's
``OverlapConfigError`` naming a flag, file or variable that exists, with its message starting
with it; never another exception, never more than a few MB of memory for one case."""

import argparse
import json
import os
import random
import tracemalloc
from pathlib import Path

import pytest

import megatron_overlap
from megatron_overlap import OverlapConfigError

SEED = 25
CASES = 600
MEMORY_BOUND = 32 << 20  # bytes one case may allocate at its peak (a range expanded to a list: gigabytes)

DATA = Path(__file__).parent / "data"
MEGATRON_FLAGS = {line for line in (DATA / "megatron_lm_parser_flags.txt").read_text().split() if line.startswith("--")}
SOURCES = set(megatron_overlap.FLAGS) | MEGATRON_FLAGS | {"MEGATRON_OVERLAP_CACHE"}

NUMBERS = ["0", "1", "2", "3", "4", "8", "16", "128", "2000", "65536", "70000", "-1", "-2", "10" + "0" * 30, "1e9",
           "2.5", "inf", "nan", "", "x", "٣", "0x10", "+4", " 8 "]
VALUES = {
    "--overlap-tp": ["off", "p2p", "auto", "fused", "symm-mem", "fast"],
    "--overlap-tp-rs": ["ring", "a2a", "tree"],
    "--overlap-tp-sub-batches": NUMBERS + ["auto"],
    "--overlap-trace-iters": ["3", "3,5", "3-5", "2-100000000", "0-1000000000000", "5-3", "a-b", ",,,", "1-" + "9" * 40,
                              ",".join(str(i) for i in range(80)), "-1", "3" * 300],
    "--overlap-cp": ["off", "ring", "a2a", "hybrid", "zigzag"],
    "--overlap-pp": ["megatron", "off", "1f1b", "zb", "zbv", "auto", "gpipe"],
    "--overlap-pp-memory-budget": ["8", "0.5", "1e-9", "1e7", "inf", "nan", "-3", "x"],
    "--overlap-timeout-s": ["2", "0.001", "599", "600", "86401", "inf", "nan", "0", "-1", "x"],
}
SWITCHES = ("--overlap-tp-bidirectional", "--overlap-tp-autotune", "--overlap-hdp")
PLAN_FILES = [b'{"default": "c2-ring"}', b"[]", b"{}", b"null", b'{"default": "c1000-ring"}', b'{"default": 3}',
              b'{"default": {"choice": "c0t-a2a"}}', b'{"default": {"choice": 7}}', b'{"default": "c99999999999-ring"}',
              b"\xff\xfe\x00", b"[" * 50000, b"{", b'{"column|rows8xb1|k1n1|f|tp2|d|p2p|t|m": "c9-ring"}', b'"c2-ring"']
CACHE_FILES = PLAN_FILES + [b'{"k": {"choice": "b"}}', b'{"k": {"choice": "zz"}}', b'{"k": [1]}', b"1e999"]


class ParserError(Exception):
    pass


class Parser(argparse.ArgumentParser):
    def error(self, message):  # what argparse would print before exiting 2
        raise ParserError(message)


def megatron_parser() -> argparse.ArgumentParser:
    parser = Parser(allow_abbrev=False)
    return megatron_overlap.add_overlap_args(parser)


def random_flags(rng: random.Random, tmp: Path, case: int) -> list:
    flags = []
    for flag in rng.sample(sorted(megatron_overlap.FLAGS), rng.randint(0, 6)):
        if flag in SWITCHES:
            flags.append(flag)
        elif flag == "--overlap-tp-plan-file":
            path = tmp / f"plan{case}.json"
            path.write_bytes(rng.choice(PLAN_FILES))
            flags += [flag, rng.choice([str(path), str(path), str(tmp / "missing.json"), str(tmp)])]
        elif flag == "--overlap-trace":
            blocker = tmp / "a_file"
            blocker.write_text("x")
            flags += [flag, rng.choice([str(tmp / f"trace{case}"), str(blocker), str(blocker / "sub"), "", "\u00e9t\u00e9"
                                        ])]
        else:
            flags += [flag, rng.choice(VALUES.get(flag, NUMBERS))]
    if rng.random() < 0.5 and "--overlap-tp" not in flags:
        flags += ["--overlap-tp", "p2p"]
    return flags


def megatron_values(rng: random.Random) -> dict:
    heads = rng.choice([4, 8, 32])
    return dict(tensor_model_parallel_size=rng.choice([1, 2, 3, 4, 8]), sequence_parallel=rng.random() < 0.8,
                transformer_impl=rng.choice(["local", "local", "transformer_engine"]),
                tp_comm_overlap=rng.random() < 0.1,
                seq_length=rng.choice([1, 7, 64, 128, 8190, 8192]), micro_batch_size=1,
                context_parallel_size=rng.choice([1, 1, 2, 3, 4]),
                pipeline_model_parallel_size=rng.choice([1, 1, 2, 4]),
                num_attention_heads=heads, group_query_attention=True, num_query_groups=rng.choice([1, 2, heads]),
                train_iters=rng.choice([None, 0, 5, 10**12]), distributed_timeout_minutes=rng.choice([None, 0.01, 10]),
                reset_attention_mask=rng.random() < 0.3, reset_position_ids=rng.random() < 0.3,
                overlap_grad_reduce=rng.random() < 0.2)


def _warm_up(tmp: Path) -> None:
    for flags, megatron in ((["--overlap-tp", "p2p", "--overlap-trace", str(tmp / "w")],
                             dict(tensor_model_parallel_size=2)),
                            (["--overlap-cp", "ring"], dict(context_parallel_size=2)),
                            (["--overlap-hdp", "--overlap-hdp-max-tokens-per-rank", "64"], {}),
                            (["--overlap-pp", "zb"], dict(pipeline_model_parallel_size=2))):
        args = megatron_parser().parse_args(flags)
        values = dict(megatron_values(random.Random(0)), tensor_model_parallel_size=1, context_parallel_size=1,
                      pipeline_model_parallel_size=1, transformer_impl="local", tp_comm_overlap=False, seq_length=64,
                      sequence_parallel=True, reset_attention_mask=True, reset_position_ids=True,
                      overlap_grad_reduce=False, train_iters=None, distributed_timeout_minutes=None)
        for name, value in dict(values, **megatron).items():
            setattr(args, name, value)
        megatron_overlap.install(args)
        megatron_overlap.uninstall()


def check_refusal(exc: OverlapConfigError, flags: list) -> None:
    assert exc.flag in SOURCES or exc.flag.startswith("TransformerConfig."), (exc.flag, str(exc), flags)
    assert str(exc).startswith(exc.flag + ":"), (str(exc), flags)
    if exc.flag == "--overlap-tp-plan-file" and any(w in str(exc) for w in ("entry", "holds", "cannot read", "MiB")):
        assert flags[flags.index("--overlap-tp-plan-file") + 1] in str(exc), (str(exc), flags)  # about the file: names it


def test_random_flags_files_and_variables_are_accepted_or_refused_by_name(tmp_path, monkeypatch):
    rng = random.Random(SEED)
    blocker = tmp_path / "cache_is_a_file"
    blocker.write_text("x")
    envs = [None, str(tmp_path / "cache"), str(blocker), str(blocker / "sub"), "relative/cache"]
    monkeypatch.chdir(tmp_path)
    outcomes = {"accepted": 0, "parser": 0, "plugin": 0}
    _warm_up(tmp_path)  # the imports of a first install are not a case's memory
    tracemalloc.start()
    try:
        for case in range(CASES):
            env = rng.choice(envs)
            if env is None:
                monkeypatch.delenv("MEGATRON_OVERLAP_CACHE", raising=False)
            else:
                monkeypatch.setenv("MEGATRON_OVERLAP_CACHE", env)
            flags = random_flags(rng, tmp_path, case)
            tracemalloc.reset_peak()
            try:
                args = megatron_parser().parse_args(flags)
            except ParserError as exc:
                outcomes["parser"] += 1
                assert str(exc).startswith("argument --") or "unrecognized" in str(exc), (str(exc), flags)
                continue
            for name, value in megatron_values(rng).items():
                setattr(args, name, value)
            try:
                megatron_overlap.install(args)
                outcomes["accepted"] += 1
            except OverlapConfigError as exc:
                outcomes["plugin"] += 1
                check_refusal(exc, flags)
            finally:
                megatron_overlap.uninstall()
            assert tracemalloc.get_traced_memory()[1] < MEMORY_BOUND, flags
    finally:
        tracemalloc.stop()
    assert min(outcomes.values()) >= CASES // 40, outcomes  # all three outcomes are exercised


@pytest.mark.parametrize("content", CACHE_FILES, ids=range(len(CACHE_FILES)))
def test_any_autotune_cache_file_leaves_the_choice_to_the_candidates(tmp_path, content):
    from megatron_overlap.tune.cache import DiskCache, choose

    cache = DiskCache("tp_plans", directory=str(tmp_path))
    Path(cache.path).write_bytes(content)
    picked, hit = choose(cache, "k", ["a", "b"], {"a": 1.0, "b": 2.0}.get)
    assert picked == ("b" if hit else "a")  # a valid cached pick is kept, anything else measured
    assert isinstance(json.loads(Path(cache.path).read_text()), dict)
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]
