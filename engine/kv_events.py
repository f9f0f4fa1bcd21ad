"""Block-hash events of one engine's KV cache, per tier, for a cluster-wide prefix index (router/prefix_index.py).

The block manager reports each block it publishes in the prefix cache (stored, tier POOL) and each published block
it reclaims (evicted, POOL); the KV tiers report what enters and leaves host memory and disk. A reader (the node's
Load reports) takes them in order, run-length grouped: `[[op, tier, [hash, ...]], ...]`. Between two takes at most
`limit` events wait; past that the log drops them and says `lost`, and the reader sends a snapshot instead
(`LLMEngine.kv_events`). Appended from the engine thread and the tiers' thread, hence the lock.
"""

from __future__ import annotations

import threading

from pdcluster.control.block_hash import DISK, EVICTED, HOST, POOL, STORED, TIER_NAMES

__all__ = ["DISK", "EVICTED", "HOST", "POOL", "STORED", "TIER_NAMES", "KVEventLog"]

MAX_PENDING_EVENTS = 1 << 17


class KVEventLog:
    def __init__(self, limit: int = MAX_PENDING_EVENTS) -> None:
        self.limit = limit
        self._groups: list[list] = []   # [op, tier, [hashes]]: consecutive events of one (op, tier) share a group
        self._count = 0
        self.lost = False
        self._lock = threading.Lock()

    def add(self, op: int, tier: int, h: int) -> None:
        with self._lock:
            if self.lost:
                return
            if self._count >= self.limit:
                self._groups, self._count, self.lost = [], 0, True
                return
            last = self._groups[-1] if self._groups else None
            if last is not None and last[0] == op and last[1] == tier:
                last[2].append(h)
            else:
                self._groups.append([op, tier, [h]])
            self._count += 1

    def take(self) -> tuple[list[list], bool]:
        """(the events since the last take, whether some were lost) and start afresh."""
        with self._lock:
            groups, lost = self._groups, self.lost
            self._groups, self._count, self.lost = [], 0, False
        return groups, lost
