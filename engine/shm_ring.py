"""One writer hands the same bytes to N reader processes each step, written once into shared memory.

How rank 0 of a tensor-parallel engine gives the other ranks each step's inputs (engine/tp_executor.py).
The messages sit in `slots` fixed-size slots of a /dev/shm file that every process maps; the writer rings a
doorbell on each reader's pipe (one byte). The pipe is also the ordering point: the writer fills the slot
before its write(2), the reader reads the slot after its read(2), so no memory fences are needed even on
weakly ordered CPUs (Ascend hosts are ARM). A message larger than a slot travels inline in the pipe instead.
The pipe also carries the rare control messages (pickled) in order with the steps.

Each reader records in the file the last message it finished reading (the writer reuses a slot only after
every reader is past it) and the last one it finished executing (to name a rank that hangs).
"""

from __future__ import annotations

import mmap
import os
import pickle
import secrets
import struct
import time
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler
from typing import Any

SLOT_HEADER = struct.Struct("<QQ")   # message number, length
COUNTER = struct.Struct("<Q")
RING_DOORBELL, INLINE, CONTROL = b"R", b"I", b"C"


class RingTimeout(TimeoutError):
    pass


class BroadcastRing:
    def __init__(self, name: str, num_readers: int, slots: int, slot_bytes: int, create: bool) -> None:
        self.name, self.num_readers, self.slots, self.slot_bytes = name, num_readers, slots, slot_bytes
        self._counters = 2 * COUNTER.size * num_readers   # per reader: read, done
        size = self._counters + slots * (SLOT_HEADER.size + slot_bytes)
        path = os.path.join("/dev/shm", name)
        fd = os.open(path, (os.O_RDWR | os.O_CREAT | os.O_EXCL) if create else os.O_RDWR, 0o600)
        try:
            if create:
                os.ftruncate(fd, size)
            self._mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.seq = 0   # writer: messages written; reader: messages read

    @classmethod
    def create(cls, num_readers: int, slots: int = 4, slot_bytes: int = 1 << 20) -> "BroadcastRing":
        return cls(f"pdcluster-tp-{os.getpid()}-{secrets.token_hex(4)}", num_readers, slots, slot_bytes, True)

    def attach_args(self) -> tuple[str, int, int, int]:
        return self.name, self.num_readers, self.slots, self.slot_bytes

    @classmethod
    def attach(cls, name: str, num_readers: int, slots: int, slot_bytes: int) -> "BroadcastRing":
        return cls(name, num_readers, slots, slot_bytes, False)

    def unlink(self) -> None:
        """Remove the file once every reader has mapped it (the mappings stay valid)."""
        try:
            os.unlink(os.path.join("/dev/shm", self.name))
        except FileNotFoundError:
            pass

    # ---- counters ----

    def _counter(self, reader: int, which: int) -> int:
        return COUNTER.unpack_from(self._mm, (2 * reader + which) * COUNTER.size)[0]

    def _set_counter(self, reader: int, which: int, value: int) -> None:
        COUNTER.pack_into(self._mm, (2 * reader + which) * COUNTER.size, value)

    def read_count(self, reader: int) -> int:
        return self._counter(reader, 0)

    def done_count(self, reader: int) -> int:
        return self._counter(reader, 1)

    def mark_done(self, reader: int) -> None:
        self._set_counter(reader, 1, self.seq)

    # ---- writer ----

    def write(self, payload: bytes, doorbells: list[Connection], timeout_s: float) -> None:
        """Hand `payload` to every reader; waits (up to `timeout_s`) only if a reader is `slots` messages behind."""
        self.seq += 1
        if len(payload) > self.slot_bytes:
            for conn in doorbells:
                conn.send_bytes(INLINE + payload)
            return
        deadline = time.monotonic() + timeout_s
        while any(self.read_count(r) < self.seq - self.slots for r in range(self.num_readers)):
            if time.monotonic() > deadline:
                behind = [r + 1 for r in range(self.num_readers) if self.read_count(r) < self.seq - self.slots]
                raise RingTimeout(f"tensor-parallel rank(s) {behind} did not read their inputs in {timeout_s:.0f} s")
            time.sleep(0.0005)
        offset = self._slot_offset(self.seq)
        SLOT_HEADER.pack_into(self._mm, offset, self.seq, len(payload))
        self._mm[offset + SLOT_HEADER.size:offset + SLOT_HEADER.size + len(payload)] = payload
        for conn in doorbells:
            conn.send_bytes(RING_DOORBELL)

    def send_control(self, obj: Any, doorbells: list[Connection]) -> None:
        """A pickled object to every reader, in order with the ring's messages (not counted as one). Pickled as
        multiprocessing does, so a shared-memory tensor arrives as the same memory, not a copy (pickled once
        per reader: each pickle hands out its file descriptors once)."""
        for conn in doorbells:
            conn.send_bytes(CONTROL + bytes(ForkingPickler.dumps(obj)))

    # ---- reader ----

    def read(self, reader: int, conn: Connection, timeout_s: float) -> tuple[str, Any] | None:
        """("step", bytes) or ("control", object); None after `timeout_s` without a message."""
        if not conn.poll(timeout_s):
            return None
        msg = conn.recv_bytes()
        tag, body = msg[:1], msg[1:]
        if tag == CONTROL:
            return "control", pickle.loads(body)
        self.seq += 1
        if tag == INLINE:
            payload = body
        else:
            offset = self._slot_offset(self.seq)
            seq, length = SLOT_HEADER.unpack_from(self._mm, offset)
            if seq != self.seq:
                raise RuntimeError(f"broadcast ring: expected message {self.seq}, slot holds {seq}")
            payload = bytes(self._mm[offset + SLOT_HEADER.size:offset + SLOT_HEADER.size + length])
        self._set_counter(reader, 0, self.seq)
        return "step", payload

    def _slot_offset(self, seq: int) -> int:
        return self._counters + (seq % self.slots) * (SLOT_HEADER.size + self.slot_bytes)

    def close(self) -> None:
        try:
            self._mm.close()
        except BufferError:   # a view of it is still alive; the mapping goes with the process
            pass
