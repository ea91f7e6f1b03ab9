"""The embedding's gradient all-gather, overlapped with the weight gradients still held.

Under sequence parallelism the embedding's output is reduce-scattered over TP
(``tensor_parallel.mappings._ReduceScatterToSequenceParallelRegion``); its backward all-gathers the
grad of the hidden states, the last transfer of the backward pass, and stock waits for it with
nothing to compute. With TP overlap on, the weight-gradient GEMMs kept back in the installation's
``WgradStore`` (``tp/wgrad_store.py``: at that point the first layer's QKV wgrad, which otherwise runs
in the drain after it) run while that gather travels: the gather is issued asynchronously, the
held tasks run, then it is waited for (bounded, ``comm.waits``). The same collective, the same
GEMMs into the same ``main_grad``: the bits do not change. Nothing held, split sizes given, or
Megatron's global buffer asked for: Megatron's own backward runs.
"""

from __future__ import annotations

import functools
import inspect

import torch


def patch(inst) -> None:
    from megatron.core.tensor_parallel import mappings

    cls = mappings._ReduceScatterToSequenceParallelRegion
    original = cls.__dict__["backward"]
    stock = original.__func__ if isinstance(original, staticmethod) else original
    inputs = len(inspect.signature(cls.forward).parameters) - 1  # the forward's inputs, ctx aside

    @functools.wraps(stock)
    def backward(ctx, grad_output):
        store = inst.wgrad
        group = ctx.group
        if store is None or not len(store) or getattr(ctx, "input_split_sizes", None) is not None \
                or getattr(ctx, "use_global_buffer", False) or group is None or group.size() == 1:
            return stock(ctx, grad_output)
        from ..comm import waits

        x = grad_output.contiguous()
        out = torch.empty((x.shape[0] * group.size(), *x.shape[1:]), dtype=x.dtype, device=x.device)
        # looked up at call time: whoever wraps Megatron's collective (an emulated link) sees it
        work = mappings.dist_all_gather_func(out, x, group=group, async_op=True)
        inst.calls["tp.embedding_grad_overlap"] += 1
        store.run()  # the held wgrad GEMMs while the gather travels
        waits.wait(work, "all-gather of the embedding's grad", group)
        return (out,) + (None,) * (inputs - 1)

    inst.set_attr(cls, "backward", staticmethod(backward))
