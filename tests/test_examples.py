"""The launch examples run: ``examples/llama3_70b_slurm.sbatch`` and
``examples/llama3_8b_tp8_torchrun.sh``, each executed on this machine as two nodes of 2 ranks, so
that a user's first multi-node launch is not the first time the script runs.

What is stood in for: SLURM's ``srun`` (one task per node, started at once with its
``SLURM_NODEID``) and ``scontrol show hostnames`` (localhost); ``megatron-overlap`` itself, by a
script that runs the same launcher with Megatron-LM's CPU shims (``lab/megatron_lm_cpu.py``).
``torchrun`` is the real one: ``--nnodes 2`` with the rendezvous on localhost. The model sizes
are shrunk by arguments appended after the scripts' own (the last value wins, as the examples
document), with the flags a CPU needs (gloo, no fused kernels)."""

from __future__ import annotations

import glob
import json
import os
import stat
import subprocess
import sys

import pytest

from .pretrain_gpt_runs import ROOT, TREE, needs_megatron_lm, port

pytestmark = [needs_megatron_lm, pytest.mark.matrix]

TINY = ["--num-layers", "4", "--hidden-size", "64", "--ffn-hidden-size", "128", "--num-attention-heads", "4",
        "--num-query-groups", "2", "--vocab-size", "1024", "--global-batch-size", "8", "--log-interval", "1",
        "--lr-warmup-iters", "1"]  # the scripts warm up for 10 iterations; these train 3
CPU = ["--distributed-backend", "gloo", "--no-rope-fusion", "--no-masked-softmax-fusion", "--no-bias-swiglu-fusion",
       "--no-bias-dropout-fusion", "--no-persist-layer-norm"]

_STANDINS = {
    "megatron-overlap": f"""#!/usr/bin/env bash
# megatron-overlap with Megatron-LM's CPU shims: "run SCRIPT ARGS" -> the same launcher, shimmed
[ "$1" = run ] || exit 2
shift
exec "{sys.executable}" -m megatron_overlap.lab.megatron_lm_cpu "$MO_LOSSES" plugin "$@"
""",
    "srun": """#!/usr/bin/env bash
# one task per node, all at once, each with its SLURM_NODEID; fails if any task fails
while [[ "$1" == --* ]]; do shift; done
pids=()
for ((n = 0; n < SLURM_NNODES; n++)); do SLURM_NODEID=$n "$@" & pids+=($!); done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=$?; done
exit $rc
""",
    "scontrol": """#!/usr/bin/env bash
[ "$1 $2" = "show hostnames" ] && echo localhost && echo localhost
""",
}


def _env(tmp_path, **extra) -> dict:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, text in _STANDINS.items():
        path = bin_dir / name
        path.write_text(text)
        path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return dict(os.environ, PATH=f"{bin_dir}:{os.path.dirname(sys.executable)}:{os.environ['PATH']}",
                MEGATRON_LM=TREE, MO_LOSSES=str(tmp_path / "losses"), OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="",
                PYTHONPATH=ROOT, GPUS_PER_NODE="2", TP="2", SEQ_LENGTH="64", TRAIN_ITERS="3",
                MASTER_PORT=str(port()), **extra)


def _trained(tmp_path, done) -> dict:
    assert done.returncode == 0, done.stderr[-4000:]
    files = sorted(glob.glob(str(tmp_path / "losses.rank*")))
    assert len(files) == 4, files  # 2 nodes x 2 ranks
    calls, losses = {}, []
    for path in files:
        with open(path) as f:
            r = json.load(f)
        losses = [step["lm loss"] for step in r["losses"] if step] or losses
        for k, v in r["calls"].items():
            calls[k] = calls.get(k, 0) + v
    assert len(losses) == 3 and losses[-1] < losses[0], losses  # 3 iterations, training
    return calls


def test_the_slurm_example_runs_on_two_nodes(tmp_path):
    """PP=2 across the two nodes, TP=2 inside each, the distributed optimizer with both
    overlaps, --overlap-tp p2p and --overlap-pp zb, as the script sets them."""
    env = _env(tmp_path, SLURM_JOB_NODELIST="node[0-1]", SLURM_NNODES="2", PP="2")
    done = subprocess.run(["bash", os.path.join(ROOT, "examples", "llama3_70b_slurm.sbatch"), *TINY, *CPU],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    calls = _trained(tmp_path, done)
    # every rank ran the zero-bubble schedule in every iteration
    assert calls.get("tp.column") and calls.get("pp.zb") == 4 * 3 and calls.get("pp.param_gather_at_start"), calls


def test_the_torchrun_example_runs_on_two_nodes(tmp_path):
    """The script once per node (NNODES=2, NODE_RANK 0 and 1), TP=2 inside each node, DP=2."""
    env = _env(tmp_path, NNODES="2", MASTER_ADDR="localhost")
    script = os.path.join(ROOT, "examples", "llama3_8b_tp8_torchrun.sh")
    nodes = [subprocess.Popen(["bash", script, *TINY, *CPU], cwd=tmp_path, env=dict(env, NODE_RANK=str(n)),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for n in range(2)]
    outs = [node.communicate(timeout=600) for node in nodes]
    for node, (_, err) in zip(nodes, outs):
        assert node.returncode == 0, err[-4000:]
    calls = _trained(tmp_path, subprocess.CompletedProcess([], 0, "", ""))
    assert calls.get("tp.column") and calls.get("tp.row"), calls
