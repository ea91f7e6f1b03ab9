"""The emulated link's parameters and counters."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field


@dataclass(frozen=True)
class LinkSpec:
    """Per-rank egress bandwidth and per-message latency of the emulated link."""

    bandwidth_GBps: float
    latency_us: float = 10.0

    def __post_init__(self):
        if not self.bandwidth_GBps > 0:
            raise ValueError(f"bandwidth_GBps must be > 0, got {self.bandwidth_GBps}")
        if self.latency_us < 0:
            raise ValueError(f"latency_us must be >= 0, got {self.latency_us}")

    def seconds(self, nbytes: float, messages: int = 1) -> float:
        return nbytes / (self.bandwidth_GBps * 1e9) + messages * self.latency_us * 1e-6

    def as_dict(self) -> dict:
        return {"bandwidth_GBps": self.bandwidth_GBps, "latency_us": self.latency_us, "ports": "1 egress per rank"}


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

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes_by_op.values())
