"""Alpha-beta communication models.

Topology: every rank has **one egress port** onto a switch (NVSwitch inside an NVLink node, the
PCIe fabric of a PCIe node, a NIC across nodes; the emulated link of ``comm.emulated_link``
models the same). Transfers a rank issues queue behind each other on that port; what a rank
receives is limited by its peers' ports, which by symmetry move the same bytes at the same
time. So a collective costs each rank the bytes it *sends*:

    ring all-gather / reduce-scatter of a buffer of B bytes (the gathered / unreduced size),
    R ranks:   (R-1) messages of B/R        t = launch + (R-1) alpha + (R-1)/R * B / beta
    ring all-reduce:  2(R-1) messages of B/R    t = launch + 2(R-1) alpha + 2(R-1)/R * B / beta
    all-to-all (B per rank, B/R to each peer): same bytes and messages as all-gather
    P2P of B bytes:   one message               t = launch + alpha + B / beta

``alpha`` is the per-message (per hop) latency, ``beta`` the per-direction port bandwidth. A
link with a small-message protocol (NCCL's LL: lower latency, a fraction of the bandwidth) is
charged the cheaper of the two, as NCCL's tuner picks. Bidirectional rings gain nothing on this
topology (one egress port), as on the emulated link.

Every function returns a ``LinkCost``: ``busy_ms`` is how long the port is occupied (the next
transfer can start after it), ``latency_ms`` how much later the data is complete.
"""

from __future__ import annotations

from dataclasses import dataclass

from .hardware import Link


@dataclass(frozen=True)
class LinkCost:
    busy_ms: float
    latency_ms: float

    @property
    def total_ms(self) -> float:
        return self.busy_ms + self.latency_ms

    def __add__(self, other: "LinkCost") -> "LinkCost":
        return LinkCost(self.busy_ms + other.busy_ms, self.latency_ms + other.latency_ms)


ZERO = LinkCost(0.0, 0.0)


def transfer_cost(nbytes: float, link: Link, messages: int = 1, launch: bool = True) -> LinkCost:
    """``nbytes`` leaving one port in ``messages`` messages (the cheaper protocol)."""
    if nbytes <= 0 and messages <= 0:
        return ZERO
    launch_ms = link.launch_us * 1e-3 if launch else 0.0
    bulk = LinkCost(nbytes / (link.bandwidth_GBps * 1e9) * 1e3, launch_ms + messages * link.latency_us * 1e-3)
    if link.small_latency_us is None:
        return bulk
    small = LinkCost(
        nbytes / (link.bandwidth_GBps * link.small_bandwidth_fraction * 1e9) * 1e3,
        launch_ms + messages * link.small_latency_us * 1e-3,
    )
    return small if small.total_ms < bulk.total_ms else bulk


def transfer_ms(nbytes: float, link: Link, messages: int = 1) -> float:
    """E.g. 1 GB at 100 GB/s with no latency: 10 ms."""
    return transfer_cost(nbytes, link, messages).total_ms


def p2p_cost(nbytes: float, link: Link) -> LinkCost:
    return transfer_cost(nbytes, link, 1)


def all_gather_cost(total_bytes: float, ranks: int, link: Link) -> LinkCost:
    """Ring all-gather producing ``total_bytes`` on every rank (each rank owns 1/R)."""
    if ranks <= 1:
        return ZERO
    return transfer_cost(total_bytes * (ranks - 1) / ranks, link, ranks - 1)


def reduce_scatter_cost(total_bytes: float, ranks: int, link: Link) -> LinkCost:
    """Ring reduce-scatter of a ``total_bytes`` buffer (each rank keeps 1/R of it, reduced)."""
    return all_gather_cost(total_bytes, ranks, link)


def all_reduce_cost(total_bytes: float, ranks: int, link: Link) -> LinkCost:
    """Ring all-reduce: a reduce-scatter then an all-gather, 2(R-1) hops."""
    if ranks <= 1:
        return ZERO
    return transfer_cost(2 * total_bytes * (ranks - 1) / ranks, link, 2 * (ranks - 1))


def all_to_all_cost(bytes_per_rank: float, ranks: int, link: Link) -> LinkCost:
    """Each rank sends ``bytes_per_rank / R`` to each of the R-1 others (through its one port)."""
    return all_gather_cost(bytes_per_rank, ranks, link)


def all_gather_ms(total_bytes: float, ranks: int, link: Link) -> float:
    return all_gather_cost(total_bytes, ranks, link).total_ms


def reduce_scatter_ms(total_bytes: float, ranks: int, link: Link) -> float:
    return reduce_scatter_cost(total_bytes, ranks, link).total_ms


def all_reduce_ms(total_bytes: float, ranks: int, link: Link) -> float:
    return all_reduce_cost(total_bytes, ranks, link).total_ms


def all_to_all_ms(bytes_per_rank: float, ranks: int, link: Link) -> float:
    return all_to_all_cost(bytes_per_rank, ranks, link).total_ms


def p2p_ms(nbytes: float, link: Link) -> float:
    return p2p_cost(nbytes, link).total_ms
