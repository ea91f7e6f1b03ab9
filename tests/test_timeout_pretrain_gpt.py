"""``--overlap-timeout-s`` through Megatron-LM's own ``pretrain_gpt.py``: a peer frozen (SIGSTOP:
alive, silent) in each place a rank can block ends every other rank within the flag's seconds +
10 s: in the plugin's TP ring, in Megatron's own TP broadcast of the batch, in DDP's gradient
reductions and the optimizer's collectives, and in a pipeline transfer. The plugin's own waits
fail at S seconds with an error naming the op and the peer; Megatron's collectives fail when
its process groups time out, which the flag sets to S + 5 s from the second iteration on
(Megatron-LM's ``--distributed-timeout-seconds-after-init``; ``install._bound_megatron_groups``).
Rank 1 freezes in iteration 2.

The four trainings run at once (they mostly wait), each on 2 ranks forked from one process
(``tests/pretrain_gpt_runs.py``); the frozen rank is killed 5 s after its peer ended."""

from __future__ import annotations

import os

import pytest

from .pretrain_gpt_runs import BASE, NO_DROPOUT, SCRIPT, TP2, _launcher, needs_megatron_lm

pytestmark = needs_megatron_lm

S = 10  # --overlap-timeout-s
CASES = {  # name: (flags, where rank 1 freezes, what the survivor's error says)
    "tp-ring": (TP2 + ("--overlap-tp", "p2p"), "column",
                ("never answered within 10 s (--overlap-timeout-s)", "group rank 1 (world rank 1)")),
    "megatron-broadcast": (TP2 + ("--overlap-tp", "p2p"), "broadcast", ()),
    "ddp-and-optimizer": (NO_DROPOUT + ("--context-parallel-size", "2", "--overlap-cp", "ring",
                                        "--use-distributed-optimizer", "--overlap-grad-reduce"), "grad-sync", ()),
    "pipeline-p2p": (("--pipeline-model-parallel-size", "2", "--global-batch-size", "8", "--overlap-pp", "zb"),
                     "stage", ("--overlap-timeout-s", "did not complete")),
}


def test_a_frozen_peer_ends_every_other_rank_within_the_timeout(tmp_path):
    launches, paths = [], {}
    for name, (flags, site, _) in CASES.items():
        paths[name] = str(tmp_path / name)
        argv = [paths[name], "plugin", SCRIPT, *BASE, *flags, "--overlap-timeout-s", str(S),
                "--lab-freeze", f"{site}:1:2"]
        launches.append((2, argv))
    results = _launcher().run_many(launches, timeout=300, grace=5)
    for (name, (_, site, says)), run in zip(CASES.items(), results):
        frozen_file = paths[name] + ".frozen"
        assert os.path.exists(frozen_file), (name, "rank 1 never reached", site, run["stderr"][-3000:])
        with open(frozen_file) as f:
            frozen_at = float(f.read())
        code, ended = run["exits"][0]  # the survivor, rank 0
        assert code != 0, (name, run["stdout"][-2000:])
        assert ended - frozen_at <= S + 10, (name, ended - frozen_at, run["stderr"][-3000:])
        assert run["exits"][1][0] == 124, (name, run["exits"])  # still frozen when the launch ended
        for text in says:
            assert text in run["stderr"], (name, text, run["stderr"][-3000:])
    # Megatron's own broadcast ended by the process groups' timeout, which the flag set (S + 5 s)
    assert "Timed out waiting 15000ms" in results[1]["stderr"], results[1]["stderr"][-3000:]
