"""KV pool in POSIX shared memory: the receiver creates it, a same-host sender maps it and copies in.

Files live in /dev/shm; the creator unlinks on close. Mapping with MAP_POPULATE pre-faults pages so the
first transfer does not pay page faults (a fresh mapping copies far below memcpy speed).

Next to the pool, `<name>.tags` holds one int64 per block: the tag of the reservation the block is open
to, 0 when none. The receiver sets a reservation's tags before handing out its destination and clears
them the moment it resolves or fails; a sender checks them right before and right after it copies, so it
needs no round trip to learn that its reservation is still live (a failed reservation's blocks stay
away from their owner for a grace period, so a copy already under way never lands in reused blocks).
"""

from __future__ import annotations

import mmap
import os
import secrets

import numpy as np
import torch

SHM_DIR = "/dev/shm"


def token_tag(token: str) -> int:
    """The non-zero int64 block tag of a reservation token (hex)."""
    return int(token[:15], 16) | 1


class SharedKVPool:
    """A tensor of `shape`/`dtype` backed by /dev/shm/<name>; hand `.tensor` to the engine."""

    def __init__(self, name: str, nbytes: int, shape: tuple[int, ...], dtype: torch.dtype, owner: bool):
        if "/" in name or not name:
            raise ValueError(f"shm name: expected a plain file name, got {name!r}")
        self.name = name
        self.owner = owner
        self._mmap = _map(name, nbytes, owner)
        self.tensor = torch.frombuffer(self._mmap, dtype=torch.uint8).view(dtype).view(shape)
        self.tags = block_tags(name, shape[0], owner)

    @classmethod
    def create(cls, shape: tuple[int, ...], dtype: torch.dtype, name: str | None = None) -> "SharedKVPool":
        name = name or f"pdcluster-kv-{os.getpid()}-{secrets.token_hex(4)}"
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        pool = cls(name, nbytes, tuple(shape), dtype, owner=True)
        pool.tensor.view(torch.uint8).zero_()  # touch every page now, not during serving
        return pool

    @classmethod
    def attach(cls, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> "SharedKVPool":
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        return cls(name, nbytes, tuple(shape), dtype, owner=False)

    def close(self) -> None:
        """Unlink the files (owner only). The mappings stay valid while tensors still reference them."""
        if self.owner:
            for name in (self.name, self.name + ".tags"):
                try:
                    os.unlink(os.path.join(SHM_DIR, name))
                except FileNotFoundError:
                    pass


def block_tags(name: str, num_blocks: int, create: bool = False) -> np.ndarray:
    """The int64 per-block tags next to pool `name` (see the module docstring)."""
    return np.frombuffer(_map(name + ".tags", 8 * num_blocks, create), dtype=np.int64)


def _map(name: str, nbytes: int, owner: bool) -> mmap.mmap:
    flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if owner else 0)
    fd = os.open(os.path.join(SHM_DIR, name), flags, 0o600)
    try:
        if owner:
            os.ftruncate(fd, nbytes)
        elif os.fstat(fd).st_size != nbytes:
            raise ValueError(f"shm {name}: size {os.fstat(fd).st_size} bytes, expected {nbytes}")
        return mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
    finally:
        os.close(fd)
