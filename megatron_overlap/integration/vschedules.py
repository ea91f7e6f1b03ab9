"""Megatron's interleaved schedule (virtual pipelines) -> ``pp`` with model chunks
(``pp/chunks.py``): a drop-in for ``forward_backward_pipelining_with_interleaving`` that runs
the ``pp.build`` schedule of ``--overlap-pp`` 1f1b or zb over Megatron's list of model chunks,
in Megatron's interleaved placement, with Megatron's own ``forward_step`` (``vp_stage``-aware)
and ``backward_step``. Around them it does what Megatron's interleaved schedule does:

- ``no_sync_func`` (one per chunk), ``grad_sync_func`` / ``param_sync_func`` made one per
  chunk; without ``grad_sync_func`` the sync is enabled before each chunk's last backward (as
  stock); with it, each chunk's gradient sync is launched once its last gradient is in (after
  its last B, or in a split schedule its last W) and the rest at the end. Where that function is
  Megatron DDP's ``start_grad_sync`` with ``overlap_grad_reduce`` and the chunk has several bucket
  groups (``ddp.py`` keeps buckets on every stage and chunk), the chunk's buckets leave as they
  fill instead (``_streaming_groups``): its own ``no_sync`` is left before its last backward, so
  DDP's hooks dispatch each bucket once its gradients are in (in a split schedule after the W
  GEMMs that complete them, ``ddp.py``), and whatever is not dispatched by the chunk's last
  gradient is launched then, as stock launches it. Parameter gathers: chunk 0's at the start,
  chunk 1's before the stage's first wait for a transfer or right after its first forward was
  issued, whichever comes first (stock launches both at the start: the port serves chunk 0's
  first either way, and the first stage's host issues its first forward without launching
  chunk 1's collectives before it), chunk c's before its first forward (stock
  launches them a few virtual micro-batches earlier: timing only). Where that
  function is Megatron DDP's ``start_param_sync`` (``align_param_gather``), a chunk's bucket
  all-gathers are dispatched in the order its forward needs them (``_gather_params``);
- the embedding's activation buffer and weight gradient, ``finalize_model_grads_func`` over
  the list of chunks, the token count, forward-only (the syncs disabled, as stock).

The transfers, their waits and errors are the executors' core (``pp_executor.py``: every stage
posting its transfers in one order shared by both ends, every wait bounded), keyed by (chunk,
micro-batch).
"""

from __future__ import annotations

import contextlib
import functools
import time

import torch
import torch.distributed as dist

from ..errors import OverlapConfigError
from ..pp import build
from ..pp.schedule import B, F, POST, WAIT, W
from .pp_executor import StageRun, inflight_for, make_forward_backward


def make_interleaved_executor(inst):
    """A drop-in for ``forward_backward_pipelining_with_interleaving`` running ``inst``'s schedule
    over the model chunks."""
    return make_forward_backward(inst, _VRun, f"pp.{inst.config.pp.mode}.interleaved")


def _gather_params(func, chunk) -> None:
    """Dispatch model chunk ``chunk``'s parameter all-gathers (``param_sync_func``).

    Megatron-LM's ``align_param_gather`` makes ``param_sync_func`` each chunk's DDP
    ``start_param_sync``, which dispatches the chunk's bucket groups in their order: bucket 0 holds
    the chunk's *last* layers (buckets fill in backward order), so the chunk's first forward waits
    until every bucket is gathered. The same collectives dispatched last bucket first (the order
    Megatron's own forward-hook chain uses without ``align_param_gather``) let the forward start
    once its first layers' bucket is in, and each later bucket arrives while earlier layers
    compute. Only the order changes (an all-gather copies). Anything else (another function,
    Megatron FSDP, gathers overlapped with the optimizer step or not asynchronous) is called as
    stock calls it."""
    ddp = getattr(func, "__self__", None)
    cfg = getattr(ddp, "ddp_config", None)
    groups = _bucket_groups(ddp)
    plain = (getattr(func, "__name__", "") != "start_param_sync" or cfg is None or not groups
             or not getattr(cfg, "overlap_param_gather", False) or getattr(cfg, "with_megatron_fsdp_code_path", False)
             or getattr(ddp, "overlap_param_gather_with_optimizer_step", False)
             or any(getattr(g, "param_gather_dispatched", True) for g in groups))
    if plain:
        func(chunk.parameters())
        return
    for group in reversed(groups):
        group.start_param_sync()


def _bucket_groups(ddp) -> list:
    groups = getattr(ddp, "all_bucket_groups", None)  # megatron-core >= 0.17 keeps one list
    if groups is None:
        groups = list(getattr(ddp, "bucket_groups", ())) + list(getattr(ddp, "expert_parallel_bucket_groups", ()))
    return list(groups)


def _streaming_groups(func, per_chunk_no_sync: bool):
    """The bucket groups of the chunk whose ``grad_sync_func`` is ``func`` when its buckets can
    leave as they fill (module docstring), else None: ``func`` is Megatron DDP's
    ``start_grad_sync`` under ``overlap_grad_reduce``, the chunk has several bucket groups and
    its own ``no_sync``."""
    ddp = getattr(func, "__self__", None)
    cfg = getattr(ddp, "ddp_config", None)
    if (not per_chunk_no_sync or getattr(func, "__name__", "") != "start_grad_sync" or cfg is None
            or not getattr(cfg, "overlap_grad_reduce", False) or getattr(cfg, "with_megatron_fsdp_code_path", False)):
        return None
    groups = _bucket_groups(ddp)
    return groups if len(groups) > 1 else None


class _VRun(StageRun):
    """One call over ``v`` model chunks (``pp_executor.StageRun`` keyed by (chunk, micro-batch))."""

    def __init__(self, inst, schedules, with_model_type, forward_step_func, data_iterator, model, m, forward_only,
                 collect_non_loss_data, first_val_step, p2p_communicator, pg_collection):
        super().__init__(inst, schedules, with_model_type, forward_step_func, data_iterator[0], model[0], m,
                         forward_only, collect_non_loss_data, first_val_step, p2p_communicator, pg_collection)
        self.models, self.iterators, self.v = list(model), list(data_iterator), len(model)

    @staticmethod
    def check_call(model, data_iterator) -> None:
        if not isinstance(model, list) or not isinstance(data_iterator, list) or len(model) != len(data_iterator):
            raise OverlapConfigError("pp.mode", "runs virtual pipelines over Megatron's list of model chunks, one data "
                                     "iterator per chunk (as Megatron's interleaved schedule asserts)")

    def key(self, comm):
        return comm.chunk, comm.mb

    def describe(self, comm) -> str:
        return f"{comm} (model chunk {comm.chunk}, stage {comm.peer}'s chunk {comm.peer_chunk})"

    def shapes(self, seq_length, micro_batch_size, decoder_seq_length, adjust):
        if adjust is not None:
            raise OverlapConfigError("pp.mode", "adjust_tensor_shapes_fn is not supported for interleaved pipelines "
                                     "(Megatron's interleaved schedule refuses it too)")
        if self.inst.microbatch_rows is not None:  # refused at install; a loop of its own could still get here
            raise OverlapConfigError("hdp.enabled", "runs under non-interleaved pipelines only: interleaved ones send "
                                     "one shape for every micro-batch, HDP's vary in length")
        kw = dict(seq_length=seq_length, micro_batch_size=micro_batch_size, decoder_seq_length=decoder_seq_length,
                  config=self.config, tp_group=self.tp_group, cp_group=self.cp_group)
        shapes = self.schedules.get_tensor_shapes(**kw)
        if len(shapes) != 1:
            raise OverlapConfigError("pp.mode", f"sends one tensor between stages; this model sends {len(shapes)}")
        self.recv_shape = self.send_shape = tuple(shapes[0])
        pp = self.inst.config.pp
        inflight = inflight_for(pp, self.p, self.m, self.config, seq_length, micro_batch_size)
        group = self.config.microbatch_group_size_per_vp_stage or self.p
        self.schedule = _vschedule(pp.mode, self.p, self.m, self.v, group, inflight, self.forward_only,
                                   self.inst.pp_times)
        self.store = self.inst.wgrad if self.schedule.split else None
        self.drain, self.last_b, self.trailing_w = "", None, frozenset()
        vs = self.schedule.virtual_stages
        self.loss_chunk = vs[-1][1] if vs[-1][0] == self.stage else None  # the model's last layer is here
        self.loss_stage = vs[-1][0]  # ZB-V: stage 0, not the last stage
        self.last = self.loss_chunk is not None
        self.handover = {}  # chunk -> the chunk of this stage its output goes to (ZB-V's turn)
        for j in range(len(vs) - 1):
            if vs[j][0] == vs[j + 1][0] == self.stage:
                self.handover[vs[j][1]] = vs[j + 1][1]
        self.handed_from = {b: a for a, b in self.handover.items()}

    def execute(self, force_all_reduce):
        config, schedules = self.config, self.schedules
        embedding = None
        if config.finalize_model_grads_func is not None and not self.forward_only:
            embedding = schedules.clear_embedding_activation_buffer(config, self.models, self.last)
        if config.timers is not None:
            config.timers("forward-backward", log_level=1).start(barrier=config.barrier_with_L1_time)
        for name in ("grad_sync_func", "param_sync_func"):  # one per chunk, as stock makes them
            func = getattr(config, name)
            if func is not None and not isinstance(func, list):
                setattr(config, name, [func for _ in self.models])
        saved = None
        if self.forward_only:
            saved = config.grad_sync_func, config.param_sync_func
            config.grad_sync_func = config.param_sync_func = None
        self.total_tokens = torch.zeros([], dtype=torch.int, device=self.device)
        self.data = []
        sync = _ChunkSync(config)
        sync.disable()
        if config.param_sync_func is not None:
            _gather_params(config.param_sync_func[0], self.models[0])
        self._steps(sync)
        if saved is not None:
            config.grad_sync_func, config.param_sync_func = saved
        else:
            sync.enable()
            if config.grad_sync_func is not None:
                for c in range(self.v):
                    if c not in sync.synced:
                        config.grad_sync_func[c](self.models[c].parameters())
        if config.finalize_model_grads_func is not None and not self.forward_only:
            schedules.finish_embedding_wgrad_compute(config, embedding, self.last, self.tp_group)
            self._finalize(self.models, force_all_reduce)
        if config.timers is not None:
            config.timers("forward-backward").stop()
        return self.data

    def _steps(self, sync):
        config, m = self.config, self.m
        last_grad = {}  # chunk -> index of the action that completes its gradients
        acts = self.schedule.actions[self.stage]
        for i, a in enumerate(acts):
            if a.op == (W if self.schedule.split else B) and a.mb == m - 1:
                last_grad[a.chunk] = i
        streams = {}  # chunk -> its bucket groups, where they leave as they fill
        if config.grad_sync_func is not None and not self.forward_only:
            for c in range(self.v):
                groups = _streaming_groups(config.grad_sync_func[c], sync.per_chunk)
                if groups is not None:
                    streams[c] = groups
        if streams:
            self.inst.calls["pp.buckets_streamed"] += 1
        gathered = {0}
        observe = self.inst.pp_observer

        def gather(c):  # chunk c's parameter gathers, once
            if c < self.v and c not in gathered and config.param_sync_func is not None:
                _gather_params(config.param_sync_func[c], self.models[c])
                gathered.add(c)
        for i, action in enumerate(acts):
            if action.op == B and action.mb == m - 1 and config.grad_sync_func is None:
                sync.enable()  # stock: before the chunk's last backward, and left on
                sync.synced.add(action.chunk)
            elif action.op == B and action.mb == m - 1 and action.chunk in streams:
                sync.release(action.chunk)  # its hooks dispatch each bucket as it fills
            if action.op == WAIT:
                gather(1)  # chunk 1's while this stage waits
            if action.op == F:
                gather(action.chunk)
            t0 = time.perf_counter()
            self._run(action)
            if observe is not None:
                observe(self.stage, action, t0, time.perf_counter())
            if action.op == F:
                gather(1)  # after the step's first forward was issued
            if action.chunk in streams and last_grad.get(action.chunk) == i:
                for group in streams[action.chunk]:  # not dispatched by its hooks (the first step): now, as stock
                    if group.grad_reduce_handle is None:
                        group.start_grad_sync()
                sync.synced.add(action.chunk)
            elif config.grad_sync_func is not None and last_grad.get(action.chunk) == i and not self.forward_only:
                sync.enable()
                config.grad_sync_func[action.chunk](self.models[action.chunk].parameters())
                sync.synced.add(action.chunk)
                sync.disable()

    def _finalize(self, models, force_all_reduce):
        if self.config.calculate_per_token_loss and self.loss_stage != self.p - 1:
            # Megatron's finalize_model_grads broadcasts the token count from the last stage,
            # where the loss is in its placement; ZB-V's loss (and so its count) is on stage 0,
            # the other stages counted 0: their sum is stage 0's count, on every stage.
            dist.all_reduce(self.total_tokens, group=self.pp_group)
        super()._finalize(models, force_all_reduce)

    def _act(self, action):
        if action.op == POST:
            self._post(action.comms)
        elif action.op == WAIT:
            self._wait(action.comms[0])
        elif action.op == F:
            self._vforward(action.chunk, action.mb)
        elif action.op == B:
            self._vbackward(action.chunk, action.mb)
        else:
            self.store.run_microbatch((action.chunk, action.mb))

    def _vforward(self, c, mb):
        s = self.schedules
        key = (c, mb)
        input_tensor = [self.inputs.get(key)]
        output, tokens = s.forward_step(
            self.forward_step_func, self.iterators[c], self.models[c], self.m, input_tensor, self.data, self.config,
            cp_group_size=self.cp_group.size(), collect_non_loss_data=self.collect_non_loss_data,
            checkpoint_activations_microbatch=None,
            is_first_microbatch=s.check_first_val_step(self.first_val_step, self.forward_only, mb == 0),
            current_microbatch=mb, vp_stage=c, is_last_stage=c == self.loss_chunk)
        self.total_tokens += tokens
        self.outputs[key] = output
        if c in self.handover and not self.forward_only:  # to the next chunk on this stage, as a receive would
            self.inputs[(self.handover[c], mb)] = output[0].detach().requires_grad_(True)
        elif c in self.handover:
            self.inputs[(self.handover[c], mb)] = output[0].detach()
        if self.forward_only:
            self.inputs.pop(key, None)
        else:
            self.inputs[key] = input_tensor

    def _vbackward(self, c, mb):
        key = (c, mb)
        args = (self.inputs.pop(key), self.outputs.pop(key), [self.out_grads.pop(key, None)])
        if self.with_model_type:
            args = args + (self.model_type,)
        hold = contextlib.nullcontext() if self.store is None else self.store.hold_for(key)
        with hold:
            grad = self.schedules.backward_step(*args, self.config)
        grad = grad[0] if isinstance(grad, list) else grad
        if c in self.handed_from:  # the turn: this chunk's input gradient is the previous chunk's output gradient
            self.out_grads[(self.handed_from[c], mb)] = grad
        else:
            self.in_grads[key] = grad


class _ChunkSync:
    """Megatron's ``no_sync`` of every chunk, entered together; with one function per chunk
    (``per_chunk``) a chunk can be left on its own (``release``) and stays out."""

    def __init__(self, config):
        funcs = config.no_sync_func
        self.per_chunk = isinstance(funcs, list)
        self.funcs = list(funcs) if self.per_chunk else [funcs or contextlib.nullcontext]
        self.contexts = {}  # index in funcs -> the entered context
        self.released = set()
        self.synced = set()

    def disable(self):
        for k, func in enumerate(self.funcs):
            if k not in self.contexts and k not in self.released:
                self.contexts[k] = func()
                self.contexts[k].__enter__()

    def enable(self):
        for k in list(self.contexts):
            self.contexts.pop(k).__exit__(None, None, None)

    def release(self, chunk: int):
        self.released.add(chunk)
        context = self.contexts.pop(chunk, None)
        if context is not None:
            context.__exit__(None, None, None)


@functools.lru_cache(maxsize=64)
def _vschedule(mode, p, m, v, group, inflight, forward_only, times=None):
    return build(mode, p, m, inflight, forward_only=forward_only, times=times or (1.0, 1.0, 1.0), chunks=v,
                 group=group)
