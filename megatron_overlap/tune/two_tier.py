"""A two-tier fabric as one value: nodes of ``node_size`` ranks, a fast link inside a node
(NVLink-class), a slower one between nodes (InfiniBand-class), per rank and per direction.

The long-context simulators (``cp/step_model.py``, ``hdp/simulate.py`` through ``HdpCostModel``)
and the emulated cluster (``lab/link_spec.LinkSpec.two_tier``) are built from the same value, so
the lab and the simulator price a transfer alike::

    tier(ranks)   "intra" when every rank of the transfer sits in one node
                  (``rank // node_size`` equal), else "inter"
    t(B)          latency + B / bandwidth of that tier  (a ring is paced by its slowest hop)

Defaults: ``for_hardware`` takes the cost model's links (``tune.hardware``: NVLink and the NIC
per GPU at NCCL's ring efficiency, NCCL's per-hop latencies) and the hardware's GPUs per node.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Iterable

from .hardware import HardwareSpec, Link

TIERS = ("intra", "inter")


@dataclass(frozen=True)
class TwoTierLink:
    """``node_size`` ranks per node; ``intra_*`` inside a node, ``inter_*`` between nodes."""

    node_size: int
    intra_GBps: float
    inter_GBps: float
    intra_latency_us: float = 0.0
    inter_latency_us: float = 0.0

    def __post_init__(self):
        if self.node_size < 1:
            raise ValueError(f"a node holds at least one rank, got node_size {self.node_size}")
        if not (self.intra_GBps > 0 and self.inter_GBps > 0):
            raise ValueError(f"link bandwidths must be > 0, got intra {self.intra_GBps}, inter {self.inter_GBps} GB/s")
        if self.intra_latency_us < 0 or self.inter_latency_us < 0:
            raise ValueError("link latencies must be >= 0")

    @classmethod
    def for_hardware(cls, hw: HardwareSpec, node_size: int = 0, intra_GBps: float = 0.0,
                     inter_GBps: float = 0.0) -> "TwoTierLink":
        """The fabric of ``hw`` (its links and GPUs per node), any of which a caller may set."""
        return cls(node_size=node_size or hw.gpus_per_node,
                   intra_GBps=intra_GBps or hw.intra.bandwidth_GBps, inter_GBps=inter_GBps or hw.inter.bandwidth_GBps,
                   intra_latency_us=hw.intra.latency_us, inter_latency_us=hw.inter.latency_us)

    @classmethod
    def of_cost(cls, cost) -> "TwoTierLink":
        """The fabric an ``HdpCostModel`` prices rings with."""
        return cls(node_size=cost.gpus_per_node, intra_GBps=cost.intra_link_GBps, inter_GBps=cost.inter_link_GBps,
                   intra_latency_us=cost.intra_latency_us, inter_latency_us=cost.inter_latency_us)

    def apply_to(self, cost):
        """``cost`` (an ``HdpCostModel``) pricing its rings on this fabric."""
        return replace(cost, gpus_per_node=self.node_size, intra_link_GBps=self.intra_GBps,
                       inter_link_GBps=self.inter_GBps, intra_latency_us=self.intra_latency_us,
                       inter_latency_us=self.inter_latency_us)

    def tier(self, ranks: Iterable[int]) -> str:
        return "intra" if len({int(r) // self.node_size for r in ranks}) <= 1 else "inter"

    def link(self, ranks: Iterable[int]) -> Link:
        if self.tier(ranks) == "intra":
            return Link(bandwidth_GBps=self.intra_GBps, latency_us=self.intra_latency_us)
        return Link(bandwidth_GBps=self.inter_GBps, latency_us=self.inter_latency_us)

    def transfer_ms(self, nbytes: float, ranks: Iterable[int]) -> tuple:
        """(port busy ms, ms until delivered) of one message among ``ranks``."""
        link = self.link(ranks)
        busy = nbytes / (link.bandwidth_GBps * 1e9) * 1e3
        return busy, busy + link.latency_us * 1e-3

    def as_dict(self) -> dict:
        return {"node_size": self.node_size, "intra_GBps": self.intra_GBps, "inter_GBps": self.inter_GBps,
                "intra_latency_us": self.intra_latency_us, "inter_latency_us": self.inter_latency_us}
