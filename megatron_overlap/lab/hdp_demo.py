"""The rank side of ``megatron-overlap demo --overlap-hdp`` (driver: ``cli/demo_hdp.py``): per rank, one
tiny GPT with ``--overlap-hdp`` installed (and, at TP > 1, TP overlap: each HDP rank is a TP group), its
share of a mixed-length batch, and the static and HDP layouts of the same batch run through the
HDP runtime."""

from __future__ import annotations

import statistics
import time
from typing import Sequence

import torch
import torch.distributed as dist


class HdpDemoRanks:
    """Per-rank state (through ``lab.session``): the model, this rank's samples, the gradients of
    each layout."""

    def __init__(self, lengths: Sequence[int], capacity: int, seed: int, hidden: int, ffn: int, layers: int,
                 tp: int = 1):
        import megatron_overlap
        from megatron.core import parallel_state

        from ..hdp.samples import Sample
        from .tiny_gpt import TinyGPT, build, init_parallel

        init_parallel(tp, seed=seed)
        megatron_overlap.uninstall()
        flags = ["--overlap-hdp", "--overlap-hdp-max-tokens-per-rank", str(capacity)]
        flags += ["--overlap-tp", "p2p"] if tp > 1 else []
        self.installation = megatron_overlap.install(megatron_overlap.overlap_parser().parse_args(flags))
        spec = TinyGPT(num_layers=layers, hidden=hidden, ffn=ffn, heads=8, kv_heads=2, vocab=512, seq=max(lengths) + tp)
        self.model = build(spec, tp=tp, sequence_parallel=tp > 1)
        gen = torch.Generator().manual_seed(seed)
        me, world = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
        self.samples = []
        for i, L in enumerate(lengths):
            tokens = torch.randint(0, spec.vocab, (L + 1,), generator=gen)
            if i % world == me:  # dealt round-robin over the HDP ranks: this TP group's data iterator loaded it
                self.samples.append(Sample(tokens[:-1], tokens[1:], torch.ones(L)))
        self.grads = {}

    def describe(self) -> dict:
        return {"samples": len(self.samples), "tokens": sum(len(s) for s in self.samples)}

    def measure(self, layout: str, repeats: int) -> dict:
        from ..hdp.runtime import forward_backward, reduce_gradients, reduce_loss
        from ..integration.hdp import make_runtime

        model, world = self.model, dist.group.WORLD
        runtime = make_runtime(self.installation.config.hdp, scheduler=layout)  # the DP ranks of this TP rank
        group = runtime.group
        runtime.step(self.samples)  # the first call of a process pays one-time costs (imports)
        dist.barrier(world)
        t0 = time.perf_counter()
        step = runtime.step(self.samples)
        load_ms = 1e3 * (time.perf_counter() - t0)
        forward_backward(model, step)  # warm-up
        busy, wall, steps = [], [], []
        for _ in range(repeats):
            model.zero_grad(set_to_none=True)
            dist.barrier(world)
            start = time.perf_counter()
            result = forward_backward(model, step)
            end = time.perf_counter()
            span = torch.tensor([-start, end], dtype=torch.float64)
            dist.all_reduce(span, op=dist.ReduceOp.MAX, group=world)  # earliest start, latest end
            steps.append(1e3 * float(span.sum()))
            busy.append(1e3 * sum(result.cpu_s))
            wall.append(1e3 * sum(result.wall_s))
        loss = reduce_loss(result.loss, group)
        reduce_gradients(model, group)
        sum_sequence_parallel_grads(model)
        self.grads[layout] = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).clone()
        return {
            "busy_ms": statistics.median(busy),
            "wall_ms": statistics.median(wall),
            "step_ms": statistics.median(steps),
            "load_ms": load_ms,
            "microbatches": step.num_microbatches,
            "rows": sum(mb.layout.rows for mb in step.microbatches),
            "tokens": sum(int(mb.layout.valid.sum()) for mb in step.microbatches),
            "ring_sizes": sorted(step.plan.ring_sizes().values(), reverse=True),
            "moved_tokens": step.moved_tokens,
            "loss": loss,
        }

    def measure_planning(self, plan_ahead: bool, steps: int, warmup: int = 2) -> dict:
        """``steps`` training steps of the hdp layout through ``HdpDataIterator`` (the same
        samples each step), planning inline or one step ahead in a helper process: per step the
        wall time from a barrier to the last rank's end (start_step + forward + backward), and
        the time start_step waited for its plan (inline: the whole lengths + plan + exchange)."""
        from ..hdp.planahead import HdpDataIterator
        from ..hdp.runtime import forward_backward
        from ..integration.hdp import make_runtime

        runtime = make_runtime(self.installation.config.hdp)
        it = HdpDataIterator(iter([self.samples] * (warmup + steps)), runtime, plan_ahead=plan_ahead)
        times, waits = [], []
        for k in range(warmup + steps):
            self.model.zero_grad(set_to_none=True)
            dist.barrier(dist.group.WORLD)
            wait0, start = it.plan_wait_s, time.perf_counter()
            count = it.start_step()
            forward_backward(self.model, it.current)
            for _ in range(count):
                next(it)
            span = torch.tensor([-start, time.perf_counter()], dtype=torch.float64)
            dist.all_reduce(span, op=dist.ReduceOp.MAX, group=dist.group.WORLD)
            if k >= warmup:
                times.append(1e3 * float(span.sum()))
                waits.append(1e3 * (it.plan_wait_s - wait0))
        it.close()
        return {"step_ms": statistics.median(times), "plan_wait_ms": statistics.median(waits),
                "plan_ms": 1e3 * it.plan_s / max(1, warmup + steps) if plan_ahead else None}

    def tp_calls(self) -> int:
        return self.installation.calls["tp.column"]

    def compare_grads(self) -> float:
        a, b = self.grads["static"], self.grads["hdp"]
        return float((a.double() - b.double()).norm() / b.double().norm())

    def close(self) -> None:
        self.installation.uninstall()


def sum_sequence_parallel_grads(model) -> None:
    """Sum, over the TP group, the gradients of the parameters sequence parallelism replicates
    (the norms: each TP rank saw only its rows), as Megatron's ``finalize_model_grads`` does."""
    from megatron.core import parallel_state

    if parallel_state.get_tensor_model_parallel_world_size() == 1:
        return
    for p in model.parameters():
        if getattr(p, "sequence_parallel", False) and p.grad is not None:
            dist.all_reduce(p.grad, group=parallel_state.get_tensor_model_parallel_group())
