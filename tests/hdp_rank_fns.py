"""HDP runtime functions the tests run on every rank of the pool (module-level, so the pool can
import them by name). Every rank draws the whole global batch from one seed, keeps its own share
as "what its data iterator loaded", and computes the single-process reference itself."""

from __future__ import annotations

import functools
import itertools
import traceback

import torch
import torch.distributed as dist

# Per rank, the lengths of the samples it loads. C = 32 on 4 ranks: 70 -> a ring of 3 ranks,
# 61 and 40 -> rings of 2, the rest held whole and packed; rank 3 loads one short sample only.
LENGTHS = ((70, 9, 17), (40, 5), (30, 23, 61, 12), (3,))
CAPACITY = 32
VOCAB = 512


def _install(capacity: int):
    """Install --overlap-hdp; returns the installation (its config builds the runtime)."""
    import megatron_overlap

    megatron_overlap.uninstall()
    return megatron_overlap.install(megatron_overlap.overlap_parser().parse_args(
        ["--overlap-hdp", "--overlap-hdp-max-tokens-per-rank", str(capacity)]))


def _uninstall():
    import megatron_overlap

    megatron_overlap.uninstall()


def global_samples(seed: int, lengths=LENGTHS):
    """Every rank's samples (lists per rank), the same on every rank: random tokens and labels,
    about one token in eight masked out of the loss."""
    from megatron_overlap.hdp.samples import Sample

    gen = torch.Generator().manual_seed(seed)
    out = []
    for lens in lengths:
        mine = []
        for L in lens:
            tokens = torch.randint(0, VOCAB, (L,), generator=gen)
            labels = torch.randint(0, VOCAB, (L,), generator=gen)
            mask = (torch.rand(L, generator=gen) > 0.125).float()
            mine.append(Sample(tokens, labels, mask))
        out.append(mine)
    return out


def build_model(position: str, seq: int, tp: int = 1):
    """The tiny GPT of ``testing.tiny_gpt`` (local spec, fp32; TP ``tp``, with sequence parallelism
    when > 1) with a choice of position embedding (tiny_gpt.build fixes rope)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    from megatron_overlap.lab.tiny_gpt import TinyGPT, _SPNorm, transformer_config

    spec = TinyGPT(seq=seq, vocab=VOCAB)
    config = transformer_config(spec, tp, sequence_parallel=tp > 1)
    layer = get_gpt_layer_local_spec(normalization=spec.normalization)
    layer.submodules.input_layernorm = _SPNorm
    layer.submodules.pre_mlp_layernorm = _SPNorm
    block = TransformerBlockSubmodules(layer_specs=[layer] * spec.num_layers, layer_norm=_SPNorm)
    return GPTModel(config=config, transformer_layer_spec=block, vocab_size=spec.vocab, max_sequence_length=spec.seq,
                    position_embedding_type=position, share_embeddings_and_output_weights=False)


def _grads(model) -> dict:
    return {n: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)) for n, p in model.named_parameters()}


def _zero(model):
    for p in model.parameters():
        p.grad = None


def _rel(a: dict, b: dict) -> dict:
    return {n: ((a[n].double() - b[n].double()).norm() / b[n].double().norm().clamp_min(1e-30)).item() for n in b}


def _total_rel(a: dict, b: dict) -> float:
    num = sum(((a[n].double() - b[n].double()) ** 2).sum() for n in b)
    den = sum((b[n].double() ** 2).sum() for n in b)
    return float((num / den).sqrt())


def reference(model, samples, multiple: int = 1) -> float:
    """One process (one TP group), the whole batch: each sequence alone with a causal mask and
    positions 0..L-1 (stock Megatron attention, no ring context); mean over every loss-weighted
    token. ``multiple``: each sequence padded at its end to a multiple of it (sequence
    parallelism splits the rows over TP; causal attention keeps the padding out of every real
    token's output, and its loss weight is 0)."""
    total_tokens = sum(float(s.loss_mask.sum()) for rank in samples for s in rank)
    loss_sum = 0.0
    for s in itertools.chain.from_iterable(samples):
        L = -(-len(s) // multiple) * multiple
        pad = L - len(s)
        tokens, labels = (torch.cat([t, t.new_zeros(pad)]) for t in (s.tokens, s.labels))
        weight = torch.cat([s.loss_mask, s.loss_mask.new_zeros(pad)])
        mask = torch.triu(torch.ones(1, 1, L, L, dtype=torch.bool), diagonal=1)
        losses = model(tokens[None], torch.arange(L)[None], mask, labels=labels[None])
        loss = (losses.float().reshape(-1) * weight).sum() / total_tokens
        loss.backward()
        loss_sum += loss.item()
    return loss_sum


def exactness(seed: int, position: str = "rope") -> dict:
    """HDP on the 4 ranks against the one-process reference: loss and every gradient, through
    ``forward_backward`` and through the Megatron-style iterator + ``forward_step``."""
    from megatron_overlap.hdp import runtime as hdp
    from megatron_overlap.integration.hdp import make_runtime
    from megatron_overlap.lab.tiny_gpt import init_parallel

    init_parallel(1, seed=seed)
    installation = _install(CAPACITY)
    try:
        me = dist.get_rank()
        samples = global_samples(seed)
        model = build_model(position, seq=max(itertools.chain.from_iterable(LENGTHS)))
        ref_loss = reference(model, samples)
        ref = _grads(model)
        _zero(model)

        rt = make_runtime(installation.config.hdp)  # Megatron's DP group's ranks (CP = 1): all 4 ranks
        from megatron.core import parallel_state

        dp = parallel_state.get_data_parallel_group(with_context_parallel=True)
        # HDP's own communicator over the DP ranks (never DDP's), made once
        own_group = (rt.group is not dp and dist.get_process_group_ranks(rt.group) == dist.get_process_group_ranks(dp)
                     and make_runtime(installation.config.hdp).group is rt.group)
        step = rt.step(samples[me])
        step.plan.validate()
        result = hdp.forward_backward(model, step)
        loss = hdp.reduce_loss(result.loss, rt.group)
        local = _grads(model)
        # What dividing by this rank's own token count and averaging over ranks would give (the
        # usual DP recipe): not the global mean when ranks hold different token counts.
        mine = float(sum(mb.loss_mask.sum() for mb in step.microbatches))
        wrong_scale = step.global_tokens / (mine * rt.size) if mine else 0.0
        wrong = {n: g * wrong_scale for n, g in local.items()}
        flat = torch.cat([g.reshape(-1) for g in wrong.values()])
        dist.all_reduce(flat, group=rt.group)
        offset = 0
        for n, g in wrong.items():
            wrong[n] = flat[offset:offset + g.numel()].view_as(g)
            offset += g.numel()
        hdp.reduce_gradients(model, rt.group)
        got = _grads(model)

        # Megatron-style: iterator, forward_step, loss sums backward, grads / all-reduced count
        _zero(model)
        it = hdp.HdpDataIterator(iter([samples[me]]), rt)
        n = it.start_step()
        count = torch.zeros((), dtype=torch.float64)
        for _ in range(n):
            output, loss_func = hdp.forward_step(it, model)
            loss_sum, num_tokens, _report = loss_func(output)
            loss_sum.backward()
            count += num_tokens.double()
        dist.all_reduce(count, group=rt.group)
        hdp.reduce_gradients(model, rt.group)
        for p in model.parameters():
            p.grad /= count
        iter_grads = _grads(model)
        return dict(
            rank=me,
            loss=loss, ref_loss=ref_loss,
            grad_rel=_rel(got, ref), grad_total_rel=_total_rel(got, ref),
            iter_grad_rel=_rel(iter_grads, ref), iter_count=float(count), global_tokens=step.global_tokens,
            wrong_total_rel=_total_rel(wrong, ref),
            ring_sizes=sorted(step.plan.ring_sizes().values()),
            my_rings=[len(mb.ring) for mb in step.microbatches],
            microbatches=step.num_microbatches, iterator_microbatches=n, moved_tokens=step.moved_tokens,
            signature=repr(step.plan.microbatches), lengths=list(step.seq_lens), own_group=own_group,
        )
    finally:
        _uninstall()


# TP = 2 x HDP = 2 on the 4 ranks: per HDP rank (a TP group), the samples it loads; C = 40, so
# 70 and 61 run on rings of the two TP groups, the rest whole.
TP_LENGTHS = ((70, 9, 17, 40, 3), (5, 30, 23, 61, 12))
TP_CAPACITY = 40


def exactness_tp(seed: int) -> dict:
    """HDP with tensor parallelism: each HDP rank is a TP group of 2 running the TP-overlap
    linears (sequence parallelism on); rings run between the TP groups at the same TP rank.
    Against each TP group running the whole batch itself (plain DP x TP's gradient)."""
    import megatron_overlap
    from megatron.core import parallel_state

    from megatron_overlap.hdp import runtime as hdp
    from megatron_overlap.integration.hdp import make_runtime
    from megatron_overlap.lab.hdp_demo import sum_sequence_parallel_grads
    from megatron_overlap.lab.tiny_gpt import init_parallel

    init_parallel(2, seed=seed)
    megatron_overlap.uninstall()
    installation = megatron_overlap.install(megatron_overlap.overlap_parser().parse_args(
        ["--overlap-hdp", "--overlap-hdp-max-tokens-per-rank", str(TP_CAPACITY), "--overlap-tp", "p2p"]))
    try:
        samples = global_samples(seed, lengths=TP_LENGTHS)
        model = build_model("rope", seq=max(itertools.chain.from_iterable(TP_LENGTHS)) + 2, tp=2)
        ref_loss = reference(model, samples, multiple=2)
        sum_sequence_parallel_grads(model)  # each TP rank saw its rows only, as finalize_model_grads sums
        ref = _grads(model)
        _zero(model)
        calls_ref = installation.calls["tp.column"]
        rt = make_runtime(installation.config.hdp)  # Megatron's DP group: the ranks of this TP rank
        step = rt.step(samples[parallel_state.get_data_parallel_rank()])
        step.plan.validate()
        result = hdp.forward_backward(model, step)
        loss = hdp.reduce_loss(result.loss, rt.group)
        hdp.reduce_gradients(model, rt.group)
        sum_sequence_parallel_grads(model)
        got = _grads(model)
        return dict(rank=dist.get_rank(), loss=loss, ref_loss=ref_loss, grad_rel=_rel(got, ref),
                    grad_total_rel=_total_rel(got, ref), group=dist.get_process_group_ranks(rt.group),
                    rows=[mb.layout.rows for mb in step.microbatches], my_rings=[len(mb.ring) for mb in step.microbatches],
                    tp_calls=installation.calls["tp.column"] - calls_ref, row_multiple=rt.row_multiple,
                    signature=repr(step.plan.microbatches))
    finally:
        _uninstall()


def one_rank_ring(seed: int) -> dict:
    """``cp_attention`` on a ring of one rank (``ranks=[me]``) with packed documents of odd
    lengths, unpadded, every rank at once: against single-rank attention per document."""
    from megatron.core.packed_seq_params import PackedSeqParams

    from megatron_overlap.cp import cp_attention, pad_cu_seqlens, reference_attention

    me = dist.get_rank()
    docs = (5, 17, 1, 23, 8)[me % 2:]
    cu = torch.tensor([0, *itertools.accumulate(docs)], dtype=torch.int32)
    gen = torch.Generator().manual_seed(seed + me)
    total = sum(docs)
    q, k, v, dout = (torch.randn(total, h, 16, generator=gen) for h in (4, 2, 2, 4))
    out = {}
    for causal in (True, False):
        ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
        ref = reference_attention(*ref_in, causal=causal, cu_seqlens=cu)
        ref.backward(dout)
        local = [t.clone().requires_grad_() for t in (q, k, v)]
        params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu,
                                 cu_seqlens_kv_padded=cu, max_seqlen_q=max(docs), max_seqlen_kv=max(docs))
        got = cp_attention(*local, mode="ring", causal=causal, group=dist.group.WORLD, ranks=[me], packed=params)
        got.backward(dout.reshape(total, -1))
        rel = lambda a, b: float((a.double() - b.double()).norm() / b.double().norm())  # noqa: E731
        out[causal] = dict(out=rel(got.reshape(ref.shape), ref.detach()),
                           dq=rel(local[0].grad, ref_in[0].grad), dk=rel(local[1].grad, ref_in[1].grad),
                           dv=rel(local[2].grad, ref_in[2].grad))
    out["pad_unchanged"] = bool(torch.equal(pad_cu_seqlens(cu, 1), cu))
    return out


def _error(fn) -> tuple:
    try:
        fn()
    except Exception as exc:  # the error under test
        return type(exc).__name__, getattr(exc, "flag", None), str(exc)
    return None, None, traceback.format_stack()[-1]


def runtime_errors(seed: int) -> dict:
    """The runtime's refusals, each raised the same way on every rank (after the all-gather)."""
    from megatron_overlap.integration import hdp
    from megatron_overlap.integration.hdp import make_runtime

    installation = _install(CAPACITY)
    try:
        me = dist.get_rank()
        rt = make_runtime(installation.config.hdp, group=dist.group.WORLD)
        out = {}
        out["empty"] = _error(lambda: rt.step([]))
        too_long = global_samples(seed, lengths=((5,), (200,), (), (7,)))
        out["too_long"] = _error(lambda: rt.step(too_long[me]))
        mb = rt.step(global_samples(seed, lengths=((3,), (4,), (5,), (6,)))[me]).microbatches[0]
        _uninstall()
        out["not_installed"] = _error(lambda: mb.context().__enter__())

        class Fake(torch.nn.Module):
            position_embedding_type = "yarn"

        out["yarn"] = _error(lambda: hdp.check_model(Fake()))
        out["no_local_attention"] = _error(lambda: hdp.check_model(torch.nn.Linear(2, 2)))
        return out
    finally:
        _uninstall()


# PP = 2 x HDP = 2 on the 4 ranks: per pipeline (both its stages load the same samples), C = 40,
# so 70 and 61 run on rings of the two pipelines' stages, the rest whole; the scheduler's pp mode (from the pipeline size).
PP_LENGTHS = ((70, 9, 17, 40, 3), (5, 30, 23, 61, 12))
PP_CAPACITY = 40


def _pipeline_step(model, data, forward_step_func, count: int, rows: int) -> float:
    """Megatron's pipeline schedule (1F1B, variable sequence lengths) over ``count`` micro-batches;
    the summed gradients of the data-parallel group divided by the global token count; the loss
    sum of this pipeline's last stage."""
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    out = get_forward_backward_func()(forward_step_func=forward_step_func, data_iterator=data, model=[model],
                                      num_microbatches=count, seq_length=rows, micro_batch_size=1)
    loss = sum(float(d["lm loss"][0]) for d in out) if parallel_state.is_pipeline_last_stage() else 0.0
    return loss


def exactness_pp(seed: int) -> dict:
    """HDP under Megatron's own pipeline schedule (the scheduler's ``pp`` mode, derived from PP = 2): each pipeline stage's HDP
    group is the data-parallel ranks of that stage, rings run between the pipelines at the same
    stage and micro-batch index, and every rank runs the same number of slots. Against plain
    DP x PP on the same documents: every document its own micro-batch through the same
    schedule (causal mask, positions 0..L-1)."""
    import megatron_overlap
    from megatron.core import parallel_state

    from megatron_overlap.hdp import runtime as hdp
    from megatron_overlap.integration.hdp import make_runtime
    from megatron_overlap.lab import tiny_gpt

    tiny_gpt.init_parallel(1, pp=2, seed=seed)
    megatron_overlap.uninstall()
    installation = megatron_overlap.install(megatron_overlap.overlap_parser().parse_args(
        ["--overlap-hdp", "--overlap-hdp-max-tokens-per-rank", str(PP_CAPACITY)]))
    try:
        torch.manual_seed(seed)  # the same stage weights on both pipelines
        spec = tiny_gpt.TinyGPT(seq=max(itertools.chain.from_iterable(PP_LENGTHS)) + 2, vocab=VOCAB)
        model = tiny_gpt.build(spec, 1, pipeline_model_parallel_size=2, pipeline_dtype=torch.float32,
                               calculate_per_token_loss=True)
        from megatron_overlap.integration.hdp import check_model

        try:  # fixed shapes between stages: refused, naming what to set
            check_model(model)
            fixed_shapes = "accepted"
        except Exception as exc:  # noqa: BLE001
            fixed_shapes = f"{type(exc).__name__}: {exc}"
        model.config.variable_seq_lengths = True  # after __post_init__ (it asks MoE dispatchers about it)
        dp_group, dp = parallel_state.get_data_parallel_group(), parallel_state.get_data_parallel_rank()
        samples = global_samples(seed, lengths=PP_LENGTHS)
        tokens = sum(float(s.loss_mask.sum()) for rank in samples for s in rank)

        def finish(loss_sum: float):
            grads = _grads(model)
            flat = torch.cat([g.reshape(-1) for g in grads.values()])
            dist.all_reduce(flat, group=dp_group)
            offset = 0
            for n, g in grads.items():
                grads[n] = flat[offset:offset + g.numel()].view_as(g) / tokens
                offset += g.numel()
            t = torch.tensor([loss_sum], dtype=torch.float64)
            dist.all_reduce(t, group=dp_group)
            dist.all_reduce(t, group=parallel_state.get_pipeline_model_parallel_group())
            _zero(model)
            return float(t) / tokens, grads

        def plain_step(data_iterator, model):
            s = next(data_iterator)
            L = len(s)
            mask = torch.triu(torch.ones(1, 1, L, L, dtype=torch.bool), diagonal=1)
            out = model(s.tokens[None], torch.arange(L)[None], mask, labels=s.labels[None])
            return out, functools.partial(hdp.per_token_loss, s.loss_mask[None])

        mine = samples[dp]
        ref_loss, ref = finish(_pipeline_step(model, iter(mine), plain_step, len(mine), max(map(len, mine))))

        rt = make_runtime(installation.config.hdp)  # Megatron's DP group: this stage of both pipelines
        it = hdp.HdpDataIterator(iter([mine]), rt)
        count = it.start_step()
        step = it.current
        step.plan.validate()
        rows = max(mb.layout.rows for mb in step.microbatches)
        loss, got = finish(_pipeline_step(model, it, hdp.forward_step, count, rows))
        return dict(rank=dist.get_rank(), stage=parallel_state.get_pipeline_model_parallel_rank(), loss=loss,
                    ref_loss=ref_loss, grad_rel=_rel(got, ref), grad_total_rel=_total_rel(got, ref), count=count,
                    group=dist.get_process_group_ranks(rt.group), my_rings=[len(mb.ring) for mb in step.microbatches],
                    signature=repr(step.plan.microbatches), fixed_shapes=fixed_shapes,
                    planned_for=(rt.planner.mode, rt.planner.stages))
    except Exception:
        return dict(error=traceback.format_exc())
    finally:
        _uninstall()
