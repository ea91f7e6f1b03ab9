"""The planner with Python's cyclic garbage collector paused.

A step's plan builds some 10^5 small objects (shards, tuples, micro-batches), all alive until the
plan is returned and none in a reference cycle. Each allocation burst makes the collector walk
them, young generations often and every live object now and then (the full collection), for
nothing to free: 15-20% of the planner's time at R = 256 on the 6204-sequence batch of
BENCHMARKS.md's HDP planner-time pass. :func:`gc_paused` turns the collector off for the call and
back on after it (only if it was on: nested calls, and a caller that turned it off, are left as
they are); reference counting still frees everything as usual. The plans do not change.
"""

from __future__ import annotations

import contextlib
import functools
import gc


@contextlib.contextmanager
def collector_paused():
    """The block run with the cyclic collector off, turned back on after it only if it was on."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def gc_paused(fn):
    """``fn`` run with the cyclic collector off (module docstring)."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        with collector_paused():
            return fn(*args, **kwargs)

    return run
