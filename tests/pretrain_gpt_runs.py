"""Launches of Megatron-LM's own ``pretrain_gpt.py`` for the tests (``test_pretrain_gpt.py``,
``test_config_matrix.py``): stock or through the plugin, with gloo on this CPU, a tiny GPT (2
layers, hidden 128, seq 128, mock data by default).

The ranks of each training are forked from one process that imported Megatron-LM once
(``lab/fork_launcher.py``: what torchrun sets, without the import per rank). The Megatron-LM
tree comes from ``MEGATRON_LM_DIR`` (default: the shared core_v0.16.1 copy); the CPU shims of
its training loop are ``lab/megatron_lm_cpu.py``. :func:`train` is cached: tests that compare
against the same stock run share it.

What a launch returns: the losses Megatron logs on the rank it prints from (the last rank:
``training_log``'s reduced values, exact, not the ``%.6E`` log line), the log lines themselves
(training and validation losses as printed), and the plugin's patched calls summed over ranks.
"""

from __future__ import annotations

import atexit
import functools
import glob
import json
import os
import re
import socket
import tempfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TREE = os.environ.get("MEGATRON_LM_DIR",
                      os.path.join(ROOT, "..", "shared", "third_party", "megatron-lm", "core_v0.16.1"))
SCRIPT = os.path.join(TREE, "pretrain_gpt.py")
needs_megatron_lm = pytest.mark.skipif(
    not os.path.isfile(SCRIPT),
    reason=f"no Megatron-LM training loop at {TREE} (set MEGATRON_LM_DIR to a Megatron-LM checkout)")

BASE = ["--num-layers", "2", "--hidden-size", "128", "--num-attention-heads", "4", "--seq-length", "128",
        "--max-position-embeddings", "128", "--micro-batch-size", "2", "--global-batch-size", "4",
        "--train-iters", "5", "--lr", "1e-3", "--mock-data", "--tokenizer-type", "NullTokenizer",
        "--vocab-size", "1024", "--transformer-impl", "local", "--eval-iters", "0", "--eval-interval", "1000",
        "--clip-grad", "0", "--distributed-backend", "gloo", "--no-masked-softmax-fusion", "--no-bias-gelu-fusion",
        "--no-bias-dropout-fusion", "--no-persist-layer-norm", "--log-interval", "1", "--seed", "1234"]
TP2 = ("--tensor-model-parallel-size", "2", "--sequence-parallel")
NO_DROPOUT = ("--attention-dropout", "0", "--hidden-dropout", "0")
PP2 = ("--pipeline-model-parallel-size", "2", "--global-batch-size", "8")  # 4 micro-batches
VPP2 = ("--num-layers", "4", "--pipeline-model-parallel-size", "2", "--global-batch-size", "8",
        "--num-layers-per-virtual-pipeline-stage", "1")  # PP=2 x VPP=2, 4 micro-batches
CPU_INIT = ("--use-cpu-initialization",)  # the same initial weights at every TP size

_LOG_LOSS = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?\| lm loss: ([0-9.E+-]+) \|")
_VAL_LOSS = re.compile(r"validation loss at iteration (\d+)[^|]*\| lm loss value: ([0-9.E+-]+) \|")


def port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@functools.lru_cache(maxsize=None)
def _launcher():
    """One zygote per test session: Megatron-LM imported once, the ranks of every training
    forked from it."""
    from megatron_overlap.lab.fork_launcher import ForkLauncher

    launcher = ForkLauncher(TREE, env=dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES=""))
    atexit.register(launcher.close)
    return launcher


def launch(mode: str, ranks: int, flags: tuple, timeout: float = 600) -> dict:
    """One launch of pretrain_gpt.py, uncached: ``rc``, ``stdout``, ``stderr``, ``losses`` (per
    iteration, from the last rank), ``grad_norms`` (beside them; None unless ``--clip-grad`` > 0),
    ``calls`` (summed over ranks), ``redrawn``, ``log_losses`` and ``val_losses`` ({iteration:
    value} as printed)."""
    out = os.path.join(os.environ.get("PYTEST_TMP", "/tmp"), f"pretrain_gpt_{os.getpid()}_{abs(hash((mode, ranks, flags)))}")
    argv = [out, mode, SCRIPT, *(a for a in BASE if not (a == "--mock-data" and "--data-path" in flags)), *flags]
    rc, stdout, stderr = _launcher().run(ranks, argv, timeout=timeout)
    losses, calls, redrawn, grad_norms = [], {}, [], []
    for path in sorted(glob.glob(out + ".rank*")):
        with open(path) as f:
            r = json.load(f)
        os.remove(path)
        if path.endswith(f".rank{ranks - 1}"):  # the rank Megatron prints and writes its logs from
            losses = [step["lm loss"] for step in r["losses"] if step]
            grad_norms = r.get("grad_norms", [])
        for k, v in r["calls"].items():
            calls[k] = calls.get(k, 0) + v
        redrawn += r.get("redrawn", [])
    return {"rc": rc, "stdout": stdout, "stderr": stderr, "losses": losses, "calls": calls,
            "redrawn": sorted(redrawn), "grad_norms": grad_norms,
            "log_losses": {int(i): float(v) for i, v in _LOG_LOSS.findall(stdout)},
            "val_losses": {int(i): float(v) for i, v in _VAL_LOSS.findall(stdout)}}


@functools.lru_cache(maxsize=None)
def train(mode: str, ranks: int, flags: tuple, iterations: int = 5) -> dict:
    """:func:`launch`, asserted to have trained ``iterations`` iterations; cached."""
    run = launch(mode, ranks, flags)
    assert run["rc"] == 0, run["stderr"][-4000:]
    assert len(run["losses"]) == iterations, (run["losses"], run["stdout"][-2000:])
    return run


_EOD = 1023


@functools.lru_cache(maxsize=None)
def documents_dataset() -> str:
    """A Megatron indexed dataset (megatron-core's own ``IndexedDatasetBuilder``) of 300 documents
    of mixed lengths (5 to 401 tokens, long-tailed), each ending in the end-of-document token
    1023; returns its path prefix."""
    import numpy
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix = os.path.join(tempfile.mkdtemp(prefix="hdp_docs_"), "docs")
    rng = numpy.random.default_rng(7)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=numpy.int32)
    for _ in range(300):
        n = int(min(400, 4 + rng.pareto(1.2) * 30))
        builder.add_document(torch.from_numpy(numpy.append(rng.integers(0, _EOD, n), _EOD).astype(numpy.int32)),
                             [n + 1])
    builder.finalize(prefix + ".idx")
    return prefix


def eod_flags() -> tuple:
    """The NullTokenizer's end-of-document id, pinned to 1023: core_v0.16's is ``--vocab-size``
    itself, 0.19's is ``--vocab-size - 1`` or ``--null-tokenizer-eod-id``."""
    config = os.path.join(TREE, "megatron", "training", "config", "training_config.py")
    if os.path.isfile(config) and "null_tokenizer_eod_id" in open(config).read():
        return ("--null-tokenizer-eod-id", str(_EOD))
    return ("--vocab-size", str(_EOD))


def packed(*flags) -> tuple:
    """The documents dataset, packed, with document-aware positions, masks and per-token loss."""
    prefix = documents_dataset()
    return (*NO_DROPOUT, *eod_flags(), "--data-path", prefix, "--split", "100,0,0", "--data-cache-path",
            os.path.dirname(prefix), "--reset-position-ids", "--reset-attention-mask", "--calculate-per-token-loss",
            "--position-embedding-type", "learned_absolute", "--global-batch-size", "8", *flags)


def with_evaluation(flags: tuple) -> tuple:
    """A validation split (80/20) and one evaluation iteration every 2 steps."""
    flags = list(flags)
    flags[flags.index("--split") + 1] = "80,20,0"
    return (*flags, "--eval-iters", "1", "--eval-interval", "2")
