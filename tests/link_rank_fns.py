"""Rank functions of the emulated link: times and bytes of every path that moves bytes (Megatron's
bindings, torch's collectives under both names, P2P in two groups, a free communicator)."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from .rank_helpers import install, tp_group


def link_timing() -> dict:
    """Transfers on the emulated link take latency + bytes/bandwidth, queue on the egress
    port, and Megatron's import-time bindings are rebound while it is installed."""
    from megatron.core.tensor_parallel import layers, mappings

    from megatron_overlap.lab.emulated_link import EmulatedLink, LinkSpec
    from megatron_overlap.comm.p2p import exchange

    group = tp_group(2)
    peer = 1 - dist.get_rank(group)
    # slow enough that "issuing does not wait" holds with a wide margin on a loaded machine
    spec = LinkSpec(bandwidth_GBps=0.02, latency_us=2000.0)  # 1 MiB -> 52 ms + 2 ms
    x = torch.ones(1 << 18)  # 1 MiB
    out = torch.empty(2 * x.numel())
    before = (layers.dist_all_gather_func, mappings.dist_reduce_scatter_func)
    result = {}
    with EmulatedLink(spec) as link:
        result["rebound"] = layers.dist_all_gather_func is not before[0] and mappings.dist_reduce_scatter_func is not before[1]
        dist.barrier(group=group)
        t0 = time.perf_counter()
        work = layers.dist_all_gather_func(out, x, group=group, async_op=True)
        result["async_return_s"] = time.perf_counter() - t0
        work.wait()
        result["all_gather_s"] = time.perf_counter() - t0
        result["all_gather_bytes"] = link.stats.bytes_by_op["all_gather_single"] + link.stats.bytes_by_op["all_gather_into_tensor"]
        dist.barrier(group=group)
        # absolute times (perf_counter is one clock for all processes of this machine)
        result["send_issued_at"] = time.perf_counter()
        recv = [torch.empty_like(x), torch.empty_like(x)]
        works = [exchange(group, send=x, dst=peer, recv=recv[i], src=peer, tag=i) for i in range(2)]
        works[0][1].wait()
        result["first_recv_at"] = time.perf_counter()
        works[1][1].wait()
        result["second_recv_at"] = time.perf_counter()
        for send, _ in works:
            send.wait()
        result["recv_ok"] = all(torch.equal(r, x) for r in recv)
        result["expected_one_s"] = spec.seconds(x.nbytes)
        result["blocked_s"] = link.stats.blocked_s
    result["restored"] = (layers.dist_all_gather_func, mappings.dist_reduce_scatter_func) == before
    return result


def mlp_bytes_stock_vs_ours(tp: int) -> dict:
    """Bytes per fwd+bwd step counted by the emulated link: equal for stock and the plugin,
    so no transfer of ours escapes the emulation."""
    import torch.nn.functional as F
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLP, MLPSubmodules

    from megatron_overlap.lab.emulated_link import EmulatedLink, LinkSpec
    from megatron_overlap.lab import tiny_gpt

    tiny_gpt.init_parallel(tp)
    config = tiny_gpt.transformer_config(tiny_gpt.TinyGPT(), tp, add_bias_linear=True,
                                         gated_linear_unit=False, activation_func=F.gelu)
    mlp = MLP(config, MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear))
    x = torch.randn(16, 2, 96, requires_grad=True)
    counted = {}
    for mode, flags in (("stock", []), ("ours", ["--overlap-tp", "p2p", "--overlap-tp-chunks", str(2 * tp)])):
        install(flags)
        with EmulatedLink(LinkSpec(bandwidth_GBps=1e4, latency_us=0.0)) as link:
            out, bias = mlp(x)
            (out + bias).sum().backward()
            counted[mode] = (link.stats.total_bytes, dict(link.stats.bytes_by_op))
    install([])
    return counted


_PAIR_GROUPS: dict = {}


def _pair_groups():
    """Two distinct groups over the same pairs (0,1) and (2,3): same ranks, separate channels."""
    if not _PAIR_GROUPS:
        for name in ("a", "b"):
            for start in (0, 2):
                group = dist.new_group([start, start + 1])
                if start <= dist.get_rank() < start + 2:
                    _PAIR_GROUPS[name] = group
    return _PAIR_GROUPS["a"], _PAIR_GROUPS["b"]


def link_paths(overlap_grad_reduce: bool) -> dict:
    """Megatron DDP's coalesced bucket all-reduces, torch's two names of each collective, and two
    groups with the same tags between the same ranks, all on the emulated link: bytes counted
    against bytes computed from the tensors themselves, times against bytes / bandwidth."""
    from megatron_overlap.comm.p2p import exchange
    from megatron_overlap.lab import tiny_gpt
    from megatron_overlap.lab.emulated_link import EmulatedLink, LinkSpec

    out = {}
    spec = tiny_gpt.TinyGPT()
    tiny_gpt.init_parallel(1)
    model = tiny_gpt.wrap_ddp(tiny_gpt.build(spec, 1), overlap_grad_reduce=overlap_grad_reduce)
    size = dist.get_world_size()
    buckets = [b.grad_data.nbytes for buf in model.buffers for b in buf.buckets]
    out["expected_ddp_bytes"] = sum(int(2 * (size - 1) / size * n) for n in buckets)
    out["buckets"] = len(buckets)
    link_spec = LinkSpec(bandwidth_GBps=0.01, latency_us=0.0)  # ~0.16 s for the grads: far above the compute
    with EmulatedLink(LinkSpec(bandwidth_GBps=1e6, latency_us=0.0)) as link:
        tiny_gpt.train_step(model, spec, 0)  # warm: the first step builds buffers and the autograd graph
        link.spec = link_spec
        link.reset()
        dist.barrier()
        t0 = time.perf_counter()
        tiny_gpt.train_step(model, spec, 1)
        out["step_s"] = time.perf_counter() - t0
        stats = link.reset()
        out["all_reduce_bytes"] = stats.bytes_by_op["all_reduce"]
        out["total_bytes"] = stats.total_bytes
        out["bytes_s"] = stats.total_bytes / (link_spec.bandwidth_GBps * 1e9)
        out["blocked_s"] = stats.blocked_s
        # both names of each collective, counted once per call
        x = torch.ones(1 << 16)
        gathered = torch.empty(size * x.numel())
        shard = torch.empty(x.numel() // size)
        for name in ("all_gather_into_tensor", "all_gather_single"):
            getattr(dist, name)(gathered, x)
        for name in ("reduce_scatter_tensor", "reduce_scatter_single"):
            getattr(dist, name)(shard, x)
        stats = link.reset()
        out["names"] = {k: (stats.calls_by_op[k], stats.bytes_by_op[k]) for k in stats.calls_by_op}
        out["expected_gather_bytes"] = 2 * (size - 1) * x.nbytes
        out["expected_scatter_bytes"] = 2 * (size - 1) * shard.nbytes
        # the same tag in two groups between the same ranks: B (small) sent first, A (large) second;
        # the receiver takes A first, which must wait for A's own deadline, not B's
        a, b = _pair_groups()
        peer = dist.get_rank(a) ^ 1
        small, large = torch.ones(1 << 10), torch.ones(1 << 18)  # 4 KiB, 1 MiB
        link.spec = LinkSpec(bandwidth_GBps=0.02, latency_us=0.0)
        dist.barrier()
        rb, rl = torch.empty_like(small), torch.empty_like(large)
        sb, wb = exchange(b, send=small, dst=peer, recv=rb, src=peer, tag=7)
        posted = time.perf_counter()  # the large send leaves after this (CLOCK_MONOTONIC: one clock for all ranks)
        sl, wl = exchange(a, send=large, dst=peer, recv=rl, src=peer, tag=7)
        wl.wait()
        done = time.perf_counter()
        wb.wait()
        sb.wait()
        sl.wait()
        # measured from the peer's posting of the large send, not from this rank's barrier exit
        # (the ranks leave the barrier a few ms apart, which made this check flaky)
        stamps = [torch.zeros(1, dtype=torch.float64) for _ in range(2)]
        dist.all_gather(stamps, torch.tensor([posted], dtype=torch.float64), group=a)
        out["large_recv_s"] = done - float(stamps[peer])
        out["large_s"] = link.spec.seconds(large.nbytes)
        out["recv_ok"] = bool(torch.equal(rb, small) and torch.equal(rl, large))
        # a free communicator (the emulated cluster's "DP free"): counted, not run, done at once;
        # plain, asynchronous and coalesced (both modes); the other group's collective runs
        link.spec = LinkSpec(bandwidth_GBps=1e-4, latency_us=0.0)  # 10 s per MiB: a run op would show
        link.free_channels = (link._channel(a),)
        mine = torch.full((1 << 18,), float(dist.get_rank() + 1))
        link.reset()
        t0 = time.perf_counter()
        dist.all_reduce(mine, group=a)
        dist.all_reduce(mine, group=a, async_op=True).wait()
        for async_ops in (False, True):
            with dist._coalescing_manager(group=a, async_ops=async_ops) as cm:
                dist.all_reduce(mine, group=a, async_op=async_ops)
                dist.reduce_scatter_tensor(mine[: mine.numel() // 2], mine, group=a, async_op=async_ops)
            if async_ops:
                cm.wait()
        out["free_s"] = time.perf_counter() - t0
        out["free_untouched"] = bool(torch.all(mine == dist.get_rank() + 1))
        stats = link.reset()
        out["free_counted"] = (stats.calls_by_op["all_reduce"], stats.calls_by_op["reduce_scatter_tensor"],
                               stats.total_bytes)
        out["free_expected_bytes"] = 4 * mine.nbytes + 2 * (mine.nbytes // 2)  # a ring over two ranks
        out["rank"] = dist.get_rank()
        link.spec = LinkSpec(bandwidth_GBps=1e6, latency_us=0.0)
        other = torch.full((4,), float(dist.get_rank() + 1))
        dist.all_reduce(other, group=b)
        out["other_reduced"] = other.tolist()
        link.free_channels = ()
    return out
