"""tcp: a write header, then the raw bytes on the same socket, gathered from and scattered into pool views.

The sender `sendmsg`s memoryviews of its pool, the receiver `recvmsg_into`s views of its pool: no
staging on either side. Whole-block runs are one view per run; a layer sub-range is one view per block
(each block's layer range is contiguous).
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
        views = _views(self.pool, src_runs, l0, l1)
        return Staged(checksum_runs(self.pool.words, src_runs, l0, l1), sum(len(v) for v in views), views=views)

    def receive_runs(self, runs: DstRuns, l0: int, l1: int, frame: dict[str, Any]) -> int:
        recv_into_views(self.wire.sock, _views(self.pool, runs, l0, l1))
        return checksum_runs(self.pool.words, runs, l0, l1)

    def discard(self, nbytes: int) -> None:
        drain(self.wire.sock, nbytes)


def _views(pool: PoolViews, runs: list[tuple[int, int]], l0: int, l1: int) -> list[memoryview]:
    nb = pool.np_bytes
    if l0 == 0 and l1 == pool.layout.num_layers:
        return [memoryview(nb[s : s + n].reshape(-1)) for s, n in runs]
    return [memoryview(nb[b, l0:l1].reshape(-1)) for s, n in runs for b in range(s, s + n)]
