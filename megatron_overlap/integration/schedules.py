"""Megatron's pipeline schedule -> ``pp`` (patch table in ``install.py``).

``get_forward_backward_func`` is replaced where Megatron looks it up
(``megatron.core.pipeline_parallel``, its ``schedules`` module, and
``megatron.training.training``, which binds it by name at import): for PP > 1 without a
virtual pipeline it returns :func:`make_executor`'s function (with one,
``vschedules.make_interleaved_executor``'s), which runs the ``pp.build``
schedule asked for with Megatron's own ``forward_step`` / ``backward_step``, so the
``forward_step_func`` contract, loss scaling, ``forward_only``, ``collect_non_loss_data``,
``first_val_step``, ``deallocate_pipeline_outputs`` and the ``no_sync_func`` /
``grad_sync_func`` / ``finalize_model_grads_func`` hooks behave as in stock Megatron. Only the
order of the compute and where each transfer is posted and waited differ; the transfers, their
waits and errors are the executors' core (``pp_executor.py``), the virtual executor's too.

Shapes. Every micro-batch's activation has Megatron's ``get_tensor_shapes`` shape, the same for
all of them; under ``--overlap-hdp`` with a pipeline (``hdp_loop.py``) micro-batch k has its own token
rows T_k, which the HDP loop gives the executor (``Installation.microbatch_rows``) and each
transfer takes ``get_tensor_shapes(seq_length=T_k, micro_batch_size=1)``. Both ends know every
T_k before the step: each stage planned the same step from the same documents. Where stock
Megatron's ``variable_seq_lengths`` exchanges a shape before every transfer and waits for it,
the stages here check once per step that they agree (each sends its list of T_k to the next
stage, which compares it with its own) and post every transfer as with fixed shapes.

The data-parallel sync in the bubbles (Centauri's model level): with Megatron DDP's
distributed optimizer and ``overlap_param_gather``, Megatron's non-interleaved schedule leaves
the first parameter all-gather to the first forward's hook, so every stage but the first waits
for its parameters after its activation arrived, one stage after the other; here it is
dispatched when the step begins and travels while the stage waits for its first activation
(the hooks then chain the other buckets as in stock). In a split schedule the weight gradients
left after a stage's last B run as a drain (``Schedule.drain``): layer by layer, each
parameter's in micro-batch order, inside the last B on the first stage, so each DDP bucket's
reduction starts as soon as its last gradient is in (``tp/wgrad_store.py``).
"""

from __future__ import annotations

import contextlib
import functools
import time

import torch
import torch.distributed as dist

from ..comm import tags, waits
from ..errors import OverlapConfigError
from ..pp import build
from ..pp.schedule import B, F, POST, WAIT, W
from .pp_executor import StageRun, inflight_for, make_forward_backward
from .pp_megatron import GradSync, dispatch_param_gather
from .vschedules import make_interleaved_executor

_NAME = "get_forward_backward_func"


def patch(inst) -> None:
    import sys

    from megatron.core import pipeline_parallel
    from megatron.core.pipeline_parallel import schedules

    if inst.config.pp.mode == "off":  # `auto` chose Megatron's own (interleaved) schedule
        return
    original = schedules.__dict__[_NAME]
    stock = schedules.forward_backward_pipelining_without_interleaving
    executor = make_executor(inst)
    interleaved = make_interleaved_executor(inst)

    @functools.wraps(original)
    def get_forward_backward_func(*args, **kwargs):
        func = original(*args, **kwargs)
        if func is schedules.forward_backward_pipelining_with_interleaving:
            return interleaved  # virtual pipelines: integration/vschedules.py
        return executor if func is stock else func

    if inst.config.pp.mode == "zbv":  # ZB-V's layer placement (integration/vplacement.py)
        from . import compat, vplacement

        vplacement.check_version(compat.check_megatron_version())
        vplacement.patch(inst)
    for module in (schedules, pipeline_parallel, sys.modules.get("megatron.training.training")):
        if module is not None and getattr(module, _NAME, None) is original:
            inst.set_attr(module, _NAME, get_forward_backward_func)
    inst.notice_once("pp-on", f"pipeline schedule: {inst.config.pp.mode}"
                     + (f", up to {inst.config.pp.max_inflight} micro-batches in flight" if inst.config.pp.max_inflight
                        else ""))


def make_executor(inst):
    """A drop-in for ``forward_backward_pipelining_without_interleaving`` running ``inst``'s
    schedule."""
    return make_forward_backward(inst, _Run, f"pp.{inst.config.pp.mode}")


class _Run(StageRun):
    """One call of the schedule (``pp_executor.StageRun``), its micro-batches' shapes where
    they vary, its weight-gradient drain."""

    def shapes(self, seq_length, micro_batch_size, decoder_seq_length, adjust):
        """The shape of each transfer; each micro-batch's own where the HDP loop gave its token
        rows (``Installation.microbatch_rows``, module docstring)."""
        rows = self.inst.microbatch_rows
        kw = dict(seq_length=seq_length, micro_batch_size=micro_batch_size, decoder_seq_length=decoder_seq_length,
                  config=self.config, tp_group=self.tp_group, cp_group=self.cp_group)
        recv = send = self.schedules.get_tensor_shapes(**kw)
        if adjust is not None:
            recv, send = adjust(recv, send)
        if len(recv) != 1 or len(send) != 1:
            raise OverlapConfigError("pp.mode", f"sends one tensor between stages; this model sends {len(send)} "
                                     "(encoder-decoder or adjusted shapes): use `pp.mode` megatron")
        self.recv_shape, self.send_shape = tuple(recv[0]), tuple(send[0])
        if rows is not None:
            if adjust is not None or len(rows) != self.m:
                raise RuntimeError(f"megatron-overlap pipeline stage {self.stage}: {len(rows)} micro-batch lengths "
                                   f"for {self.m} micro-batches" + (" and adjusted shapes" if adjust else ""))
            self.rows = [int(r) for r in rows]
            kw.update(micro_batch_size=1, decoder_seq_length=None)
            self.mb_shapes = [tuple(self.schedules.get_tensor_shapes(**dict(kw, seq_length=r))[0]) for r in self.rows]
            seq_length, micro_batch_size = max(self.rows), 1
        pp = self.inst.config.pp
        inflight = inflight_for(pp, self.p, self.m, self.config, seq_length, micro_batch_size)
        self.schedule = _schedule(pp.mode, self.p, self.m, inflight, self.forward_only, self.inst.pp_times)
        self.store = self.inst.wgrad if self.schedule.split else None
        self.drain, self.last_b, self.trailing_w = _drain_plan(self.schedule, self.stage)

    # -- the step ------------------------------------------------------------------------------
    def execute(self, force_all_reduce):
        config, schedules = self.config, self.schedules
        embedding = None
        if config.finalize_model_grads_func is not None and not self.forward_only:
            embedding = schedules.clear_embedding_activation_buffer(config, self.model, self.last)
        if config.timers is not None:
            config.timers("forward-backward", log_level=1).start(barrier=config.barrier_with_L1_time)
        self.total_tokens = torch.zeros([], dtype=torch.int, device=self.device)
        self.data = []
        sync = GradSync(config)
        sync.disable()
        last_b = self.m - 1
        if self.rows is not None:
            self._agree_rows()
            self.inst.calls["pp.variable_shapes"] += 1
        if dispatch_param_gather(self.model):
            self.inst.calls["pp.param_gather_at_start"] += 1
        observe = self.inst.pp_observer
        for action in self.schedule.actions[self.stage]:
            if action.op == B and action.mb == last_b and (config.grad_sync_func is None or self.stage == 0):
                sync.enable()
            if observe is None:
                self._run(action)
            else:
                t0 = time.perf_counter()
                self._run(action)
                observe(self.stage, action, t0, time.perf_counter())
        if not self.forward_only and sync.context is not None:  # as stock: forward-only leaves it entered
            sync.enable()
            if config.grad_sync_func is not None:
                config.grad_sync_func(self.model.parameters())
        if config.finalize_model_grads_func is not None and not self.forward_only:
            schedules.finish_embedding_wgrad_compute(config, embedding, self.last, self.tp_group)
            self._finalize([self.model], force_all_reduce)
        if config.timers is not None:
            config.timers("forward-backward").stop()
        return self.data

    def _act(self, action):
        if action.op == POST:
            self._post(action.comms)
        elif action.op == WAIT:
            self._wait(action.comms[0])
        elif action.op == F:
            self._forward(action.mb)
        elif action.op == B:
            self._backward(action.mb)
        elif self.drain == "w" and action.mb in self.trailing_w:
            if self.store.run_layer_major(self.trailing_w):  # the first of them drains all; the rest find none
                self.inst.calls["pp.drain.w"] += 1
        else:
            self.store.run_microbatch(action.mb)

    def _forward(self, mb):
        s = self.schedules
        input_tensor = [self.inputs.get(mb)]
        output, tokens = s.forward_step(
            self.forward_step_func, self.data_iterator, self.model, self.m, input_tensor, self.data, self.config,
            cp_group_size=self.cp_group.size(), collect_non_loss_data=self.collect_non_loss_data,
            checkpoint_activations_microbatch=None,
            is_first_microbatch=s.check_first_val_step(self.first_val_step, self.forward_only, mb == 0),
            current_microbatch=mb, is_last_stage=self.last)
        self.total_tokens += tokens
        self.outputs[mb] = output
        if self.forward_only:
            self.inputs.pop(mb, None)
        else:
            self.inputs[mb] = input_tensor

    def _backward(self, mb):
        args = (self.inputs.pop(mb), self.outputs.pop(mb), [self.out_grads.pop(mb, None)])
        if self.with_model_type:
            args = args + (self.model_type,)
        if self.store is None:
            hold = contextlib.nullcontext()
        elif self.drain == "bw" and mb == self.last_b:
            hold = self.store.flush_for(mb)
            self.inst.calls["pp.drain.bw"] += 1
        else:
            hold = self.store.hold_for(mb)
        with hold:
            grad = self.schedules.backward_step(*args, self.config)
        self.in_grads[mb] = grad[0] if isinstance(grad, list) else grad

    # -- transfers (posting and waiting: pp_executor.StageRun) ----------------------------------
    def _agree_rows(self):
        """Every stage runs the step's micro-batches with the rows the previous stage has (module
        docstring): each sends its list to the next stage, which compares it with its own."""
        mine = torch.tensor(self.rows, dtype=torch.int64, device=self.device)
        theirs = None if self.first else torch.empty_like(mine)
        ops = []
        if not self.last:
            ops.append(dist.P2POp(dist.isend, mine, dist.get_global_rank(self.pp_group, self.stage + 1),
                                  self.pp_group, tags.tag("pp.rows", 0)))
        if theirs is not None:
            ops.append(dist.P2POp(dist.irecv, theirs, dist.get_global_rank(self.pp_group, self.stage - 1),
                                  self.pp_group, tags.tag("pp.rows", 0)))
        for work, peer in zip(dist.batch_isend_irecv(ops) if ops else [],
                              ([self.stage + 1] if not self.last else []) + ([self.stage - 1] if not self.first else [])):
            waits.wait(work, f"pipeline stage {self.stage}: the step's micro-batch lengths, checked with stage {peer}",
                       self.pp_group, peer)
        if theirs is not None and not torch.equal(theirs, mine):
            raise RuntimeError(
                f"megatron-overlap pipeline stage {self.stage}: this step's micro-batches have {self.rows} token rows "
                f"here and {theirs.tolist()} on stage {self.stage - 1}; the stages of a pipeline must plan the same "
                "step (the same documents in the same order)")


def _drain_plan(schedule, stage: int) -> tuple:
    """(how the stage drains, its last B's micro-batch, the micro-batches of the W actions
    after it) from ``schedule.drain`` (``pp/schedule.py``)."""
    if not schedule.split or not schedule.drain:
        return "", None, frozenset()
    acts = schedule.actions[stage]
    last = max(i for i, a in enumerate(acts) if a.op == B)
    trailing = frozenset(a.mb for a in acts[last + 1:] if a.op == W)
    return schedule.drain[stage], acts[last].mb, trailing


@functools.lru_cache(maxsize=64)
def _schedule(mode, p, m, inflight, forward_only, times=None):
    """The schedule the executor runs: ``times``, the (F, B, W) a split schedule places its
    weight gradients for (``Installation.pp_times``; None: all equal)."""
    return build(mode, p, m, inflight, forward_only=forward_only, times=times or (1.0, 1.0, 1.0))
