"""The emulated link's board of P2P deadlines, shared by the rank processes of one machine."""

from __future__ import annotations

import mmap
import os
import tempfile
from collections import defaultdict
from typing import Optional


class DeadlineBoard:
    """Deadlines of P2P messages in flight, in a shared file mapping (/dev/shm), one hash table
    per (src, dst).

    The sender posts ``(group, tag, seq) -> deadline`` before it sends (``seq`` counts its
    messages to that peer with that tag in that group); the receiver, which counts the same way
    (gloo matches a peer's messages of one tag in one group in order), takes the entry once the
    data has arrived, so the entry is always there by then. ``group`` is a channel number
    derived from the process group's name, the same on every rank; two groups are two channels,
    as in gloo, so equal tags in different groups never mix.
    """

    SLOTS = 8192
    EMPTY = -1

    def __init__(self, world: int, path: Optional[str] = None):
        size = world * world * self.SLOTS * 16
        self.owner = path is None
        if self.owner:
            directory = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
            fd, path = tempfile.mkstemp(prefix="megatron_overlap_link_", dir=directory)
            os.ftruncate(fd, size)
        else:
            fd = os.open(path, os.O_RDWR)
        self.path = path
        self._mmap = mmap.mmap(fd, size)
        os.close(fd)
        self._view = memoryview(self._mmap)
        self._halves = (self._view[: size // 2], self._view[size // 2 :])
        self.keys = self._halves[0].cast("q")
        self.values = self._halves[1].cast("d")
        self.world = world
        if self.owner:
            for i in range(len(self.keys)):
                self.keys[i] = self.EMPTY
        self._sent: dict = defaultdict(int)
        self._received: dict = defaultdict(int)

    def _base(self, src: int, dst: int) -> int:
        return (src * self.world + dst) * self.SLOTS

    @staticmethod
    def _key(channel: int, tag: int, seq: int) -> int:
        if not 0 <= tag < 1 << 23:
            raise ValueError(f"emulated link: P2P tag {tag} outside 0 .. 2**23 - 1 (gloo matches 24 bits)")
        return (channel << 43) | (tag << 20) | (seq & 0xFFFFF)  # < 2**63: fits the board's int64

    def post(self, src: int, dst: int, tag: int, deadline: float, channel: int = 0):
        seq = self._sent[(channel, dst, tag)]
        self._sent[(channel, dst, tag)] = seq + 1
        key, base = self._key(channel, tag, seq), self._base(src, dst)
        slot = hash(key) % self.SLOTS
        for _ in range(self.SLOTS):
            if self.keys[base + slot] == self.EMPTY:
                self.values[base + slot] = deadline
                self.keys[base + slot] = key  # written last: the entry is complete once seen
                return
            slot = (slot + 1) % self.SLOTS
        raise RuntimeError("emulated link: more than 8192 messages in flight between two ranks")

    def next_key(self, src: int, dst: int, tag: int, channel: int = 0) -> tuple:
        seq = self._received[(channel, src, tag)]
        self._received[(channel, src, tag)] = seq + 1
        return (src, dst, tag, seq, channel)

    def take(self, src: int, dst: int, tag: int, seq: int, channel: int = 0) -> float:
        key, base = self._key(channel, tag, seq), self._base(src, dst)
        slot = hash(key) % self.SLOTS
        for _ in range(self.SLOTS):
            if self.keys[base + slot] == key:
                deadline = self.values[base + slot]
                self.keys[base + slot] = self.EMPTY
                return deadline
            slot = (slot + 1) % self.SLOTS
        raise RuntimeError(f"emulated link: no deadline posted for message {seq} with tag {tag} from rank {src} "
                           f"(channel {channel})")

    def close(self):
        for view in (self.keys, self.values, *self._halves, self._view):
            view.release()
        self._mmap.close()
        if self.owner:
            os.unlink(self.path)
