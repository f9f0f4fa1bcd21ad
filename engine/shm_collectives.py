"""All-reduce and gather between the CPU ranks of one tensor-parallel engine, through shared memory.

gloo moves a collective over loopback TCP: ~1.6 ms for a [64, 1024] fp32 all-reduce here, 17 of them per
decode step of the 8-layer benchmark model, ~40 % of the step (docs/benchmarks.md, Tensor parallelism). All
ranks of a CPU engine share one host, so each rank writes its tensor into its slot of a /dev/shm file, raises
its flag, waits for every rank's flag and sums the slots itself, in rank order (every rank gets the same bits).

Collective number m uses buffer m % 2. A rank reuses a buffer only once every rank has raised its flag for
the collective before (it then finished reading the one before that): double buffering without a second
barrier. Flags are plain 8-byte stores: ordered after the data on x86-64 (TSO); other CPUs use gloo
(`supported()`). Tensors larger than a slot go through gloo too, decided by size alone, so every rank picks
the same path.
"""

from __future__ import annotations

import mmap
import os
import platform
import secrets
import struct
import time
from typing import Callable

import torch

FLAG = struct.Struct("<q")
FLAG_STRIDE = 64            # one cache line per rank's flag
SPIN_CHECKS = 200           # busy polls (~1 µs each) before yielding the core: ranks usually arrive within µs


def supported(device: torch.device) -> bool:
    return device.type == "cpu" and platform.machine().lower() in ("x86_64", "amd64")


class ShmCollectives:
    def __init__(self, name: str, size: int, rank: int, slot_bytes: int, create: bool) -> None:
        self.name, self.size, self.rank, self.slot_bytes = name, size, rank, slot_bytes
        self._data_at = FLAG_STRIDE * size
        total = self._data_at + 2 * size * slot_bytes
        path = os.path.join("/dev/shm", name)
        fd = os.open(path, (os.O_RDWR | os.O_CREAT | os.O_EXCL) if create else os.O_RDWR, 0o600)
        try:
            if create:
                try:
                    os.posix_fallocate(fd, 0, total)   # ENOSPC now rather than SIGBUS on first touch
                except OSError:
                    os.unlink(path)
                    raise
            self._mm = mmap.mmap(fd, total)
        finally:
            os.close(fd)
        data = torch.frombuffer(self._mm, dtype=torch.uint8)[self._data_at:]
        self._slots = data.view(2, size, slot_bytes)
        self.count = 0                       # collectives this rank started
        self.abort_reason: str | None = None   # set from another thread (a rank died): waits stop at once
        self.peer_check: Callable[[], str | None] | None = None   # polled while waiting; a reason to stop

    @classmethod
    def create(cls, size: int, slot_bytes: int) -> "ShmCollectives":
        return cls(f"pdcluster-tpc-{os.getpid()}-{secrets.token_hex(4)}", size, 0, slot_bytes, True)

    def attach_args(self, rank: int) -> tuple[str, int, int, int]:
        return self.name, self.size, rank, self.slot_bytes

    @classmethod
    def attach(cls, name: str, size: int, rank: int, slot_bytes: int) -> "ShmCollectives":
        return cls(name, size, rank, slot_bytes, False)

    def unlink(self) -> None:
        try:
            os.unlink(os.path.join("/dev/shm", self.name))
        except FileNotFoundError:
            pass

    def fits(self, x: torch.Tensor) -> bool:
        return x.device.type == "cpu" and x.numel() * x.element_size() <= self.slot_bytes

    # ---- collectives ----

    def all_reduce(self, x: torch.Tensor, timeout_s: float) -> torch.Tensor:
        """Sum of every rank's `x`, written into `x`."""
        parts = self._exchange(x, timeout_s)
        torch.add(parts[0], parts[1], out=x) if self.size == 2 else _sum_into(x, parts)
        return x

    def gather(self, x: torch.Tensor, timeout_s: float) -> list[torch.Tensor] | None:
        """Every rank's `x` (same shape everywhere), on rank 0; None on the others. The parts are views of the
        shared slots: valid until this rank's next collective but one."""
        if self.rank == 0:
            return self._exchange(x, timeout_s)
        self._write(x, timeout_s)
        return None

    def _exchange(self, x: torch.Tensor, timeout_s: float) -> list[torch.Tensor]:
        """Every rank's `x`, once all have written theirs."""
        m, deadline = self._write(x, timeout_s)
        self._wait_all(m, deadline)
        buf = self._slots[m % 2]
        nbytes = x.numel() * x.element_size()
        return [buf[r, :nbytes].view(x.dtype).view(x.shape) for r in range(self.size)]

    def _write(self, x: torch.Tensor, timeout_s: float) -> tuple[int, float]:
        """`x` into this rank's slot of the next collective, flag raised; returns (its number, its deadline)."""
        self.count += 1
        m = self.count
        deadline = time.monotonic() + timeout_s
        self._wait_all(m - 1, deadline)   # everyone is done reading this buffer's previous use
        nbytes = x.numel() * x.element_size()
        self._slots[m % 2][self.rank, :nbytes].copy_(x.contiguous().view(-1).view(torch.uint8))
        FLAG.pack_into(self._mm, self.rank * FLAG_STRIDE, m)
        return m, deadline

    def _flags(self) -> list[int]:
        return [FLAG.unpack_from(self._mm, r * FLAG_STRIDE)[0] for r in range(self.size)]

    def _wait_all(self, m: int, deadline: float) -> None:
        checks = 0
        next_peer_check = 0.0
        while min(self._flags()) < m:
            checks += 1
            if checks < SPIN_CHECKS:
                continue
            now = time.monotonic()
            if self.abort_reason is not None:
                raise RuntimeError(f"tensor-parallel collective aborted: {self.abort_reason}")
            if self.peer_check is not None and now > next_peer_check:
                next_peer_check = now + 0.5
                reason = self.peer_check()
                if reason:
                    raise RuntimeError(f"tensor-parallel collective aborted: {reason}")
            if now > deadline:
                behind = [r for r, f in enumerate(self._flags()) if f < m]
                raise TimeoutError(f"tensor-parallel collective {m}: rank(s) {behind} did not arrive in time")
            if checks < 20 * SPIN_CHECKS:
                os.sched_yield()   # ranks may outnumber cores: let the one we wait for run
            else:
                time.sleep(0.0001)

    def close(self) -> None:
        self._slots = torch.empty((2, 0, 0), dtype=torch.uint8)   # drop the views of the mapping, so it can close
        try:
            self._mm.close()
        except BufferError:   # a view is still alive; the mapping goes with the process
            pass


def _sum_into(out: torch.Tensor, parts: list[torch.Tensor]) -> None:
    torch.add(parts[0], parts[1], out=out)
    for p in parts[2:]:
        out.add_(p)
