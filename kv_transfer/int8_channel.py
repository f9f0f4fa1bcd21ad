"""tcp+int8: tcp with the KV quantised to int8 on the wire (quant.py), `KVSender(quant="int8")`.

Rides on a receiver's "tcp" offer. The one path with staging: the sender quantises into a payload
buffer, the receiver reads it into a staging buffer and dequantises into the pool.
"""

from __future__ import annotations

from typing import Any

import torch

from pdcluster.kv_transfer import quant
from pdcluster.kv_transfer.channel import DstRuns, PoolViews, Runs, Staged
from pdcluster.kv_transfer.checksum import checksum_bytes
from pdcluster.kv_transfer.layout import KVLayout
from pdcluster.kv_transfer.tcp import recv_into_views
from pdcluster.kv_transfer.tcp_channel import TcpChannel


class Int8Channel(TcpChannel):
    name = "tcp+int8"
    offer = "tcp"
    regroups = True   # the receiver dequantizes the sender's planes into its head slices (regroup.land)

    @classmethod
    def offered(cls, pool: PoolViews, shm_name: str | None) -> bool:
        return False  # not a backend of its own: offered with "tcp"

    @classmethod
    def auto_rank(cls, pool, dst) -> int | None:
        return None  # lossy: only when asked for

    def stage(self, token: str, part: Runs, l0: int, l1: int) -> Staged:
        p0, p1 = self.pool.plane_range(l0, l1)
        if self.regroup is None:
            kv = torch.cat([self.pool.planes[p0:p1, s : s + n] for _, s, n in part], dim=1)
        else:   # only the planes of the sender ranks the receiver needs (regroup.wire_planes), read once
            qs = torch.tensor([q for layer in range(l0, l1) for q in self.regroup.wire_planes(layer)])
            kv = torch.cat([self.pool.planes[qs, s : s + n] for _, s, n in part], dim=1)
        payload = quant.quantize(kv)
        return Staged(checksum_bytes(payload), payload.numel(), views=[payload.numpy().data])

    def wire_bytes(self, nblocks: int, l0: int, l1: int) -> int:
        lay, planes = self._wire_geometry()
        return quant.wire_bytes(nblocks, l1 - l0, lay.block_size, lay.num_kv_heads, lay.head_dim, planes)

    def _wire_geometry(self) -> tuple[KVLayout, int]:
        """The layout whose planes travel (the sender's) and how many per layer."""
        if self.regroup is None:
            return self.pool.layout, self.pool.layout.kv_planes
        return self.regroup.src, 2 * len(self.regroup.wire_ranks)

    def receive_runs(self, runs: DstRuns, l0: int, l1: int, frame: dict[str, Any]) -> int:
        lay, per_layer = self._wire_geometry()
        nblocks = sum(n for _, n in runs)
        staging = torch.empty(self.wire_bytes(nblocks, l0, l1), dtype=torch.uint8)
        recv_into_views(self.wire.sock, [staging.numpy().data])
        shape = ((l1 - l0) * per_layer, nblocks, lay.block_size, lay.num_kv_heads, lay.head_dim)
        kv = quant.dequantize(staging, shape, self.pool.tensor.dtype)
        if self.regroup is not None:
            self.regroup.land(self.pool.tensor, kv.view(l1 - l0, -1, 2, *shape[1:]), runs, l0, l1)
            return checksum_bytes(staging)
        p0, p1 = self.pool.plane_range(l0, l1)
        planes = self.pool.planes[p0:p1]
        i = 0
        for s, n in runs:
            planes[:, s : s + n].copy_(kv[:, i : i + n])
            i += n
        return checksum_bytes(staging)
