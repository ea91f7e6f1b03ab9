"""Make megatron-core 0.16-0.19 run on a CPU-only torch with gloo.

Megatron calls ``torch.cuda.*`` in a handful of places that matter for training a GPT with
TP/SP/DP on CPU (buffers created on ``torch.cuda.current_device()``, the CUDA RNG tracker, DDP's
streams). ``apply()`` maps those onto the CPU; it is idempotent and touches nothing when CUDA is
available. The list is the one in shared/notes/megatron-seams.md, checked against 0.16.1.
"""

from __future__ import annotations

import contextlib
import sys
import types

import torch
from torch.overrides import TorchFunctionMode

_applied = False


class _Stream:
    """Stand-in for torch.cuda.Stream on CPU: everything runs in order anyway."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, other):
        pass

    def wait_event(self, event):
        pass

    def synchronize(self):
        pass

    def record_event(self, event=None):
        return event


def _fake_fused_wgrad_module() -> types.ModuleType:
    """apex's ``fused_weight_gradient_mlp_cuda`` in plain torch, so gradient-accumulation
    fusion (``weight.main_grad += dy^T @ x``) can run, and be compared, on CPU."""
    module = types.ModuleType("fused_weight_gradient_mlp_cuda")

    def accumulate(total_input, grad_output, main_grad):
        main_grad.add_(torch.matmul(grad_output.t(), total_input).to(main_grad.dtype))

    module.wgrad_gemm_accum_fp32 = accumulate
    module.wgrad_gemm_accum_fp16 = accumulate
    return module


def apply(enable_grad_accum_fusion: bool = True) -> None:
    """Install the shims (no-op on a machine with CUDA, and when already applied)."""
    global _applied
    if _applied or torch.cuda.is_available():
        return
    cpu = torch.device("cpu")
    torch.cuda.current_device = lambda: cpu
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_stream = lambda *a, **k: _Stream()
    torch.cuda.default_stream = lambda *a, **k: _Stream()
    torch.cuda.Stream = _Stream
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()
    torch.cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    torch.cuda.set_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    # Not torch.manual_seed: it calls torch.cuda.manual_seed_all itself.
    torch.cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(seed)
    torch.cuda.random.get_rng_state = torch.cuda.get_rng_state
    torch.cuda.random.set_rng_state = torch.cuda.set_rng_state
    torch.cuda.empty_cache = lambda: None
    # Megatron stages small index tensors through pinned memory and .cuda() (e.g. RoPE under
    # context parallelism, rope_utils.get_pos_emb_on_this_cp_rank): on CPU, plain tensors.
    _tensor = torch.tensor

    def tensor(*a, pin_memory=False, **k):
        if str(k.get("device", "")).startswith("cuda"):  # e.g. the optimizer's grad-norm scalars
            k["device"] = "cpu"
        return _tensor(*a, **k)

    torch.tensor = tensor
    torch.Tensor.cuda = lambda self, *a, **k: self
    # Megatron's pipeline schedules count tokens in torch.zeros(..., device="cuda").
    _zeros = torch.zeros

    def zeros(*a, **k):
        if str(k.get("device", "")).startswith("cuda"):
            k["device"] = "cpu"
        return _zeros(*a, **k)

    torch.zeros = zeros

    from megatron.core.tensor_parallel import random as mrandom

    mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)

    if enable_grad_accum_fusion:
        sys.modules.setdefault("fused_weight_gradient_mlp_cuda", _fake_fused_wgrad_module())
        from megatron.core.tensor_parallel import layers

        layers.fused_weight_gradient_mlp_cuda = sys.modules["fused_weight_gradient_mlp_cuda"]
        layers._grad_accum_fusion_available = True
    _applied = True


_FACTORIES = {"empty", "zeros", "ones", "full", "tensor", "arange", "rand", "randn", "randint", "empty_like",
              "zeros_like", "ones_like", "full_like", "rand_like", "randn_like", "as_tensor", "eye", "linspace"}


def _is_cuda(device) -> bool:
    if device is None:
        return False
    if isinstance(device, int):
        return True
    return str(device).startswith("cuda")


class CPUDevices(TorchFunctionMode):
    """Tensors asked for on ``cuda`` are made on the CPU; ``pin_memory`` is dropped; a tensor's
    ``type()`` reads as its CUDA type (Megatron's optimizers assert it)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        name = getattr(func, "__name__", "")
        if name in _FACTORIES or name in ("to", "new_empty", "new_zeros", "new_ones", "new_full", "new_tensor"):
            if _is_cuda(kwargs.get("device")):
                kwargs["device"] = "cpu"
            kwargs.pop("pin_memory", None)
            if name == "to" and args and len(args) > 1 and _is_cuda(args[1]):
                args = (args[0], "cpu", *args[2:])
        if name in ("cuda", "pin_memory"):
            return args[0]
        if name == "type" and len(args) == 1 and not kwargs:
            # Megatron's optimizers check ``param.type()`` against the CUDA tensor types
            text = func(*args)
            return text.replace("torch.", "torch.cuda.", 1) if not text.startswith("torch.cuda.") else text
        return func(*args, **kwargs)


def optimizer_shims() -> None:
    """Megatron's optimizer on CPU without a process-wide ``CPUDevices``: its gradient clipping
    asserts ``param.grad.type() == 'torch.cuda.FloatTensor'``, so it runs inside one (the rest
    of the step only makes scalars on "cuda", which ``apply`` maps). Idempotent."""
    import functools

    from megatron.core.optimizer import clip_grads, optimizer

    original = clip_grads.clip_grad_by_total_norm_fp32
    if getattr(original, "_cpu_shim", False):
        return

    @functools.wraps(original)
    def clip(*args, **kwargs):
        with CPUDevices():
            return original(*args, **kwargs)

    clip._cpu_shim = True
    clip_grads.clip_grad_by_total_norm_fp32 = clip
    optimizer.clip_grad_by_total_norm_fp32 = clip
