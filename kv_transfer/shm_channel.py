"""shm: a same-host sender maps the receiver's pool (shm.py) and copies the blocks straight into it.

One copy, no staging: fused_copy's kernel copies and sums both ends in one pass, so the write header
carries the "sent" and the "landed" checksum and the receiver reads no payload byte. Into a receiver whose heads
are split over another number of ranks the copy is regroup.copy (strided torch copies from this pool's rank planes
into the receiver's head slices, still one copy), then both sums over row words (regroup.py). Before and after
copying, the sender checks the destination blocks' tags (shm.py), so it never waits for a round trip
to learn that its reservation is still live.
"""

from __future__ import annotations

import os
import threading
from typing import Any, cast

import numpy as np

from pdcluster.kv_transfer.channel import Channel, DstRuns, PoolViews, Runs, Staged
from pdcluster.kv_transfer.checksum import MASK64, row_words, weighted, words
from pdcluster.kv_transfer.destination import Destination, host_id
from pdcluster.kv_transfer.errors import StaleReservationError
from pdcluster.kv_transfer.fused_copy import copy_blocks, warm_up
from pdcluster.kv_transfer.layout import KVLayout, byte_view
from pdcluster.kv_transfer.shm import SHM_DIR, SharedKVPool, token_tag
from pdcluster.kv_transfer.tcp import FrameError, Wire


class ShmChannel(Channel):
    name = "shm"
    offer = "shm"
    direct = True
    regroups = True   # into a receiver of another tensor-parallel split: regroup.copy, straight into its pool

    def __init__(self, wire: Wire, pool: PoolViews, remote: SharedKVPool | None = None):
        super().__init__(wire, pool)
        self.remote = remote  # sender side: the receiver's pool, mapped here (None once closed)
        # [planes, blocks, words per plane]; numpy: the mapped pool is a CPU tensor
        self.remote_words = None if remote is None else cast(np.ndarray, words(byte_view(remote.tensor)))
        self.remote_row_words: np.ndarray | None = None   # made on the first write that regroups heads

    @classmethod
    def offered(cls, pool: PoolViews, shm_name: str | None) -> bool:
        return shm_name is not None

    @classmethod
    def auto_rank(cls, pool: PoolViews, dst: Destination) -> int | None:
        same_host = dst.host_id == host_id() and dst.shm_name and os.path.exists(os.path.join(SHM_DIR, dst.shm_name))
        return 0 if same_host and pool.on_cpu else None

    @classmethod
    def prepare(cls, pool: PoolViews) -> None:
        if pool.on_cpu:  # compile the copy kernel now, not on the first transfer
            threading.Thread(target=warm_up, name="kv-send-warm-up", daemon=True).start()

    @classmethod
    def connect(cls, wire: Wire, pool: PoolViews, hello_ok: dict[str, Any], **_: Any) -> "ShmChannel":
        name = hello_ok.get("shm_name")
        if not isinstance(name, str):
            raise FrameError("hello_ok.shm_name: the receiver has no shared-memory pool")
        remote = KVLayout.from_dict(hello_ok["layout"])
        return cls(wire, pool, SharedKVPool.attach(name, remote.shape, pool.tensor.dtype))

    def stage(self, token: str, part: Runs, l0: int, l1: int) -> Staged:
        dst_ids = np.array([d + i for d, _, n in part for i in range(n)], dtype=np.int64)
        src_ids = np.array([s + i for _, s, n in part for i in range(n)], dtype=np.int64)
        tag = token_tag(token)
        self._check_tags(dst_ids, tag, "is not open to this transfer")
        remote = self.remote
        if remote is None:
            raise ConnectionError("shm channel closed")
        nbytes = self.wire_bytes(len(dst_ids), l0, l1)
        if self.regroup is not None:
            self.regroup.copy(remote.tensor, self.pool.tensor, part, l0, l1)
            self._check_tags(dst_ids, tag, "was withdrawn during the copy")
            checksum = self.regroup.sent_checksum(self.pool.row_words, [(s, n) for _, s, n in part], l0, l1)
            back = self.regroup.landed_checksum(self._remote_row_words(remote), [(d, n) for d, _, n in part], l0, l1)
            return Staged(checksum, nbytes, landed=back)
        p0, p1 = self.pool.plane_range(l0, l1)
        src_words = cast(np.ndarray, self.pool.words)  # shm pools are CPU pools (auto_rank)
        sent, landed = copy_blocks(cast(np.ndarray, self.remote_words), src_words, dst_ids, src_ids, p0, p1)
        self._check_tags(dst_ids, tag, "was withdrawn during the copy")
        return Staged(weighted(sent), nbytes, landed=weighted(landed))

    def _remote_row_words(self, remote: SharedKVPool) -> np.ndarray:
        if self.remote_row_words is None:
            self.remote_row_words = cast(np.ndarray, row_words(remote.tensor))
        return self.remote_row_words

    def close(self) -> None:
        # Drop the receiver's mapped pool: the mapping goes with the last reference (a copy still under way
        # holds its own), so a peer that is gone does not keep its pool in this process's memory.
        self.remote = None
        self.remote_words = self.remote_row_words = None

    def _check_tags(self, dst_ids: np.ndarray, tag: int, what: str) -> None:
        remote = self.remote  # sender side: connect() mapped it; None once closed
        if remote is None:
            raise ConnectionError("shm channel closed")
        if not (remote.tags[dst_ids] == tag).all():
            raise StaleReservationError(f"reservation {what} (failed, expired or cancelled)")

    def receive_runs(self, runs: DstRuns, l0: int, l1: int, frame: dict[str, Any]) -> int:
        # The sender read each block back from these very pages while still in its cache (fused_copy):
        # its "landed" sum stands for a second pass over DRAM here.
        landed = frame.get("landed")
        if not isinstance(landed, int):
            raise FrameError("write.landed: an shm write must carry the checksum read back from the pool")
        return landed & MASK64
