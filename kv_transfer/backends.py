"""The channel registry: backend name → channel class. The one place that lists the backends.

Sender and receiver look a name up here once per connection and from then on only call the channel.
Tests swap entries to install wrapper channels (kv_transfer/testing.py).
"""

from __future__ import annotations

from pdcluster.kv_transfer.channel import Channel, PoolViews
from pdcluster.kv_transfer.cuda_ipc_channel import CudaIpcChannel
from pdcluster.kv_transfer.destination import Destination
from pdcluster.kv_transfer.dist_channel import GlooChannel, HcclChannel, NcclChannel
from pdcluster.kv_transfer.errors import LayoutMismatchError
from pdcluster.kv_transfer.int8_channel import Int8Channel
from pdcluster.kv_transfer.shm_channel import ShmChannel
from pdcluster.kv_transfer.tcp_channel import TcpChannel

CHANNELS: dict[str, type[Channel]] = {
    c.name: c for c in (ShmChannel, TcpChannel, Int8Channel, GlooChannel, NcclChannel, HcclChannel, CudaIpcChannel)
}


def offered(pool: PoolViews, shm_name: str | None) -> list[str]:
    """The backends a receiver with this pool offers, in registry order."""
    return [name for name, cls in CHANNELS.items() if cls.offered(pool, shm_name)]


def choose(backend: str, quant: str | None, pool: PoolViews, dst: Destination) -> type[Channel]:
    """The channel class a sender uses for dst: `backend` ("auto" or a name), then its `quant` variant
    ("tcp" + "int8" → "tcp+int8"; backends without that variant ignore quant)."""
    if backend == "auto":
        ranked = [
            (rank, name) for name, cls in CHANNELS.items()
            if cls.offer in dst.backends and (rank := cls.auto_rank(pool, dst)) is not None
        ]  # fmt: skip
        if not ranked:
            raise LayoutMismatchError(f"no common KV backend with {dst.address} (it offers {dst.backends})")
        backend = min(ranked)[1]
    cls = CHANNELS[backend]
    if quant is not None:
        cls = CHANNELS.get(f"{cls.offer}+{quant}", cls)
    if cls.offer not in dst.backends:
        raise LayoutMismatchError(f"backend {cls.offer!r} not offered by {dst.address} ({dst.backends})")
    return cls
