"""kv_transfer between real processes: the receiver lives in the test process, senders in spawned children."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import signal
import socket
import struct
import time
from contextlib import nullcontext

import msgpack
import pytest
import torch

from pdcluster.kv_transfer import (
    ChecksumError,
    Destination,
    KVLayout,
    KVReceiver,
    KVSender,
    LayoutMismatchError,
    SharedKVPool,
    TransferError,
    quant,
)
from pdcluster.kv_transfer.handshake import client_handshake
from pdcluster.kv_transfer.layout import blocks_of
from pdcluster.kv_transfer.shm import block_tags, token_tag
from pdcluster.kv_transfer.tcp import WIRE_VERSION, Wire
from pdcluster.kv_transfer.testing import corrupt_writes

pytestmark = pytest.mark.slow  # real processes or sockets: each test takes most of a second

SHAPE = (2, 2, 64, 16, 2, 32)  # layers, k/v, blocks, block_size, kv heads, head_dim (engine/kv_cache.py)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CTX = mp.get_context("spawn")


def source_pool(seed: int, dtype: str, shape=SHAPE) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(DTYPES[dtype])


# ---- child process: a sender that runs jobs sent over a pipe -------------------------------------------


def _run_job(job: dict) -> list:
    with corrupt_writes(job["backend"]) if job.get("corrupt") else nullcontext():
        return _run_transfers(job)


def _run_transfers(job: dict) -> list:
    pool = source_pool(job["seed"], job["dtype"], tuple(job.get("shape", SHAPE)))
    sender = KVSender(pool, backend=job["backend"], num_streams=job.get("streams", 1), quant=job.get("quant"))
    out = []
    try:
        transfers = []
        for dst, src in zip(job["dsts"], job["srcs"], strict=True):
            try:
                transfers.append(sender.start(dst, src))
            except Exception as exc:
                transfers.append(exc)
        for l0, l1 in job["layers"]:  # interleave: every request's layer range before the next range
            for t in transfers:
                if not isinstance(t, Exception):
                    t.send_layers(l0, l1)
        for t in transfers:
            if isinstance(t, Exception):
                out.append(("error", type(t).__name__, str(t)))
                continue
            try:
                out.append(("ok", t.finish(timeout=10)))
            except Exception as exc:
                out.append(("error", type(exc).__name__, str(exc)))
    finally:
        sender.close()
    return out


def _sender_server(conn) -> None:
    while True:
        job = conn.recv()
        if job is None:
            return
        if job.get("hang_after_first_layer"):
            pool = source_pool(job["seed"], job["dtype"])
            sender = KVSender(pool, backend=job["backend"])
            t = sender.start(job["dsts"][0], job["srcs"][0])
            t.send_layers(0, 1)
            time.sleep(0.5)  # let the first layer land
            conn.send("hanging")
            time.sleep(3600)
        try:
            conn.send(_run_job(job))
        except Exception as exc:  # report, keep serving
            conn.send([("error", type(exc).__name__, str(exc))])


class SenderProc:
    def __init__(self):
        self.conn, child = CTX.Pipe()
        self.proc = CTX.Process(target=_sender_server, args=(child,), daemon=True)
        self.proc.start()

    def run(self, timeout: float = 60, **job) -> list:
        self.conn.send(job)
        if not self.conn.poll(timeout):
            raise TimeoutError("sender child did not answer")
        return self.conn.recv()

    def stop(self) -> None:
        if self.proc.is_alive():
            self.conn.send(None)
            self.proc.join(5)
        if self.proc.is_alive():
            self.proc.kill()


@pytest.fixture(scope="module")
def sender():
    proc = SenderProc()
    yield proc
    proc.stop()


@pytest.fixture
def receiver_pool():
    """A receiver whose pool lives in POSIX shm (so every backend is offered)."""
    made = []

    def make(dtype="float32", **kw):
        shm = SharedKVPool.create(SHAPE, DTYPES[dtype])
        rx = KVReceiver(shm.tensor, shm_name=shm.name, **kw)
        made.append((rx, shm))
        return rx, shm.tensor

    yield make
    for rx, shm in made:
        rx.close()
        shm.close()


# ---- round trips -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("backend", ["shm", "tcp", "gloo"])
def test_round_trip_byte_exact(sender, receiver_pool, backend, dtype):
    rx, pool = receiver_pool(dtype)
    src = source_pool(7, dtype)
    dst_a = rx.reserve("a", [40, 3, 17, 18, 19, 63])  # scattered, one consecutive run
    dst_b = rx.reserve("b", [5, 6])
    out = sender.run(
        backend=backend, dtype=dtype, seed=7, streams=2,
        dsts=[dst_a.to_dict(), dst_b.to_dict()], srcs=[[0, 9, 30, 31, 32, 1], [2, 3]],
        layers=[(0, 1), (1, 2)],  # layer by layer
    )  # fmt: skip
    assert [o[0] for o in out] == ["ok", "ok"], out
    ra, rb = asyncio.run(rx.wait("a", 10)), asyncio.run(rx.wait("b", 10))
    assert ra.ok and rb.ok and ra.checksum == out[0][1]
    assert torch.equal(blocks_of(pool, [40, 3, 17, 18, 19, 63]).view(torch.uint8),
                       blocks_of(src, [0, 9, 30, 31, 32, 1]).view(torch.uint8))
    assert torch.equal(blocks_of(pool, [5, 6]).view(torch.uint8), blocks_of(src, [2, 3]).view(torch.uint8))
    untouched = [b for b in range(SHAPE[2]) if b not in (40, 3, 17, 18, 19, 63, 5, 6)]
    assert not blocks_of(pool, untouched).view(torch.uint8).any()
    assert rx.num_active_reservations == 0


def test_layer_range_only_touches_those_layers(sender, receiver_pool):
    rx, pool = receiver_pool("bfloat16")
    src = source_pool(3, "bfloat16")
    dst = rx.reserve("r", [10, 12])
    # only layer 1 is sent: the receiver completes when the sender says done, layer 0 stays zero
    assert (
        sender.run(backend="tcp", dtype="bfloat16", seed=3, dsts=[dst.to_dict()], srcs=[[4, 5]], layers=[(1, 2)])[0][0]
        == "ok"
    )
    assert asyncio.run(rx.wait("r", 10)).ok
    assert torch.equal(blocks_of(pool, [10, 12])[:, 1], blocks_of(src, [4, 5])[:, 1])
    assert not blocks_of(pool, [10, 12])[:, 0].view(torch.uint8).any()


@pytest.mark.parametrize("backend", ["shm", "tcp"])
def test_many_interleaved_requests(sender, receiver_pool, backend):
    rx, pool = receiver_pool("float16")
    src = source_pool(11, "float16")
    n = 16
    dsts = [rx.reserve(f"r{i}", [63 - 2 * i, 62 - 2 * i]) for i in range(n)]
    srcs = [[i, 40 + i] for i in range(n)]
    out = sender.run(
        backend=backend,
        dtype="float16",
        seed=11,
        streams=3,
        dsts=[d.to_dict() for d in dsts],
        srcs=srcs,
        layers=[(0, 1), (1, 2)],
    )
    assert all(o[0] == "ok" for o in out), out
    for i, d in enumerate(dsts):
        assert asyncio.run(rx.wait(f"r{i}", 10)).ok
        assert torch.equal(blocks_of(pool, d.block_ids), blocks_of(src, srcs[i]))
    assert rx.num_active_reservations == 0


def test_async_wait_before_and_after_the_transfer(sender, receiver_pool):
    rx, pool = receiver_pool()
    dst = rx.reserve("x", [1, 2, 3])

    async def main():
        waiter = asyncio.create_task(rx.wait("x", 20))
        out = await asyncio.to_thread(
            sender.run, backend="tcp", dtype="float32", seed=1, dsts=[dst.to_dict()], srcs=[[7, 8, 9]], layers=[(0, 2)]
        )
        return out, await waiter

    out, result = asyncio.run(main())
    assert out[0][0] == "ok" and result.ok and result.nbytes == 3 * KVLayout.of(pool).block_bytes
    assert rx.bytes_received == result.nbytes

    rx2, _ = receiver_pool()
    dst = rx2.reserve("y", [0])
    assert (
        sender.run(backend="shm", dtype="float32", seed=1, dsts=[dst.to_dict()], srcs=[[0]], layers=[(0, 2)])[0][0]
        == "ok"
    )
    result = asyncio.run(rx2.wait("y", 5))  # resolved before anyone waited: kept for the first waiter
    assert (result.request_id, result.ok) == ("y", True) and rx2.num_active_reservations == 0
    with pytest.raises(TransferError, match="no such reservation") as taken:  # ... and handed over once
        asyncio.run(rx2.wait("y", 5))
    assert taken.value.code == "missing"


# ---- integrity and safety ---------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["shm", "tcp", "tcp+int8", "gloo"])
def test_checksum_mismatch_is_an_error(sender, receiver_pool, backend):
    rx, _ = receiver_pool()
    dst = rx.reserve("c", [8, 9, 10])
    out = sender.run(
        backend=backend, dtype="float32", seed=2, corrupt=True, dsts=[dst.to_dict()], srcs=[[1, 2, 3]], layers=[(0, 2)]
    )
    assert out[0][0] == "error" and out[0][1] == "ChecksumError", out
    with pytest.raises(ChecksumError, match="checksum mismatch"):
        asyncio.run(rx.wait("c", 10))
    assert rx.num_active_reservations == 0


def _tampered(dst: Destination, **changes) -> dict:
    d = dst.to_dict()
    d.update(changes)
    return d


@pytest.mark.parametrize("backend", ["shm", "tcp"])
def test_rejected_writes_leave_pool_untouched(sender, receiver_pool, backend):
    rx, pool = receiver_pool()
    good = rx.reserve("good", [20, 21])
    expired = rx.reserve("old", [30], timeout_s=0.05)
    time.sleep(0.3)  # the reaper expires "old"
    jobs = [
        _tampered(good, token="0" * 32),  # wrong token
        _tampered(good, block_ids=[20, 22]),  # block 22 is not reserved
        _tampered(good, block_ids=[20, 99]),  # outside the pool
        _tampered(expired, deadline=time.time() + 30, timeout_s=30),  # the receiver's deadline counts, not the sender's
    ]
    out = sender.run(
        backend=backend, dtype="float32", seed=5, dsts=jobs, srcs=[[1, 2], [1, 2], [1, 2], [3]], layers=[(0, 2)]
    )
    assert all(o[0] == "error" and o[1] == "TransferError" for o in out), out
    assert "bad token" in out[0][2] and "not reserved" in out[1][2] and "outside" in out[2][2]
    assert not pool.view(torch.uint8).any()
    with pytest.raises(TransferError, match="deadline"):
        asyncio.run(rx.wait("old", 5))
    # the receiver keeps serving: the real destination still works
    assert (
        sender.run(backend=backend, dtype="float32", seed=5, dsts=[good.to_dict()], srcs=[[1, 2]], layers=[(0, 2)])[0][
            0
        ]
        == "ok"
    )
    assert asyncio.run(rx.wait("good", 5)).ok
    assert rx.num_active_reservations == 0


def test_done_without_accepted_open_does_not_bind_the_reservation(sender, receiver_pool):
    rx, _ = receiver_pool()
    dst = rx.reserve("b", [6, 7])
    host, port = rx.address.rsplit(":", 1)

    with socket.create_connection((host, int(port)), timeout=5) as s:
        wire = Wire(s)
        hello = {"op": "hello", "version": WIRE_VERSION, "backend": "tcp", "session": "x", "layout": dst.layout}
        assert client_handshake(wire, None, hello, "rx")["op"] == "hello_ok"
        wire.send({"op": "open", "rid": "b", "xid": 1, "token": dst.token, "blocks": [6, 9]})  # 9: not reserved
        assert wire.recv()["op"] == "error"
        wire.send({"op": "done", "rid": "b", "xid": 1, "token": dst.token, "writes": 1, "checksum": 0})
        assert "without an accepted open" in wire.recv()["error"]
    time.sleep(0.2)  # that connection's close must not fail the reservation
    assert (
        sender.run(backend="tcp", dtype="float32", seed=2, dsts=[dst.to_dict()], srcs=[[0, 1]], layers=[(0, 2)])[0][0]
        == "ok"
    )
    assert asyncio.run(rx.wait("b", 5)).ok


@pytest.mark.parametrize("backend", ["tcp", "shm"])
def test_cancel_returns_blocks_and_rejects_later_writes(sender, receiver_pool, backend):
    rx, pool = receiver_pool(shm_grace_s=0.3)
    tags = block_tags(rx.shm_name, pool.shape[2])
    dst = rx.reserve("z", [4, 5])
    assert (tags[[4, 5]] == token_tag(dst.token)).all() and tags[[3, 6]].tolist() == [0, 0]
    t0 = time.monotonic()
    rx.cancel("z")
    assert not tags.any()  # closed to shm writers at once ...
    with pytest.raises(TransferError, match="cancelled"):
        asyncio.run(rx.wait("z", 5))
    assert time.monotonic() - t0 >= 0.3  # ... but the blocks come back only after the grace period
    assert rx.num_active_reservations == 0
    out = sender.run(backend=backend, dtype="float32", seed=1, dsts=[dst.to_dict()], srcs=[[0, 1]], layers=[(0, 2)])
    assert out[0][0] == "error" and "cancelled" in out[0][2], out
    assert not pool.view(torch.uint8).any()
    rx.reserve("z", [4, 5])  # the blocks are reservable again
    with pytest.raises(ValueError, match="already reserved"):
        rx.reserve("w", [5])


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["tcp", "shm"])
def test_sender_killed_mid_transfer(receiver_pool, backend):
    rx, _ = receiver_pool()
    dst = rx.reserve("k", list(range(0, 32)), timeout_s=60)
    proc = SenderProc()
    try:
        proc.conn.send(
            {
                "hang_after_first_layer": True,
                "backend": backend,
                "dtype": "float32",
                "seed": 1,
                "dsts": [dst.to_dict()],
                "srcs": [list(range(32))],
            }
        )
        assert proc.conn.poll(60) and proc.conn.recv() == "hanging"
        assert rx.num_active_reservations == 1
        killed_at = time.time()
        os.kill(proc.proc.pid, signal.SIGKILL)
        with pytest.raises(TransferError, match="connection lost") as lost:  # TimeoutError: not noticed in 5 s
            asyncio.run(rx.wait("k", 5))
        at = time.time()
    finally:
        proc.proc.kill()
        proc.proc.join(5)
    assert lost.value.code == "lost" and at - killed_at < 5
    assert rx.num_active_reservations == 0


def test_garbage_on_the_port_is_dropped(sender, receiver_pool):
    rx, pool = receiver_pool()
    host, port = rx.address.rsplit(":", 1)
    # 1) pure garbage, 2) a huge length prefix, 3) a valid hello followed by a frame that is not a map
    hello = {"op": "hello", "version": WIRE_VERSION, "backend": "tcp", "session": "evil",
             "layout": KVLayout.of(pool).to_dict()}
    payloads = [
        os.urandom(4096),
        struct.pack("!I", 2**31) + b"x" * 64,
        struct.pack("!I", 3) + msgpack.packb(7) + b"zz",
    ]
    for i, data in enumerate(payloads):
        with socket.create_connection((host, int(port)), timeout=5) as s:
            if i == 2:
                client_handshake(Wire(s), None, hello, "rx")
            s.sendall(data)
            s.settimeout(5)
            try:
                while s.recv(65536):  # the receiver closes the connection on its side
                    pass
            except ConnectionResetError:
                pass
    assert not pool.view(torch.uint8).any()
    dst = rx.reserve("after", [1])
    assert (
        sender.run(backend="tcp", dtype="float32", seed=1, dsts=[dst.to_dict()], srcs=[[0]], layers=[(0, 2)])[0][0]
        == "ok"
    )
    assert asyncio.run(rx.wait("after", 5)).ok


def test_layout_mismatch_fails_clearly(sender, receiver_pool):
    rx, pool = receiver_pool("bfloat16")
    dst = rx.reserve("m", [1])
    out = sender.run(backend="tcp", dtype="float16", seed=1, dsts=[dst.to_dict()], srcs=[[0]], layers=[(0, 2)])
    assert out[0][1] == "LayoutMismatchError" and "dtype" in out[0][2] and "bfloat16" in out[0][2], out
    # the receiver's own handshake check, for a sender that lies in its destination copy
    host, port = rx.address.rsplit(":", 1)
    theirs = {**KVLayout.of(pool).to_dict(), "head_dim": 64}
    with socket.create_connection((host, int(port)), timeout=5) as s:
        wire = Wire(s)
        hello = {"op": "hello", "version": WIRE_VERSION, "backend": "tcp", "session": "s", "layout": theirs}
        with pytest.raises(LayoutMismatchError, match="head_dim: sender 64 vs receiver 32"):
            client_handshake(wire, None, hello, "rx")
    rx.cancel("m")
    with pytest.raises(TransferError, match="cancelled"):
        asyncio.run(rx.wait("m", 5))
    assert rx.num_active_reservations == 0


# ---- int8 wire compression and the destination format ----------------------------------------------------


def test_int8_wire_compression_round_trip(sender, receiver_pool):
    rx, pool = receiver_pool("bfloat16")
    src = source_pool(9, "bfloat16")
    dst = rx.reserve("q", [2, 3, 50])
    out = sender.run(
        backend="tcp",
        dtype="bfloat16",
        seed=9,
        quant="int8",
        dsts=[dst.to_dict()],
        srcs=[[5, 6, 7]],
        layers=[(0, 1), (1, 2)],
    )
    assert out[0][0] == "ok", out
    res = asyncio.run(rx.wait("q", 10))
    lay = KVLayout.of(pool)
    assert (
        res.nbytes == quant.wire_bytes(3, 2, lay.block_size, lay.num_kv_heads, lay.head_dim) < 3 * lay.block_bytes * 0.6
    )
    got, want = blocks_of(pool, [2, 3, 50]).float(), blocks_of(src, [5, 6, 7]).float()
    assert not torch.equal(got, want)  # lossy, but within half a quantisation step per (block, layer, k|v, head)
    step = want.abs().amax(dim=(3, 5), keepdim=True) / 127
    assert ((got - want).abs() <= step * 0.5 + want.abs() * 2**-7).all()


def test_destination_is_a_msgpack_dict(receiver_pool):
    rx, _ = receiver_pool()
    dst = rx.reserve("d", [1, 2])
    again = Destination.from_dict(msgpack.unpackb(msgpack.packb(dst.to_dict())))
    assert again == dst and set(again.backends) == {"shm", "tcp", "gloo"}
    with pytest.raises(ValueError, match="destination.token"):
        Destination.from_dict({**dst.to_dict(), "token": 5})
    with pytest.raises(ValueError, match="block_ids"):
        rx.reserve("e", [64])
    rx.cancel("d")
