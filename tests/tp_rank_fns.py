"""Rank functions of the TP linears: the ring ops against stock collectives, Megatron's Column and
Row linears against stock under every flag combination and backend, the errors a layer raises at
its first run, and the sub-batch cut's refusals."""

from __future__ import annotations

import contextlib
import itertools

import torch
import torch.distributed as dist

from .rank_helpers import install, reference_symm_mem, rel, run_layer, tiny_layers, tp_group


def ring_ops_vs_reference(seed: int) -> list[dict]:
    """ag_gemm / gemm_rs against stock collectives + one GEMM, over every combination."""
    from megatron_overlap.comm.rings import split_pieces
    from megatron_overlap.tp.ag_gemm import ag_gemm, ag_gemm_reference
    from megatron_overlap.tp.gemm_rs import gemm_rs, gemm_rs_reference

    rank = dist.get_rank()
    rows = []
    for size in (2, 4):
        group = tp_group(size)
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
                             ag_rel=rel(y, y_ref), ag_equal=torch.equal(y, y_ref),
                             rs_rel=rel(z, z_ref), rs_equal=torch.equal(z, z_ref)))
    return rows


def layer_parity(tp: int, fusion: bool, seed: int, dtype=torch.float32) -> list[dict]:
    """Stock Megatron Column/Row linears vs the patched ones, every flag combination."""
    from megatron_overlap.lab import tiny_gpt

    tiny_gpt.init_parallel(tp, seed=seed)
    config, layers = tiny_layers(tp, fusion, dtype=dtype)
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
        install([])
        stock = run_layer(layer, x, dy, fusion)
        for rs, bidir, mult in itertools.product(("ring", "a2a"), (False, True), (1, 2)):
            flags = ["--overlap-tp", "p2p", "--overlap-tp-rs", rs, "--overlap-tp-chunks", str(mult * tp)]
            if bidir:
                flags.append("--overlap-tp-bidirectional")
            install(flags)
            ours = run_layer(layer, x, dy, fusion)
            for key in stock:
                rows.append(dict(layer=name, rs=rs, bidir=bidir, chunks=mult * tp, tensor=key,
                                 rel=rel(ours[key], stock[key]), equal=torch.equal(ours[key], stock[key])))
    install([])
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
    _config, layers = tiny_layers(tp, fusion=False)
    ops_linear.ColumnParallelSP.forward = count("column", originals[0])
    ops_linear.RowParallelSP.forward = count("row", originals[1])
    try:
        install(["--overlap-tp", "p2p"])
        s, b = 13, 3
        layers["fc1(column)"](torch.randn(s, b, 96))
        layers["fc2(row)"](torch.randn(s * tp, b, layers["fc2(row)"].input_size_per_partition))
        install([])
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
        install(flags)
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
    install([])
    s, o = results["stock"], results["ours"]
    return dict(out_rel=rel(o["out"], s["out"]), dgrad_rel=rel(o["dgrad"], s["dgrad"]),
                buffered=(s["buffered"], o["buffered"]),
                buffered_rel=rel(o["buffered_grad"], s["buffered_grad"]),
                main_grad_norm=(s["main_grad_norm"], o["main_grad_norm"]),
                added=(s["added"], o["added"]))


def programmatic_install_checks_at_first_run(tp: int, chunks: int) -> str:
    """Install from a namespace holding only our flags; the TP-size check fires when a
    patched layer first runs."""
    from megatron_overlap.lab import tiny_gpt

    tiny_gpt.init_parallel(tp)
    _config, layers = tiny_layers(tp, fusion=False)
    install(["--overlap-tp", "p2p", "--overlap-tp-chunks", str(chunks)])
    try:
        layers["fc1(column)"](torch.randn(13, 3, 96))
    except Exception as exc:  # the message is what the test checks
        return f"{type(exc).__name__}: {exc}"
    finally:
        install([])
    return "no error"


def sp_off_error(tp: int, flags: list[str] = ("--overlap-tp", "fused")) -> str:
    """The error a Column layer without sequence parallelism raises at its first run under
    ``flags`` (a programmatic install: the model settings are learnt there)."""
    from megatron_overlap.lab import tiny_gpt

    tiny_gpt.init_parallel(tp)
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    config = tiny_gpt.transformer_config(tiny_gpt.TinyGPT(), tp, sequence_parallel=False)
    layer = ColumnParallelLinear(96, 200, config=config, init_method=torch.nn.init.normal_, bias=True)
    install(list(flags))
    try:
        layer(torch.randn(8, 2, 96))
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    finally:
        install([])
    return "no error"


def backend_layer_parity(tp: int, backend: str, seed: int) -> list[dict]:
    """Stock Megatron Column/Row linears vs the given backend (fused: Triton interpreter;
    symm-mem: its composition with the reference ops, put back after)."""
    with reference_symm_mem() if backend == "symm-mem" else contextlib.nullcontext():
        return _backend_layer_parity(tp, backend, seed)


def _backend_layer_parity(tp: int, backend: str, seed: int) -> list[dict]:
    from megatron_overlap.lab import tiny_gpt

    tiny_gpt.init_parallel(tp, seed=seed)
    _config, layers = tiny_layers(tp, fusion=False)
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
        install([])
        stock = run_layer(layer, x, dy, False)
        for flags in variants:
            install(flags)
            ours = run_layer(layer, x, dy, False)
            for key in stock:
                rows.append(dict(layer=name, flags=" ".join(flags), tensor=key, rel=rel(ours[key], stock[key])))
    install([])
    return rows


def first_run_error(tp: int, flags: list[str], dtype=torch.float32) -> str:
    """The error a layer raises at its first run under ``flags`` (or 'no error')."""
    from megatron_overlap.lab import tiny_gpt

    tiny_gpt.init_parallel(tp)
    _config, layers = tiny_layers(tp, fusion=False, dtype=dtype)
    install(flags)
    try:
        layers["fc1(column)"](torch.randn(13, 3, 96, dtype=dtype))
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    finally:
        install([])
    return "no error"


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
        install(["--overlap-tp", "p2p"] + flags)
        try:
            mlp(x)
            out[key] = "no error"
        except Exception as exc:
            out[key] = f"{type(exc).__name__}: {exc}"
        finally:
            install([])
    few = torch.randn(3, 2, spec.hidden)
    with torch.no_grad():
        stock = mlp(few)[0]
        install(["--overlap-tp", "p2p", "--overlap-tp-sub-batches", "4"])
        try:
            ours = mlp(few)[0]
            out["no_grad_calls"] = find_installation().calls["tp.sub_batches"]
        finally:
            install([])
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
    install(["--overlap-tp", "p2p", "--overlap-tp-sub-batches", "2"])
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
        install([])
