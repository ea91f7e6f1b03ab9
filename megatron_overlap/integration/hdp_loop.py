"""Megatron-LM's training loop -> the ``hdp`` runtime: ``--overlap-hdp`` through ``pretrain_gpt.py``
unmodified (patch table in ``install.py``).

``train()`` and ``evaluate()`` take their schedule from ``get_forward_backward_func``, bound by
name in ``megatron.training.training``. There it is wrapped so that each call of the schedule
(one training step, or one evaluation step) runs as an HDP step:

1. the ``num_microbatches`` batches the schedule would have read from the script's data
   iterator are read from it here, this rank's share of the full batch, and cut into their
   documents (``hdp.samples.split_documents``: Megatron's GPT dataset resets the positions after
   each end-of-document token under ``--reset-position-ids``; packed THD batches carry
   ``cu_seqlens``);
2. the runtime plans the step over the data-parallel group (``hdp.runtime.HdpDataIterator``):
   this rank's micro-batch count replaces ``num_microbatches`` (it differs between ranks without
   a pipeline; under one, every rank runs the same slots: the scheduler's ``pp`` mode). Planned one
   step ahead (``hdp.planahead``): while a step is loaded the next step's documents are read and
   their lengths all-gathered, and a helper process plans them while this step trains (one
   ``HdpDataIterator`` per script data iterator, so validation steps keep their own). The next
   step's documents are read with this step's ``num_microbatches``: under a batch-size ramp-up a
   step runs the previous step's count of batches;
3. the script's own ``forward_step_func`` runs on each micro-batch, read from an iterator of
   plain batch dicts (tokens, labels, loss mask, true positions; no attention mask: documents
   are kept apart by the ring context), inside the micro-batch's ring context
   (``MicroBatch.context``), so the script's ``get_batch`` and loss function (NaN checks, its
   ``(loss sum, tokens, report)``) run as they are. Under a pipeline the stages pass each
   micro-batch on with its own length: Megatron's 1F1B exchanges each shape
   (``variable_seq_lengths``, set for the step), our schedules (``--overlap-pp``) take every
   micro-batch's rows from the step (``Installation.microbatch_rows``).

With TP > 1 the HDP group is the data-parallel ranks of one TP rank, and each HDP "rank" a TP
group: Megatron gives the data iterator to TP rank 0 only, so it reads the documents and hands
them to its TP group (one object broadcast per step); every TP rank then plans the same step from
the same documents. The script's ``get_batch`` would broadcast fixed ``[micro-batch, seq-length]``
tensors over TP; during an HDP step ``get_batch_on_this_tp_rank`` (where the script bound it,
and its module) instead gives every TP rank its own copy of the planned micro-batch, with the
keys and devices Megatron's would have.

Checked at the first call (a loop driving the runtime itself needs none of it): documents
marked (``--reset-attention-mask --reset-position-ids``), ``--calculate-per-token-loss``.
Megatron's per-token-loss contract does the rest: with ``--calculate-per-token-loss`` the
schedule does not divide by the micro-batch count, DDP sums the gradients over ranks, and
``finalize_model_grads`` divides them by the all-reduced token count; ``train_step`` reports
the summed loss over the summed tokens. That is the mean over every token of the step, as plain
data parallelism over the same documents computes it. A schedule handed an
``HdpDataIterator`` already (a loop that drives the runtime itself) runs untouched.
"""

from __future__ import annotations

import functools
import importlib
import sys
from typing import List

from ..comm import waits
from ..errors import OverlapConfigError

_NAME = "get_forward_backward_func"
_TP_BATCH = "get_batch_on_this_tp_rank"
_TP_BATCH_HOMES = ("megatron.training.utils", "megatron.core.utils")  # core_v0.16 / 0.19
# core_v0.19's pretrain_gpt.BATCH_KEYS, for a script that does not define them
_BATCH_KEYS_019 = ("attention_mask", "cu_seqlens", "cu_seqlens_padded", "hybrid_cp_group", "labels", "local_cp_size",
                   "loss_mask", "max_seqlen", "position_ids", "tokens")


def patch(inst) -> None:
    try:
        from megatron.training import training
    except ImportError:
        return  # megatron-core only: the user's loop drives hdp.runtime.HdpDataIterator itself
    loop = _Loop(inst)
    original = training.__dict__[_NAME]

    @functools.wraps(original)
    def get_forward_backward_func(*args, **kwargs):
        return loop.wrap(original(*args, **kwargs))

    inst.set_attr(training, _NAME, get_forward_backward_func)
    _patch_tp_batch(inst, loop)
    if inst.context.position_embedding == "rope":
        inst.notice_once("hdp-rope", "`hdp.enabled` rotates each document from position 0 (RoPE at the true "
                         "position, as Megatron's packed THD path does); stock Megatron with "
                         "`megatron.reset_position_ids` keeps RoPE's positions running across a sample's documents, "
                         "so its losses differ. `megatron.position_embedding_type` learned_absolute matches it")


def _patch_tp_batch(inst, loop) -> None:
    """``get_batch_on_this_tp_rank`` in its module and in every module that bound it by name (the
    running script, a module that imported the script's ``get_batch``)."""
    main = sys.modules.get("__main__")
    for home in _TP_BATCH_HOMES:
        try:
            module = importlib.import_module(home)
        except ImportError:
            continue
        original = module.__dict__.get(_TP_BATCH)
        if original is None:
            continue
        replacement = _tp_batch(loop, original, getattr(main, "BATCH_KEYS", None))
        for other in list(sys.modules.values()):
            if getattr(other, "__dict__", {}).get(_TP_BATCH) is original:
                inst.set_attr(other, _TP_BATCH, replacement)


def _tp_batch(loop, original, batch_keys):
    """During an HDP step each TP rank reads its own copy of the micro-batch (TP rank 0's, read by
    the script itself on 0.19, as it is); otherwise Megatron's broadcast."""

    @functools.wraps(original)
    def get_batch_on_this_tp_rank(first, *args, **kwargs):
        from megatron.core import parallel_state

        if loop.active is None or parallel_state.get_tensor_model_parallel_world_size() == 1:
            return original(first, *args, **kwargs)
        if isinstance(first, _Batches):  # core_v0.16: every TP rank passes the iterator; its keys, in its order
            data = {k: v.cuda(non_blocking=True) for k, v in next(first).items()}
            return {"tokens": data["tokens"], "labels": data["labels"], "loss_mask": data["loss_mask"],
                    "attention_mask": None, "position_ids": data["position_ids"], "cu_seqlens": None,
                    "max_seqlen": None, "local_cp_size": None}
        if isinstance(first, dict) and first.get("tokens") is not None:  # 0.19, TP rank 0: read and moved
            return first
        data = next(loop.active)  # 0.19, TP rank > 0: the script read nothing
        batch = dict.fromkeys(batch_keys or _BATCH_KEYS_019, None)
        batch.update({k: data[k].cuda(non_blocking=True) for k in _Batches.KEYS})
        return batch

    return get_batch_on_this_tp_rank


class _Batches:
    """The micro-batches of one HDP step as the script's ``get_batch`` reads them; ``peek()`` is
    the ``MicroBatch`` the next ``next()`` returns."""

    KEYS = ("tokens", "labels", "loss_mask", "position_ids")

    def __init__(self, hdp_iterator):
        self._hdp = hdp_iterator
        self._next = None

    def peek(self):
        if self._next is None:
            self._next = next(self._hdp)
        return self._next["hdp"]

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        self.peek()
        batch, self._next = self._next, None
        return {k: batch[k] for k in self.KEYS}

    def settle(self) -> None:
        """After a forward step: the micro-batch it ran is used up even where the script read no
        batch (a middle pipeline stage's ``get_batch`` returns early)."""
        self._next = None


class _Loop:
    """The runtime (made at the first step, once Megatron's groups exist) and the wrapped
    schedules."""

    def __init__(self, inst):
        self.inst = inst
        self.runtime = None
        self.active = None  # the step's _Batches while its schedule runs
        self.iterators = {}  # forward_only -> (the script's data iterator, its HdpDataIterator)
        inst.closers.append(self.close)

    def close(self) -> None:
        """Stop the planning helpers (at uninstall)."""
        iterators, self.iterators = self.iterators, {}
        for _it, hdp_iterator in iterators.values():
            hdp_iterator.close()
        self.microbatches = 0  # the running step's num_microbatches: batches a step's documents take

    def wrap(self, schedule):
        from megatron.core.utils import get_model_config

        from ..hdp.runtime import HdpDataIterator

        @functools.wraps(schedule)
        def forward_backward(*, forward_step_func, data_iterator, model, num_microbatches, **kwargs):
            if isinstance(data_iterator, HdpDataIterator):
                return schedule(forward_step_func=forward_step_func, data_iterator=data_iterator, model=model,
                                num_microbatches=num_microbatches, **kwargs)
            config = get_model_config(model[0] if isinstance(model, list) else model)
            _check_script_path(self.inst, config)
            with waits.at(timeout_s=self.inst.config.comm.timeout_s):  # the exchange's and the rings' bound
                return self._step(schedule, forward_step_func, data_iterator, model, num_microbatches, config, kwargs)

        return forward_backward

    def _step(self, schedule, forward_step_func, data_iterator, model, num_microbatches, config, kwargs):
        step = self._hdp_iterator(data_iterator, num_microbatches, bool(kwargs.get("forward_only", False)))
        ahead = step.ahead_steps
        count = step.start_step()
        self._count(step.current)
        self.inst.calls["hdp.planned_ahead"] += step.ahead_steps - ahead
        self.active = _Batches(step)
        variable = config.variable_seq_lengths  # stages exchange each micro-batch's shape (they vary)
        config.variable_seq_lengths = True
        self.inst.microbatch_rows = step.rows  # our pipeline schedules take them from here (schedules.py)
        try:
            return schedule(forward_step_func=_in_ring(forward_step_func), data_iterator=self.active,
                            model=model, num_microbatches=count, **kwargs)
        finally:
            self.active = None
            self.inst.microbatch_rows = None
            config.variable_seq_lengths = variable

    def _hdp_iterator(self, data_iterator, m: int, forward_only: bool):
        """One ``HdpDataIterator`` for training, planning one step ahead (it reads the next step's
        documents, ``m`` batches, this step's count, while loading this one and plans them in its
        helper process while this step trains), and one for evaluation, planned inline (an
        evaluation reads no step beyond its own). Keyed by ``forward_only``, which every rank
        agrees on: the script passes ``None`` as the iterator on TP ranks > 0 and middle stages,
        for training and validation alike."""
        from ..hdp.planahead import HdpDataIterator

        self.microbatches = m
        entry = self.iterators.get(forward_only)
        if entry is None or entry[0] is not data_iterator:
            if entry is not None:
                entry[1].close()
            entry = (data_iterator, HdpDataIterator(self._reader(data_iterator), self._runtime(),
                                                    plan_ahead=not forward_only))
            self.iterators[forward_only] = entry
        return entry[1]

    def _reader(self, data_iterator):
        while True:
            try:
                docs = self._documents(data_iterator, self.microbatches)
            except StopIteration:  # the script's data ended: so does the HDP iterator
                return
            yield docs

    def _runtime(self):
        if self.runtime is None:
            from .hdp import make_runtime

            self.runtime = make_runtime(self.inst.config.hdp, timeout_s=self.inst.config.comm.timeout_s)
        return self.runtime

    @staticmethod
    def _documents(data_iterator, m: int) -> List:
        """This rank's documents of the step: read by TP rank 0 (the one Megatron gives the data
        iterator), handed to the rest of its TP group (and, past 2 stages, from the first pipeline stage
        to the middle ones, which Megatron gives none)."""
        from megatron.core import parallel_state

        from ..hdp.samples import split_documents

        tp, pp = (parallel_state.get_tensor_model_parallel_world_size(),
                  parallel_state.get_pipeline_model_parallel_world_size())
        middle = not (parallel_state.is_pipeline_first_stage() or parallel_state.is_pipeline_last_stage())
        reader = (tp == 1 or parallel_state.get_tensor_model_parallel_rank() == 0) and not middle
        if reader and (data_iterator is None or isinstance(data_iterator, list)):
            raise OverlapConfigError("hdp.enabled", "`hdp.enabled` through the training loop needs one data iterator "
                                     "on TP rank 0 of every first and last pipeline stage (no virtual pipeline)")
        docs = []
        if reader:
            for _ in range(m):
                docs.extend(split_documents(next(data_iterator)))
        if pp > 2:  # middle stages load nothing: the first stage's documents (the last stage's are the same)
            docs = _broadcast(docs, parallel_state.get_pipeline_model_parallel_first_rank(),
                              parallel_state.get_pipeline_model_parallel_group())
        if tp > 1:
            docs = _broadcast(docs, parallel_state.get_tensor_model_parallel_src_rank(),
                              parallel_state.get_tensor_model_parallel_group())
        return docs

    def _count(self, step) -> None:
        calls = self.inst.calls
        calls["hdp.step"] += 1
        calls["hdp.microbatch"] += step.num_microbatches
        calls["hdp.ring"] += sum(len(mb.ring) > 1 for mb in step.microbatches)
        calls["hdp.moved_tokens"] += step.moved_tokens


def _broadcast(obj, src: int, group):
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def _in_ring(forward_step_func):
    """The script's forward step, run inside the next micro-batch's ring context."""

    @functools.wraps(forward_step_func)
    def forward_step(data_iterator: _Batches, model, *args, **kwargs):
        mb = data_iterator.peek()
        mb.adapter.check(model)
        try:
            with mb.context(model):
                return forward_step_func(data_iterator, model, *args, **kwargs)
        finally:
            data_iterator.settle()

    return forward_step


def _check_script_path(inst, config) -> None:
    """What the script path needs (``config``: the model's), checked at its first schedule call
    (every rank takes the same branch: these are settings, not data). A loop that drives the
    runtime itself needs none of it."""
    ctx = inst.context
    if ctx.documents is False:
        raise OverlapConfigError(
            "megatron.reset_attention_mask",
            "`hdp.enabled` gives each document of a packed sample its own ring; Megatron's GPT dataset marks the "
            "documents only with `megatron.reset_attention_mask` and `megatron.reset_position_ids` (without them a "
            "sample is one sequence of `megatron.seq_length` tokens, attended across documents, and HDP has nothing "
            "to balance). Add both")
    if not getattr(config, "calculate_per_token_loss", False):
        raise OverlapConfigError(
            "megatron.calculate_per_token_loss", "`hdp.enabled` gives ranks different numbers of tokens: the model "
            "config needs calculate_per_token_loss (the gradients summed over ranks and divided by the step's "
            "token count)")
