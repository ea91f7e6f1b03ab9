"""What one rank spends on the rows it holds in one micro-batch: compute, and ring communication
the attention does not hide. Pure functions of a small value; every scheduler is scored by it.

Per rank, for ``rows`` rows (padding included) and ``pairs`` causal (query, key) pairs, forward +
backward over all layers::

    linear_ms    = rows  * 6 (P_layer * layers + vocab * hidden) / (peak * gemm_fraction)
    attention_ms = pairs * 4 hidden layers (1 + bwd_factor)     / (peak * attention_fraction)
    pairs of a causal sequence of L tokens = L (L + 1) / 2   (the causal half), / n on a ring of n

A ring of n ranks moves, per layer, n-1 key/value blocks of ``kv_bytes = 2 kv_heads head_dim
dtype_bytes rows`` forward, and n-1 key/value blocks plus n-1 dK/dV running sums backward, the
sums in fp32 (``cp/ring.py``: twice a bf16 block's bytes). Each block travels while the rank
attends to the block in hand, so per ring step only the part of the transfer longer than one
block's attention is exposed::

    exposed_ms = layers (n-1) [ max(0, t(kv) - a_fwd / n) + max(0, t(kv + dkv) - a_bwd / n) ]
    dkv        = kv_bytes x 4 / dtype_bytes   (fp32 sums)
    t(B)       = latency + B / bandwidth        a_fwd, a_bwd = this rank's attention per layer

Nothing else hides the ring (the linears before and after attention depend on it). Links: a ring
whose ranks all sit in one node (``rank // gpus_per_node``) uses the intra-node link, any other
the inter-node one. Several sequences of one micro-batch on the same ring (a packed static CP
micro-batch) share one ring: rows and pairs add. Gradient all-reduce, optimizer and data loading
are the same for every scheduler and left out.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from functools import cached_property
from typing import Optional, Sequence

from ..tune.comm import transfer_ms
from ..tune.hardware import HardwareSpec, Link, get_hardware
from ..tune.models import ModelSpec, get_model
from .shard import rows_held

# An intra-node ring is preferred over an inter-node one that ends earlier by less than this
# fraction of the ring's duration: the cost model hides most ring traffic behind attention, but
# an inter-node ring also competes with the gradient all-reduce, which the model leaves out.
NODE_SLACK = 0.02

DKV_BYTES = 4  # the dK/dV running sums travel in fp32 (cp/ring.py)


@dataclass(frozen=True)
class HdpCostModel:
    """Defaults: ``from_hardware(get_hardware("h100-sxm"), get_model("llama3-8b"))`` (pinned by a
    test): datasheet H100 SXM (989 dense bf16 TFLOPS; NVLink 450 GB/s per direction, 50 GB/s
    per GPU across nodes, each at 80% ring efficiency; NCCL's per-hop latencies), one rank = one
    GPU holding a whole Llama-3-8B replica (TP = 1)."""

    peak_tflops: float = 989.0
    gemm_fraction: float = 0.75  # linears' share of peak (cost.gemm.GemmEfficiency.max_fraction)
    attention_fraction: float = 0.5  # flash attention's share of peak (HardwareSpec.attention_fraction)
    intra_link_GBps: float = 360.0  # per direction, as a ring achieves it
    intra_latency_us: float = 3.4
    inter_link_GBps: float = 40.0
    inter_latency_us: float = 14.0
    gpus_per_node: int = 8
    hidden: int = 4096
    ffn: int = 14336
    heads: int = 32
    kv_heads: int = 8
    layers: int = 32
    vocab: int = 128256
    gated: bool = True
    dtype_bytes: int = 2
    attention_bwd_factor: float = 2.5  # flash attention backward / forward FLOPs (5 GEMMs vs 2)
    microbatch_overhead_ms: float = 0.0  # fixed cost of each non-empty micro-batch (launches, the schedule)

    def __post_init__(self):
        positive = ("peak_tflops", "gemm_fraction", "attention_fraction", "intra_link_GBps",
                    "inter_link_GBps", "gpus_per_node", "hidden", "heads", "kv_heads", "layers", "dtype_bytes")
        for name in positive:
            if not getattr(self, name) > 0:
                raise ValueError(f"HdpCostModel.{name} must be > 0, got {getattr(self, name)}")
        if self.microbatch_overhead_ms < 0:
            raise ValueError(f"HdpCostModel.microbatch_overhead_ms must be >= 0, got {self.microbatch_overhead_ms}")
        if self.hidden % self.heads or self.heads % self.kv_heads:
            raise ValueError(f"hidden {self.hidden} / heads {self.heads} / kv heads {self.kv_heads} do not divide")

    @classmethod
    def from_hardware(cls, hw: HardwareSpec, model: Optional[ModelSpec] = None) -> "HdpCostModel":
        model = model or get_model("llama3-8b")
        return cls(
            peak_tflops=hw.peak_tflops,
            gemm_fraction=hw.gemm.max_fraction,
            attention_fraction=hw.attention_fraction,
            intra_link_GBps=hw.intra.bandwidth_GBps,
            intra_latency_us=hw.intra.latency_us,
            inter_link_GBps=hw.inter.bandwidth_GBps,
            inter_latency_us=hw.inter.latency_us,
            gpus_per_node=hw.gpus_per_node,
            hidden=model.hidden,
            ffn=model.ffn,
            heads=model.heads,
            kv_heads=model.kv_heads,
            layers=model.layers,
            vocab=model.vocab,
            gated=model.gated,
            dtype_bytes=hw.dtype_bytes,
        )

    @classmethod
    def named(cls, hardware: str = "h100-sxm", model: str = "llama3-8b") -> "HdpCostModel":
        return cls.from_hardware(get_hardware(hardware), get_model(model))

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    # -- per-token and per-pair rates ---------------------------------------------------------
    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @cached_property  # the same float every call: computed once per instance (the planner calls it ~10^5 times a step)
    def linear_flops_per_token(self) -> float:
        """6 x (weights a token passes through): forward 2 per weight, backward 4."""
        qkv = self.hidden * (self.heads + 2 * self.kv_heads) * self.head_dim
        mlp = self.hidden * self.ffn * (3 if self.gated else 2)
        per_layer = qkv + self.hidden * self.hidden + mlp
        return 6.0 * (per_layer * self.layers + self.vocab * self.hidden)

    @cached_property
    def attention_fwd_flops_per_pair(self) -> float:
        """QK^T and PV: 2 GEMMs x 2 FLOPs x hidden, every layer."""
        return 4.0 * self.hidden * self.layers

    @cached_property
    def linear_ms_per_token(self) -> float:
        return self.linear_flops_per_token / (self.peak_tflops * 1e12 * self.gemm_fraction) * 1e3

    @cached_property
    def attention_fwd_ms_per_pair(self) -> float:
        return self.attention_fwd_flops_per_pair / (self.peak_tflops * 1e12 * self.attention_fraction) * 1e3

    @property
    def kv_bytes_per_token(self) -> int:
        """2 (K, V) x kv_heads x head_dim x dtype_bytes, per layer."""
        return 2 * self.kv_heads * self.head_dim * self.dtype_bytes

    @property
    def kv_dkv_bytes_per_token(self) -> int:
        """A backward ring step's bytes per token and layer: K, V and the fp32 dK, dV sums."""
        return 2 * self.kv_heads * self.head_dim * (self.dtype_bytes + DKV_BYTES)

    # -- costs ---------------------------------------------------------------------------------
    def compute_ms(self, rows: float, pairs: float) -> float:
        """Forward + backward compute of ``rows`` rows with ``pairs`` causal attention pairs."""
        return rows * self.linear_ms_per_token + pairs * self.attention_fwd_ms_per_pair * (1 + self.attention_bwd_factor)

    def link(self, ring: Sequence[int]) -> Link:
        nodes = {r // self.gpus_per_node for r in ring}
        if len(nodes) <= 1:
            return Link(bandwidth_GBps=self.intra_link_GBps, latency_us=self.intra_latency_us)
        return Link(bandwidth_GBps=self.inter_link_GBps, latency_us=self.inter_latency_us)

    def ring_bytes(self, rows: float, cp_size: int) -> float:
        """Bytes one rank sends for its ``rows`` in one ring of ``cp_size``: all layers, forward
        and backward: ``layers x (n-1) x (2 kv_bytes_per_token + the fp32 dK/dV) x rows``."""
        if cp_size <= 1:
            return 0.0
        return self.layers * (cp_size - 1) * (self.kv_bytes_per_token + self.kv_dkv_bytes_per_token) * rows

    def exposed_ring_ms(self, rows: float, pairs: float, ring: Sequence[int]) -> float:
        """Ring transfer time not hidden behind attention (module docstring)."""
        if len(ring) <= 1:
            return 0.0
        return self._exposed(rows, pairs, len(ring), self.link(ring))

    def _exposed(self, rows: float, pairs: float, n: int, link: Link) -> float:
        t_kv = transfer_ms(self.kv_bytes_per_token * rows, link)
        t_kv_dkv = transfer_ms(self.kv_dkv_bytes_per_token * rows, link, messages=2)
        a_fwd = pairs * self.attention_fwd_ms_per_pair / self.layers
        a_bwd = a_fwd * self.attention_bwd_factor
        per_layer = (n - 1) * (max(0.0, t_kv - a_fwd / n) + max(0.0, t_kv_dkv - a_bwd / n))
        return self.layers * per_layer

    def peer_ms(self, seq_len: int, n: int, intra: bool) -> float:
        """``sequence_ms`` of a ring of ``n`` that sits in one node (``intra``) or not, without
        building the ring (the scheduler asks this for every size of every ring)."""
        from .shard import rows_held

        pairs = seq_len * (seq_len + 1) / 2 / n
        if n <= 1:
            return self.compute_ms(seq_len, pairs)
        rows = rows_held(seq_len, n)
        link = (Link(bandwidth_GBps=self.intra_link_GBps, latency_us=self.intra_latency_us) if intra else
                Link(bandwidth_GBps=self.inter_link_GBps, latency_us=self.inter_latency_us))
        return self.compute_ms(rows, pairs) + self._exposed(rows, pairs, n, link)

    def peer_ms_many(self, seq_len: int, ns, intra):
        """``peer_ms`` for a numpy array of ring sizes ``ns`` (all >= 2) and of ``intra`` flags:
        the same float operations in the same order, elementwise (the scheduler's scan)."""
        import numpy as np

        pairs = seq_len * (seq_len + 1) / 2 / ns
        rows = 2 * (-(-seq_len // (2 * ns)))
        compute = rows * self.linear_ms_per_token + pairs * self.attention_fwd_ms_per_pair * (1 + self.attention_bwd_factor)
        bw = np.where(intra, self.intra_link_GBps, self.inter_link_GBps)
        lat = np.where(intra, self.intra_latency_us, self.inter_latency_us)
        kvb = self.kv_bytes_per_token
        t_kv = kvb * rows / (bw * 1e9) * 1e3 + (0.0 + 1 * lat * 1e-3)
        t_kv_dkv = self.kv_dkv_bytes_per_token * rows / (bw * 1e9) * 1e3 + (0.0 + 2 * lat * 1e-3)
        a_fwd = pairs * self.attention_fwd_ms_per_pair / self.layers
        a_bwd = a_fwd * self.attention_bwd_factor
        per_layer = (ns - 1) * (np.maximum(0.0, t_kv - a_fwd / ns) + np.maximum(0.0, t_kv_dkv - a_bwd / ns))
        return compute + self.layers * per_layer

    def item_ms(self, rows: float, pairs: float, ring: Sequence[int] = ()) -> float:
        """Busy time of one rank for one ring's (or local) rows in a micro-batch."""
        return self.compute_ms(rows, pairs) + self.exposed_ring_ms(rows, pairs, ring)

    def sequence_ms(self, seq_len: int, cp_size: int = 1, ring: Sequence[int] = ()) -> float:
        """Per-rank busy time of one sequence on ``cp_size`` ranks (``ring`` picks the link;
        by default ``range(cp_size)``, one node when it fits)."""
        from .shard import rows_held

        if not ring:  # range(cp_size): one node when it fits
            return self.peer_ms(seq_len, cp_size, cp_size <= self.gpus_per_node)
        pairs = seq_len * (seq_len + 1) / 2 / cp_size
        return self.item_ms(rows_held(seq_len, cp_size), pairs, tuple(ring) if cp_size > 1 else ())


@dataclass(frozen=True)
class SquareWorkload:
    """megatron-core's own workload model (``BalancedCPScheduler.get_total_workload``): a
    sequence of L tokens on a ring of n ranks costs each peer L^2 / n, nothing for linears or
    communication. In the same interface as :class:`HdpCostModel`, to score every scheduler with
    the baseline's model too. ``ms_per_unit`` only scales the numbers (by default one unit is
    one causal pair's attention in the default ``HdpCostModel``, forward + backward, so the
    figures read as attention milliseconds); ``2 x pairs = L (L + 1) / n``."""

    ms_per_unit: float = HdpCostModel().attention_fwd_ms_per_pair * (1 + HdpCostModel().attention_bwd_factor) / 2
    gpus_per_node: int = 8
    microbatch_overhead_ms: float = 0.0

    def compute_ms(self, rows: float, pairs: float) -> float:
        return 2.0 * pairs * self.ms_per_unit

    def exposed_ring_ms(self, rows: float, pairs: float, ring: Sequence[int]) -> float:
        return 0.0

    def item_ms(self, rows: float, pairs: float, ring: Sequence[int] = ()) -> float:
        return self.compute_ms(rows, pairs)

    def ring_bytes(self, rows: float, cp_size: int) -> float:
        return 0.0

    def sequence_ms(self, seq_len: int, cp_size: int = 1, ring: Sequence[int] = ()) -> float:
        return seq_len * (seq_len + 1) / cp_size * self.ms_per_unit

    def peer_ms(self, seq_len: int, n: int, intra: bool) -> float:
        return self.sequence_ms(seq_len, n)

    def peer_ms_many(self, seq_len: int, ns, intra):
        return seq_len * (seq_len + 1) / ns * self.ms_per_unit


def local_ms(seq_len: int, cost: HdpCostModel) -> float:
    """Busy time of a sequence held whole (no ring)."""
    return cost.compute_ms(seq_len, seq_len * (seq_len + 1) / 2)


def ring_ms(seq_len: int, ring: Sequence[int], cost: HdpCostModel) -> float:
    """Busy time of each peer of ``ring`` for its zigzag shard (the same on every peer)."""
    n = len(ring)
    return cost.item_ms(rows_held(seq_len, n), seq_len * (seq_len + 1) / 2 / n, ring)
