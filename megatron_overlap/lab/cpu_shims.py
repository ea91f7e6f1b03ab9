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
    torch.tensor = lambda *a, pin_memory=False, **k: _tensor(*a, **k)
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
