"""The channel interface: how one connection moves runs of KV blocks, one class per backend.

A channel is built once per connection by the handshake (`connect` on the sender, `accept` on the
receiver) and then only moves bytes: the sender's `write_runs` sends one write (its header frame and
its bytes), the receiver's `receive_runs` lands them in its pool and returns the checksum of what
landed. Reservations, tokens and acks are not a channel's business (receiver.py, reservations.py).

The sender side is two steps so that a wrapper (kv_transfer/testing.py) can reach the bytes between
them: `stage` reads the source (and, for shm, already copies), `ship` puts the header and bytes on
their way. Per write, not per block: the hot paths stay one copy or one gather. A write's bytes are, for each plane of
its layer range (engine/kv_cache.py: one layer's K or V cache of one rank), its runs of blocks in order:
one contiguous range per (plane, run).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, ClassVar, cast

import numpy as np
import torch

from pdcluster.kv_transfer.checksum import row_words, words
from pdcluster.kv_transfer.destination import Destination
from pdcluster.kv_transfer.layout import KVLayout, RankSlice, byte_view
from pdcluster.kv_transfer.tcp import Wire

if TYPE_CHECKING:
    from pdcluster.kv_transfer.regroup import Regroup

Runs = list[tuple[int, int, int]]  # (dst_start, src_start, n): blocks consecutive on both sides
DstRuns = list[tuple[int, int]]  # (dst_start, n), as a write header carries them


class PoolViews:
    """A local KV pool and the views channels read and write it through (built once per endpoint)."""

    def __init__(self, pool: torch.Tensor, total_kv_heads: int | None = None, rank_slice: RankSlice | None = None):
        """`rank_slice`: (rank, ranks[, model KV heads]) when the pool is one rank's slice of an engine sliced per
        rank (KVLayout.sliced)."""
        self.tensor = pool
        self.layout = KVLayout.of(pool, total_kv_heads)
        if rank_slice is not None:
            self.layout = self.layout.sliced(*rank_slice)
        self.words = words(byte_view(pool))  # [planes, blocks, words per plane]: numpy on CPU, torch else
        self.on_cpu = pool.device.type == "cpu"
        self.np_bytes: np.ndarray | None = None  # [planes, blocks, plane bytes] (CPU pools)
        self.flat: memoryview | None = None  # the pool's bytes as one flat memoryview (CPU pools): slicing it
        if self.on_cpu:  # is ~30x cheaper than a numpy view per piece
            self.np_bytes = byte_view(pool).numpy()
            self.flat = self.np_bytes.reshape(-1).data
        self.planes = pool.flatten(0, 1)  # [planes, num_blocks, block_size, heads, row]: one cache per plane
        self._row_words: np.ndarray | None = None

    @property
    def row_words(self) -> np.ndarray:
        """checksum.row_words of a CPU pool (made on first use: only writes that regroup heads sum over it)."""
        if self._row_words is None:
            self._row_words = cast(np.ndarray, row_words(self.tensor))
        return self._row_words

    def plane_range(self, l0: int, l1: int) -> tuple[int, int]:
        """Layers [l0, l1) as the planes [p0, p1) holding them."""
        r = self.layout.planes(l0, l1)
        return r.start, r.stop


@dataclass
class Staged:
    """One write, read from the source and ready to ship."""

    checksum: int  # of the bytes read, as the receiver will sum them
    nbytes: int  # wire bytes the receiver expects (its check against wire_bytes)
    landed: int | None = None  # checksum read back where the bytes landed (channels that write directly)
    views: list[memoryview] = field(default_factory=list)  # bytes following the header on the socket
    tensors: list[torch.Tensor] = field(default_factory=list)  # bytes following it out of band


class Channel:
    name: ClassVar[str]  # the hello's "backend" and the registry key (backends.py)
    offer: ClassVar[str]  # the backend a receiver must offer for this channel (int8 rides on "tcp")
    parallel_streams: ClassVar[bool] = False  # writes may be split over several connections
    direct: ClassVar[bool] = False  # the sender writes into the receiver's pool itself (shm)
    regroups: ClassVar[bool] = False  # moves KV between pools whose heads are split over other ranks (regroup.py)
    # set by the sender and the receiver after the handshake when the peer's heads are split otherwise
    regroup: "Regroup | None" = None

    def __init__(self, wire: Wire, pool: PoolViews):
        self.wire = wire
        self.pool = pool

    # ---- who uses it -------------------------------------------------------------------------------

    @classmethod
    def offered(cls, pool: PoolViews, shm_name: str | None) -> bool:
        """Receiver side: whether a receiver with this pool offers the channel's backend."""
        return False

    @classmethod
    def auto_rank(cls, pool: PoolViews, dst: Destination) -> int | None:
        """Sender side: preference under backend="auto" (lower first); None = never picked by auto."""
        return None

    @classmethod
    def prepare(cls, pool: PoolViews) -> None:
        """Sender side, at construction: get ready off the hot path (e.g. compile a kernel)."""

    # ---- handshake ---------------------------------------------------------------------------------

    @classmethod
    def connect(
        cls, wire: Wire, pool: PoolViews, hello_ok: dict[str, Any], *, session: str, connect_timeout: float,
        io_timeout: float,
    ) -> "Channel":  # fmt: skip
        """Sender side, after the receiver's hello_ok."""
        return cls(wire, pool)

    @classmethod
    def accept(
        cls, wire: Wire, pool: PoolViews, hello_ok: dict[str, Any], *, session: str, timeout: float
    ) -> "Channel":
        """Receiver side: answer the hello with `hello_ok` (plus what the channel adds) and build."""
        wire.send(hello_ok)
        return cls(wire, pool)

    # ---- sender ------------------------------------------------------------------------------------

    def write_runs(
        self, token: str, part: Runs, l0: int, l1: int, header: Callable[[int, int], dict[str, Any]]
    ) -> int:
        """Send layers [l0, l1) of the runs as one write; `header(checksum, nbytes)` is the frame's map
        without the channel's own fields. Returns the write's checksum."""
        staged = self.stage(token, part, l0, l1)
        self.ship({**header(staged.checksum, staged.nbytes), "nbytes": staged.nbytes, "checksum": staged.checksum},
                  staged)
        return staged.checksum

    def stage(self, token: str, part: Runs, l0: int, l1: int) -> Staged:
        raise NotImplementedError

    def ship(self, body: dict[str, Any], staged: Staged) -> None:
        if staged.landed is not None:
            body["landed"] = staged.landed
        self.wire.send(body, staged.views)

    # ---- receiver ----------------------------------------------------------------------------------

    def wire_bytes(self, nblocks: int, l0: int, l1: int) -> int:
        """Bytes a write of nblocks blocks, layers [l0, l1), announces."""
        layer = self.pool.layout.layer_bytes if self.regroup is None else self.regroup.wire_layer_bytes
        return nblocks * (l1 - l0) * layer

    def receive_runs(self, runs: DstRuns, l0: int, l1: int, frame: dict[str, Any]) -> int:
        """Land one accepted write's bytes in the pool; return the checksum of what landed."""
        raise NotImplementedError

    def discard(self, nbytes: int) -> None:
        """Skip a rejected write's bytes without touching the pool (or raise to drop the connection)."""

    def close(self) -> None:
        """Release what the channel holds besides the socket (the connection closes it)."""
