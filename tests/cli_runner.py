"""``megatron-overlap`` commands as the tests run them: forked from one process that imported
torch, Megatron and the plugin once, or a fresh ``python -m megatron_overlap``."""

import atexit
import functools
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@functools.lru_cache(maxsize=None)
def _launcher():
    from megatron_overlap.lab.fork_launcher import ForkLauncher

    launcher = ForkLauncher(None, env=dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1"))
    atexit.register(launcher.close)
    return launcher


def cli(*args, cwd=None, timeout=600, fresh=False):
    """``megatron-overlap ARGS``: forked from one process that imported torch, Megatron and the
    plugin once (``lab/fork_launcher.py``), or a new ``python -m megatron_overlap`` (``fresh``:
    the entry point itself, and the ``run`` tests, whose fake Megatron-LM must be the one imported)."""
    if not fresh:
        rc, stdout, stderr = _launcher().run_cli(list(args), str(cwd or ROOT), timeout=timeout)
        return subprocess.CompletedProcess(args, rc, stdout, stderr)
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "megatron_overlap", *args], cwd=cwd or ROOT,
                          capture_output=True, text=True, timeout=timeout, env=env)
