"""Chunked rings: all-gather that feeds a GEMM piece by piece, and reduce-scatter of partial
sums produced piece by piece.

Notation (R ranks in the TP group, this rank r, s rows per rank along dim 0):

- a rank's shard is cut into *pieces* (row ranges ``[start, stop)`` of the shard); with the
  bidirectional option each chunk is halved and the halves travel opposite ways;
- a piece travelling in direction ``d`` (+1 or -1) goes from rank r to rank r+d each hop.

All-gather: at step i a rank holds, for a piece of direction d, the rows that rank ``r - d*i``
owns, and forwards them to ``r + d`` the moment they land (for i < R-1). A consumer takes the
pieces in (step, piece) order and computes on each while later ones are in flight.

Reduce-scatter of partials ``P_q`` (rank q's contribution to every rank's rows): at step i rank r
computes its partial for the rows of rank ``r - d*(i+1)``, adds the running sum received from
``r - d``, and sends the sum on to ``r + d``; at step R-1 the destination is r itself. The
all-to-all variant sends each partial straight to its owner, which adds them up locally.

Tags (``comm.tags``: one named stream per engine) keep concurrent streams apart on gloo; NCCL
matches by order, which every rank follows identically because all loops here run in the same
(step, piece) order on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

from . import tags
from .p2p import exchange
from .waits import wait

# Partial-sum producer: (destination group rank, piece, optional output view) -> tensor of
# shape [piece.stop - piece.start, *rest]; when ``out`` is given the result is written there.
PartialFn = Callable[[int, "Piece", Optional[torch.Tensor]], torch.Tensor]


@dataclass(frozen=True)
class Piece:
    """Rows ``[start, stop)`` of a rank's shard, travelling towards rank ``r + direction``."""

    start: int
    stop: int
    direction: int = 1

    @property
    def rows(self) -> int:
        return self.stop - self.start


def split_pieces(rows: int, chunks: int, bidirectional: bool = False, taper: bool = False) -> tuple[Piece, ...]:
    """Cut ``rows`` into ``chunks`` chunks, halve each when ``bidirectional``, drop empty ones.

    Uniform chunks differ by at most one row (like ``torch.tensor_split``). ``taper`` makes
    the first and last chunk half the size of the others (weights 1, 2, ..., 2, 1): only those
    two sit on the critical path of a ring (the first partial before anything can be sent, the
    last piece's GEMM after everything has arrived), so they can be short while the middle
    chunks stay large and run at full GEMM speed.
    """
    if rows < 0 or chunks < 1:
        raise ValueError(f"split_pieces needs rows >= 0 and chunks >= 1, got {rows}, {chunks}")
    weights = [1] + [2] * (chunks - 2) + [1] if taper and chunks > 2 else [1] * chunks
    total = sum(weights)
    bounds = [0]
    acc = 0
    for w in weights:
        acc += w
        bounds.append((rows * acc) // total)  # near-proportional, monotone, ends at rows
    pieces = []
    for start, stop in zip(bounds, bounds[1:]):
        if bidirectional:
            mid = start + (stop - start + 1) // 2
            pieces += [Piece(start, mid, 1), Piece(mid, stop, -1)]
        else:
            pieces.append(Piece(start, stop, 1))
    return tuple(p for p in pieces if p.rows > 0)


class _RingBase:
    def __init__(self, group: dist.ProcessGroup, pieces: Sequence[Piece], shard_rows: int, stream: str):
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.pieces = tuple(pieces)
        self.shard_rows = shard_rows
        self.stream = stream
        if self.size * len(self.pieces) > tags.STREAM_SIZE:
            raise ValueError(f"{self.size} ranks x {len(self.pieces)} pieces exceed the {tags.STREAM_SIZE} tags of a ring")
        self._sends: list[tuple[dist.Work, torch.Tensor, int]] = []  # (work, tensor kept alive, destination)

    def _peer(self, offset: int) -> int:
        return (self.rank + offset) % self.size

    def _tag(self, step: int, k: int) -> int:
        return tags.tag(self.stream, step * len(self.pieces) + k)

    def _what(self, step: int, k: int) -> str:
        return f"{self.stream}: step {step} piece {k} receive"

    def rows_of(self, owner: int, piece: Piece) -> slice:
        """Rows of ``piece`` of rank ``owner`` inside the gathered [R*s, ...] tensor."""
        base = owner * self.shard_rows
        return slice(base + piece.start, base + piece.stop)

    def _wait_sends(self):
        for work, _keepalive, dst in self._sends:
            wait(work, f"{self.stream}: send", self.group, dst)
        self._sends.clear()


class RingAllGather(_RingBase):
    """Gather ``x_shard [s, *rest]`` of every rank into ``gathered [R*s, *rest]`` piece by piece.

    ``own()`` gives this rank's rows and shard (step 0, local: one GEMM for all of it);
    ``take(step, k)`` returns ``(owner, rows, tensor)`` for piece k at ring step ``step >= 1`` —
    waiting for it if needed and forwarding it before returning, so the caller's GEMM on it
    overlaps the next hop. Call ``take`` for every (step >= 1, k) in order, then ``finish``.
    ``copy_own`` also copies this rank's shard into ``gathered`` (for callers that keep it).
    """

    def __init__(
        self,
        x_shard: torch.Tensor,
        gathered: torch.Tensor,
        group: dist.ProcessGroup,
        pieces: Sequence[Piece],
        stream: str = "tp.ring_all_gather",
        copy_own: bool = False,
    ):
        super().__init__(group, pieces, x_shard.shape[0], stream)
        self.x_shard = x_shard
        self.gathered = gathered
        self._recvs: dict[tuple[int, int], dist.Work] = {}
        if copy_own:
            own = slice(self.rank * self.shard_rows, (self.rank + 1) * self.shard_rows)
            gathered[own].copy_(x_shard)
        for k, piece in enumerate(self.pieces):
            self._forward(0, k, x_shard[piece.start : piece.stop])

    def owner(self, step: int, piece: Piece) -> int:
        return self._peer(-piece.direction * step)

    def own(self) -> tuple[slice, torch.Tensor]:
        return slice(self.rank * self.shard_rows, (self.rank + 1) * self.shard_rows), self.x_shard

    def _forward(self, step: int, k: int, tensor: torch.Tensor):
        if step >= self.size - 1:
            return
        piece = self.pieces[k]
        nxt = self.gathered[self.rows_of(self.owner(step + 1, piece), piece)]
        send, recv = exchange(
            self.group,
            send=tensor,
            dst=self._peer(piece.direction),
            recv=nxt,
            src=self._peer(-piece.direction),
            tag=self._tag(step, k),
        )
        self._sends.append((send, tensor, self._peer(piece.direction)))
        self._recvs[(step + 1, k)] = recv

    def take(self, step: int, k: int) -> tuple[int, slice, torch.Tensor]:
        piece = self.pieces[k]
        owner = self.owner(step, piece)
        rows = self.rows_of(owner, piece)
        if step == 0:
            return owner, rows, self.x_shard[piece.start : piece.stop]
        self._pump()
        if (step, k) in self._recvs:
            wait(self._recvs.pop((step, k)), self._what(step, k), self.group, self._peer(-piece.direction))
            self._forward(step, k, self.gathered[rows])
        return owner, rows, self.gathered[rows]

    def _pump(self):
        """Forward every piece that has already landed, in (step, piece) order, so the ring
        keeps moving while the caller computes. Stops at the first piece still in flight:
        every rank forwards in the same order, which NCCL's in-order matching needs."""
        for key in sorted(self._recvs):
            work = self._recvs[key]
            if not work.is_completed():
                return
            del self._recvs[key]
            step, k = key
            piece = self.pieces[k]
            wait(work, self._what(step, k), self.group, self._peer(-piece.direction))
            self._forward(step, k, self.gathered[self.rows_of(self.owner(step, piece), piece)])

    def finish(self):
        if self._recvs:
            raise RuntimeError(f"RingAllGather finished with pieces never taken: {sorted(self._recvs)}")
        self._wait_sends()


class _ReduceScatterBase(_RingBase):
    def __init__(self, out_shard: torch.Tensor, group, pieces: Sequence[Piece], partial: PartialFn, stream: str):
        super().__init__(group, pieces, out_shard.shape[0], stream)
        self.out = out_shard
        self.partial = partial
        self._recvs: dict = {}
        self._own_done = False

    def run_own(self):
        """This rank's partial for its own rows, in one GEMM, into ``out_shard``."""
        self.partial(self.rank, Piece(0, self.shard_rows), self.out)
        self._own_done = True

    def _check_finish(self):
        if not self._own_done:
            raise RuntimeError(f"{type(self).__name__}.finish before run_own")


class RingReduceScatter(_ReduceScatterBase):
    """``out_shard [s, *rest]`` = sum over ranks of their partials for this rank's rows.

    ``run(step, k)`` (steps 0 .. R-2) computes this rank's partial for the destination of
    piece k at ``step``, adds the running sum that arrived from the previous rank, and passes it
    on. ``run_own()`` computes the partial for this rank's own rows in one GEMM into
    ``out_shard``; ``finish`` adds what arrived, so the caller can overlap other work (e.g. the
    wgrad GEMM) with the last hop.
    """

    def __init__(
        self,
        out_shard: torch.Tensor,
        group: dist.ProcessGroup,
        pieces: Sequence[Piece],
        partial: PartialFn,
        stream: str = "tp.ring_reduce_scatter",
    ):
        super().__init__(out_shard, group, pieces, partial, stream)

    def dest(self, step: int, piece: Piece) -> int:
        return self._peer(-piece.direction * (step + 1))

    def run(self, step: int, k: int):
        piece = self.pieces[k]
        acc = self.partial(self.dest(step, piece), piece, None)
        if step > 0:
            work, buf = self._recvs.pop((step, k))
            wait(work, self._what(step, k), self.group, self._peer(-piece.direction))
            acc = buf.add_(acc)
        nxt = torch.empty_like(acc)
        send, recv = exchange(
            self.group,
            send=acc,
            dst=self._peer(piece.direction),
            recv=nxt,
            src=self._peer(-piece.direction),
            tag=self._tag(step, k),
        )
        self._sends.append((send, acc, self._peer(piece.direction)))
        self._recvs[(step + 1, k)] = (recv, nxt)

    def finish(self) -> torch.Tensor:
        self._check_finish()
        last = self.size - 1
        for k, piece in enumerate(self.pieces):
            if (last, k) in self._recvs:
                work, buf = self._recvs.pop((last, k))
                wait(work, self._what(last, k), self.group, self._peer(-piece.direction))
                self.out[piece.start : piece.stop].add_(buf)
        if self._recvs:
            raise RuntimeError(f"RingReduceScatter finished with steps never run: {sorted(self._recvs)}")
        self._wait_sends()
        return self.out


class A2AReduceScatter(_ReduceScatterBase):
    """Reduce-scatter as all-to-all plus a local reduce.

    At step i < R-1 the partial for rank ``r + d*(i+1)`` goes straight to it, while the partial
    of rank ``r - d*(i+1)`` for our rows arrives; ``run_own`` computes the own partial into
    ``out_shard`` in one GEMM and ``finish`` adds the R-1 received partials in step order.
    """

    def __init__(
        self,
        out_shard: torch.Tensor,
        group: dist.ProcessGroup,
        pieces: Sequence[Piece],
        partial: PartialFn,
        stream: str = "tp.a2a_reduce_scatter",
    ):
        super().__init__(out_shard, group, pieces, partial, stream)

    def run(self, step: int, k: int):
        piece = self.pieces[k]
        offset = piece.direction * (step + 1)
        acc = self.partial(self._peer(offset), piece, None)
        buf = torch.empty_like(acc)
        send, recv = exchange(
            self.group, send=acc, dst=self._peer(offset), recv=buf, src=self._peer(-offset),
            tag=self._tag(step, k),
        )
        self._sends.append((send, acc, self._peer(offset)))
        self._recvs.setdefault(k, []).append((recv, buf, self._peer(-offset), step))

    def finish(self) -> torch.Tensor:
        self._check_finish()
        for k, piece in enumerate(self.pieces):
            view = self.out[piece.start : piece.stop]
            for work, buf, src, step in self._recvs.pop(k, []):
                wait(work, self._what(step, k), self.group, src)
                view.add_(buf)
        self._wait_sends()
        return self.out


def make_reduce_scatter(algo: str, out_shard, group, pieces, partial):
    """The reduce-scatter engine of ``algo`` (``ring`` or ``a2a``, ``tp.rs``)."""
    if algo == "ring":
        return RingReduceScatter(out_shard, group, pieces, partial)
    if algo == "a2a":
        return A2AReduceScatter(out_shard, group, pieces, partial)
    raise ValueError(f"unknown reduce-scatter algorithm {algo!r}")
