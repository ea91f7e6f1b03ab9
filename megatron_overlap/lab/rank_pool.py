"""A pool of gloo rank processes kept alive across tests.

Spawning ranks and importing Megatron costs ~20 s for 4 ranks on a 2-core machine, so tests
send work to live ranks instead (and a single-threaded process forks them, ``_fork_is_safe``)::

    pool = RankPool(4)
    results = pool.run(some_module.some_function, arg1, arg2)   # one result per rank

The function runs on every rank as ``fn(*args)`` inside an initialised default process group
(gloo); it must be importable by name (module-level). A rank that raises makes ``run`` raise
:class:`RankError` with every failing rank's traceback; a rank that does not answer within
``timeout`` makes it raise ``TimeoutError``. After either, the pool restarts its processes on
the next ``run``, so one failing test cannot poison the next.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
import time
import traceback
import warnings
from typing import Any, Callable, Optional

import torch.multiprocessing as mp
from multiprocessing.connection import wait


class RankError(RuntimeError):
    def __init__(self, failures: dict[int, str]):
        self.failures = failures
        text = "\n".join(f"--- rank {rank} ---\n{tb}" for rank, tb in sorted(failures.items()))
        super().__init__(f"{len(failures)} rank(s) failed:\n{text}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, conn, pg_timeout_s: float, threads: int):
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        OMP_NUM_THREADS=str(threads),
        CUDA_DEVICE_MAX_CONNECTIONS="1",
    )
    import warnings

    # Megatron announces at import that apex/TE are absent; on CPU that is the expected state.
    warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex|apex).*")
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")
    warnings.filterwarnings("ignore", message=".*(deprecated|cuda_graph_scope).*", category=UserWarning)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    try:
        dist.init_process_group(
            "gloo",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=pg_timeout_s),
        )
        from . import cpu_shims

        cpu_shims.apply()
        conn.send(("ready", None))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    while True:
        try:
            task = conn.recv()
        except EOFError:
            break
        if task is None:
            break
        fn, args, kwargs = task
        try:
            conn.send(("ok", fn(*args, **kwargs)))
        except BaseException:
            conn.send(("error", traceback.format_exc()))
    try:
        dist.destroy_process_group()
    except Exception:
        pass


def no_bar_thread() -> None:
    """No tqdm monitor thread (the command line calls this first): tqdm starts one even for a
    disabled bar, and with a second thread the pools here spawn their ranks (each importing
    Megatron again, seconds per rank) instead of forking them (``_fork_is_safe``); the bars
    still draw, only tqdm's stall check is off."""
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover - a dependency
        return
    tqdm.monitor_interval = 0


def _fork_is_safe() -> bool:
    """Fork (the ranks inherit this process's imports: Megatron's take ~8 s per spawned rank)
    only from a process with no Python thread but the main one and no process group of its
    own, such as a command-line run before its first collective; spawn otherwise (a fork copies
    no other thread, so a lock one of them held, the interpreter's included, would never be
    released in the child). Native thread pools do not count: numpy's OpenBLAS starts one at
    import unless ``OMP_NUM_THREADS`` / ``OPENBLAS_NUM_THREADS`` is 1, and it, like torch's
    OpenMP pool, shuts down or re-initialises across a fork by its own ``pthread_atfork``
    handlers (what a fork-started DataLoader worker relies on). Counting them made every
    command-line run without those variables spawn its ranks."""
    import threading

    import torch.distributed as dist

    if not hasattr(os, "fork") or dist.is_initialized():
        return False
    return threading.active_count() == 1


@contextlib.contextmanager
def _spawn_env(threads: int):
    """The thread limits a spawned rank needs before it imports numpy and torch (its
    ``_worker`` runs after those imports), set for the processes started in the block."""
    names = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
    saved = {name: os.environ.get(name) for name in names}
    os.environ.update({name: str(threads) for name in names})
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


class RankPool:
    """``world_size`` live gloo ranks; see the module docstring."""

    def __init__(
        self,
        world_size: int,
        timeout: float = 300.0,
        pg_timeout_s: float = 120.0,
        threads_per_rank: int = 1,
    ):
        self.world_size = world_size
        self.timeout = timeout
        self.pg_timeout_s = pg_timeout_s
        self.threads_per_rank = threads_per_rank
        self._procs: list = []
        self._conns: list = []
        self._healthy = False
        self._start()

    def _start(self):
        fork = _fork_is_safe()
        ctx = mp.get_context("fork" if fork else "spawn")
        port = _free_port()
        self._procs, self._conns = [], []
        with warnings.catch_warnings(), (contextlib.nullcontext() if fork else _spawn_env(self.threads_per_rank)):
            # Python >= 3.12 warns of any native thread at a fork (_fork_is_safe says why these are safe)
            warnings.filterwarnings("ignore", message=".*multi-threaded, use of fork.*", category=DeprecationWarning)
            self._start_ranks(ctx, port)
        self._collect(timeout=self.timeout, what="start")
        self._healthy = True

    def _start_ranks(self, ctx, port: int) -> None:
        for rank in range(self.world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=_worker,
                args=(rank, self.world_size, port, child, self.pg_timeout_s, self.threads_per_rank),
                daemon=True,
            )
            proc.start()
            child.close()
            self._procs.append(proc)
            self._conns.append(parent)

    def _collect(self, timeout: float, what: str) -> list:
        """Gather one answer per rank. Once a rank has failed, the others get a short grace
        period (they may be stuck in a collective with it) before the failure is raised."""
        results: list = [None] * self.world_size
        failures: dict[int, str] = {}
        pending = dict(enumerate(self._conns))
        deadline = time.monotonic() + timeout
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            for conn in wait(list(pending.values()), timeout=left):
                rank = next(r for r, c in pending.items() if c is conn)
                del pending[rank]
                try:
                    status, value = conn.recv()
                except EOFError:
                    status, value = "error", "the rank process died"
                if status == "error":
                    failures[rank] = value
                    deadline = min(deadline, time.monotonic() + 10.0)
                else:
                    results[rank] = value
        if pending or failures:
            self._healthy = False
            for rank in pending:
                failures[rank] = f"no answer to {what} within the time allowed"
            if len(failures) == len(pending):
                raise TimeoutError(f"ranks {sorted(pending)} gave no answer to {what} within {timeout:.0f} s")
            raise RankError(failures)
        return results

    def run(self, fn: Callable, *args, timeout: Optional[float] = None, **kwargs) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; return the per-rank results."""
        if not self._healthy:
            self.close()
            self._start()
        for conn in self._conns:
            conn.send((fn, args, kwargs))
        return self._collect(timeout or self.timeout, getattr(fn, "__name__", repr(fn)))

    def close(self):
        for conn in self._conns:
            try:
                conn.send(None)
            except (OSError, BrokenPipeError):
                pass
        for proc in self._procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        self._procs, self._conns = [], []
        self._healthy = False

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
