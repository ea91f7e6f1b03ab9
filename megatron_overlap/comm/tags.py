"""P2P tags: one table of streams, each owning ``STREAM_SIZE`` consecutive tags.

Gloo matches a peer's point-to-point messages by tag (on the tag's low 24 bits), and the
emulated link keys its deadlines by tag: two streams of P2P traffic that can be in flight at
the same time between the same ranks must never share a tag, and every rank must give the same
message the same tag. All of it is decided here, in one table, instead of in tag ranges
coordinated through comments: a stream is named, its base is its position in the table, and
an index inside it (step x pieces + piece, a peer offset, ...) must stay below ``STREAM_SIZE``.
Every tag stays below 2**23.
"""

from __future__ import annotations

STREAM_SIZE = 1 << 16

STREAMS = (
    "tp.ring_all_gather",      # comm.rings.RingAllGather (Column forward, Row backward, fused transport)
    "tp.ring_reduce_scatter",  # comm.rings.RingReduceScatter
    "tp.a2a_reduce_scatter",   # comm.rings.A2AReduceScatter
    "tp.fused_slots",          # tp.backends.fused: GEMM-RS slots to their owners
    "cp.kv_forward",           # cp.ring: K/V blocks, forward
    "cp.kv_backward",          # cp.ring: K/V blocks, backward
    "cp.dkv",                  # cp.ring: dK/dV running sums travelling back
    "cp.a2a",                  # cp.a2a: sequence <-> head all-to-all, forward
    "cp.a2a_grad_out",         # cp.a2a: its backward, head -> sequence
    "cp.a2a_grad_in",          # cp.a2a: its backward, sequence -> head
    "pp.stage",                # integration.schedules: activations and gradients between stages
    "pp.rows",                 # integration.schedules: a step's micro-batch rows, checked between stages (HDP)
    "tp.fusion_all_gather",    # tp.allreduce_fusion: the fused block's all-gather into the next norm and GEMM
)
assert (len(STREAMS) + 1) * STREAM_SIZE <= 1 << 23


def base(stream: str) -> int:
    """The first tag of ``stream``."""
    try:
        return (STREAMS.index(stream) + 1) * STREAM_SIZE
    except ValueError:
        raise KeyError(f"unknown P2P tag stream {stream!r}; streams: {', '.join(STREAMS)}") from None


def tag(stream: str, index: int = 0) -> int:
    """Tag ``index`` of ``stream``."""
    if not 0 <= index < STREAM_SIZE:
        raise ValueError(f"tag index {index} outside stream {stream!r} (0 .. {STREAM_SIZE - 1}): too many ring "
                         "steps x pieces for one stream")
    return base(stream) + index
