"""Hardware as values: what one GPU (or one emulated CPU rank) computes and moves.

Nothing here probes the machine. Every number says where it comes from: *datasheet* (the
vendor's product datasheet for that part), *NCCL tuning.cc* (the latency constants NCCL's own
cost model uses, ``src/graph/tuning.cc``: ``baseLat`` per collective, ``hwLat`` per ring hop),
or *assumption* (a round engineering figure this model chose; calibrate it when a measurement
exists). Link rates are per GPU and per direction, as a ring collective achieves them: the
datasheets give bidirectional aggregates (NVLink "600 GB/s" = 300 GB/s each way), and a ring
reaches about ``RING_EFFICIENCY`` of the per-direction rate (assumption, the usual ratio of
nccl-tests bus bandwidth to link rate; not measured here).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Optional

from .gemm import GemmEfficiency

RING_EFFICIENCY = 0.8  # assumption: achieved ring bus bandwidth / per-direction link rate

# NCCL tuning.cc, ring algorithm: baseLat (us per collective) and hwLat (us per hop), for the
# LL protocol (small messages; moves 4 B of data per 8 B line, so half the bandwidth) and the
# Simple protocol (bulk).
_NCCL_BASE_US = {"LL": 6.6, "Simple": 8.4}
_NCCL_HOP_US = {
    "nvlink": {"LL": 0.6, "Simple": 3.4},
    "pcie": {"LL": 1.0, "Simple": 5.7},
    "net": {"LL": 2.7, "Simple": 14.0},
}


@dataclass(frozen=True)
class Link:
    """One rank's port onto a fabric (one egress port per rank: a switch, as NVSwitch, a NIC
    or the emulated link; see ``comm``).

    A transfer of ``nbytes`` in ``m`` messages occupies the port ``nbytes / bandwidth`` and is
    complete ``launch + m * latency`` later. ``small_*`` describe a low-latency protocol
    (NCCL's LL) that a collective uses instead when it is faster."""

    bandwidth_GBps: float
    latency_us: float
    launch_us: float = 0.0
    small_latency_us: Optional[float] = None
    small_bandwidth_fraction: float = 1.0

    def __post_init__(self):
        if not self.bandwidth_GBps > 0:
            raise ValueError(f"bandwidth_GBps must be > 0, got {self.bandwidth_GBps}")
        if self.latency_us < 0 or self.launch_us < 0:
            raise ValueError("latencies must be >= 0")


def nccl_link(rate_GBps: float, kind: str, efficiency: float = RING_EFFICIENCY) -> Link:
    """A link at ``efficiency`` x ``rate_GBps`` (per direction) with NCCL's ring latencies for
    ``kind`` in {nvlink, pcie, net}."""
    hops = _NCCL_HOP_US[kind]
    return Link(
        bandwidth_GBps=rate_GBps * efficiency,
        latency_us=hops["Simple"],
        launch_us=_NCCL_BASE_US["Simple"],
        small_latency_us=hops["LL"],
        small_bandwidth_fraction=0.5,
    )


@dataclass(frozen=True)
class HardwareSpec:
    """One accelerator of a node, with its node's fabrics."""

    name: str
    peak_tflops: float  # dense tensor-core bf16 (fp32 for the CPU spec)
    hbm_GBps: float
    intra: Link  # within a node
    inter: Link  # across nodes, per GPU
    sm_count: int
    gpus_per_node: int = 8
    dtype_bytes: int = 2
    gemm: GemmEfficiency = field(default_factory=GemmEfficiency)
    attention_fraction: float = 0.5  # assumption: flash attention fwd/bwd at 50% of dense peak
    nccl_ctas: int = 16  # assumption: CTAs (SMs) an NCCL collective / P2P kernel occupies
    note: str = ""

    @property
    def intra_link_GBps(self) -> float:
        return self.intra.bandwidth_GBps

    @property
    def intra_latency_us(self) -> float:
        return self.intra.latency_us

    @property
    def inter_link_GBps(self) -> float:
        return self.inter.bandwidth_GBps

    @property
    def inter_latency_us(self) -> float:
        return self.inter.latency_us

    def link_for(self, group_span: int) -> Link:
        """The fabric a group of consecutive ranks spanning ``group_span`` GPUs uses."""
        return self.intra if group_span <= self.gpus_per_node else self.inter

    @property
    def nccl_sm_fraction(self) -> float:
        """Share of the SMs NCCL's kernels take from a concurrent GEMM (0 on a CPU rank)."""
        return min(1.0, self.nccl_ctas / self.sm_count) if self.sm_count > 1 else 0.0


def _gpu(name, tflops, hbm, nvlink_total_GBps, sms, inter_GBps, note, pcie=False) -> HardwareSpec:
    per_direction = nvlink_total_GBps / 2  # datasheets quote both directions together
    return HardwareSpec(
        name=name,
        peak_tflops=tflops,
        hbm_GBps=hbm,
        intra=nccl_link(per_direction, "pcie" if pcie else "nvlink"),
        inter=nccl_link(inter_GBps, "net"),
        sm_count=sms,
        note=note,
    )


HARDWARE: dict[str, HardwareSpec] = {
    # A100 80GB PCIe datasheet: 312 TFLOPS bf16 dense, 1,935 GB/s HBM2e, PCIe Gen4 64 GB/s
    # (both directions; TP=8 has no NVLink: the bridge pairs only 2 GPUs). 108 SMs (A100
    # whitepaper). Inter-node 12.5 GB/s per GPU: assumption (one 100 Gb/s NIC per GPU; PCIe
    # servers carry fewer NICs than a DGX).
    "a100-pcie": _gpu("a100-pcie", 312.0, 1935.0, 64.0, 108, 12.5, "A100 80GB PCIe, PCIe Gen4 ring", pcie=True),
    # A100 80GB SXM datasheet: 312 TFLOPS, 2,039 GB/s, NVLink 600 GB/s. DGX A100 datasheet:
    # 8 x 200 Gb/s HDR InfiniBand = 25 GB/s per GPU.
    "a100-sxm": _gpu("a100-sxm", 312.0, 2039.0, 600.0, 108, 25.0, "A100 80GB SXM4, NVSwitch"),
    # H800 SXM datasheet: 989 TFLOPS bf16 dense (1,979 with sparsity), 3.35 TB/s HBM3, NVLink
    # 400 GB/s. 132 SMs. Inter-node 50 GB/s per GPU: assumption (a 400 Gb/s NIC per GPU, as DGX H100).
    "h800-sxm": _gpu("h800-sxm", 989.0, 3350.0, 400.0, 132, 50.0, "H800 SXM5, NVSwitch (NVLink 400 GB/s)"),
    # H100 SXM datasheet: 989 TFLOPS bf16 dense, 3.35 TB/s, NVLink 900 GB/s; 132 SMs. DGX H100
    # datasheet: 8 x 400 Gb/s ConnectX-7 = 50 GB/s per GPU.
    "h100-sxm": _gpu("h100-sxm", 989.0, 3350.0, 900.0, 132, 50.0, "H100 SXM5, NVSwitch"),
    # H200 SXM datasheet: 989 TFLOPS bf16 dense, 4.8 TB/s HBM3e, NVLink 900 GB/s; 132 SMs.
    # Inter-node as DGX H100 (assumption: DGX H200 uses the same 400 Gb/s per GPU).
    "h200-sxm": _gpu("h200-sxm", 989.0, 4800.0, 900.0, 132, 50.0, "H200 SXM, NVSwitch"),
}


def get_hardware(name: str) -> HardwareSpec:
    try:
        return HARDWARE[name]
    except KeyError:
        raise KeyError(f"unknown hardware {name!r}; known: {', '.join(sorted(HARDWARE))}") from None


def cpu_emulated_spec(
    gemm_gflops: float,
    mem_GBps: float,
    link_bandwidth_GBps: float,
    link_latency_us: float,
    gemm: Optional[GemmEfficiency] = None,
    dtype_bytes: int = 4,
) -> HardwareSpec:
    """One CPU rank (one thread) on the emulated link (``comm.emulated_link.LinkSpec``).

    ``gemm_gflops`` is a *measured* GEMM rate of large shapes, so the efficiency curve's
    maximum is 1 unless ``gemm`` (e.g. fitted by ``gemm.fit_efficiency``) says otherwise;
    ``mem_GBps`` the measured rate of element-wise ops. The emulated link charges
    ``latency`` per message with no launch cost and has no small-message protocol; waiting on it
    costs no CPU, so communication takes nothing from compute (``sm_count`` 1: no contention).
    """
    return HardwareSpec(
        name="cpu-emulated",
        peak_tflops=gemm_gflops / 1e3,
        hbm_GBps=mem_GBps,
        intra=Link(bandwidth_GBps=link_bandwidth_GBps, latency_us=link_latency_us),
        inter=Link(bandwidth_GBps=link_bandwidth_GBps, latency_us=link_latency_us),
        sm_count=1,
        gpus_per_node=1 << 20,
        dtype_bytes=dtype_bytes,
        gemm=gemm if gemm is not None else GemmEfficiency(max_fraction=1.0, half_dim=0.0, hbm_fraction=1.0),
        attention_fraction=1.0,
        nccl_ctas=0,
        note="one CPU thread per rank, emulated link (1 egress port per rank)",
    )


def calibrate_gemm(hw: HardwareSpec, table) -> HardwareSpec:
    """``hw`` with its GEMM efficiency curve fitted to measured times: ``{(M, N, K): ms}`` or rows
    ``{"M", "N", "K", "ms"}`` (e.g. the GPU check's chunked-GEMM table of 1-16 chunks)."""
    from .gemm import fit_efficiency, table_from_rows

    if not isinstance(table, dict):
        table = table_from_rows(table)
    fitted = fit_efficiency(table, hw.peak_tflops, hbm_fraction=hw.gemm.hbm_fraction)
    return replace(hw, gemm=fitted)


def with_link(hw: HardwareSpec, bandwidth_GBps: float) -> HardwareSpec:
    """``hw`` with its intra-node link at another bandwidth (for what-if and monotonicity)."""
    return replace(hw, intra=replace(hw.intra, bandwidth_GBps=bandwidth_GBps))
