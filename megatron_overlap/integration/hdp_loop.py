"""Megatron-LM's training loop -> the ``hdp`` runtime: ``--hdp`` through ``pretrain_gpt.py``
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
   this rank's micro-batch count, which differs between ranks, replaces ``num_microbatches``;
3. the script's own ``forward_step_func`` runs on each micro-batch, read from an iterator of
   plain batch dicts (tokens, labels, loss mask, true positions; no attention mask: documents
   are kept apart by the ring context), inside the micro-batch's ring context
   (``MicroBatch.context``), so the script's ``get_batch`` and loss function (NaN checks, its
   ``(loss sum, tokens, report)``) run as they are.

Checked at the first call (a loop driving the runtime itself needs none of it): TP 1, documents
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
from typing import List

from ..errors import OverlapConfigError

_NAME = "get_forward_backward_func"


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
    if inst.context.position_embedding == "rope":
        inst.notice_once("hdp-rope", "`hdp.enabled` rotates each document from position 0 (RoPE at the true "
                         "position, as Megatron's packed THD path does); stock Megatron with "
                         "`megatron.reset_position_ids` keeps RoPE's positions running across a sample's documents, "
                         "so its losses differ. `megatron.position_embedding_type` learned_absolute matches it")


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


class _Loop:
    """The runtime (made at the first step, once Megatron's groups exist) and the wrapped
    schedules."""

    def __init__(self, inst):
        self.inst = inst
        self.runtime = None

    def wrap(self, schedule):
        from ..hdp.runtime import HdpDataIterator

        @functools.wraps(schedule)
        def forward_backward(*, forward_step_func, data_iterator, model, num_microbatches, **kwargs):
            if isinstance(data_iterator, HdpDataIterator):
                return schedule(forward_step_func=forward_step_func, data_iterator=data_iterator, model=model,
                                num_microbatches=num_microbatches, **kwargs)
            _check_script_path(self.inst, model)
            step = HdpDataIterator(iter([self._documents(data_iterator, num_microbatches)]), self._runtime())
            count = step.start_step()
            self._count(step.current)
            return schedule(forward_step_func=_in_ring(forward_step_func), data_iterator=_Batches(step), model=model,
                            num_microbatches=count, **kwargs)

        return forward_backward

    def _runtime(self):
        if self.runtime is None:
            from .hdp import make_runtime

            self.runtime = make_runtime(self.inst.config.hdp)
        return self.runtime

    @staticmethod
    def _documents(data_iterator, m: int) -> List:
        from ..hdp.samples import split_documents

        if data_iterator is None or isinstance(data_iterator, list):
            raise OverlapConfigError("hdp.enabled", "`hdp.enabled` through the training loop needs one data iterator "
                                     "on every data-parallel rank (`megatron.tensor_model_parallel_size` and "
                                     "`megatron.pipeline_model_parallel_size` 1, no virtual pipeline)")
        docs = []
        for _ in range(m):
            docs.extend(split_documents(next(data_iterator)))
        return docs

    def _count(self, step) -> None:
        calls = self.inst.calls
        calls["hdp.step"] += 1
        calls["hdp.microbatch"] += step.num_microbatches
        calls["hdp.ring"] += sum(len(mb.ring) > 1 for mb in step.microbatches)
        calls["hdp.moved_tokens"] += step.moved_tokens


def _in_ring(forward_step_func):
    """The script's forward step, run inside the next micro-batch's ring context."""

    @functools.wraps(forward_step_func)
    def forward_step(data_iterator: _Batches, model, *args, **kwargs):
        mb = data_iterator.peek()
        mb.adapter.check(model, recompute_allowed=False)
        with mb.context(model):
            return forward_step_func(data_iterator, model, *args, **kwargs)

    return forward_step


def _check_script_path(inst, model) -> None:
    """What the script path needs, checked at its first schedule call (every rank takes the same
    branch: these are settings, not data). A loop that drives the runtime itself needs none of it."""
    from megatron.core import parallel_state
    from megatron.core.utils import get_model_config

    ctx = inst.context
    tp = ctx.tp_size or (parallel_state.get_tensor_model_parallel_world_size()
                         if parallel_state.model_parallel_is_initialized() else 1)
    if tp > 1:
        raise OverlapConfigError(
            "megatron.tensor_model_parallel_size", "`hdp.enabled` through Megatron-LM's training loop runs with TP 1 "
            "so far: pretrain_gpt.py's get_batch broadcasts fixed [micro-batch, seq-length] tensors over the TP "
            "group, and HDP's micro-batches vary in length. With TP > 1 drive the runtime from your own loop "
            "(megatron_overlap.integration.hdp.make_runtime pads the rows for TP)")
    if ctx.documents is False:
        raise OverlapConfigError(
            "megatron.reset_attention_mask",
            "`hdp.enabled` gives each document of a packed sample its own ring; Megatron's GPT dataset marks the "
            "documents only with `megatron.reset_attention_mask` and `megatron.reset_position_ids` (without them a "
            "sample is one sequence of `megatron.seq_length` tokens, attended across documents, and HDP has nothing "
            "to balance). Add both")
    config = get_model_config(model[0] if isinstance(model, list) else model)
    if not getattr(config, "calculate_per_token_loss", False):
        raise OverlapConfigError(
            "megatron.calculate_per_token_loss", "`hdp.enabled` gives ranks different numbers of tokens: the model "
            "config needs calculate_per_token_loss (the gradients summed over ranks and divided by the step's "
            "token count)")
