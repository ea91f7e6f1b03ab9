"""The pipeline executors' core, one for the plain executor (``schedules.py``) and the virtual
one (``vschedules.py``): the drop-in for Megatron's ``forward_backward`` signature, the process
groups and model state of one call, the transfers between stages and the data-parallel sync
after the schedule.

Transfers: every stage posts its transfers through ``batch_isend_irecv`` on the pipeline group,
both ends posting the same transfers in the same order (the schedule's ``POST``); a ``WAIT``
waits for one of them, bounded by the group's timeout or ``comm.timeout_s``
(``comm/waits.py``), and a transfer that does not complete ends the step with an error naming
the stage, the transfer (:meth:`StageRun.describe`) and the timeout flag. The plain executor
adds the micro-batches' own shapes and the weight-gradient drain; the virtual one adds model
chunks: its transfers and tensors are keyed by (chunk, micro-batch) (:meth:`StageRun.key`).
"""

from __future__ import annotations

import inspect

import torch
import torch.distributed as dist

from ..comm import tags, waits
from ..errors import OverlapConfigError, render
from ..pp.schedule import ACT, RECV, SEND
from .pp_megatron import default_collection, refuse_unsupported, single, timed_out


def make_forward_backward(inst, run_class, calls_key: str):
    """A drop-in for one of Megatron's ``forward_backward_pipelining_*`` functions: each call
    builds a ``run_class`` (a :class:`StageRun`) and executes ``inst``'s schedule with it;
    ``inst.calls[calls_key]`` counts the calls."""
    from megatron.core.pipeline_parallel import schedules

    with_model_type = "model_type" in set(inspect.signature(schedules.backward_step).parameters)

    def forward_backward(*, forward_step_func, data_iterator, model, num_microbatches, seq_length,
                         micro_batch_size, decoder_seq_length=None, forward_only=False, collect_non_loss_data=False,
                         first_val_step=None, adjust_tensor_shapes_fn=None, p2p_communicator=None, pg_collection=None,
                         force_all_reduce=False, **unknown):
        if unknown:
            raise OverlapConfigError("pp.mode", f"runs a schedule that does not take {sorted(unknown)} (a newer "
                                     "megatron-core?): use `pp.mode` megatron")
        run_class.check_call(model, data_iterator)
        inst.calls[calls_key] += 1
        run = run_class(inst, schedules, with_model_type, forward_step_func, data_iterator, model, num_microbatches,
                        forward_only, collect_non_loss_data, first_val_step, p2p_communicator, pg_collection)
        run.shapes(seq_length, micro_batch_size, decoder_seq_length, adjust_tensor_shapes_fn)
        with waits.at(timeout_s=inst.config.comm.timeout_s):  # --overlap-timeout-s: every wait below
            return run.execute(force_all_reduce)

    forward_backward.megatron_overlap_schedule = True
    return forward_backward


class StageRun:
    """One call of the schedule on one stage: Megatron's state around it and the transfers in
    flight. Subclasses give ``shapes``, ``execute`` and ``_act`` (what each action runs)."""

    def __init__(self, inst, schedules, with_model_type, forward_step_func, data_iterator, model, m, forward_only,
                 collect_non_loss_data, first_val_step, p2p_communicator, pg_collection):
        from megatron.core import parallel_state
        from megatron.core.utils import get_model_config, get_model_type

        model = single(model, "model")
        self.inst, self.schedules, self.with_model_type = inst, schedules, with_model_type
        self.forward_step_func, self.data_iterator = forward_step_func, single(data_iterator, "data_iterator")
        self.model, self.m, self.forward_only = model, m, forward_only
        self.collect_non_loss_data, self.first_val_step = collect_non_loss_data, first_val_step
        self.config = config = get_model_config(model)
        self.model_type = get_model_type(model)
        refuse_unsupported(config, rows_known=inst.microbatch_rows is not None)
        if pg_collection is not None and not hasattr(pg_collection, "tp"):
            raise OverlapConfigError("pp.mode", "runs single-module pipelines; a multi-module process-group "
                                     "collection needs Megatron's own schedule (`pp.mode` megatron)")
        if p2p_communicator is not None:
            self.pp_group = p2p_communicator.pp_group
        elif pg_collection is not None and getattr(pg_collection, "pp", None) is not None:
            self.pp_group = pg_collection.pp
        else:
            self.pp_group = parallel_state.get_pipeline_model_parallel_group()
        if pg_collection is None:
            self.tp_group = parallel_state.get_tensor_model_parallel_group()
            self.cp_group = parallel_state.get_context_parallel_group()
        else:
            self.tp_group, self.cp_group = pg_collection.tp, pg_collection.cp
        self.pg_collection = pg_collection
        self.stage, self.p = self.pp_group.rank(), self.pp_group.size()
        self.first, self.last = self.stage == 0, self.stage == self.p - 1
        self.device = next(model.parameters()).device
        self.works, self.buffers = {}, {}
        self.inputs, self.outputs, self.out_grads, self.in_grads = {}, {}, {}, {}
        self.rows = self.mb_shapes = None  # each micro-batch's rows and transfer shape, where they vary

    @staticmethod
    def check_call(model, data_iterator) -> None:
        """Refuse a call this executor cannot run (before anything is counted or built)."""

    def key(self, comm):
        """What a transfer's tensors are stored under: its micro-batch."""
        return comm.mb

    def describe(self, comm) -> str:
        """A transfer, as its errors name it."""
        return str(comm)

    def _run(self, action):
        with waits.at(f"pipeline stage {self.stage} {action}"):  # what the waits inside it belong to
            self._act(action)

    def _act(self, action):
        raise NotImplementedError

    # -- transfers -----------------------------------------------------------------------------
    def _post(self, comms):
        ops = []
        for c in comms:
            peer = dist.get_global_rank(self.pp_group, c.peer)
            tag = tags.tag("pp.stage", 0)
            key = self.key(c)
            if c.op == SEND:
                tensor = (self.outputs[key][0] if c.kind == ACT else self.in_grads.pop(key))
                if self.mb_shapes is not None and tuple(tensor.shape) != self.mb_shapes[c.mb]:
                    raise RuntimeError(
                        f"megatron-overlap pipeline stage {self.stage}: {c} is a tensor of shape "
                        f"{tuple(tensor.shape)}; micro-batch {c.mb}'s {self.rows[c.mb]} rows give "
                        f"{self.mb_shapes[c.mb]}, which the peer stage receives")
                self.buffers[c] = tensor
                ops.append(dist.P2POp(dist.isend, tensor, peer, self.pp_group, tag))
            else:
                shape = (self.mb_shapes[c.mb] if self.mb_shapes is not None else
                         self.recv_shape if c.kind == ACT else self.send_shape)
                buf = torch.empty(shape, dtype=self.config.pipeline_dtype, device=self.device, requires_grad=True)
                self.buffers[c] = buf
                ops.append(dist.P2POp(dist.irecv, buf, peer, self.pp_group, tag))
        works = dist.batch_isend_irecv(ops)
        for i, c in enumerate(comms):
            self.works[c] = [works[i]] if len(works) == len(comms) else list(works)

    def _wait(self, c):
        for work in self.works.pop(c):
            try:
                waits.wait(work, str(c), self.pp_group, c.peer)
            except RuntimeError as exc:
                raise RuntimeError(
                    f"megatron-overlap pipeline stage {self.stage}: {self.describe(c)} did not complete "
                    f"({'the peer stage is silent or failed: ' if timed_out(exc) else ''}{exc}); "
                    + render("the pipeline group's timeout (or `comm.timeout_s`) bounds every wait")) from exc
        buf = self.buffers.pop(c)
        key = self.key(c)
        if c.op == RECV and c.kind == ACT:
            self.inputs[key] = buf
        elif c.op == RECV:
            self.out_grads[key] = buf
        elif c.kind == ACT:
            output = self.outputs[key] if not self.forward_only else self.outputs.pop(key)
            self.schedules.deallocate_output_tensor(output[0], self.config.deallocate_pipeline_outputs)

    # -- after the schedule --------------------------------------------------------------------
    def _finalize(self, models, force_all_reduce):
        """Megatron's ``finalize_model_grads_func`` over ``models``; a data-parallel peer that
        never joins ends it with an error saying so."""
        config = self.config
        try:
            config.finalize_model_grads_func(
                models, self.total_tokens if config.calculate_per_token_loss else None,
                pg_collection=self.pg_collection or default_collection(self), force_all_reduce=force_all_reduce)
        except RuntimeError as exc:
            if not timed_out(exc):
                raise
            raise RuntimeError(
                f"megatron-overlap pipeline stage {self.stage}: the data-parallel gradient sync after the "
                f"schedule did not complete (a data-parallel peer is silent or failed); the group's timeout "
                f"bounds the wait: {exc}") from exc


def inflight_for(pp, p, m, config, seq_length, micro_batch_size) -> int:
    """Micro-batches in flight on stage 0: the flag (checked against the micro-batches of this
    call), or what the memory budget allows, or the PP size."""
    from ..pp import check_inflight
    from ..pp.memory import inflight_for_budget, stage_activation_bytes

    if pp.max_inflight:
        check_inflight(p, m, pp.max_inflight)
        return pp.max_inflight
    if pp.memory_budget_gb:
        per = stage_activation_bytes(config, seq_length, micro_batch_size, p)
        return inflight_for_budget(pp.memory_budget_gb, p, m, per)
    return p
