"""A transformer whose compute is a wait, around the product's context-parallel attention: the
long-context runs of the emulated cluster (``lab/cp_cluster.py``, ``lab/hdp_cluster.py``,
``lab/hdp_pp_cluster.py``), and their link and device clock (``emulated_two_tier``, ``start_device``).

Per layer group (``layers`` consecutive layers, every one alike), in autograd order::

    forward    QKV linears (wait) -> attention (``attend(q, k, v)``: the product's code, its
               blocks waits, ``lab/emulated_attention.py``) -> projection + MLP (wait)
    backward   the same in reverse, each linear's B + W twice its forward

and the output layer after the last group (its backward first). The linears' rates are
``cp.step_model.LayerCosts`` (the cost model's, as the simulator takes them); a group of k layers
waits k times one layer's time. Tensors hold one element per head (``[rows, 1, heads, 1]``,
bf16), so the attention's transfers carry its modelled bytes times the lab's byte factor.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

HOST_AHEAD_S = 0.1  # wall s a rank's host may run ahead of its device (a GPU's launch queue holds a step)


class _Wait(torch.autograd.Function):
    """Identity whose forward waits ``fwd_s`` and backward ``bwd_s`` on the clock."""

    @staticmethod
    def forward(ctx, x, clock, fwd_s: float, bwd_s: float, label: str):
        clock.run(fwd_s, label)
        ctx.clock, ctx.bwd_s, ctx.label = clock, bwd_s, label
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.clock.run(ctx.bwd_s, ctx.label + " backward")
        return grad, None, None, None, None


class EmulatedTransformer:
    """``groups``: layers per group; ``costs``: ``cp.step_model.LayerCosts``; ``time_factor``: clock
    seconds per modelled second; ``heads`` / ``kv_heads``: the head tensors' heads."""

    def __init__(self, costs, clock, groups: Sequence[int], time_factor: float, heads: int, kv_heads: int):
        self.costs, self.clock, self.groups = costs, clock, tuple(groups)
        self.time_factor, self.heads, self.kv_heads = time_factor, heads, kv_heads

    def _s(self, ms: float) -> float:
        return ms * 1e-3 * self.time_factor

    def step(self, rows: int, modelled_rows: float, attend: Callable, groups: Sequence[int] = ()) -> None:
        """Forward and backward of every group (``groups``: layers per group, default the
        model's) on ``rows`` emulated rows standing for ``modelled_rows`` tokens (padding
        included)."""
        self.forward(rows, modelled_rows, attend, groups).backward()

    def forward(self, rows: int, modelled_rows: float, attend: Callable, groups: Sequence[int] = (),
                head: bool = True) -> torch.Tensor:
        """The forward of every group (a pipeline stage: its layers), then, with ``head``, the
        output layer: a scalar whose ``backward()`` runs the backward; without, the last group's
        output (``out.backward(torch.ones_like(out))`` runs it)."""
        c, hq, hk = self.costs, self.heads, self.kv_heads
        h = torch.zeros(rows, 1, hq + 2 * hk, 1, dtype=torch.bfloat16, requires_grad=True)
        x = h
        for k in groups or self.groups:
            qkv = self._s(modelled_rows * c.qkv_ms_per_token * k)
            x = _Wait.apply(x, self.clock, qkv, 2 * qkv, "qkv")
            q, key, value = x.split([hq, hk, hk], dim=2)
            out = attend(q, key, value)
            post = self._s(modelled_rows * c.post_ms_per_token * k)
            out = _Wait.apply(out, self.clock, post, 2 * post, "proj + mlp").reshape(rows, 1, hq, 1)
            x = torch.cat([out, out[:, :, :1].expand(rows, 1, 2 * hk, 1)], dim=2)
        if not head:
            return x
        ms = self._s(modelled_rows * c.head_ms_per_token)
        return _Wait.apply(x, self.clock, ms, 2 * ms, "output layer").float().sum()


def emulated_two_tier(link, byte_factor: float, per_group: int, time_factor: float, world: int):
    """The long-context lab's link on this rank: the two-tier emulated link (bytes scaled by
    ``byte_factor``, times by the layer group and the lab's time factor) installed with a compute
    clock, and a free link to swap in for the exposed-communication runs. Returns
    ``(spec, free_spec, clock, link)``."""
    from .compute_clock import ComputeClock
    from .emulated_link import EmulatedLink
    from .link_spec import LinkSpec

    spec = LinkSpec.two_tier(link, byte_factor / (per_group * time_factor), per_group * time_factor)
    spec.check_world(world)
    free = LinkSpec(bandwidth_GBps=1e9, latency_us=0.0, ports="group")
    clock = ComputeClock(ahead_s=HOST_AHEAD_S)
    emulated = EmulatedLink(spec).install()
    emulated.clock = clock
    emulated.stream_waits = True  # a wait holds the emulated device, not the host (start_device)
    return spec, free, clock, emulated


def start_device(clock, t0: float) -> float:
    """Start a step's emulated device at the hosts' common start ``t0`` (returned, moved): the
    clock forgets the start's own all-reduce and the device begins ``HOST_AHEAD_S`` later, as a
    GPU begins once its host has queued that far ahead.

    The long-context labs' hosts, as on a GPU, do not wait for their devices: a communication wait
    holds the emulated device until the transfer's deadline and lets the host go on once the real
    gloo op is done (``EmulatedLink.stream_waits``); the host runs up to ``HOST_AHEAD_S`` ahead of
    its device, and a step ends at the device's end (``clock.end`` after ``clock.sync()``). A host
    (16 ranks share 2 cores here) costs the device time only when it falls further behind
    (``clock.late_s``). Sleeping each host to every deadline instead charged its wake-up, and
    gloo's real message latency, to the device: the CP lab's blocking exchanges showed several
    times the simulated exposure at the slowest clock (BENCHMARKS.md, long context)."""
    clock.reset()
    t0 += clock.ahead_s
    clock.resume_at(t0)
    return t0


def rank_samples(batches: Sequence[Sequence[int]], seed: int, index: int, count: int) -> list:
    """Per batch, the samples loader ``index`` of ``count`` holds (sequence i by loader i mod
    count): random tokens from a generator seeded by ``seed`` and ``index``, all-ones loss masks."""
    from ..hdp.samples import Sample

    gen = torch.Generator().manual_seed(seed * 7919 + index)
    out = []
    for lens in batches:
        mine = []
        for i, L in enumerate(lens):
            if i % count == index:
                tokens = torch.randint(0, 1000, (L + 1,), generator=gen)
                mine.append(Sample(tokens[:-1], tokens[1:], torch.ones(L)))
        out.append(mine)
    return out


class EmulatedRanks:
    """What the long-context lab's rank classes share: a round runs each name once, the order
    rotating with the round (``rotated``); closing uninstalls the emulated link and unfreezes the
    collector (their constructors install and freeze)."""

    link = None

    @staticmethod
    def rotated(names: Sequence[str], index: int) -> list:
        k = index % len(names)
        return list(names[k:]) + list(names[:k])

    def close(self) -> dict:
        import gc

        self.link.uninstall()
        gc.unfreeze()
        return {}
