"""Megatron DDP's grad-ready registration -> ``tp.wgrad_store`` (patch table in ``install.py``).

With ``overlap_grad_reduce`` DDP starts a bucket's reduction once every parameter in it has
registered its grad as ready, which its backward hook does right after the linear's backward
returned. A linear whose wgrad GEMM waits in the installation's ``WgradStore`` has not added
into ``main_grad`` yet at that moment: its registration is held back until that GEMM ran
(``WgradStore.after``), so no bucket is reduced before all its gradients are in. Whether the
registration counts is decided when the hook fires (``is_last_microbatch`` then): a split
pipeline runs W passes of earlier micro-batches after the last one's B has turned grad sync on,
and those must not register.
"""

from __future__ import annotations

import functools


def patch(inst) -> None:
    from megatron.core.distributed import param_and_grad_buffer

    cls = param_and_grad_buffer._ParamAndGradBucketGroup
    original = cls.__dict__["register_grad_ready"]
    store = inst.wgrad

    @functools.wraps(original)
    def register_grad_ready(self, param, *args, **kwargs):
        if not self.is_last_microbatch:
            return original(self, param, *args, **kwargs)  # does nothing now, as it would later
        store.after(param, lambda: original(self, param, *args, **kwargs))

    inst.set_attr(cls, "register_grad_ready", register_grad_ready)
