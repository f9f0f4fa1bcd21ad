"""Channels on their own (no receiver, no reservations) and the registry that picks them."""

from __future__ import annotations

import socket
import threading

import pytest
import torch

from pdcluster.kv_transfer import SharedKVPool
from pdcluster.kv_transfer.backends import CHANNELS, choose, offered
from pdcluster.kv_transfer.channel import PoolViews
from pdcluster.kv_transfer.destination import Destination, host_id
from pdcluster.kv_transfer.dist_channel import GlooChannel
from pdcluster.kv_transfer.errors import TransferError
from pdcluster.kv_transfer.int8_channel import Int8Channel
from pdcluster.kv_transfer.layout import blocks_of
from pdcluster.kv_transfer.shm_channel import ShmChannel
from pdcluster.kv_transfer.tcp import Wire
from pdcluster.kv_transfer.tcp_channel import TcpChannel
from pdcluster.kv_transfer.testing import CorruptingChannel, corrupt_writes

SHAPE = (3, 2, 8, 4, 2, 8)   # layers, k/v, blocks, block_size, heads, head_dim


def pools(dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(SHAPE, generator=g).to(dtype), torch.zeros(SHAPE, dtype=dtype)


def transfer(send_channel, recv_channel, part, l0, l1) -> tuple[dict, int, int]:
    """One write through a socket pair: (header frame, sender checksum, receiver landed checksum)."""
    sent: list[int] = []
    t = threading.Thread(
        target=lambda: sent.append(send_channel.write_runs("tok", part, l0, l1, lambda c, n: {"op": "write"}))
    )
    t.start()
    frame = recv_channel.wire.recv()
    runs = [(d, n) for d, _, n in part]
    assert frame["nbytes"] == recv_channel.wire_bytes(sum(n for _, n in runs), l0, l1)
    landed = recv_channel.receive_runs(runs, l0, l1, frame)
    t.join(5)
    return frame, sent[0], landed


@pytest.fixture
def wires():
    a, b = socket.socketpair()
    yield Wire(a), Wire(b)
    a.close()
    b.close()


@pytest.mark.parametrize("l0, l1", [(0, 3), (1, 2)])  # every layer, a layer range: a view per (plane, run)
def test_tcp_channel_lands_exactly_the_runs(wires, l0, l1):
    src, dst = pools(torch.bfloat16)
    part = [(5, 0, 2), (1, 6, 1)]  # (dst_start, src_start, n)
    frame, checksum, landed = transfer(TcpChannel(wires[0], PoolViews(src)), TcpChannel(wires[1], PoolViews(dst)),
                                       part, l0, l1)  # fmt: skip
    assert frame["checksum"] == checksum == landed and "landed" not in frame
    assert torch.equal(blocks_of(dst, [5, 6, 1])[:, l0:l1], blocks_of(src, [0, 1, 6])[:, l0:l1])
    dst[l0:l1, :, [5, 6, 1]] = 0
    assert not dst.view(torch.uint8).any()  # nothing else was touched


def test_int8_channel_is_lossy_but_checksummed(wires):
    src, dst = pools()
    frame, checksum, landed = transfer(Int8Channel(wires[0], PoolViews(src)), Int8Channel(wires[1], PoolViews(dst)),
                                       [(0, 3, 2)], 0, 3)  # fmt: skip
    got, want = blocks_of(dst, slice(0, 2)), blocks_of(src, slice(3, 5))
    assert checksum == landed and frame["nbytes"] < want.numel() * 4 / 3
    step = want.abs().amax(dim=(3, 5), keepdim=True) / 127
    assert ((got - want).abs() <= step * 0.5 + 1e-6).all() and not torch.equal(got, want)


def test_corrupting_channel_changes_bytes_after_the_checksum(wires):
    src, dst = pools()
    corrupting = CorruptingChannel(TcpChannel(wires[0], PoolViews(src)))
    frame, checksum, landed = transfer(corrupting, TcpChannel(wires[1], PoolViews(dst)), [(0, 0, 1)], 0, 3)
    assert frame["checksum"] == checksum != landed
    assert (blocks_of(dst, 0).view(torch.uint8) != blocks_of(src, 0).view(torch.uint8)).sum() == 1
    assert not src.view(torch.uint8).eq(pools()[0].view(torch.uint8)).logical_not().any()  # the source is intact


def test_corrupt_writes_swaps_registry_entries_and_restores_them():
    before = dict(CHANNELS)
    with corrupt_writes("tcp", "shm"):
        assert CHANNELS["tcp"] is not TcpChannel and issubclass(CHANNELS["tcp"], TcpChannel)
        assert CHANNELS["tcp"].name == "tcp" and CHANNELS["gloo"] is GlooChannel
    assert CHANNELS == before


def _dst(backends, shm_name=None, same_host=True) -> Destination:
    return Destination(
        "r", "127.0.0.1:1", [0], "t" * 32, 0.0, backends, {}, host_id() if same_host else "x/y", shm_name
    )


def test_offered_and_auto_choice():
    src, _ = pools()
    views = PoolViews(src)
    assert offered(views, None) == ["tcp", "gloo"]
    assert offered(views, "some-pool") == ["shm", "tcp", "gloo"]
    shm = SharedKVPool.create(SHAPE, torch.float32)
    try:
        assert choose("auto", None, views, _dst(["shm", "tcp", "gloo"], shm.name)) is ShmChannel
        assert choose("auto", "int8", views, _dst(["shm", "tcp"], shm.name)) is ShmChannel  # int8 is tcp only
        assert choose("auto", None, views, _dst(["shm", "tcp"], shm.name, same_host=False)) is TcpChannel
    finally:
        shm.close()
    assert choose("auto", None, views, _dst(["shm", "tcp"], "gone")) is TcpChannel  # no such shm file here
    assert choose("auto", "int8", views, _dst(["tcp", "gloo"])) is Int8Channel
    assert choose("auto", None, views, _dst(["gloo"])) is GlooChannel
    assert choose("gloo", "int8", views, _dst(["tcp", "gloo"])) is GlooChannel
    assert choose("tcp+int8", None, views, _dst(["tcp"])) is Int8Channel
    with pytest.raises(TransferError, match="'gloo' not offered"):
        choose("gloo", None, views, _dst(["tcp"]))
    with pytest.raises(TransferError, match="no common KV backend"):
        choose("auto", None, views, _dst(["nccl"]))
