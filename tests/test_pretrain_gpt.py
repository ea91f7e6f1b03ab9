"""Megatron-LM's own ``pretrain_gpt.py`` (issue: training-loop), stock against the plugin,
through ``torchrun`` with gloo on this CPU: a tiny GPT (2 layers, hidden 128, seq 128, mock
data), 5 iterations, the losses Megatron computes read exactly (``train_step``'s reduced
values, not the log line), and the plugin's patched calls counted, so a run where the patch did
not take over fails. The Megatron-LM tree comes from ``MEGATRON_LM_DIR`` (default: the shared
core_v0.16.1 copy); the CPU shims of its training loop are ``lab/megatron_lm_cpu.py``.

Tolerances: TP overlap and the pipeline schedules run the same ops on the same tensors in the
same order at TP = 2 (bit-identical, ``==``); context parallelism against one rank merges the
attention blocks in another order (online softmax over ring steps): rel. 1e-6."""

import functools
import glob
import json
import os
import socket
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TREE = os.environ.get("MEGATRON_LM_DIR",
                      os.path.join(ROOT, "..", "shared", "third_party", "megatron-lm", "core_v0.16.1"))
SCRIPT = os.path.join(TREE, "pretrain_gpt.py")
pytestmark = pytest.mark.skipif(
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


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@functools.lru_cache(maxsize=None)
def train(mode: str, ranks: int, flags: tuple) -> dict:
    """One torchrun of pretrain_gpt.py: the last stage's losses and the calls summed over ranks."""
    out = os.path.join(os.environ.get("PYTEST_TMP", "/tmp"), f"pretrain_gpt_{os.getpid()}_{abs(hash((mode, ranks, flags)))}")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--master-port",
           str(_port()), "-m", "megatron_overlap.lab.megatron_lm_cpu", out, mode, SCRIPT, *BASE, *flags]
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    losses, calls = [], {}
    for path in sorted(glob.glob(out + ".rank*")):
        with open(path) as f:
            r = json.load(f)
        os.remove(path)
        if any(r["losses"]):
            losses = [step["lm loss"] for step in r["losses"]]
        for k, v in r["calls"].items():
            calls[k] = calls.get(k, 0) + v
    assert len(losses) == 5, (losses, done.stdout[-2000:])
    return {"losses": losses, "calls": calls}


@pytest.mark.parametrize("flags, calls", [
    (("--overlap-tp", "p2p"), {"tp.column", "tp.row"}),
    (("--overlap-tp", "p2p", "--overlap-tp-rs", "a2a"), {"tp.column", "tp.row"}),
], ids=["p2p", "p2p-a2a"])
def test_tp_overlap_trains_like_stock(flags, calls):
    stock = train("stock", 2, TP2)
    ours = train("plugin", 2, TP2 + flags)
    assert stock["calls"] == {} and calls <= set(ours["calls"]) and min(ours["calls"].values()) > 0, ours
    assert ours["losses"] == stock["losses"]


def test_context_parallel_ring_trains_like_one_rank():
    one = train("stock", 1, NO_DROPOUT)
    ours = train("plugin", 2, NO_DROPOUT + ("--context-parallel-size", "2", "--overlap-cp", "ring"))
    assert ours["calls"].get("cp.ring", 0) > 0, ours
    for a, b in zip(ours["losses"], one["losses"]):
        assert abs(a - b) <= 1e-6 * abs(b), (ours["losses"], one["losses"])


@pytest.mark.parametrize("mode", ["1f1b", "zb"])
def test_pipeline_schedules_train_like_megatrons_1f1b(mode):
    stock = train("stock", 2, PP2)
    ours = train("plugin", 2, PP2 + ("--overlap-pp", mode))
    assert ours["calls"].get(f"pp.{mode}", 0) == 2 * 5, ours  # one schedule call per iteration and stage
    if mode == "zb":
        assert ours["calls"].get("pp.deferred_linear", 0) > 0, ours  # the weight gradients waited for W
    assert ours["losses"] == stock["losses"]


def test_plugin_refuses_megatrons_own_cp_path_clearly():
    """Stock Megatron's local attention refuses CP; the plugin's message names the flag."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(_port()),
           "-m", "megatron_overlap.lab.megatron_lm_cpu", "/tmp/unused", "plugin", SCRIPT, *BASE,
           "--context-parallel-size", "2", "--overlap-cp", "ring"]  # attention dropout left at 0.1
    done = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True,
                          timeout=600)
    assert done.returncode != 0
    assert "--attention-dropout: context-parallel attention (--overlap-cp) runs without attention dropout" \
        in done.stderr
