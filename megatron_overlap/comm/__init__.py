"""Communication helpers: chunked P2P rings over explicit process groups, and an emulated link.

Nothing in this package imports Megatron.
"""

from .rings import A2AReduceScatter, Piece, RingAllGather, RingReduceScatter, make_reduce_scatter, split_pieces

__all__ = [
    "A2AReduceScatter",
    "Piece",
    "RingAllGather",
    "RingReduceScatter",
    "make_reduce_scatter",
    "split_pieces",
]
