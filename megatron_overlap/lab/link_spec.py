"""The emulated link's parameters and counters."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field


PORTS = ("rank", "group")


@dataclass(frozen=True)
class LinkSpec:
    """Per-rank egress bandwidth and per-message latency of the emulated link.

    ``launch_us``: charged once per operation (a collective's or a send's start-up, as NCCL's
    base latency). ``ports``: ``"rank"``, one egress port per rank that every transfer queues
    on; ``"group"``, one per rank and process group (each communicator its own queue, as NCCL
    communicators run side by side on their own streams). ``node_size`` > 0: two tiers, ranks
    ``[k n, (k + 1) n)`` form a node; a transfer whose ranks all sit in one node moves at
    ``intra_GBps`` with ``intra_latency_us`` (and ``intra_launch_us``), every other at the
    rates above."""

    bandwidth_GBps: float
    latency_us: float = 10.0
    launch_us: float = 0.0
    ports: str = "rank"
    node_size: int = 0
    intra_GBps: float = 0.0
    intra_latency_us: float = 0.0
    intra_launch_us: float = 0.0

    def __post_init__(self):
        if not self.bandwidth_GBps > 0:
            raise ValueError(f"bandwidth_GBps must be > 0, got {self.bandwidth_GBps}")
        if self.latency_us < 0 or self.launch_us < 0:
            raise ValueError(f"latency_us and launch_us must be >= 0, got {self.latency_us}, {self.launch_us}")
        if self.ports not in PORTS:
            raise ValueError(f"ports must be one of {PORTS}, got {self.ports!r}")
        if self.node_size < 0:
            raise ValueError(f"node_size must be >= 0 (0: one tier), got {self.node_size}")
        if self.node_size and not self.intra_GBps > 0:
            raise ValueError(f"a two-tier link (node_size {self.node_size}) needs intra_GBps > 0, got "
                             f"{self.intra_GBps}")
        if self.intra_latency_us < 0 or self.intra_launch_us < 0:
            raise ValueError("intra-node latencies must be >= 0")

    def check_world(self, world: int) -> None:
        """A two-tier link's nodes must tile the ranks."""
        if self.node_size and world % self.node_size:
            raise ValueError(f"a two-tier link with {self.node_size} ranks per node does not divide {world} ranks "
                             f"into nodes: pick a node size that divides {world}")

    def tier(self, ranks) -> tuple:
        """(GB/s, latency us, launch us) for a transfer among global ``ranks``."""
        if self.node_size and len({r // self.node_size for r in ranks}) == 1:
            return self.intra_GBps, self.intra_latency_us, self.intra_launch_us
        return self.bandwidth_GBps, self.latency_us, self.launch_us

    @classmethod
    def two_tier(cls, link, bandwidth_factor: float = 1.0, time_factor: float = 1.0) -> "LinkSpec":
        """The emulated link of a ``tune.two_tier.TwoTierLink`` (the simulator's fabric), one port
        per rank and process group. Bandwidths times ``bandwidth_factor``, latencies times
        ``time_factor``: a lab whose bytes are ``b`` x the modelled ones and whose clock runs ``t`` x
        the modelled time passes ``b / t`` and ``t``, so every transfer takes ``t`` x its modelled
        time."""
        return cls(bandwidth_GBps=link.inter_GBps * bandwidth_factor, latency_us=link.inter_latency_us * time_factor,
                   ports="group", node_size=link.node_size, intra_GBps=link.intra_GBps * bandwidth_factor,
                   intra_latency_us=link.intra_latency_us * time_factor)

    def tier_name(self, ranks) -> str:
        """"intra" or "inter" for a transfer among global ``ranks`` ("link" on a one-tier link)."""
        if not self.node_size:
            return "link"
        return "intra" if len({r // self.node_size for r in ranks}) == 1 else "inter"

    def seconds(self, nbytes: float, messages: int = 1) -> float:
        return nbytes / (self.bandwidth_GBps * 1e9) + messages * self.latency_us * 1e-6 + self.launch_us * 1e-6

    def as_dict(self) -> dict:
        out = {"bandwidth_GBps": self.bandwidth_GBps, "latency_us": self.latency_us,
               "ports": "1 egress per rank" if self.ports == "rank" else "1 egress per rank and process group"}
        if self.launch_us:
            out["launch_us"] = self.launch_us
        if self.node_size:
            out.update(node_size=self.node_size, intra_GBps=self.intra_GBps, intra_latency_us=self.intra_latency_us,
                       intra_launch_us=self.intra_launch_us)
        return out


@dataclass
class Span:
    """One transfer on this rank's link: issued, started on the port, done (deadline)."""

    op: str
    nbytes: int
    issued: float
    start: float
    done: float


@dataclass
class LinkStats:
    """Counters since the last ``reset``; times in seconds."""

    bytes_by_op: dict = field(default_factory=lambda: defaultdict(int))
    calls_by_op: dict = field(default_factory=lambda: defaultdict(int))
    busy_s: float = 0.0  # port occupancy: sum of bytes / bandwidth (+ latency)
    blocked_s: float = 0.0  # time callers spent blocked in wait(): exposed communication
    spans: list = field(default_factory=list)
    waits: list = field(default_factory=list)  # (start, end) of blocking waits
    wait_ops: list = field(default_factory=list)  # the op each of ``waits`` waited for
    blocked_by_op: dict = field(default_factory=lambda: defaultdict(float))
    bytes_by_tier: dict = field(default_factory=lambda: defaultdict(int))  # "intra" / "inter" ("link": one tier)

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes_by_op.values())
