"""KV cache tiers below the pool: host memory, then local disk (vLLM's offloading connector, SGLang HiCache).

A block published in the prefix cache (`BlockManager.cache_full_blocks`) is copied to the host tier by this
module's worker thread (write-through: eviction from the pool, which happens on the allocation path, then copies
nothing). The engine pins the block until the copy is done (`BlockManager.pin`), so the allocator cannot hand it
out meanwhile. When the host tier is over its byte budget its least recently used blocks go to the disk tier
(write-back, same thread), one file per block; over the disk budget the oldest files are deleted.

A prompt whose leading blocks are missing from the pool but present in a tier gets fresh blocks, pinned, and
waits (`SequenceStatus.LOADING_KV`) while the worker copies them back; then they are published in the prefix
cache and the request is admitted as usual, its prefix served by them. A block that cannot be read back (evicted
meanwhile, file missing, truncated, corrupt: checksum or header mismatch) ends the load there: the rest of the
prompt is recomputed, never read wrong.

Blocks keep the pool's format: one block across every layer and plane (`KVCachePool.block`, int8 rows with their
scales included), contiguous. A disk file is a header (magic, format version, block hash, the pool's layout key,
payload bytes, CRC32) and the payload. The layout key (`layout_key`) covers the model, dtype, KV layout and block
geometry: a file written by another model or layout is a miss. A disk write that fails (disk full, I/O error)
turns the disk tier off with a warning; serving goes on with the host tier.

Threads: the engine thread calls `submit_store`, `submit_load`, `lookup`, `poll`; the worker owns the tiers'
contents. The index of which hashes a tier holds is shared under one lock.

A pool sliced per tensor-parallel rank keeps this class on rank 0, for rank 0's slice, and mirrors every change
of its index on the other ranks (`mirror`; engine/rank_tiers.py).
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import os
import queue
import struct
import threading
import zlib
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pdcluster.engine.kv_cache import KVCachePool
from pdcluster.engine.kv_events import DISK, EVICTED, HOST, STORED, KVEventLog

log = logging.getLogger(__name__)

MAGIC = b"PDKV"
FORMAT_VERSION = 1
HEADER = struct.Struct("<4sIQQQI")   # magic, version, block hash, layout key, payload bytes, crc32
SUFFIX = ".kvblock"
MAX_PENDING_STORES = 512             # blocks pinned for a store at once; past it new blocks are not offloaded


def layout_key(seed: int, pool: KVCachePool, rank_slice: tuple[int, int] | None = None) -> int:
    """A 63-bit key of what a stored block's bytes mean: the engine's hash seed (checkpoint, dtypes, block size,
    salt: `LLMEngine.hash_seed`), the pool's dtype and shape but for the block count, this format's version, and
    for a pool sliced per rank which slice (rank, ranks) the bytes are. Stable across processes (blake2b, not
    Python's hash)."""
    parts: tuple = (FORMAT_VERSION, seed, pool.dtype, tuple(pool.tensor.shape[:2]), tuple(pool.tensor.shape[3:]))
    if rank_slice is not None:
        parts += rank_slice
    text = "|".join(str(p) for p in parts).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") >> 1


@dataclass
class TierStats:
    """Counters since the start (the engine thread reads them; the worker writes them)."""
    stored_blocks: int = 0          # pool -> host copies
    dropped_stores: int = 0         # blocks not offloaded: too many stores pending
    host_evictions: int = 0         # host -> disk (or dropped without a disk tier)
    disk_writes: int = 0
    disk_evictions: int = 0         # files deleted over the disk budget
    loaded_host_blocks: int = 0     # tier -> pool copies, by the tier that served them
    loaded_disk_blocks: int = 0
    failed_loads: int = 0           # a block that could not be read back (missing, corrupt): recomputed
    disk_errors: int = 0
    disk_disabled: bool = False


@dataclass
class TierLoad:
    request_id: str
    blocks: list[int]
    hashes: list[int]
    done: int = 0                    # leading blocks copied into the pool
    job: int = 0                     # a sliced pool's: which load the ranks' reports are about


@dataclass
class TierPoll:
    stored: list[int] = field(default_factory=list)          # blocks whose store finished (unpin them)
    loaded: list[TierLoad] = field(default_factory=list)


class HostTier:
    """Blocks in host memory (pinned on a device), LRU, at most `capacity` bytes."""

    def __init__(self, capacity: int, pin: bool) -> None:
        self.capacity = capacity
        self.pin = pin
        self.entries: OrderedDict[int, torch.Tensor] = OrderedDict()   # hash -> block
        self.nbytes = 0

    def put(self, h: int, block: torch.Tensor) -> None:
        self.entries[h] = block
        self.nbytes += block.numel() * block.element_size()

    def pop_oldest(self) -> tuple[int, torch.Tensor]:
        h, block = self.entries.popitem(last=False)
        self.nbytes -= block.numel() * block.element_size()
        return h, block

    def drop(self, h: int) -> bool:
        block = self.entries.pop(h, None)
        if block is not None:
            self.nbytes -= block.numel() * block.element_size()
        return block is not None


class DiskTier:
    """One file per block under `path`, LRU by use, at most `capacity` bytes. Files left by an earlier run are
    indexed at start (oldest first) and checked when read. The file I/O runs on the worker; the index
    (`sizes`) is changed by the caller under its lock."""

    def __init__(self, path: str, capacity: int, key: int) -> None:
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.capacity = capacity
        self.key = key
        self.sizes: OrderedDict[int, int] = OrderedDict()   # hash -> file bytes
        self.nbytes = 0
        for f in sorted(self.path.glob(f"*{SUFFIX}"), key=lambda f: f.stat().st_mtime):
            try:
                h = int(f.name[:-len(SUFFIX)], 16)
            except ValueError:
                continue
            self.add(h, f.stat().st_size)

    def file(self, h: int) -> Path:
        return self.path / f"{h:016x}{SUFFIX}"

    def write_file(self, h: int, payload: memoryview) -> int:
        """Write atomically (a temporary file renamed), with the payload's CRC32, and return the file's size;
        OSError when the disk refuses."""
        target = self.file(h)
        tmp = target.with_suffix(".tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(HEADER.pack(MAGIC, FORMAT_VERSION, h, self.key, len(payload), zlib.crc32(payload)))
                f.write(payload)
            os.replace(tmp, target)
        except OSError:
            tmp.unlink(missing_ok=True)
            raise
        return HEADER.size + len(payload)

    def read_file(self, h: int, nbytes: int) -> bytes | None:
        """The block's payload, or None when the file is missing, truncated, of another layout or corrupt."""
        try:
            with open(self.file(h), "rb") as f:
                data = f.read(HEADER.size + nbytes + 1)
        except OSError:
            return None
        if len(data) != HEADER.size + nbytes:
            return None
        magic, version, got_h, key, size, crc = HEADER.unpack_from(data)
        payload = data[HEADER.size:]
        if (magic, version, got_h, key, size) != (MAGIC, FORMAT_VERSION, h, self.key, nbytes) \
                or zlib.crc32(payload) != crc:
            return None
        return payload

    def add(self, h: int, size: int) -> None:
        self.forget(h)
        self.sizes[h] = size
        self.nbytes += size

    def forget(self, h: int) -> None:
        self.nbytes -= self.sizes.pop(h, 0)

    def delete(self, h: int) -> None:
        self.file(h).unlink(missing_ok=True)
        self.forget(h)


class KVTiers:
    """The host and disk tiers of one engine's pool and the worker thread that moves blocks between them."""

    def __init__(self, pool: KVCachePool, host_bytes: int, disk_path: str | None, disk_bytes: int,
                 key: int) -> None:
        self.pool = pool
        self.block_bytes = pool.block_bytes
        self.host = HostTier(host_bytes, pin=pool.device.type != "cpu")
        self.disk = DiskTier(disk_path, disk_bytes, key) if disk_path and disk_bytes > 0 else None
        self.stats = TierStats()
        self.events: KVEventLog | None = None  # what enters and leaves each tier, for a cluster index
        self._lock = threading.Lock()          # guards the tiers' indexes and `_done`
        self._done = TierPoll()
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()         # set when `_done` gains something
        self.pending_stores = 0                # engine thread only
        self.pending_loads = 0
        # a sliced pool's: what left or moved in the index since the other ranks heard ("spill" | "drop" | "unlink",
        # hash), under the lock; None: no other rank mirrors these tiers
        self.mirror: list[tuple[str, int]] | None = None
        self._thread = threading.Thread(target=self._work, name="kv-tiers", daemon=True)
        self._thread.start()

    # ---- engine thread ---------------------------------------------------------------------------------------

    @property
    def busy(self) -> bool:
        return self.pending_stores > 0 or self.pending_loads > 0

    def lookup(self, hashes: list[int]) -> int:
        """How many leading `hashes` a tier holds."""
        n = 0
        with self._lock:
            for h in hashes:
                if h not in self.host.entries and (self.disk is None or h not in self.disk.sizes):
                    break
                n += 1
        return n

    def holds(self, h: int) -> bool:
        return self.lookup([h]) == 1

    def submit_store(self, block: int, h: int) -> bool:
        """Copy pinned `block` (published under `h`) to the host tier. False when too many stores are pending (the
        caller keeps the block unpinned; it is simply not offloaded)."""
        if self.pending_stores >= MAX_PENDING_STORES:
            self.stats.dropped_stores += 1
            return False
        self.pending_stores += 1
        self._submit(("store", block, h))
        return True

    def submit_load(self, request_id: str, blocks: list[int], hashes: list[int]) -> None:
        """Copy the tiers' blocks `hashes` into pinned pool `blocks`, in order, stopping at the first one missing."""
        self.pending_loads += 1
        self._submit(("load", TierLoad(request_id, list(blocks), list(hashes))))

    def _submit(self, job: tuple) -> None:
        self._jobs.put(job)

    def flush(self) -> None:
        """Hand on what was submitted since the last call (here the worker has it already; a sliced pool's other
        ranks hear it in one message)."""

    def poll(self, timeout: float = 0.0) -> TierPoll:
        """What finished since the last call (waiting up to `timeout` for something when nothing has)."""
        done = self._finished(timeout)
        self.pending_stores -= len(done.stored)
        self.pending_loads -= len(done.loaded)
        return done

    def _finished(self, timeout: float) -> TierPoll:
        if timeout > 0 and not self._wake.is_set():
            self._wake.wait(timeout)
        with self._lock:
            done, self._done = self._done, TierPoll()
            self._wake.clear()
        return done

    def _event(self, op: int, tier: int, h: int) -> None:
        if self.events is not None:
            self.events.add(op, tier, h)

    def _tell(self, op: str, h: int) -> None:
        """Under the lock: the index lost or moved `h`; the other ranks' copies follow (engine/rank_tiers.py)."""
        if self.mirror is not None:
            self.mirror.append((op, h))

    def snapshot(self, limit: int) -> tuple[list[int], list[int]]:
        """(host, disk) hashes, most recently used first, at most `limit` of each."""
        with self._lock:
            host = list(itertools.islice(reversed(self.host.entries), limit))
            disk = list(itertools.islice(reversed(self.disk.sizes), limit)) if self.disk is not None else []
        return host, disk

    def figures(self) -> dict:
        """The `EngineStats` fields of the tiers."""
        st = self.stats
        with self._lock:
            host, disk = len(self.host.entries), len(self.disk.sizes) if self.disk is not None else 0
        return dict(kv_tier_host_blocks=host, kv_tier_disk_blocks=disk, kv_tier_stored_blocks=st.stored_blocks,
                    kv_tier_disk_writes=st.disk_writes, kv_tier_loaded_host_blocks=st.loaded_host_blocks,
                    kv_tier_loaded_disk_blocks=st.loaded_disk_blocks, kv_tier_failed_loads=st.failed_loads,
                    kv_tier_dropped_stores=st.dropped_stores, kv_tier_disk_disabled=st.disk_disabled)

    def close(self) -> None:
        self._jobs.put(None)

    # ---- worker thread ---------------------------------------------------------------------------------------

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                if job[0] == "store":
                    self._store(job[1], job[2])
                else:
                    self._load(job[1])
            except Exception:   # a bug here must not leave the engine waiting: report the job as finished
                log.exception("KV tiers: %s failed", job[0])
            with self._lock:
                if job[0] == "store":
                    self._done.stored.append(job[1])
                else:
                    self._done.loaded.append(job[1])
                self._wake.set()

    def _store(self, block: int, h: int) -> None:
        with self._lock:
            if h in self.host.entries:
                self.host.entries.move_to_end(h)
                return
        copy = copy_out(self.pool, block, self.host.pin)
        evicted = []
        with self._lock:
            self.host.put(h, copy)
            self._event(STORED, HOST, h)
            self.stats.stored_blocks += 1
            while self.host.nbytes > self.host.capacity and self.host.entries:
                evicted.append(self.host.pop_oldest())
                self._event(EVICTED, HOST, evicted[-1][0])
                self.stats.host_evictions += 1
        for old_h, old_block in evicted:
            self._to_disk(old_h, old_block)

    def _to_disk(self, h: int, block: torch.Tensor) -> None:
        disk = self.disk
        if disk is None:
            with self._lock:
                self._tell("drop", h)
            return
        try:
            size = disk.write_file(h, raw_bytes(block))
        except OSError as e:
            with self._lock:
                self._tell("drop", h)
            self.disk_failed(disk, str(e))
            return
        with self._lock:
            disk.add(h, size)
            self._event(STORED, DISK, h)
            self._tell("spill", h)
            self.stats.disk_writes += 1
            while disk.nbytes > disk.capacity and disk.sizes:
                old = next(iter(disk.sizes))
                disk.delete(old)
                self._event(EVICTED, DISK, old)
                self._tell("unlink", old)
                self.stats.disk_evictions += 1

    def disk_failed(self, disk: DiskTier, error: str) -> None:
        """Turn the disk tier off: a write failed (disk full, I/O error)."""
        with self._lock:
            if self.disk is not disk:
                return
            self.stats.disk_errors += 1
            self.stats.disk_disabled = True
            self.disk = None
            for old in disk.sizes:
                self._event(EVICTED, DISK, old)
                self._tell("unlink", old)
        log.warning("KV disk tier %s turned off: %s (serving goes on with the host tier)", disk.path, error)

    def _load(self, job: TierLoad) -> None:
        for block, h in zip(job.blocks, job.hashes, strict=True):
            with self._lock:
                entry = self.host.entries.get(h)
                if entry is not None:
                    self.host.entries.move_to_end(h)
                disk = self.disk if entry is None and self.disk is not None and h in self.disk.sizes else None
            if entry is not None:
                copy_in(self.pool, block, entry)
                self.stats.loaded_host_blocks += 1
            else:
                payload = disk.read_file(h, self.block_bytes) if disk is not None else None
                if payload is None:
                    if disk is not None:
                        log.warning("KV disk tier: block %016x unreadable (missing, truncated, corrupt or another "
                                    "layout): recomputed", h)
                        with self._lock:
                            disk.delete(h)
                            self._event(EVICTED, DISK, h)
                            self._tell("unlink", h)
                    self.stats.failed_loads += 1
                    return
                copy_in(self.pool, block, payload)
                self.stats.loaded_disk_blocks += 1
            job.done += 1


def copy_out(pool: KVCachePool, block: int, pin: bool) -> torch.Tensor:
    """Pool block `block` (every layer and plane) as a new contiguous host tensor."""
    copy = torch.empty(pool.block(block).shape, dtype=pool.dtype, pin_memory=pin)
    return copy.copy_(pool.block(block))


def copy_in(pool: KVCachePool, block: int, src: torch.Tensor | bytes) -> None:
    """A block `copy_out` made, or a disk file's payload of it, into pool block `block`."""
    dst = pool.block(block)
    if isinstance(src, bytes):
        src = torch.frombuffer(bytearray(src), dtype=torch.uint8).view(pool.dtype).view(dst.shape)
    dst.copy_(src)


def raw_bytes(t: torch.Tensor) -> memoryview:
    """A contiguous CPU tensor's bytes, without a copy."""
    return t.reshape(-1).view(torch.uint8).numpy().data
