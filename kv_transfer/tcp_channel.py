"""tcp: a write header, then the raw bytes on the same socket, gathered from and scattered into pool views.

The sender `sendmsg`s memoryviews of its pool, the receiver `recvmsg_into`s views of its pool: no
staging on either side. One view per (plane, run): a run of consecutive blocks is contiguous in each plane.
Between pools whose heads are split over different numbers of ranks the sender's planes travel as they are and
the receiver scatters them, one view per (token, run of heads), into its head slices (regroup.py).
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
    regroups = True   # the receiver scatters the sender's planes into its head slices (regroup.py)

    @classmethod
    def offered(cls, pool: PoolViews, shm_name: str | None) -> bool:
        return pool.on_cpu

    @classmethod
    def auto_rank(cls, pool: PoolViews, dst: Destination) -> int | None:
        return 2 if pool.on_cpu else None

    def stage(self, token: str, part: Runs, l0: int, l1: int) -> Staged:
        src_runs = [(s, n) for _, s, n in part]
        if self.regroup is not None:
            assert self.pool.flat is not None, "tcp reads CPU pools only"
            views = self.regroup.wire_views(self.pool.flat, src_runs, l0, l1)
            checksum = self.regroup.sent_checksum(self.pool.row_words, src_runs, l0, l1)
            return Staged(checksum, sum(len(v) for v in views), views=views)
        p0, p1 = self.pool.plane_range(l0, l1)
        views = _views(self.pool, src_runs, p0, p1)
        return Staged(checksum_runs(self.pool.words, src_runs, p0, p1), sum(len(v) for v in views), views=views)

    def receive_runs(self, runs: DstRuns, l0: int, l1: int, frame: dict[str, Any]) -> int:
        if self.regroup is not None:
            assert self.pool.flat is not None, "tcp writes CPU pools only"
            recv_into_views(self.wire.sock, self.regroup.scatter_views(self.pool.flat, runs, l0, l1))
            self.regroup.replicate(self.pool.tensor, runs, l0, l1)
            return self.regroup.landed_checksum(self.pool.row_words, runs, l0, l1)
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
