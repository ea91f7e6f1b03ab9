"""Weight gradients with Megatron's ``weight.main_grad`` semantics.

Mirrors the tail of megatron-core's ``LinearWithGradAccumulationAndAsyncCommunication.backward``
(0.16-0.19) so the overlapped linears hand Megatron's DDP exactly what the stock ones do:

- ``gradient_accumulation_fusion``: ``main_grad += grad_output^T @ input`` in place (apex's
  ``fused_weight_gradient_mlp_cuda`` where it exists; Megatron-FSDP params write
  ``get_main_grad()``), then a dummy grad is returned and ``grad_added_to_main_grad`` is set
  when the param carries that attribute (DDP's hook then skips the add);
- otherwise the gradient is returned and DDP's hook adds it into ``main_grad``.

Only tensor attributes are read here; nothing imports Megatron.
"""

from __future__ import annotations

from typing import Optional

import torch


def as_2d(grad_output: torch.Tensor, total_input: torch.Tensor):
    """Contiguous 2-D views ``[tokens, features]`` for the wgrad GEMM (Megatron does the same)."""
    if grad_output.dim() == 3:
        return as_rows(grad_output), as_rows(total_input)
    return grad_output.contiguous(), total_input.contiguous()


def as_rows(tensor: torch.Tensor) -> torch.Tensor:
    """One tensor of :func:`as_2d`: contiguous, ``[s, b, h]`` viewed as ``[s * b, h]``."""
    tensor = tensor.contiguous()
    return tensor.view(-1, tensor.shape[2]) if tensor.dim() == 3 else tensor


def _fused_accumulate(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor):
    try:
        import fused_weight_gradient_mlp_cuda  # apex's CUDA extension, as Megatron uses it
    except ImportError:
        fused_weight_gradient_mlp_cuda = None
    if fused_weight_gradient_mlp_cuda is not None:
        if main_grad.dtype == torch.float32:
            fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32(total_input, grad_output, main_grad)
            return
        if main_grad.dtype in (torch.float16, torch.bfloat16):
            fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp16(total_input, grad_output, main_grad)
            return
        raise RuntimeError("Unsupported gradient type for gradient accumulation fusion")
    # Megatron refuses to build a layer with the fusion on and no extension, so this branch
    # only serves callers of the op outside Megatron.
    main_grad.add_(torch.matmul(grad_output.t(), total_input).to(main_grad.dtype))


def deferrable(weight: torch.Tensor, gradient_accumulation_fusion: bool) -> bool:
    """Whether the wgrad of ``weight`` may wait in a ``WgradStore``: only where stock itself
    accumulates into ``main_grad`` and hands DDP a dummy (fusion on a DDP parameter, not a
    Megatron-FSDP one), so every attribute DDP reads is set exactly as stock sets it."""
    return (gradient_accumulation_fusion and getattr(weight, "main_grad", None) is not None
            and hasattr(weight, "grad_added_to_main_grad") and not hasattr(weight, "__fsdp_param__"))


def deferred_weight_gradient(weight: torch.Tensor, grad_output: torch.Tensor, total_input,
                             like: torch.Tensor, store, input_nbytes: int = 0) -> torch.Tensor:
    """Stock's return value now (the dummy, ``grad_added_to_main_grad``); ``main_grad +=
    grad_output^T @ total_input`` pushed to ``store`` (``tp.wgrad_store``). ``total_input`` may
    be a callable that returns it (a re-gather still travelling: the task takes it when it runs;
    ``input_nbytes`` its size), with ``grad_output`` then as the linear returned it."""
    main_grad = weight.main_grad  # this use's buffer, as restored from ctx by the caller
    if callable(total_input):
        take = total_input
        store.late_inputs += 1
        nbytes = input_nbytes + grad_output.untyped_storage().nbytes()
        store.push(weight, lambda: _fused_accumulate(*reversed(as_2d(grad_output, take())), main_grad), nbytes)
    else:
        nbytes = total_input.untyped_storage().nbytes() + grad_output.untyped_storage().nbytes()
        store.push(weight, lambda: _fused_accumulate(total_input, grad_output, main_grad), nbytes)
    return weight_gradient(weight, None, None, True, like)


def weight_gradient(
    weight: torch.Tensor,
    grad_output: Optional[torch.Tensor],
    total_input: Optional[torch.Tensor],
    gradient_accumulation_fusion: bool,
    like: torch.Tensor,
) -> Optional[torch.Tensor]:
    """The value the linear's backward returns for ``weight``.

    ``grad_output``/``total_input`` are the 2-D views from :func:`as_2d`, or both None when the
    wgrad GEMM is deferred (Megatron's ``defer_embedding_wgrad_compute``, which requires the
    fusion). ``like`` gives dtype and device of the dummy grad.
    """
    compute = grad_output is not None
    if not gradient_accumulation_fusion:
        if not compute:
            raise RuntimeError(
                "deferred embedding wgrad needs gradient_accumulation_fusion (as in Megatron)"
            )
        return grad_output.t().matmul(total_input)
    if compute:
        if hasattr(weight, "__fsdp_param__"):
            weight.main_grad = weight.get_main_grad()
            torch.matmul(grad_output.t(), total_input, out=weight.main_grad)
        else:
            _fused_accumulate(total_input, grad_output, weight.main_grad)
    if not hasattr(weight, "grad_added_to_main_grad"):
        return None
    # A dummy grad keeps DDP's backward hooks on the main thread (Megatron's reasoning).
    make = torch.zeros if getattr(weight, "zero_out_wgrad", False) else torch.empty
    dummy = make(weight.main_grad.shape, dtype=like.dtype, device=like.device)
    weight.grad_added_to_main_grad = True
    return dummy
