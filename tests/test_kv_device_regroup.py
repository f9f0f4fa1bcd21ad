"""KV between device pools whose heads are split over different numbers of ranks (issue #34 item 3): the channels
devices use — the collectives (gloo here; nccl and hccl are the same class) and cuda_ipc (its CPU path) — regroup
heads as tcp and shm do (kv_transfer/regroup.py).

A collective moves contiguous tensors only: the sender sends the planes of the ranks the receiver needs, whole, from
its pool, and the receiver lands each head from one staging tensor per write into its slot. cuda_ipc's receiver
copies from the sender's mapped pool straight into its slots. Both byte-exact for float and int8 pools, between
whole pools and slices of engines sliced per rank (a device's pools), layer by layer, with the checksum over what
landed: a bit changed on the way fails the transfer on both sides.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from kv_pool_helpers import assert_landed, close_all, model_kv, split

from pdcluster.kv_transfer import ChecksumError, KVLayout, KVReceiver, KVSender, TransferError
from pdcluster.kv_transfer import cuda_ipc_channel as ipc
from pdcluster.kv_transfer.regroup import Regroup
from pdcluster.kv_transfer.testing import corrupt_writes

pytestmark = pytest.mark.timeout(300)

SRC, DST = [0, 1, 5, 6], [7, 8, 2, 3]
# (model KV heads, sender ranks, receiver ranks, sender sliced, receiver sliced): each receiving pool from one
# sending pool (several writers into one reservation is the receiver's business, not the channel's)
PAIRINGS = [
    (4, 2, 1, False, False),   # whole pools of TP 2 and TP 1
    (4, 1, 2, False, False),
    (4, 1, 2, False, True),    # TP 1 prefill -> a device's TP 2 decode: each slice takes its heads
    (4, 2, 4, True, True),     # device TP 2 -> device TP 4
    (2, 1, 4, False, True),    # fewer KV heads than receiver ranks: each slice a copy of one
    (1, 2, 1, False, False),   # ... than sender ranks: the copy stays home
]


def _pools(kv: torch.Tensor, tp: int, sliced: bool) -> list[torch.Tensor]:
    whole = split(kv, tp)
    return [whole[:, 2 * r:2 * r + 2].contiguous() for r in range(tp)] if sliced else [whole]


def _layouts(pools: list[torch.Tensor], total: int, tp: int, sliced: bool) -> list[KVLayout]:
    if not sliced:
        return [KVLayout.of(pools[0], total)]
    return [KVLayout.of(p).sliced(r, tp, total) for r, p in enumerate(pools)]


@pytest.fixture
def device_channel(monkeypatch):
    monkeypatch.setenv(ipc.CPU_PATH_ENV, "1")   # cuda_ipc over host memory (never picked by auto)

    def prepare(backend: str, pool: torch.Tensor) -> torch.Tensor:
        return ipc.share_cpu_pool(pool) if backend == "cuda_ipc" else pool
    return prepare


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["gloo", "cuda_ipc"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8], ids=str)
@pytest.mark.parametrize("total, src_tp, dst_tp, src_sliced, dst_sliced", PAIRINGS)
def test_device_channels_regroup_heads_byte_exact_layer_by_layer(device_channel, backend, dtype, total, src_tp,
                                                                 dst_tp, src_sliced, dst_sliced):
    kv = model_kv(total * 11 + src_tp, total, dtype)
    src_pools = [device_channel(backend, p) for p in _pools(kv, src_tp, src_sliced)]
    src_layouts = _layouts(src_pools, total, src_tp, src_sliced)
    expected = _pools(kv, dst_tp, dst_sliced)
    dst_pools = [torch.zeros_like(e) for e in expected]
    dst_layouts = _layouts(dst_pools, total, dst_tp, dst_sliced)
    receivers, senders = [], []
    try:
        for d, pool in enumerate(dst_pools):
            receivers.append(KVReceiver(pool, total_kv_heads=None if dst_sliced else total,
                                        rank_slice=(d, dst_tp, total) if dst_sliced else None))  # type: ignore[arg-type]
            assert backend in receivers[-1].backends
        for p, pool in enumerate(src_pools):
            senders.append(KVSender(pool, backend=backend, total_kv_heads=None if src_sliced else total,
                                    rank_slice=(p, src_tp, total) if src_sliced else None))  # type: ignore[arg-type]
        layers = kv.shape[0]
        for d, rx in enumerate(receivers):
            parts = 0
            for p, tx in enumerate(senders):
                try:
                    pair = Regroup(src_layouts[p], dst_layouts[d])
                except Exception:   # no heads in common (tests/test_kv_slice_regroup.py checks the refusal)
                    continue
                parts += 1
                rid = f"r-{p}-{d}"
                t = tx.start(rx.reserve(rid, DST, timeout_s=30), SRC)
                for layer in range(layers):   # the layer-wise push: one write per layer
                    t.send_layers(layer, layer + 1)
                checksum = t.finish(20)
                res = asyncio.run(rx.wait(rid, 20))
                assert res.ok and res.checksum == checksum
                if backend == "gloo":   # the sending ranks' whole planes
                    assert res.nbytes == len(SRC) * layers * pair.plane_layer_bytes
            assert parts == 1
        assert_landed(dst_pools, expected, SRC, DST)
        assert all(rx.num_active_reservations == 0 for rx in receivers)
    finally:
        close_all(senders, receivers)


@pytest.mark.slow
def test_a_bit_changed_on_the_way_fails_a_regrouped_collective_transfer_on_both_sides():
    src = split(model_kv(4, 4, torch.float32), 2)
    rx = KVReceiver(torch.zeros_like(split(model_kv(4, 4, torch.float32), 1)), total_kv_heads=4)
    sender = KVSender(src, backend="gloo", total_kv_heads=4)
    try:
        with corrupt_writes("gloo"), pytest.raises(ChecksumError):
            sender.send(rx.reserve("c", [1, 2]), [3, 4], timeout=20)
        with pytest.raises(TransferError, match="checksum"):
            asyncio.run(rx.wait("c", 20))
        assert rx.num_active_reservations == 0
    finally:
        sender.close()
        rx.close()


def test_the_wire_of_a_collective_carries_whole_planes_of_the_ranks_the_receiver_needs():
    tp2 = KVLayout.of(torch.zeros(2, 4, 4, 4, 2, 8), 4)
    whole = KVLayout.of(torch.zeros(2, 2, 4, 4, 4, 8), 4)
    rank1 = KVLayout.of(torch.zeros(2, 2, 4, 4, 2, 8)).sliced(1, 2, 4)
    into_slice = Regroup(whole, rank1)   # a whole pool feeding rank 1 of a device's TP 2
    assert into_slice.wire_ranks == [0] and into_slice.wire_planes(1) == [2, 3]
    assert into_slice.plane_layer_bytes == 2 * whole.plane_bytes   # all 4 heads go; the receiver lands 2
    assert into_slice.wire_layer_bytes == whole.plane_bytes        # (tcp sends just the 2, row by row)
    from_two = Regroup(tp2, whole)
    assert from_two.wire_ranks == [0, 1] and from_two.plane_layer_bytes == tp2.layer_bytes


def test_cuda_ipc_regroups_from_the_mapped_pool_and_sums_what_landed(device_channel):
    """Channel level: a source changed between the sender's sum and the receiver's copy shows; a mapped pool that
    is not the layout its sender announced is refused before anything is copied."""
    import socket
    import threading

    from pdcluster.kv_transfer.channel import PoolViews
    from pdcluster.kv_transfer.tcp import FrameError, Wire

    src = device_channel("cuda_ipc", split(model_kv(6, 4, torch.bfloat16), 2))
    dst = torch.zeros_like(split(model_kv(6, 4, torch.bfloat16), 1))
    a, b = socket.socketpair()
    try:
        got: list = []
        t = threading.Thread(target=lambda: got.append(ipc.CudaIpcChannel.accept(
            Wire(b), PoolViews(dst, 4), {"op": "hello_ok"}, session="s", timeout=5)))
        t.start()
        tx = ipc.CudaIpcChannel.connect(Wire(a), PoolViews(src, 4), Wire(a).recv())
        t.join(5)
        rx = got[0]
        tx.regroup = rx.regroup = Regroup(tx.pool.layout, rx.pool.layout)

        def write(before_receive=None) -> tuple[int, int]:
            sent = tx.write_runs("tok", [(5, 0, 2)], 0, 3, lambda c, n: {"op": "write"})
            frame = rx.wire.recv()
            if before_receive:
                before_receive()
            return sent, rx.receive_runs([(5, 2)], 0, 3, frame)

        sent, landed = write()
        assert sent == landed and torch.equal(dst[:, :, 5:7], split(model_kv(6, 4, torch.bfloat16), 1)[:, :, 0:2])
        sent, landed = write(lambda: src[1, 3, 0].add_(1))   # rank 1's V plane of layer 1
        assert sent != landed
        rx.regroup = Regroup(KVLayout.of(torch.zeros(3, 8, 12, 4, 1, 8), 4), rx.pool.layout)   # announced TP 4
        dst.zero_()
        with pytest.raises(FrameError, match="not the layout it announced"):
            write()
        assert not dst.view(torch.uint8).any()
    finally:
        a.close()
        b.close()
