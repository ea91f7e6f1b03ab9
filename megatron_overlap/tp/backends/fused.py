"""``--overlap-tp fused``: our Triton kernels (``megatron_overlap.kernels``) fed by a transport.

gather_matmul: the gathered input buffer is cut into chunks (rank r's piece k is chunk
``r*P + k``); the local chunks' flags are raised at once, the P2P ring of the ``p2p`` backend
brings the others and raises each chunk's flag as it lands; one persistent AG-GEMM kernel
reads every chunk the moment its flag is up. On a GPU the kernel is launched first, on the
compute stream, and the transport runs on a side stream (it spins until the data it reads is
there; ``reserved_sms`` SMs stay free for NCCL). On the CPU interpreter, which runs programs
one after another, the transport completes first and the kernel then finds every flag up.

matmul_reduce_scatter: one GEMM-RS kernel writes this rank's partial for every owner into a
slot (peers first, own last) and raises each owner's flag when its slot is complete; the
slots go to their owners as an all-to-all (P2P pairs); ``finish`` adds the received slots
with the reduce kernel (fixed order). The fused backend's reduce-scatter is always this
all-to-all + local reduce. Across GPUs the slots leave when the GEMM kernel has finished: the
reduce-scatter overlaps the next work (the Column backward's wgrad), not the GEMM itself;
inside one device (``kernels/emulation.py``) the owners read their slots as they complete.
"""

from __future__ import annotations

import functools
import os
from typing import Optional

import torch
import torch.distributed as dist

from ...comm import tags
from ...comm.p2p import exchange
from ...comm.rings import RingAllGather
from ...comm import waits
from .base import TPBackend, gathered_buffer, refuse



def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.lru_cache(maxsize=None)
def triton_version() -> Optional[str]:
    try:
        import triton

        return triton.__version__
    except ImportError:
        return None


def availability(device_type: Optional[str] = None) -> tuple[bool, str]:
    """Whether the fused kernels can run here, and why not."""
    if triton_version() is None:
        return False, "Triton is not installed (pip install 'megatron-overlap[kernels]')"
    cuda = torch.cuda.is_available() if device_type is None else device_type == "cuda"
    if cuda:
        return True, f"Triton {triton_version()} on CUDA"
    if interpreting():
        return True, "Triton interpreter (TRITON_INTERPRET=1): fp32 only, slow, for tests"
    return False, "the Triton kernels need a CUDA GPU (on CPU they run only under TRITON_INTERPRET=1, for tests)"


def _flat(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])


class FusedBackend(TPBackend):
    name = "fused"
    ALL_REDUCE = False  # its slots leave once the whole GEMM kernel ran: an all-reduce from it hides nothing

    def __init__(self, reserved_sms: int = 8, configs=None, timeout_s: float = 300.0):
        from ...kernels.ag_gemm import spin_limit

        self.reserved_sms = reserved_sms
        self.configs = configs  # optional kernels.tuning.ConfigChooser
        self.max_spins = spin_limit(timeout_s)  # every flag wait in the kernels ends
        self._streams: dict = {}  # transport stream per CUDA device
        self._watched: list = []  # (event, error word, kernel, describe) of kernels still running
        self.timeout_s = timeout_s

    def _watch(self, error, kernel: str, describe, device) -> None:
        """Check ``error`` now on CPU; on a GPU once the kernel has finished (polled without a
        sync at the next fused op, and at every ``finish``): the host must not wait for a
        kernel that waits for the transport the host is about to issue."""
        where = waits.current().describe()  # the layer the kernel ran for, for its message
        if where:
            describe = (lambda d: lambda index: f"{d(index)} [{where}]")(describe)
        if device.type != "cuda":
            self._raise_if_set(error, kernel, describe)
            return
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        self._watched.append((event, error, kernel, describe))

    def poll(self) -> None:
        """Raise the error of any finished kernel whose flag wait gave up."""
        still = []
        for event, error, kernel, describe in self._watched:
            if event.query():
                self._raise_if_set(error, kernel, describe)
            else:
                still.append((event, error, kernel, describe))
        self._watched = still

    def _raise_if_set(self, error, kernel, describe) -> None:
        from ...kernels.ag_gemm import FlagWaitTimeout, check_error

        try:
            check_error(error, kernel, self.max_spins)
        except FlagWaitTimeout as exc:
            raise RuntimeError(f"fused {kernel}: {describe(exc.index)} never arrived within {self.max_spins} spins: "
                               "its sender failed or went silent (the ranks' collectives time out the same way)"
                               ) from exc

    def _side_stream(self, device: torch.device):
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device=device)
        return self._streams[device]

    def check(self, x: torch.Tensor) -> None:
        ok, why = availability(x.device.type)
        if not ok:
            refuse("fused", why)
        allowed = (torch.float32,) if x.device.type != "cuda" else (torch.float32, torch.float16, torch.bfloat16)
        if x.dtype not in allowed:
            names = ", ".join(str(d).replace("torch.", "") for d in allowed)
            refuse("fused", f"dtype {str(x.dtype).replace('torch.', '')} is not supported here (supported: {names})")
        if x.numel() == 0:
            refuse("fused", "empty activations")

    def _config(self, kind, m, n, k, dtype, group):
        from ...kernels.ag_gemm import CONFIGS

        if interpreting() or self.configs is None:
            return CONFIGS[-1] if interpreting() else CONFIGS[0]
        from ...comm.agree import GroupAgreement

        return self.configs.choose(kind, m, n, k, dtype, world=dist.get_world_size(group), agree=GroupAgreement(group))

    # ------------------------------------------------------------------ AG-GEMM
    def gather_matmul(self, x_shard, weight_t, group, plan, keep_gathered=False, after_own=None):
        from ...kernels.ag_gemm import ag_gemm

        self.poll()
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        s = x_shard.shape[0]
        per_row = x_shard[0].numel() // x_shard.shape[-1] if s else 1  # tokens per sequence row
        pieces = plan.pieces
        bounds = [0]
        for owner in range(size):
            for piece in pieces:
                bounds.append((owner * s + piece.stop) * per_row)
        gathered = gathered_buffer(x_shard, group)
        flags = torch.zeros(size * len(pieces), dtype=torch.int32, device=x_shard.device)
        ring = RingAllGather(x_shard, gathered, group, pieces, copy_own=True)
        own = [rank * len(pieces) + k for k in range(len(pieces))]
        flags[own] = 1
        order = list(own)
        for step in range(1, size):
            for k, piece in enumerate(pieces):
                order.append(ring.owner(step, piece) * len(pieces) + k)
        out = torch.empty((s * size, *x_shard.shape[1:-1], weight_t.shape[1]), dtype=x_shard.dtype,
                          device=x_shard.device)
        config = self._config("ag_gemm", s * size * per_row, weight_t.shape[1], weight_t.shape[0], x_shard.dtype, group)

        def transport():
            for step in range(1, size):
                for k, piece in enumerate(pieces):
                    owner, _rows, _view = ring.take(step, k)
                    flags[owner * len(pieces) + k] = 1
            ring.finish()

        error = torch.zeros(1, dtype=torch.int32, device=x_shard.device)
        launch = functools.partial(ag_gemm, _flat(gathered), weight_t, flags, bounds, order, out=_flat(out),
                                   config=config, reserved_sms=self.reserved_sms, max_spins=self.max_spins, error=error)
        P = len(pieces)
        describe = lambda c: f"chunk {c} (group rank {c // P}'s piece {c % P})"  # noqa: E731
        if x_shard.device.type == "cuda":
            side = self._side_stream(x_shard.device)
            side.wait_stream(torch.cuda.current_stream(x_shard.device))
            launch()  # spins on the flags the side stream raises
            with torch.cuda.stream(side):
                transport()
            torch.cuda.current_stream(x_shard.device).wait_stream(side)
        else:
            transport()
            launch()
        self._watch(error, "ag_gemm", describe, x_shard.device)
        if after_own is not None:  # the kernel is one op: after it is issued
            after_own()
        return out, (gathered if keep_gathered else None)

    # ------------------------------------------------------------------ GEMM-RS
    def matmul_reduce_scatter(self, x, weight_t, group, plan):
        from ...kernels.gemm_rs import gemm_rs

        self.poll()
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        if x.shape[0] % size:
            raise ValueError(f"fused gemm_rs: {x.shape[0]} rows do not split over {size} ranks")
        order = [(rank + i) % size for i in range(1, size)] + [rank]
        a = _flat(x)
        config = self._config("gemm_rs", a.shape[0], weight_t.shape[1], a.shape[1], x.dtype, group)
        slots, _flags = gemm_rs(a, weight_t, size, order, config=config, reserved_sms=self.reserved_sms)
        return _PendingA2A(x, slots, weight_t.shape[1], group, rank, size, self)


class _PendingA2A:
    """The slots of a GEMM-RS on their way to their owners; ``finish`` reduces what arrived."""

    def __init__(self, x, slots, n, group, rank, size, backend: FusedBackend):
        self.backend = backend
        self.shape = (x.shape[0] // size, *x.shape[1:-1], n)
        self.received = torch.empty_like(slots)
        self.flags = torch.zeros(size, dtype=torch.int32, device=slots.device)
        self.rank, self.size, self.group = rank, size, group
        self.works = []
        for offset in range(1, size):
            dst, src = (rank + offset) % size, (rank - offset) % size
            send, recv = exchange(group, send=slots[dst], dst=dst, recv=self.received[src], src=src,
                                  tag=tags.tag("tp.fused_slots", offset))
            self.works.append((send, recv, src, slots))
        self.received[rank].copy_(slots[rank])
        self.flags[rank] = 1

    def finish(self) -> torch.Tensor:
        from ...kernels.gemm_rs import reduce_slots

        for send, recv, src, _keep in self.works:
            waits.wait(recv, f"fused GEMM-RS: slot of group rank {src} receive", self.group, src)
            self.flags[src] = 1
        for send, _recv, src, _keep in self.works:
            waits.wait(send, "fused GEMM-RS: slot send", self.group, (self.rank - (src - self.rank)) % self.size)
        order = [(self.rank - i) % self.size for i in range(self.size)]  # own first, then arrivals
        error = torch.zeros(1, dtype=torch.int32, device=self.received.device)
        out = reduce_slots(self.received, self.flags, order, max_spins=self.backend.max_spins, error=error)
        self.backend._watch(error, "reduce_slots", lambda src: f"the slot of group rank {src}", self.received.device)
        self.backend.poll()
        return out.view(self.shape)

