"""A launcher for the tests that pays the imports once: ``pretrain_gpt.py`` trainings and
``megatron-overlap`` command lines.

``torchrun`` starts every rank as a new Python, which imports torch, megatron-core and
``megatron.training`` again: ~13 s of one core per rank, most of a 5-iteration test training
on 2 cores. The zygote here imports them once (a process of its own, single-threaded, nothing
run), then forks the ranks of each launch; a rank sets the environment ``torchrun`` would set
(``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT``), sends its stdout and stderr to files, and runs ``megatron_lm_cpu.main``: the
script from its first line, in a fresh copy of a process that has only imported modules.

    launcher = ForkLauncher(tree)          # starts the zygote (its imports: ~13 s)
    rc, out, err = launcher.run(2, argv, timeout=600)
    launcher.close()

``ForkLauncher(None)`` is the command line's zygote (torch, megatron-core, the plugin, matplotlib
imported): ``run_cli(argv, cwd)`` forks one process that runs ``megatron-overlap ARGV`` there
(``cli.main.main``), whose rank pools fork in turn (``rank_pool._fork_is_safe``).

Every wait is bounded: a launch that outlives ``timeout`` has its ranks killed (rc 124), and a
zygote that does not answer is killed. Lab code: tests only; ``torchrun`` stays the way users
launch (one test still goes through it).
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from typing import List, Tuple

_PRELOAD = ("torch", "torch.distributed", "megatron.core", "megatron.training", "megatron.training.training",
            "megatron_overlap", "megatron_overlap.lab.megatron_lm_cpu")
_PRELOAD_CLI = ("torch", "torch.distributed", "megatron.core", "megatron.core.parallel_state", "megatron_overlap",
                "megatron_overlap.cli.main", "megatron_overlap.lab.rank_pool", "matplotlib", "matplotlib.pyplot", "tqdm")


class ForkLauncher:
    def __init__(self, tree: str | None, env: dict | None = None, start_timeout: float = 300.0):
        self.tree = tree
        self.proc = subprocess.Popen([sys.executable, "-m", "megatron_overlap.lab.fork_launcher", tree or "--cli"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True, bufsize=1)
        ready = self._read(start_timeout)
        if ready.get("ready") is not True:
            raise RuntimeError(f"the fork launcher did not start: {ready}")

    def _read(self, timeout: float) -> dict:
        r, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not r:
            self.close()
            raise TimeoutError(f"the fork launcher did not answer within {timeout:g} s")
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the fork launcher exited (rc {self.proc.poll()})")
        return json.loads(line)

    def run(self, ranks: int, argv: List[str], timeout: float = 600.0, port: int = 0) -> Tuple[int, str, str]:
        """Run ``megatron_lm_cpu.main(argv)`` on ``ranks`` forked ranks; (rc, stdout, stderr),
        the ranks' streams one after the other; rc: the first non-zero exit, 124 on timeout."""
        return self._request({"ranks": ranks, "argv": list(argv), "timeout": timeout, "port": port})

    def run_many(self, launches: List[Tuple[int, List[str]]], timeout: float = 600.0,
                 grace: float = 30.0) -> List[dict]:
        """Several launches at once (``(ranks, argv)`` each, each on a port of its own): for
        launches that mostly wait (a frozen peer's timeout). Per launch: ``rc``, ``stdout``,
        ``stderr`` and ``exits``, each rank's ``(exit code, time.time() at its exit)``; ``grace``:
        how long the other ranks of a launch may run on after one failed (then killed, 124)."""
        self.proc.stdin.write(json.dumps({"many": [{"ranks": r, "argv": list(a), "timeout": timeout, "grace": grace}
                                                   for r, a in launches]}) + "\n")
        self.proc.stdin.flush()
        return self._read(timeout + 120)["many"]

    def run_cli(self, argv: List[str], cwd: str, timeout: float = 600.0) -> Tuple[int, str, str]:
        """``megatron-overlap ARGV`` in ``cwd``, in one forked process; (rc, stdout, stderr)."""
        return self._request({"ranks": 1, "argv": list(argv), "timeout": timeout, "cli": True, "cwd": cwd})

    def _request(self, request: dict) -> Tuple[int, str, str]:
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        out = self._read(request["timeout"] + 60)
        return out["rc"], out["stdout"], out["stderr"]

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
                self.proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()


class _Launch:
    """One launch's ranks, forked; ``poll`` reaps them."""

    def __init__(self, request: dict):
        from .rank_pool import _free_port

        self.ranks, argv = request["ranks"], request["argv"]
        port = request.get("port") or _free_port()
        self.logs = tempfile.mkdtemp(prefix="fork_launch_")
        self.children = []
        for rank in range(self.ranks):
            pid = os.fork()
            if pid == 0:
                _rank_main(rank, self.ranks, port, argv, self.logs, request)  # never returns
            self.children.append(pid)
        self.deadline = time.monotonic() + request["timeout"]
        self.grace = request.get("grace", 30.0)  # after a rank failed, the others' time to end
        self.codes, self.exits = {}, {}

    def poll(self) -> bool:
        """Reap what exited; True once every rank has."""
        for pid in self.children:
            if pid in self.codes:
                continue
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                self.codes[pid], self.exits[pid] = os.waitstatus_to_exitcode(status), time.time()
                if self.codes[pid] != 0:  # as torchrun: one rank failing ends the launch
                    self.deadline = min(self.deadline, time.monotonic() + self.grace)
        if len(self.codes) < len(self.children) and time.monotonic() > self.deadline:
            for pid in self.children:
                if pid not in self.codes:
                    try:  # the rank and what it started (its rank pool): its own process group
                        os.killpg(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                    os.waitpid(pid, 0)
                    self.codes[pid], self.exits[pid] = 124, time.time()
        return len(self.codes) == len(self.children)

    def result(self) -> dict:
        rc = next((self.codes[pid] for pid in self.children if self.codes[pid] != 0), 0)
        streams = {}
        for name in ("stdout", "stderr"):
            parts = []
            for rank in range(self.ranks):
                path = os.path.join(self.logs, f"{name}.{rank}")
                if os.path.exists(path):
                    with open(path, errors="replace") as f:
                        parts.append(f.read())
                    os.remove(path)
            streams[name] = "".join(parts)[-200_000:]
        os.rmdir(self.logs)
        return {"rc": rc, **streams, "exits": [(self.codes[pid], self.exits[pid]) for pid in self.children]}


def _launch(request: dict) -> dict:
    if "many" in request:
        launches = [_Launch(r) for r in request["many"]]
        while not all([launch.poll() for launch in launches]):
            time.sleep(0.05)
        return {"many": [launch.result() for launch in launches]}
    launch = _Launch(request)
    while not launch.poll():
        time.sleep(0.05)
    return launch.result()


def _rank_main(rank: int, ranks: int, port: int, argv: List[str], logs: str, request: dict) -> None:
    code = 1
    try:
        os.setpgid(0, 0)
        os.close(_PROTOCOL_FD)  # the zygote's answers are not this process's to write
        for fd, name in ((1, "stdout"), (2, "stderr")):
            f = os.open(os.path.join(logs, f"{name}.{rank}"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(f, fd)
            os.close(f)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        if request.get("cli"):
            os.chdir(request["cwd"])
            import runpy

            sys.argv = ["megatron-overlap", *argv]  # the command's own entry point (the lab imports no cli)
            runpy.run_module("megatron_overlap", run_name="__main__", alter_sys=True)
            code = 0
        else:
            os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(ranks),
                              LOCAL_WORLD_SIZE=str(ranks), GROUP_RANK="0", MASTER_ADDR="127.0.0.1",
                              MASTER_PORT=str(port))
            from megatron_overlap.lab import megatron_lm_cpu

            code = megatron_lm_cpu.main(argv)
    except SystemExit as exc:  # as the interpreter exits: a message goes to stderr, with 1
        if exc.code is not None and not isinstance(exc.code, int):
            print(exc.code, file=sys.stderr)
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    try:
        import atexit

        atexit._run_exitfuncs()  # what a normal exit runs: the losses' dump, torch's own
    except BaseException:
        import traceback

        traceback.print_exc()
        code = code or 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code if isinstance(code, int) else 1)


_PROTOCOL_FD = -1


def _serve(tree: str) -> None:
    """Answer on a copy of stdout; stdout itself goes to stderr, so nothing an import prints can
    garble an answer."""
    global _PROTOCOL_FD
    import importlib

    _PROTOCOL_FD = os.dup(1)
    os.dup2(2, 1)
    out = os.fdopen(_PROTOCOL_FD, "w", closefd=False)
    if tree != "--cli":
        sys.path.insert(0, tree)
    for name in (_PRELOAD_CLI if tree == "--cli" else _PRELOAD):
        importlib.import_module(name)
    print(json.dumps({"ready": True}), file=out, flush=True)
    for line in sys.stdin:
        print(json.dumps(_launch(json.loads(line))), file=out, flush=True)


if __name__ == "__main__":
    _serve(sys.argv[1])
