"""Functions the tests run on every rank of the pool (they must be importable by name)."""

from __future__ import annotations

import itertools
import time

import torch
import torch.distributed as dist


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    denom = b.double().norm().item()
    diff = (a.double() - b.double()).norm().item()
    return diff / denom if denom else diff


_GROUPS: dict = {}


def _tp_group(size: int):
    """A TP-like subgroup of ``size`` consecutive ranks containing this rank (all ranks call
    new_group for every group, as torch requires)."""
    if size in _GROUPS:  # created once per process: gloo groups are never freed
        return _GROUPS[size]
    world, rank = dist.get_world_size(), dist.get_rank()
    mine = None
    for start in range(0, world, size):
        group = dist.new_group(list(range(start, start + size)))
        if start <= rank < start + size:
            mine = group
    _GROUPS[size] = mine
    return mine


def _install(flags: list[str]):
    import megatron_overlap

    megatron_overlap.uninstall()
    if flags:
        megatron_overlap.install(megatron_overlap.overlap_parser().parse_args(flags))


# --------------------------------------------------------------------------- raw ops
def ring_ops_vs_reference(seed: int) -> list[dict]:
    """ag_gemm / gemm_rs against stock collectives + one GEMM, over every combination."""
    from megatron_overlap.comm.rings import split_pieces
    from megatron_overlap.tp.ag_gemm import ag_gemm, ag_gemm_reference
    from megatron_overlap.tp.gemm_rs import gemm_rs, gemm_rs_reference

    rank = dist.get_rank()
    rows = []
    for size in (2, 4):
        group = _tp_group(size)
        gen = torch.Generator().manual_seed(seed * 1000 + rank)
        for chunks, bidir, algo in itertools.product((1, 2, 3, 5), (False, True), ("ring", "a2a")):
            s, b, k, n = 13, 3, 96, 50  # odd on purpose: 13 rows never split evenly
            pieces = split_pieces(s, chunks, bidir)
            x = torch.randn(s, b, k, generator=gen)
            w = torch.randn(n, k, generator=gen)
            bias = torch.randn(n, generator=gen)
            y, y_ref = ag_gemm(x, w, group, pieces, bias), ag_gemm_reference(x, w, group, bias)
            xf = torch.randn(s * size, b, k, generator=gen)
            z, z_ref = gemm_rs(xf, w, group, pieces, algo), gemm_rs_reference(xf, w, group)
            rows.append(dict(size=size, chunks=chunks, bidir=bidir, algo=algo,
                             ag_rel=_rel(y, y_ref), ag_equal=torch.equal(y, y_ref),
                             rs_rel=_rel(z, z_ref), rs_equal=torch.equal(z, z_ref)))
    return rows


# --------------------------------------------------------------------------- Megatron layers
def _layers(tp: int, fusion: bool, defer: bool = False, dtype=torch.float32):
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    from megatron_overlap.lab import tiny_gpt

    spec = tiny_gpt.TinyGPT(hidden=96, ffn=200, heads=8, kv_heads=2)
    overrides = dict(add_bias_linear=True, gradient_accumulation_fusion=fusion, params_dtype=dtype,
                     bf16=dtype == torch.bfloat16)
    if defer:
        overrides.update(defer_embedding_wgrad_compute=True, wgrad_deferral_limit=0)
    config = tiny_gpt.transformer_config(spec, tp, **overrides)
    init = torch.nn.init.normal_
    head_dim = spec.hidden // spec.heads
    qkv_out = spec.hidden + 2 * spec.kv_heads * head_dim  # GQA: 8 query heads, 2 KV groups
    layers = {
        "qkv(column,gqa)": ColumnParallelLinear(spec.hidden, qkv_out, config=config, init_method=init, bias=True),
        "fc1(column)": ColumnParallelLinear(spec.hidden, spec.ffn, config=config, init_method=init, bias=True),
        "fc2(row)": RowParallelLinear(spec.ffn, spec.hidden, config=config, init_method=init, bias=True,
                                      input_is_parallel=True, skip_bias_add=False),
    }
    return config, layers


def _run_layer(layer, x, dy, fusion: bool):
    """fwd+bwd of one layer; returns output and grads (main_grad under fusion, fp32 as DDP's)."""
    x = x.clone().requires_grad_()
    for p in layer.parameters():
        p.grad = None
        if fusion:
            p.main_grad = torch.zeros_like(p, dtype=torch.float32)
            p.grad_added_to_main_grad = False
    out, _ = layer(x)
    out.backward(dy)
    grads = {"output": out.detach().clone(), "input.grad": x.grad.clone()}
    for name, p in layer.named_parameters():
        if fusion and name == "weight":
            grads["weight.main_grad"] = p.main_grad.clone()
            grads["weight.grad_added_to_main_grad"] = torch.tensor(float(p.grad_added_to_main_grad))
        else:
            grads[f"{name}.grad"] = p.grad.clone()
    return grads


def layer_parity(tp: int, fusion: bool, seed: int, dtype=torch.float32) -> list[dict]:
    """Stock Megatron Column/Row linears vs the patched ones, every flag combination."""
    from megatron_overlap.lab import tiny_gpt

    tiny_gpt.init_parallel(tp, seed=seed)
    config, layers = _layers(tp, fusion, dtype=dtype)
    gen = torch.Generator().manual_seed(seed * 7 + dist.get_rank())
    s, b = 13, 3  # rows per rank: odd, so chunks of 2*TP are uneven
    rows = []
    for name, layer in layers.items():
        column = "column" in name
        in_rows = s if column else s * tp
        in_dim = layer.input_size_per_partition if not column else layer.input_size
        x = torch.randn(in_rows, b, in_dim, generator=gen).to(dtype)
        out_rows = s * tp if column else s
        out_dim = layer.output_size_per_partition if column else layer.output_size
        dy = torch.randn(out_rows, b, out_dim, generator=gen).to(dtype)
        _install([])
        stock = _run_layer(layer, x, dy, fusion)
        for rs, bidir, mult in itertools.product(("ring", "a2a"), (False, True), (1, 2)):
            flags = ["--overlap-tp", "p2p", "--overlap-tp-rs", rs, "--overlap-tp-chunks", str(mult * tp)]
            if bidir:
                flags.append("--overlap-tp-bidirectional")
            _install(flags)
            ours = _run_layer(layer, x, dy, fusion)
            for key in stock:
                rows.append(dict(layer=name, rs=rs, bidir=bidir, chunks=mult * tp, tensor=key,
                                 rel=_rel(ours[key], stock[key]), equal=torch.equal(ours[key], stock[key])))
    _install([])
    return rows


def patched_path_taken(tp: int) -> dict:
    """Counts calls into the overlapped autograd functions while a layer runs."""
    from megatron_overlap.tp import linear as ops_linear

    calls = {"column": 0, "row": 0}
    originals = (ops_linear.ColumnParallelSP.forward, ops_linear.RowParallelSP.forward)

    def count(kind, fn):
        def wrapped(*args, **kwargs):
            calls[kind] += 1
            return fn(*args, **kwargs)

        return staticmethod(wrapped)

    from megatron_overlap.lab import tiny_gpt

    tiny_gpt.init_parallel(tp)
    _config, layers = _layers(tp, fusion=False)
    ops_linear.ColumnParallelSP.forward = count("column", originals[0])
    ops_linear.RowParallelSP.forward = count("row", originals[1])
    try:
        _install(["--overlap-tp", "p2p"])
        s, b = 13, 3
        layers["fc1(column)"](torch.randn(s, b, 96))
        layers["fc2(row)"](torch.randn(s * tp, b, layers["fc2(row)"].input_size_per_partition))
        _install([])
        layers["fc1(column)"](torch.randn(s, b, 96))
    finally:
        ops_linear.ColumnParallelSP.forward = staticmethod(originals[0])
        ops_linear.RowParallelSP.forward = staticmethod(originals[1])
    return calls


def deferred_wgrad_parity(tp: int) -> dict:
    """Megatron's defer_embedding_wgrad_compute path (output layer): grad_output is buffered,
    main_grad untouched, dgrad equal to stock."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    from megatron_overlap.lab import tiny_gpt

    tiny_gpt.init_parallel(tp)
    spec = tiny_gpt.TinyGPT()
    config = tiny_gpt.transformer_config(spec, tp, gradient_accumulation_fusion=True)
    # Megatron only allows the deferral with pipeline parallelism (the last stage's output
    # layer); the layer itself just reads these two fields.
    config.defer_embedding_wgrad_compute = True
    config.wgrad_deferral_limit = 0
    results = {}
    gen = torch.Generator().manual_seed(11 + dist.get_rank())
    x = torch.randn(13, 2, spec.hidden, generator=gen)
    dy = torch.randn(13 * tp, 2, spec.vocab // tp, generator=gen)
    for mode, flags in (("stock", []), ("ours", ["--overlap-tp", "p2p"])):
        _install(flags)
        activations, grads = [], []
        layer = ColumnParallelLinear(
            spec.hidden, spec.vocab, config=config, init_method=torch.nn.init.normal_, bias=False,
            embedding_activation_buffer=activations, grad_output_buffer=grads,
        )
        torch.manual_seed(5)
        torch.nn.init.normal_(layer.weight)
        layer.weight.main_grad = torch.zeros_like(layer.weight)
        layer.weight.grad_added_to_main_grad = False
        xi = x.clone().requires_grad_()
        out, _ = layer(xi)
        out.backward(dy)
        results[mode] = dict(out=out.detach(), dgrad=xi.grad, buffered=len(grads),
                             buffered_grad=grads[0].clone() if grads else None,
                             main_grad_norm=layer.weight.main_grad.norm().item(),
                             added=bool(layer.weight.grad_added_to_main_grad))
    _install([])
    s, o = results["stock"], results["ours"]
    return dict(out_rel=_rel(o["out"], s["out"]), dgrad_rel=_rel(o["dgrad"], s["dgrad"]),
                buffered=(s["buffered"], o["buffered"]),
                buffered_rel=_rel(o["buffered_grad"], s["buffered_grad"]),
                main_grad_norm=(s["main_grad_norm"], o["main_grad_norm"]),
                added=(s["added"], o["added"]))


# --------------------------------------------------------------------------- tiny GPT
def gpt_losses(tp: int, steps: int, flags: list[str], overlap_grad_reduce: bool) -> list[float]:
    from megatron_overlap.lab import tiny_gpt

    _install(flags)
    try:
        return tiny_gpt.train(tiny_gpt.TinyGPT(), tp=tp, steps=steps, overlap_grad_reduce=overlap_grad_reduce)
    finally:
        _install([])


# --------------------------------------------------------------------------- emulated link
def link_timing() -> dict:
    """Transfers on the emulated link take latency + bytes/bandwidth, queue on the egress
    port, and Megatron's import-time bindings are rebound while it is installed."""
    from megatron.core.tensor_parallel import layers, mappings

    from megatron_overlap.lab.emulated_link import EmulatedLink, LinkSpec
    from megatron_overlap.comm.p2p import exchange

    group = _tp_group(2)
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
        _install(flags)
        with EmulatedLink(LinkSpec(bandwidth_GBps=1e4, latency_us=0.0)) as link:
            out, bias = mlp(x)
            (out + bias).sum().backward()
            counted[mode] = (link.stats.total_bytes, dict(link.stats.bytes_by_op))
    _install([])
    return counted


# --------------------------------------------------------------------------- install
def programmatic_install_checks_at_first_run(tp: int, chunks: int) -> str:
    """Install from a namespace holding only our flags; the TP-size check fires when a
    patched layer first runs."""
    from megatron_overlap.lab import tiny_gpt

    tiny_gpt.init_parallel(tp)
    _config, layers = _layers(tp, fusion=False)
    _install(["--overlap-tp", "p2p", "--overlap-tp-chunks", str(chunks)])
    try:
        layers["fc1(column)"](torch.randn(13, 3, 96))
    except Exception as exc:  # the message is what the test checks
        return f"{type(exc).__name__}: {exc}"
    finally:
        _install([])
    return "no error"


def sp_off_error(tp: int, flags: list[str] = ("--overlap-tp", "fused")) -> str:
    """The error a Column layer without sequence parallelism raises at its first run under
    ``flags`` (a programmatic install: the model settings are learnt there)."""
    from megatron_overlap.lab import tiny_gpt

    tiny_gpt.init_parallel(tp)
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    config = tiny_gpt.transformer_config(tiny_gpt.TinyGPT(), tp, sequence_parallel=False)
    layer = ColumnParallelLinear(96, 200, config=config, init_method=torch.nn.init.normal_, bias=True)
    _install(list(flags))
    try:
        layer(torch.randn(8, 2, 96))
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    finally:
        _install([])
    return "no error"


# --------------------------------------------------------------------------- other backends
def _use_reference_symm_mem():
    """Run the symm-mem backend's composition on CPU: PyTorch's fused ops have no CPU kernels,
    so the same two ops are computed with stock collectives (ReferenceSymmMemOps)."""
    from megatron_overlap.tp.backends import symm_mem

    symm_mem.availability = lambda *a, **k: (True, "reference ops (test)")
    symm_mem.TorchSymmMemOps = symm_mem.ReferenceSymmMemOps


def backend_layer_parity(tp: int, backend: str, seed: int) -> list[dict]:
    """Stock Megatron Column/Row linears vs the given backend (fused: Triton interpreter)."""
    from megatron_overlap.lab import tiny_gpt

    if backend == "symm-mem":
        _use_reference_symm_mem()
    tiny_gpt.init_parallel(tp, seed=seed)
    _config, layers = _layers(tp, fusion=False)
    gen = torch.Generator().manual_seed(seed * 7 + dist.get_rank())
    s, b = 13, 3
    variants = [["--overlap-tp", backend]]
    if backend == "fused":
        variants += [["--overlap-tp", "fused", "--overlap-tp-chunks", str(2 * tp), "--overlap-tp-bidirectional"]]
    rows = []
    for name, layer in layers.items():
        column = "column" in name
        x = torch.randn(s if column else s * tp, b,
                        layer.input_size if column else layer.input_size_per_partition, generator=gen)
        dy = torch.randn(s * tp if column else s, b,
                         layer.output_size_per_partition if column else layer.output_size, generator=gen)
        _install([])
        stock = _run_layer(layer, x, dy, False)
        for flags in variants:
            _install(flags)
            ours = _run_layer(layer, x, dy, False)
            for key in stock:
                rows.append(dict(layer=name, flags=" ".join(flags), tensor=key, rel=_rel(ours[key], stock[key])))
    _install([])
    return rows


def first_run_error(tp: int, flags: list[str], dtype=torch.float32) -> str:
    """The error a layer raises at its first run under ``flags`` (or 'no error')."""
    from megatron_overlap.lab import tiny_gpt

    tiny_gpt.init_parallel(tp)
    _config, layers = _layers(tp, fusion=False, dtype=dtype)
    _install(flags)
    try:
        layers["fc1(column)"](torch.randn(13, 3, 96, dtype=dtype))
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    finally:
        _install([])
    return "no error"


def tuning_agreement(directory: str) -> dict:
    """Deliberately different per-rank timings: every rank must pick the same config (the one
    whose slowest rank is fastest), and a second start must reuse the cache."""
    from megatron_overlap.kernels.ag_gemm import TileConfig
    from megatron_overlap.kernels.tuning import ConfigChooser
    from megatron_overlap.tune.cache import DiskCache

    rank = dist.get_rank()
    candidates = [TileConfig(16, 16, 16), TileConfig(32, 32, 16), TileConfig(64, 64, 32)]
    # rank r finds candidate r % 3 fastest on its own; the max over ranks makes candidate 1 best
    own = {0: [1.0, 3.0, 9.0], 1: [9.0, 3.0, 1.0], 2: [5.0, 4.0, 6.0], 3: [2.0, 3.5, 8.0]}[rank]
    calls = []

    def timer(kind, config, m, n, k, dtype, device):
        calls.append(config.key())
        return own[candidates.index(config)]

    cache = DiskCache("tile_configs", directory=f"{directory}/rank{rank}")
    from megatron_overlap.comm.agree import GroupAgreement

    world = dict(world=dist.get_world_size(), agree=GroupAgreement(dist.group.WORLD))
    first = ConfigChooser(candidates, cache=cache, timer=timer).choose("ag_gemm", 64, 48, 32, torch.float32, **world)
    measured_first = len(calls)

    def must_not_run(*a):
        raise AssertionError("measured although cached")

    second = ConfigChooser(candidates, cache=cache, timer=must_not_run).choose("ag_gemm", 64, 48, 32,
                                                                               torch.float32, **world)
    return {"first": first.key(), "second": second.key(), "measured_first": measured_first}


# --------------------------------------------------------------------------- plan autotuner
def plan_tuner_agreement(directory: str) -> dict:
    """Deliberately different per-rank timings on a TP=4 group: one pick on every rank (the
    candidate whose slowest rank is fastest), and the next start reuses the cache."""
    from megatron_overlap.tp.autotune import PlanChoice, PlanTuner, candidates
    from megatron_overlap.tp.backends.p2p import P2PBackend
    from megatron_overlap.tune.cache import DiskCache

    group = _tp_group(4)
    rank = dist.get_rank()
    cands = [c.key() for c in candidates(4, 13, 3)]
    # each rank's own favourite differs (rank r finds candidate -r fastest); over the 4 ranks
    # every other candidate has a slow rank (>= 13), so cands[3] (10.5 everywhere) must win
    table = {c: 10.0 + ((i + rank) % len(cands)) for i, c in enumerate(cands)}
    table[cands[3]] = 10.5
    calls = []

    def measure(choice, *a):
        calls.append(choice.key())
        return table[choice.key()]

    cache = DiskCache("tp_plans", directory=f"{directory}/rank{rank}")
    x, w = torch.randn(13, 3, 96), torch.randn(50, 96)
    first = PlanTuner(True, cache=cache, measure=measure).choose("column", x, w, group, 13, P2PBackend(), None)

    def must_not_run(*a):
        raise AssertionError("measured although cached")

    second = PlanTuner(True, cache=cache, measure=must_not_run).choose("column", x, w, group, 13, P2PBackend(), None)
    return {"first": first.key(), "second": second.key(), "measured": len(calls), "expected": cands[3],
            "candidates": len(cands)}


def autotuned_layers_match_stock(tp: int, flags: list[str], cache_dir: str) -> dict:
    """Real measurements (--overlap-tp-autotune) or a plan file: results still equal stock's, the
    cache holds one entry per linear shape."""
    import glob
    import json
    import os

    from megatron_overlap.lab import tiny_gpt

    os.environ["MEGATRON_OVERLAP_CACHE"] = f"{cache_dir}/rank{dist.get_rank()}"
    tiny_gpt.init_parallel(tp)
    _config, layers = _layers(tp, fusion=False)
    gen = torch.Generator().manual_seed(3 + dist.get_rank())
    worst = 0.0
    for name in ("fc1(column)", "fc2(row)"):
        layer = layers[name]
        column = "column" in name
        x = torch.randn(13 if column else 13 * tp, 3, 96 if column else layer.input_size_per_partition, generator=gen)
        dy = torch.randn(13 * tp if column else 13, 3, layer.output_size_per_partition if column else 96, generator=gen)
        _install([])
        stock = _run_layer(layer, x, dy, False)
        _install(flags)
        ours = _run_layer(layer, x, dy, False)
        worst = max(worst, max(_rel(ours[k], stock[k]) for k in stock))
    from megatron_overlap.integration.install import find_installation

    tuned = list(find_installation().tp.plans().values())
    pieces = sorted({len(p.pieces) for p in tuned})
    _install([])
    entries = 0
    for path in glob.glob(f"{cache_dir}/rank{dist.get_rank()}/tp_plans.json"):
        entries = len(json.load(open(path)))
    return {"worst": worst, "entries": entries, "pieces": pieces}


# --------------------------------------------------------------------------- emulated link: every path
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


def gpt_losses_fused_wgrad(tp: int, steps: int, flags: list[str], overlap_grad_reduce: bool) -> dict:
    """The tiny GPT with gradient-accumulation fusion (Megatron's default where apex exists):
    the plugin keeps wgrad GEMMs back to fill its waits; losses and the store's counters."""
    from megatron_overlap.integration.install import find_installation
    from megatron_overlap.lab import tiny_gpt

    _install(flags)
    try:
        inst = find_installation()
        losses = tiny_gpt.train(tiny_gpt.TinyGPT(), tp=tp, steps=steps, overlap_grad_reduce=overlap_grad_reduce,
                                gradient_accumulation_fusion=True)
        store = inst.wgrad if inst is not None else None
        if store is None:
            return {"losses": losses, "ran": 0, "left": 0}
        return {"losses": losses, "ran": store.ran, "left": len(store)}
    finally:
        _install([])


def gpt_losses_with_dropout(tp: int, steps: int, flags: list[str], cache_dir: str) -> dict:
    """The tiny GPT with dropout on (hidden and attention), from the same seed, under
    ``flags``; the autotune cache in ``cache_dir`` (fresh when it does not exist yet). The
    losses, and how many shapes the autotuner measured (0 without it)."""
    import os

    from megatron_overlap.lab import tiny_gpt

    os.environ["MEGATRON_OVERLAP_CACHE"] = f"{cache_dir}/rank{dist.get_rank()}"
    torch.manual_seed(1234)  # dropout draws from the default generator: same start for every run
    _install(flags)
    try:
        losses = tiny_gpt.train(tiny_gpt.TinyGPT(), tp=tp, steps=steps, hidden_dropout=0.1, attention_dropout=0.1)
        import glob
        import json

        entries = 0
        for path in glob.glob(f"{cache_dir}/rank{dist.get_rank()}/tp_plans.json"):
            entries = len(json.load(open(path)))
        return {"losses": losses, "entries": entries}
    finally:
        _install([])
        os.environ.pop("MEGATRON_OVERLAP_CACHE", None)


def stock_spec_losses(tp: int, flags: list[str], steps: int, lab_norm: bool = False) -> dict:
    """The tiny GPT built from Megatron's own local spec (its norms ``WrappedTorchNorm``, as
    without apex; ``lab_norm``: the lab's SP norm shim instead), sequence parallel at TP > 1,
    under ``flags``, trained with Megatron's ``finalize_model_grads`` (which sums the gradients
    of ``sequence_parallel`` parameters over TP); the losses, or the error the build raised,
    and whether every norm parameter is marked ``sequence_parallel``."""
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    from megatron_overlap.lab import tiny_gpt

    spec = tiny_gpt.TinyGPT()
    tiny_gpt.init_parallel(tp)
    _install(flags)
    try:
        layer = get_gpt_layer_local_spec(normalization=spec.normalization)
        block = TransformerBlockSubmodules(layer_specs=[layer] * spec.num_layers, layer_norm=WrappedTorchNorm)
        try:
            if lab_norm:
                model = tiny_gpt.build(spec, tp)
            else:
                model = GPTModel(config=tiny_gpt.transformer_config(spec, tp, True), transformer_layer_spec=block,
                                 vocab_size=spec.vocab, max_sequence_length=spec.seq, position_embedding_type="rope",
                                 share_embeddings_and_output_weights=False)
        except AssertionError as exc:
            return {"error": str(exc)}
        norms = [p for n, p in model.named_parameters() if "norm" in n]
        marked = bool(norms) and all(getattr(p, "sequence_parallel", False) for p in norms)
        ddp = tiny_gpt.wrap_ddp(model, False)
        losses = []
        for step in range(steps):
            tokens, labels, position_ids, mask = tiny_gpt.batch(spec, step)
            ddp.zero_grad_buffer()
            loss = ddp(tokens, position_ids, mask, labels=labels).float().mean()
            loss.backward()
            finalize_model_grads([ddp])
            with torch.no_grad():
                for param in ddp.module.parameters():
                    param.add_(param.main_grad, alpha=-1e-1)
            reported = loss.detach().clone()
            dist.all_reduce(reported)
            losses.append(reported.item() / dist.get_world_size())
        return {"losses": losses, "marked": marked, "norms": len(norms)}
    finally:
        _install([])


def gpt_losses_and_grads(tp: int, steps: int, flags: list[str], overlap_grad_reduce: bool,
                         **config_overrides) -> dict:
    """The tiny GPT trained ``steps`` steps: the losses, every parameter's gradient of the first
    step (``main_grad``, after Megatron's finalize) and how often each patched path ran."""
    from megatron_overlap.integration.install import find_installation
    from megatron_overlap.lab import tiny_gpt

    _install(flags)
    grads = {}
    try:
        inst = find_installation()
        holder = {}

        def on_step(step, _loss):
            if step == 0:
                for name, p in holder["model"].named_parameters():
                    grads[name] = p.main_grad.detach().clone()

        original_wrap = tiny_gpt.wrap_ddp

        def wrap(model, *args, **kwargs):
            holder["model"] = wrapped = original_wrap(model, *args, **kwargs)
            return wrapped

        tiny_gpt.wrap_ddp = wrap
        try:
            losses = tiny_gpt.train(tiny_gpt.TinyGPT(), tp=tp, steps=steps, overlap_grad_reduce=overlap_grad_reduce,
                                    on_step=on_step, **config_overrides)
        finally:
            tiny_gpt.wrap_ddp = original_wrap
        calls = dict(inst.calls) if inst is not None else {}
        return {"losses": losses, "grads": grads, "calls": calls}
    finally:
        _install([])


def sub_batch_row_errors(tp: int) -> dict:
    """A Megatron MLP (SwiGLU, SP) under ``--overlap-tp-sub-batches``: the error for more
    sub-batches than rows, the one for sub-batches too small for the chunks, and a no-grad call
    with too few rows (it runs whole: output equal to stock's, the sub-batch path not taken)."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLP, MLPSubmodules

    from megatron_overlap.integration.install import find_installation
    from megatron_overlap.lab import tiny_gpt

    tiny_gpt.init_parallel(tp)
    spec = tiny_gpt.TinyGPT()
    config = tiny_gpt.transformer_config(spec, tp)
    mlp = MLP(config, MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear))
    x = torch.randn(32, 2, spec.hidden, requires_grad=True)  # 32 rows per rank
    out = {}
    for key, flags in (("too_many", ["--overlap-tp-sub-batches", "40"]),
                       ("chunks", ["--overlap-tp-sub-batches", "5", "--overlap-tp-chunks", "16"])):
        _install(["--overlap-tp", "p2p"] + flags)
        try:
            mlp(x)
            out[key] = "no error"
        except Exception as exc:
            out[key] = f"{type(exc).__name__}: {exc}"
        finally:
            _install([])
    few = torch.randn(3, 2, spec.hidden)
    with torch.no_grad():
        stock = mlp(few)[0]
        _install(["--overlap-tp", "p2p", "--overlap-tp-sub-batches", "4"])
        try:
            ours = mlp(few)[0]
            out["no_grad_calls"] = find_installation().calls["tp.sub_batches"]
        finally:
            _install([])
    out["no_grad_equal"] = bool(torch.equal(ours, stock))
    return out


def sub_batch_whole_reasons(tp: int) -> dict:
    """Why a block of the tiny GPT runs whole under ``--overlap-tp-sub-batches 2``, for each
    setting the cut cannot honour (set on the built modules one at a time)."""
    from megatron_overlap.integration.install import find_installation
    from megatron_overlap.integration.sub_batches import _attention_stock_reason, _stock_reason
    from megatron_overlap.lab import tiny_gpt

    tiny_gpt.init_parallel(tp)
    layer = tiny_gpt.build(tiny_gpt.TinyGPT(), tp).decoder.layers[0]
    attention, mlp = layer.self_attention, layer.mlp
    softmax = attention.core_attention.scale_mask_softmax
    _install(["--overlap-tp", "p2p", "--overlap-tp-sub-batches", "2"])
    try:
        inst = find_installation()
        out = {"plain": (_attention_stock_reason(inst, attention, {}), _stock_reason(mlp, (), {}))}
        softmax.window_size = (8, 0)
        out["window"] = _attention_stock_reason(inst, attention, {})
        softmax.window_size = None
        softmax.scaled_masked_softmax_fusion, softmax.input_in_float16 = True, True
        out["fused"] = _attention_stock_reason(inst, attention, {})
        softmax.scaled_masked_softmax_fusion, softmax.input_in_float16 = False, False
        attention.linear_proj.weight.requires_grad_(False)
        out["frozen"] = _attention_stock_reason(inst, attention, {})
        attention.linear_proj.weight.requires_grad_(True)
        out["inference"] = _attention_stock_reason(inst, attention, {"inference_context": object()})
        mlp.linear_fc1.weight.__fsdp_param__ = True
        out["fsdp"] = _stock_reason(mlp, (), {})
        del mlp.linear_fc1.weight.__fsdp_param__
        return out
    finally:
        _install([])

