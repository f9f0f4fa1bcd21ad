"""tcp: a write header, then the raw bytes on the same socket, gathered from and scattered into pool views.

The sender `sendmsg`s memoryviews of its pool, the receiver `recvmsg_into`s views of its pool: no
staging on either side. One view per (plane, run): a run of consecutive blocks is contiguous in each plane.
"""

from __future__ import annotations

from typing import Any

from pdcluster.kv_transfer.channel import Channel, DstRuns, PoolViews, Runs, Staged
from pdcluster.kv_transfer.checksum import checksum_runs
from pdcluster.kv_transfer.destination import Destination
from pdcluster.kv_transfer.tcp import drain, recv_into_views


class TcpChannel(Channel):
    name = "tcp"
    offer = "tcp"
    parallel_streams = True

    @classmethod
    def offered(cls, pool: PoolViews, shm_name: str | None) -> bool:
        return pool.on_cpu

    @classmethod
    def auto_rank(cls, pool: PoolViews, dst: Destination) -> int | None:
        return 2 if pool.on_cpu else None

    def stage(self, token: str, part: Runs, l0: int, l1: int) -> Staged:
        src_runs = [(s, n) for _, s, n in part]
        p0, p1 = self.pool.plane_range(l0, l1)
        views = _views(self.pool, src_runs, p0, p1)
        return Staged(checksum_runs(self.pool.words, src_runs, p0, p1), sum(len(v) for v in views), views=views)

    def receive_runs(self, runs: DstRuns, l0: int, l1: int, frame: dict[str, Any]) -> int:
        p0, p1 = self.pool.plane_range(l0, l1)
        recv_into_views(self.wire.sock, _views(self.pool, runs, p0, p1))
        return checksum_runs(self.pool.words, runs, p0, p1)

    def discard(self, nbytes: int) -> None:
        drain(self.wire.sock, nbytes)


def _views(pool: PoolViews, runs: list[tuple[int, int]], p0: int, p1: int) -> list[memoryview]:
    flat, step = pool.flat, pool.layout.plane_bytes
    assert flat is not None, "tcp reads and writes CPU pools only"
    plane = pool.layout.num_blocks * step
    return [flat[p * plane + s * step : p * plane + (s + n) * step] for p in range(p0, p1) for s, n in runs]
