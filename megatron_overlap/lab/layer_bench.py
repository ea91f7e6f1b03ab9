"""``bench layer``: one whole transformer layer of Megatron's local spec (norm -> QKV Column ->
causal core attention -> proj Row -> residual -> norm -> fc1 Column -> GeLU -> fc2 Row ->
residual; SP, or all-reduces with ``sequence_parallel=False``), and its compute replay: the same
GEMMs and attention on this rank's shards with plain torch ops and no communication at all (the
limit's compute; the norms on the rank's shard with SP, on the whole sequence without). The
rounds are ``mlp_bench``'s."""

from __future__ import annotations

import math
import time

import torch


def build_layer(cfg):
    import torch.nn.functional as F
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import TransformerConfig

    from . import tiny_gpt

    tiny_gpt.init_parallel(cfg.tp, seed=cfg.seed + 1)
    config = TransformerConfig(
        num_layers=1, hidden_size=cfg.hidden, ffn_hidden_size=cfg.ffn, num_attention_heads=cfg.heads,
        tensor_model_parallel_size=cfg.tp, sequence_parallel=cfg.tp > 1 and cfg.sequence_parallel,
        use_cpu_initialization=True,
        add_bias_linear=True, gated_linear_unit=False, activation_func=F.gelu, bias_activation_fusion=False,
        masked_softmax_fusion=False, bias_dropout_fusion=False, hidden_dropout=0.0, attention_dropout=0.0,
        persist_layer_norm=False, normalization="LayerNorm", gradient_accumulation_fusion=cfg.grad_accum_fusion,
    )
    spec = get_gpt_layer_local_spec(normalization="LayerNorm")
    spec.submodules.input_layernorm = tiny_gpt._SPNorm  # SP norms without apex (the lab's shim)
    spec.submodules.pre_mlp_layernorm = tiny_gpt._SPNorm
    return build_module(spec, config=config, layer_number=1)


def causal_mask(seq: int) -> torch.Tensor:
    return torch.triu(torch.ones(1, 1, seq, seq, dtype=torch.bool), diagonal=1)  # True: masked out


class LayerReplay:
    """This rank's compute of one fwd+bwd of the layer with no communication: the norms on its
    shard's rows, the GEMMs and the causal attention (its heads) on the whole sequence."""

    def __init__(self, layer, cfg):
        attn, mlp = layer.self_attention, layer.mlp
        w = lambda p: p.detach().clone().requires_grad_()  # noqa: E731
        self.cfg = cfg
        self.heads = cfg.heads // cfg.tp
        self.params = {
            "qkv": w(attn.linear_qkv.weight), "qkv_b": w(attn.linear_qkv.bias), "proj": w(attn.linear_proj.weight),
            "fc1": w(mlp.linear_fc1.weight), "fc1_b": w(mlp.linear_fc1.bias), "fc2": w(mlp.linear_fc2.weight)}
        self.x = torch.randn(cfg.seq, cfg.micro_batch, cfg.hidden, requires_grad=True)
        self.dy = torch.randn(cfg.seq, cfg.micro_batch, cfg.hidden)
        self.mask = causal_mask(cfg.seq)
        self.forward_s = self.attention_s = self.pre_attention_s = 0.0  # of the last call: its forward, its core
        # attention's forward, its norm and QKV GEMM

    def _attention(self, qkv):
        s, b = qkv.shape[:2]
        d = self.cfg.hidden // self.cfg.heads
        q, k, v = qkv.view(s, b, self.heads, 3, d).unbind(dim=3)
        q, k, v = (t.reshape(s, b * self.heads, d).transpose(0, 1) for t in (q, k, v))  # [b*np, s, d]
        scores = torch.baddbmm(torch.empty(b * self.heads, s, s), q, k.transpose(1, 2), beta=0.0,
                               alpha=1 / math.sqrt(d))
        probs = torch.softmax(scores.masked_fill(self.mask[0], -10000.0), dim=-1)
        return torch.bmm(probs, v).transpose(0, 1).reshape(s, b, self.heads * d)

    def __call__(self) -> float:
        import torch.nn.functional as F

        p, h, rows = self.params, self.cfg.hidden, self.cfg.rows
        t0 = time.perf_counter()
        norms = F.layer_norm(self.x[:rows], (h,)).sum()  # the norms run on this rank's rows (its shard with SP)
        qkv = torch.matmul(self.x, p["qkv"].t()) + p["qkv_b"]
        t1 = time.perf_counter()
        self.pre_attention_s = t1 - t0  # what precedes the first transfer of a layer without SP
        context = self._attention(qkv)
        self.attention_s = time.perf_counter() - t1
        mid = self.x + torch.matmul(context, p["proj"].t())
        norms = norms + F.layer_norm(mid[:rows], (h,)).sum()
        # the norms' outputs join the graph with weight 0 so their backward runs too
        y = mid + torch.matmul(F.gelu(torch.matmul(mid, p["fc1"].t()) + p["fc1_b"]), p["fc2"].t()) + 0.0 * norms
        self.forward_s = time.perf_counter() - t0
        y.backward(self.dy)
        elapsed = time.perf_counter() - t0
        self.x.grad = None
        for t in p.values():
            t.grad = None
        return elapsed
