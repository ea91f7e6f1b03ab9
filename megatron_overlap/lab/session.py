"""Per-rank state of one experiment (the demo, a benchmark), kept in the rank processes of a
:class:`~megatron_overlap.lab.rank_pool.RankPool` between calls.

A pool runs module-level functions; an experiment needs objects that live across calls (models,
the emulated link, the samples). On the driver::

    with RemoteSession(pool, MLPBenchRanks, cfg_dict) as ranks:   # MLPBenchRanks(cfg_dict) on every rank
        per_rank = ranks.call("round", index)                     # its .round(index) on every rank
    # leaving the block calls .close() on every rank and returns nothing; ranks.close() returns its results

The class must be importable by name (module level). One experiment per rank process at a time:
starting a second closes the first.
"""

from __future__ import annotations

from typing import Any, Optional

_LIVE: dict = {}  # lab only: the experiment object of this rank process


def start(cls, *args, **kwargs) -> Any:
    stop()
    obj = _LIVE["experiment"] = cls(*args, **kwargs)
    describe = getattr(obj, "describe", None)
    return describe() if describe is not None else None


def call(method: str, *args, **kwargs) -> Any:
    if "experiment" not in _LIVE:
        raise RuntimeError(f"no experiment running on this rank (call {method!r} after start)")
    return getattr(_LIVE["experiment"], method)(*args, **kwargs)


def stop() -> Any:
    obj = _LIVE.pop("experiment", None)
    close = getattr(obj, "close", None)
    return close() if close is not None else None


class RemoteSession:
    """The driver's handle on one experiment running on every rank of ``pool`` (module docstring).
    ``started``: what each rank's ``describe()`` returned (None without one)."""

    def __init__(self, pool, cls, *args, **kwargs):
        self.pool = pool
        self.started = pool.run(start, cls, *args, **kwargs)
        self._open = True

    def call(self, method: str, *args, **kwargs) -> list:
        return self.pool.run(call, method, *args, **kwargs)

    def rounds(self, warmup: int, steps: int, progress=None, record_last: Optional[bool] = None) -> list:
        """Every rank's ``round(index)`` for ``warmup + steps`` rounds; the per-rank results of
        the ``steps`` timed ones. ``record_last`` not None: ``round(index, record)``, with
        ``record`` true on the last round only when ``record_last`` is. ``progress``: a bar
        updated once per round."""
        total, timed = warmup + steps, []
        for index in range(total):
            extra = () if record_last is None else (bool(record_last) and index == total - 1,)
            per_rank = self.call("round", index, *extra)
            if index >= warmup:
                timed.append(per_rank)
            if progress is not None:
                progress.update(1)
        return timed

    def close(self) -> list:
        self._open = False
        return self.pool.run(stop)

    def __enter__(self) -> "RemoteSession":
        return self

    def __exit__(self, *exc):
        if self._open and exc[0] is None:
            self.close()
