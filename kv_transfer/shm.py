"""KV pool in POSIX shared memory: the receiver creates it, a same-host sender maps it and copies in.

Files live in /dev/shm; the creator unlinks on close. Mapping with MAP_POPULATE pre-faults pages so the
first transfer does not pay page faults (a fresh mapping copies far below memcpy speed).

Lifetime: the files are named `pdcluster-kv-<creator pid>-<random>`. The creator unlinks them on close and
at interpreter exit (exceptions, SIGINT, a SIGTERM the node turns into an exit); what a process cannot
catch (SIGKILL, the OOM killer) is swept by the next node that starts on the host, by `pdcluster up` when
a child dies or the cluster stops, and by `pdcluster cleanup` (the systemd units' `ExecStopPost=`):
`sweep_dead_pools` removes every pool whose creator is gone.

Next to the pool, `<name>.tags` holds one int64 per block: the tag of the reservation the block is open
to, 0 when none. The receiver sets a reservation's tags before handing out its destination and clears
them the moment it resolves or fails; a sender checks them right before and right after it copies, so it
needs no round trip to learn that its reservation is still live (a failed reservation's blocks stay
away from their owner for a grace period, so a copy already under way never lands in reused blocks).
"""

from __future__ import annotations

import atexit
import mmap
import os
import re
import secrets
import time

import numpy as np
import torch

from pdcluster.control.process import pid_alive

SHM_DIR = "/dev/shm"
POOL_PREFIX = "pdcluster-kv-"
_POOL_FILE = re.compile(rf"^{POOL_PREFIX}(\d+)-[0-9a-f]+(\.tags)?$")
YOUNG_S = 30.0   # a pool file this young is never swept: its creator may be mapping it right now
_owned: set[tuple[str, int]] = set()   # (pool name, creating pid): unlinked at exit by that pid only


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
        self.shape, self.dtype = tuple(shape), dtype
        self._mmap = _map(name, nbytes, owner)
        self.tensor = torch.frombuffer(self._mmap, dtype=torch.uint8).view(dtype).view(shape)
        self.tags = block_tags(name, shape[2], owner)  # shape: layout.KVLayout.shape

    @classmethod
    def create(cls, shape: tuple[int, ...], dtype: torch.dtype, name: str | None = None) -> "SharedKVPool":
        name = name or f"{POOL_PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        check_room(nbytes)
        _owned.add((name, os.getpid()))
        try:
            pool = cls(name, nbytes, tuple(shape), dtype, owner=True)
            pool.tensor.view(torch.uint8).zero_()  # touch every page now, not during serving
        except BaseException:
            _unlink_pool(name)
            raise
        return pool

    @classmethod
    def attach(cls, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> "SharedKVPool":
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        return cls(name, nbytes, tuple(shape), dtype, owner=False)

    def __reduce__(self):
        """Pickled into another process (a tensor-parallel rank of the same engine): a mapping of the same pool."""
        return SharedKVPool.attach, (self.name, self.shape, self.dtype)

    def close(self) -> None:
        """Unlink the files (owner only). The mappings stay valid while tensors still reference them."""
        if self.owner:
            _unlink_pool(self.name)


def check_room(nbytes: int, shm_dir: str = SHM_DIR) -> None:
    """Refuse a pool that /dev/shm cannot hold now, instead of a SIGBUS or an OOM kill later."""
    st = os.statvfs(shm_dir)
    free = st.f_bavail * st.f_frsize
    if nbytes > free:
        raise ValueError(f"kv_cache_memory: a {nbytes / 2**30:.2f} GiB shared-memory KV pool does not fit: "
                         f"{shm_dir} has {free / 2**30:.2f} GiB free. Lower kv_cache_memory (--kv-cache-memory) "
                         f"or free {shm_dir} (`pdcluster cleanup` removes pools of dead nodes)")


def sweep_dead_pools(shm_dir: str = SHM_DIR) -> list[str]:
    """Unlink every pdcluster KV pool (and its tags file) whose creating process is gone; the names removed.
    A pool counts as alive while its creator's pid runs and maps it (a recycled pid does not), or while
    its file is younger than YOUNG_S."""
    try:
        names = os.listdir(shm_dir)
    except FileNotFoundError:
        return []
    pools: dict[str, int] = {}
    for name in names:
        m = _POOL_FILE.match(name)
        if m:
            pools[name.removesuffix(".tags")] = int(m.group(1))
    removed = []
    for pool, pid in sorted(pools.items()):
        if not _creator_alive(pid, os.path.join(shm_dir, pool)):
            _unlink_pool(pool, shm_dir)
            removed.append(pool)
    return removed


def _creator_alive(pid: int, path: str) -> bool:
    if not pid_alive(pid):
        return False
    try:
        with open(f"/proc/{pid}/maps") as f:
            if any(path in line for line in f):   # the pool or its tags file
                return True
    except OSError:
        return True   # cannot tell: keep it
    for file in (path, path + ".tags"):
        try:
            return time.time() - os.stat(file).st_mtime < YOUNG_S
        except FileNotFoundError:
            continue
    return True   # both gone already


def _unlink_pool(name: str, shm_dir: str = SHM_DIR) -> None:
    for file in (name, name + ".tags"):
        try:
            os.unlink(os.path.join(shm_dir, file))
        except FileNotFoundError:
            pass
    _owned.discard((name, os.getpid()))


@atexit.register
def _unlink_owned_at_exit() -> None:
    for name, pid in list(_owned):
        if pid == os.getpid():   # a forked child inherits the set, not the pools
            _unlink_pool(name)


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
