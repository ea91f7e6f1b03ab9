"""Megatron's distributed checkpointing (``torch_dist``) inside the test rank workers.

``TorchDistSaveShardedStrategy`` (megatron-core 0.16.1, ``strategies/filesystem_async.py``)
writes each rank's files from forked worker processes and collects their results through a
``multiprocessing`` Manager queue (a spawned server process); each worker logs its memory through
psutil, which it requires. A rank of ``RankPool`` is a daemonic process, which may not have
children, and this environment has no psutil, so that save cannot finish here (seen: the Manager
refused, then the workers raising on psutil and the writer waiting on them for ever).

``in_process_writes()`` keeps everything of Megatron's save but that fan-out: the sharded state
dict, its validation, the planner, the metadata, and Megatron's own per-file writer
(``FileSystemWriterAsync.write_preloaded_data``) run as usual; the files are written one after
the other in the calling process, with plain queues, and the memory log reads 0. Loading needs
nothing: ``TorchDistLoadShardedStrategy`` reads in the calling process.
"""

from __future__ import annotations

import contextlib
import queue


def _write_in_process(transform_list, use_msc, rank, write_buckets, global_results_queue) -> None:
    """``FileSystemWriterAsync.write_preloaded_data_multiproc`` without processes: the same
    per-bucket writer, the same results (a dict by bucket, or the first exception)."""
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    results, count = queue.Queue(), queue.Queue()
    outcome: dict | Exception = {}
    for i, bucket in enumerate(write_buckets):
        count.put(i)
        kwargs = {"use_msc": use_msc} if use_msc else {}
        FileSystemWriterAsync.write_preloaded_data(transform_list, i, bucket, results, count, True, **kwargs)
        idx, written = results.get_nowait()
        if isinstance(written, Exception):
            outcome = written
            break
        outcome[idx] = written
    global_results_queue.put(outcome)


@contextlib.contextmanager
def in_process_writes():
    """Megatron's ``torch_dist`` save, written by the calling process (module docstring);
    restored after."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async as fsa

    saved = (fsa.FileSystemWriterAsync.__dict__["write_preloaded_data_multiproc"], fsa._get_write_results_queue,
             fsa._process_memory)
    fsa.FileSystemWriterAsync.write_preloaded_data_multiproc = staticmethod(_write_in_process)
    fsa._get_write_results_queue = queue.Queue
    fsa._process_memory = lambda: 0
    try:
        yield
    finally:
        fsa.FileSystemWriterAsync.write_preloaded_data_multiproc = saved[0]
        fsa._get_write_results_queue, fsa._process_memory = saved[1], saved[2]
