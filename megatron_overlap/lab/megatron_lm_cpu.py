"""Megatron-LM's own ``pretrain_gpt.py`` on a CPU, for the integration tests.

    torchrun --nproc-per-node 2 -m megatron_overlap.lab.megatron_lm_cpu LOSSES.json {stock,plugin} \\
        path/to/pretrain_gpt.py <Megatron-LM arguments> [<overlap flags>] [--lab-init-by-layer]
        [--lab-freeze SITE:RANK:ITERATION]

Runs the script unmodified (``plugin``: through ``megatron-overlap run``'s hook; ``stock``:
as it is) after mapping the places where Megatron-LM's training loop assumes CUDA onto the CPU,
and writes, per rank, the losses Megatron logs at every iteration (the reduced values
``train_step`` returns and ``training_log`` receives, not the ``%.6E`` log line; only the last
pipeline stage has them, and the last rank prints them) and
the plugin's patched calls to ``LOSSES.json.rank<r>``.

The shims, each for one reason (``shared/third_party/megatron-lm/README.md`` lists the facts):

- ``cpu_shims.apply()``: megatron-core's own CUDA calls (buffers on ``current_device()``, the RNG
  tracker, DDP's streams);
- ``torch.cuda.device_count() -> 1`` and a no-op ``set_device``: otherwise
  ``_initialize_distributed`` builds no parallel state and ``_set_random_seed`` seeds no TP RNG;
- ``initialize_megatron(allow_no_cuda=True)``: it asserts CUDA otherwise;
- ``_compile_dependencies`` and ``compile_helpers`` skipped: they run ``nvcc`` and build
  ``helpers_cpp`` (the wheel ships the compiled module);
- ``_warmup_jit_function`` skipped: it only warms up fused kernels, and on CPU its
  ``torch.rand(device="cuda")`` draws would shift the initial weights by sequence length and CP;
- ``get_device_arch_version() -> 9``: ``validate_args`` reads device properties for TP/CP > 1;
- ``torch.cuda.memory_*`` -> 0 and a wall-clock ``torch.cuda.Event``: ``training_log`` and the
  timers;
- a ``TorchFunctionMode`` that puts tensors created with ``device="cuda"`` (or ``.cuda()``,
  ``pin_memory=True``) on the CPU: dozens of places in ``training.py``, ``utils.py``, the
  optimizer;
- activation recompute's forwards under that mode too (``_recompute_under_cpu_devices``);
- ``TORCH_COMPILE_DISABLE=1``: ``megatron.core.jit.jit_fuser`` is ``torch.compile``;
- ``torch_dist`` checkpoints written by each rank itself (``dist_ckpt.in_process_writes``): the
  save's forked writers need psutil and report through a Manager process;
- the distributed optimizer's state initialised before a ``torch_dist`` load reads it
  (``_adam_step_in_initial_state``): without Transformer Engine or apex, megatron-core 0.16.1
  cannot resume a distributed-optimizer checkpoint otherwise;
- ``deallocate_pipeline_outputs`` off: freeing a stage's output under an asynchronous gloo send
  sends freed memory (``_keep_pipeline_outputs``);
- a data loader's iterator built under ``fork_rng``: its one host-side draw (the workers' base
  seed, on TP rank 0 only) would otherwise shift the generator that also serves as the CUDA one
  on that rank alone, and the TP ranks' hidden dropout masks would differ (``_host_draws_apart``);
- ``--lab-init-by-layer`` (taken out before the script sees its arguments): every weight
  matrix drawn again after ``get_model`` from a seed of its place in the whole model (its
  global layer number and its name in the layer), so that two layouts that put a layer on
  another stage start from the same model (Megatron seeds each stage's initialisation by its
  pipeline rank): ZB-V against stock interleaved (``_init_by_layer``);
- ``--lab-freeze SITE:RANK:ITERATION`` (taken out too): that rank stops itself (SIGSTOP) where
  it reaches SITE in that iteration, for the frozen-peer tests (``_freeze_at``).

Lab code: it patches the world for a test and is never imported by the product.
"""

from __future__ import annotations

import inspect
import json
import os
import runpy
import sys
import time

import torch

_IN_PROCESS_WRITES = None


class _Event:
    def __init__(self, *args, **kwargs):
        self.t = None

    def record(self, *args, **kwargs):
        self.t = time.perf_counter()

    def synchronize(self):
        pass

    def elapsed_time(self, other) -> float:
        return 1e3 * (other.t - self.t)


def apply() -> None:
    os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")  # validate_args asserts it for TP / CP > 1
    from . import cpu_shims

    cpu_shims.apply()
    if torch.cuda.is_available():
        return
    torch.cuda.device_count = lambda: 1
    torch.cuda.set_device = lambda *a, **k: None
    torch.cuda.Event = _Event
    for name in ("memory_allocated", "max_memory_allocated", "memory_reserved", "max_memory_reserved"):
        setattr(torch.cuda, name, lambda *a, **k: 0)
    torch.cuda.reset_peak_memory_stats = lambda *a, **k: None
    torch.cuda.empty_cache = lambda *a, **k: None
    torch.Tensor.cuda = lambda self, *a, **k: self
    torch.Tensor.pin_memory = lambda self, *a, **k: self
    cpu_shims.CPUDevices().__enter__()  # for the life of the process
    _recompute_under_cpu_devices(cpu_shims.CPUDevices)

    from megatron.core.datasets import utils as dataset_utils
    from megatron.training import arguments, initialize

    dataset_utils.compile_helpers = lambda *a, **k: None
    initialize._compile_dependencies = lambda *a, **k: None
    initialize._warmup_jit_function = lambda *a, **k: None  # 0.19 passes tp_size
    arguments.get_device_arch_version = lambda *a, **k: 9
    original = initialize.initialize_megatron

    def initialize_megatron(*args, **kwargs):
        kwargs["allow_no_cuda"] = True
        return original(*args, **kwargs)

    initialize.initialize_megatron = initialize_megatron
    _adam_step_in_initial_state()
    from .dist_ckpt import in_process_writes

    global _IN_PROCESS_WRITES  # held for the life of the process (a dropped context restores Megatron's writers)
    _IN_PROCESS_WRITES = in_process_writes()
    _IN_PROCESS_WRITES.__enter__()  # torch_dist saves written by the rank itself (lab/dist_ckpt.py)
    from megatron.training import training

    training.initialize_megatron = initialize_megatron
    _keep_pipeline_outputs(arguments)
    _host_draws_apart()


def _host_draws_apart() -> None:
    """A data loader's iterator draws its workers' base seed from the default CPU generator, on
    the ranks that load data only (TP rank 0). On a GPU that leaves the CUDA generator, which
    draws the hidden dropout masks, alike on every TP rank, as Megatron's replicated activations
    without sequence parallelism assume; here the two generators are one, so the draw runs under
    ``fork_rng`` (the CPU state saved and restored around it)."""
    from torch.utils.data import DataLoader

    original = DataLoader.__iter__
    if getattr(original, "_host_draws_apart", False):
        return

    def __iter__(self):
        with torch.random.fork_rng(devices=[]):
            return original(self)

    __iter__._host_draws_apart = True
    DataLoader.__iter__ = __iter__


def _recompute_under_cpu_devices(mode) -> None:
    """Activation recompute's forwards run under ``mode`` too. ``torch.autograd.backward`` goes
    through the process-wide ``CPUDevices`` handler, which runs it with the mode off, so the
    forward that Megatron's ``CheckpointFunction`` recomputes inside the backward would create
    its ``device="cuda"`` tensors unmapped (seen: the causal mask of selective recompute under
    the interleaved schedule)."""
    from megatron.core.tensor_parallel import random as mrandom

    for name in ("CheckpointFunction", "CheckpointWithoutOutputFunction"):
        cls = getattr(mrandom, name, None)
        if cls is None:
            continue
        original = cls.backward

        def backward(ctx, *args, _original=original):
            with mode():
                return _original(ctx, *args)

        cls.backward = staticmethod(backward)


def _adam_step_in_initial_state() -> None:
    """The distributed optimizer's state initialised, with Adam's ``step`` (0), before Megatron
    reads it to load a ``torch_dist`` checkpoint. Without Transformer Engine or apex,
    megatron-core 0.16.1 runs ``torch.optim.Adam``: loading calls ``DistributedOptimizer.
    state_dict()`` (to build the sharded state dict to load into) before any state exists, and it
    asserts exactly one ``step`` among the states; its ``init_state_fn`` creates ``exp_avg`` and
    ``exp_avg_sq`` only. Stock Megatron cannot resume such a checkpoint on this CPU otherwise. The
    checkpoint's values then replace these zeros.

    What this does not mend (stock Megatron's, on this path): the resumed losses differ from the
    uninterrupted run's from the first update after the resume (seen with bf16; the loaded step
    is one tensor that every parameter's state shares, and Adam increments it in place); with
    fp32 parameters the load copies into a view of a leaf parameter and fails; the ``torch``
    format's distributed-optimizer loader fails too (that view, and ``step`` expected among the
    per-parameter tensors it saved without it). The matrix therefore compares a resumed run
    with stock's resumed run (tests/matrix_design.py)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    original = DistributedOptimizer.state_dict

    def state_dict(self, *args, **kwargs):
        states = self.optimizer.state if self.optimizer is not None else {}
        if self.init_state_fn is not None and not any(len(s) for s in states.values()):
            self.init_state_fn(self.optimizer, self.config)
            for group in self.optimizer.param_groups:
                for param in group["params"]:
                    self.optimizer.state[param].setdefault("step", torch.tensor(0.0))
        return original(self, *args, **kwargs)

    DistributedOptimizer.state_dict = state_dict


def _keep_pipeline_outputs(arguments) -> None:
    """``deallocate_pipeline_outputs`` off (Megatron-LM always sets it): Megatron frees a stage's
    output right after posting its asynchronous send (the interleaved schedule with
    ``overlap_p2p_comm``), which a CUDA stream orders but gloo does not: its send reads the buffer
    later, from its own thread, and then sends freed memory (stock Megatron's interleaved losses
    turn to garbage on CPU). Freeing is only a memory saving; the numerics are unchanged."""
    original = arguments.core_transformer_config_from_args

    def core_transformer_config_from_args(*args, **kwargs):
        config = original(*args, **kwargs)
        config.deallocate_pipeline_outputs = False
        return config

    arguments.core_transformer_config_from_args = core_transformer_config_from_args
    for name in ("gpt_builders", "pretrain_gpt", "__main__"):  # bound by name where already imported
        module = sys.modules.get(name)
        if getattr(module, "core_transformer_config_from_args", None) is original:
            module.core_transformer_config_from_args = core_transformer_config_from_args


_REDRAWN = []  # the parameters ``_init_by_layer`` drew again, by global name (written with the losses)


def _init_by_layer() -> None:
    """See the module docstring. Biases and norms keep Megatron's constants."""
    import zlib

    from megatron.training import training

    original = training.get_model

    def get_model(*args, **kwargs):
        models = original(*args, **kwargs)
        for chunk in models:
            for key, param in sorted(_global_names(chunk).items()):
                if param.dim() >= 2:
                    g = torch.Generator().manual_seed(zlib.crc32(key.encode()))
                    with torch.no_grad():
                        param.copy_(0.02 * torch.randn(param.shape, generator=g, dtype=torch.float32))
                    _REDRAWN.append(key)
        return models

    training.get_model = get_model


def _global_names(chunk) -> dict:
    """{name in the whole model: parameter} of one model chunk: a transformer layer's by its
    ``layer_number`` (global, from Megatron's layer offset), the rest by its module path."""
    named, seen = {}, set()
    for _name, module in chunk.named_modules():
        number = getattr(module, "layer_number", None)
        if isinstance(number, int) and hasattr(module, "self_attention"):
            for pname, param in module.named_parameters():
                named[f"layer{number}.{pname}"] = param
                seen.add(id(param))
    for name, param in chunk.named_parameters():
        if id(param) not in seen:
            while name.startswith("module."):
                name = name[len("module."):]
            named[name] = param
    return named


# --lab-freeze SITE:RANK:ITERATION: where a rank stops itself (SIGSTOP: alive, silent)
_FREEZE_SITES = {
    "column": ("megatron.core.tensor_parallel.layers", "ColumnParallelLinear", "forward"),  # the plugin's TP ring
    "broadcast": ("megatron.training.utils", None, "get_batch_on_this_tp_rank"),  # Megatron's TP broadcast
    "grad-sync": ("megatron.core.distributed.distributed_data_parallel", "DistributedDataParallel",
                  "finish_grad_sync"),  # DDP's reductions, then the optimizer's collectives
    "stage": ("megatron.core.pipeline_parallel.schedules", None, "forward_step"),  # pipeline P2P
}


def _freeze_at(spec: str, path: str) -> None:
    """Rank RANK stops itself with SIGSTOP the first time it reaches SITE in training iteration
    ITERATION (1-based), after writing the time to ``path.frozen``: a peer frozen in one place,
    for the timeout tests (tests/test_timeout_pretrain_gpt.py)."""
    import importlib
    import signal

    import torch.distributed as dist
    from megatron.training import training

    site, rank, iteration = spec.split(":")
    module_name, cls, name = _FREEZE_SITES[site]
    module = importlib.import_module(module_name)
    owner = getattr(module, cls) if cls else module
    original, original_step = getattr(owner, name), training.train_step
    state = {"iteration": 0}

    def train_step(*args, **kwargs):
        state["iteration"] += 1
        return original_step(*args, **kwargs)

    def frozen(*args, **kwargs):
        if state["iteration"] == int(iteration) and dist.get_rank() == int(rank):
            with open(path + ".frozen", "w") as f:
                f.write(repr(time.time()))
            os.kill(os.getpid(), signal.SIGSTOP)
        return original(*args, **kwargs)

    training.train_step = train_step
    setattr(owner, name, frozen)


def _record_losses(path: str) -> None:
    """Wrap ``training_log`` where ``train`` looks it up: the reduced losses of each iteration as
    Megatron logs them on this rank (``train_step``'s, on the rank Megatron prints from) with the
    iteration's grad norm, and the plugin's patched calls, go to ``path.rank<r>`` when the process
    exits."""
    import atexit

    import torch.distributed as dist
    from megatron.training import training

    losses: list = []
    grad_norms: list = []  # with each logged loss: the iteration's grad norm (None unless --clip-grad > 0)
    original = training.training_log
    signature = inspect.signature(original)

    def training_log(loss_dict, *args, **kwargs):
        losses.append({k: float(v) for k, v in loss_dict.items()} if loss_dict else {})
        if loss_dict:
            norm = signature.bind_partial(loss_dict, *args, **kwargs).arguments.get("grad_norm")
            grad_norms.append(None if norm is None else float(norm))
        return original(loss_dict, *args, **kwargs)

    training.training_log = training_log

    def dump():
        from ..integration.install import find_installation

        inst = find_installation()
        rank = dist.get_rank() if dist.is_initialized() else 0
        with open(f"{path}.rank{rank}", "w") as f:
            json.dump({"losses": losses, "grad_norms": grad_norms, "calls": dict(inst.calls) if inst is not None else {},
                       "redrawn": _REDRAWN}, f)

    atexit.register(dump)


def _apex_like_norm() -> None:
    """Stock runs only: the torch norm under sequence parallelism with its parameters marked,
    as apex's FusedLayerNorm would run it (stock Megatron without apex cannot build SP; the
    plugin's own patch, ``integration/norms.py``, does this for plugin runs)."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    from ..integration.norms import original_new, sequence_parallel_new

    WrappedTorchNorm.__new__ = staticmethod(sequence_parallel_new(original_new(WrappedTorchNorm)))


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) < 3 or argv[1] not in ("stock", "plugin"):
        print(__doc__, file=sys.stderr)
        return 2
    losses, mode, script, rest = argv[0], argv[1], argv[2], argv[3:]
    by_layer = "--lab-init-by-layer" in rest
    rest = [a for a in rest if a != "--lab-init-by-layer"]
    freeze = None
    if "--lab-freeze" in rest:
        i = rest.index("--lab-freeze")
        freeze, rest = rest[i + 1], rest[:i] + rest[i + 2:]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    apply()
    if by_layer:
        _init_by_layer()
    _record_losses(losses)
    if freeze:
        _freeze_at(freeze, losses)
    if mode == "plugin":
        from ..integration.launch import run_script

        run_script(script, rest)
    else:
        _apex_like_norm()
        sys.argv = [os.path.abspath(script), *rest]
        runpy.run_path(sys.argv[0], run_name="__main__")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
