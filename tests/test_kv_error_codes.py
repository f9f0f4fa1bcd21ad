"""Failure codes across a real KV connection: a refusal leaves the receiver as a code (plus a message), and
arrives at the sender (and at the receiver's waiter) as the exception class the code names, with that code.
Receiver and sender in this process, over tcp on loopback."""

from __future__ import annotations

import asyncio
import socket
import time

import pytest
import torch

from pdcluster.kv_transfer import ChecksumError, KVReceiver, KVSender, LayoutMismatchError, TransferError
from pdcluster.kv_transfer.errors import CODES, HandshakeRefused, StaleReservationError, from_code
from pdcluster.kv_transfer.handshake import client_handshake
from pdcluster.kv_transfer.tcp import WIRE_VERSION, Wire
from pdcluster.kv_transfer.testing import corrupt_writes

SHAPE = (2, 2, 16, 4, 1, 8)   # layers, k|v, blocks, block_size, kv heads, head_dim
WAIT = 5.0


@pytest.fixture
def pair():
    made: list = []

    def make(**rx_kw):
        src = torch.randn(SHAPE)
        rx = KVReceiver(torch.zeros(SHAPE), host="127.0.0.1", **rx_kw)
        tx = KVSender(src, backend="tcp")
        made.append((rx, tx))
        return rx, tx

    yield make
    for rx, tx in made:
        tx.close()
        rx.close()


def wait(rx: KVReceiver, rid: str, timeout: float = WAIT):
    return asyncio.run(rx.wait(rid, timeout))


def send(tx: KVSender, dst, src=(0, 1)) -> int:
    t = tx.start(dst, list(src))
    t.send_all()
    return t.finish(WAIT)


# ---- the table -------------------------------------------------------------------------------------------


def test_every_code_rebuilds_its_class_and_keeps_the_code():
    for code, cls in CODES.items():
        exc = from_code(code, "why")
        assert type(exc) is cls and exc.code == code and str(exc) == "why" and isinstance(exc, TransferError)
    assert (ChecksumError.code, LayoutMismatchError.code, StaleReservationError.code) == ("checksum", "layout", "stale")
    assert HandshakeRefused.code == "auth" and TransferError().code == "failed"
    odd = from_code("from-the-future", "x")   # both ends run one version: kept, so the log shows it
    assert type(odd) is TransferError and odd.code == "from-the-future"
    assert from_code(None, "x").code == "failed" and from_code(7, "x").code == "failed"


# ---- refusals the sender hears ------------------------------------------------------------------------------


def test_a_write_with_a_bad_token_is_refused(pair):
    rx, tx = pair()
    dst = rx.reserve("a", [2, 3])
    forged = {**dst.to_dict(), "token": "0" * 32}
    with pytest.raises(TransferError, match="bad token") as exc:
        send(tx, forged)
    assert type(exc.value) is TransferError and exc.value.code == "refused"
    assert send(tx, dst) == wait(rx, "a").checksum   # the receiver keeps serving the real one


def test_a_write_into_blocks_not_reserved_is_refused(pair):
    rx, tx = pair()
    dst = rx.reserve("a", [2, 3])
    with pytest.raises(TransferError, match="not reserved") as exc:
        send(tx, {**dst.to_dict(), "block_ids": [2, 4]})
    assert exc.value.code == "refused"
    rx.cancel("a")


def test_a_cancelled_reservation_says_cancelled_on_both_sides(pair):
    rx, tx = pair()
    dst = rx.reserve("c", [1])
    rx.cancel("c")
    with pytest.raises(TransferError, match="cancelled") as waited:
        wait(rx, "c")
    assert waited.value.code == "cancelled"
    with pytest.raises(TransferError, match="already failed: cancelled") as sent:
        send(tx, dst, src=[0])
    assert type(sent.value) is TransferError and sent.value.code == "cancelled"


def test_an_expired_reservation_says_expired(pair):
    rx, tx = pair()
    dst = rx.reserve("old", [5], timeout_s=0.05)
    time.sleep(0.3)   # the reaper fails it
    with pytest.raises(TransferError, match="deadline") as waited:
        wait(rx, "old")
    assert waited.value.code == "expired"
    with pytest.raises(TransferError, match="deadline exceeded") as sent:
        send(tx, {**dst.to_dict(), "timeout_s": 30.0}, src=[0])   # the receiver's deadline counts
    assert sent.value.code == "expired"


def test_corrupted_bytes_are_a_checksum_error_on_both_sides(pair):
    rx, _ = pair()
    with corrupt_writes("tcp"):
        tx = KVSender(torch.randn(SHAPE), backend="tcp")
        try:
            dst = rx.reserve("x", [7, 8])
            with pytest.raises(ChecksumError, match="checksum mismatch") as sent:
                send(tx, dst)
        finally:
            tx.close()
    assert sent.value.code == "checksum"
    with pytest.raises(ChecksumError) as waited:
        wait(rx, "x")
    assert waited.value.code == "checksum"


def test_a_layout_the_receiver_refuses_at_the_handshake_is_a_layout_error(pair):
    rx, _ = pair()
    dst = rx.reserve("m", [1])
    host, port = rx.address.rsplit(":", 1)
    theirs = {**dst.layout, "head_dim": 16}
    with socket.create_connection((host, int(port)), timeout=WAIT) as s:
        wire = Wire(s)
        hello = {"op": "hello", "version": WIRE_VERSION, "backend": "tcp", "session": "s", "layout": theirs}
        with pytest.raises(LayoutMismatchError, match="head_dim: sender 16 vs receiver 8") as exc:
            client_handshake(wire, None, hello, "rx")
    assert exc.value.code == "layout"
    rx.cancel("m")


def test_the_error_frame_carries_the_code_beside_the_message(pair):
    rx, _ = pair()
    dst = rx.reserve("b", [6, 7])
    host, port = rx.address.rsplit(":", 1)

    with socket.create_connection((host, int(port)), timeout=WAIT) as s:
        wire = Wire(s)
        hello = {"op": "hello", "version": WIRE_VERSION, "backend": "tcp", "session": "x", "layout": dst.layout}
        client_handshake(wire, None, hello, "rx")
        wire.send({"op": "open", "rid": "b", "xid": 1, "token": dst.token, "blocks": [6, 9]})
        got = wire.recv()
        assert got["op"] == "error" and got["code"] == "refused" and "not reserved" in got["error"]
        wire.send({"op": "open", "rid": "nobody", "xid": 2, "token": dst.token, "blocks": [6]})
        assert wire.recv()["code"] == "missing"
    rx.cancel("b")


# ---- the receiver's own outcomes --------------------------------------------------------------------------


def test_wait_times_out_with_the_builtin_timeout_error_and_the_result_still_comes(pair):
    rx, tx = pair()
    dst = rx.reserve("w", [0, 1])
    with pytest.raises(TimeoutError, match="no result within 0.05 s"):
        wait(rx, "w", 0.05)
    send(tx, dst)
    assert wait(rx, "w").ok   # a timed-out waiter took nothing away


def test_wait_for_an_unknown_reservation_is_missing(pair):
    rx, _ = pair()
    with pytest.raises(TransferError, match="no such reservation") as exc:
        wait(rx, "never")
    assert exc.value.code == "missing"


def test_close_answers_whoever_still_waits(pair):
    rx, _ = pair()
    rx.reserve("p", [3])

    async def main():
        waiter = asyncio.create_task(rx.wait("p", 10))
        await asyncio.sleep(0.05)
        rx.close()
        return await asyncio.gather(waiter, return_exceptions=True)

    (exc,) = asyncio.run(main())
    assert isinstance(exc, TransferError) and exc.code == "closed"


def test_bytes_sent_and_received_agree(pair):
    rx, tx = pair()
    assert tx.bytes_sent == rx.bytes_received == 0
    for i in range(3):
        send(tx, rx.reserve(f"n{i}", [i, i + 4]))
        wait(rx, f"n{i}")
    block_bytes = torch.zeros(SHAPE)[:, :, 0].numel() * 4
    assert tx.bytes_sent == rx.bytes_received == 3 * 2 * block_bytes
    dst = rx.reserve("bad", [9])
    with pytest.raises(TransferError):
        send(tx, {**dst.to_dict(), "token": "0" * 32}, src=[0])
    assert tx.bytes_sent == rx.bytes_received == 3 * 2 * block_bytes   # refused transfers count nothing
    rx.cancel("bad")
