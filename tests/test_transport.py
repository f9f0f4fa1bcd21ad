"""pdcluster.control.transport over real zmq tcp sockets on loopback."""

from __future__ import annotations

import asyncio
import dataclasses

import msgpack
import pytest
import zmq
import zmq.asyncio

from pdcluster.control import protocol
from pdcluster.control.protocol import Abort, Generate, Load, Ping, Pong, Prefill, PrefillDone, Reject, Tokens
from pdcluster.control.transport import DealerClient, LoadPublisher, LoadSubscriber, PeerDealers, RouterServer

SAMPLES = [
    Generate(rid="r1", prompt_ids=[1, 2, 3], sampling={"temperature": 0.0, "stop": ["x"]}, prefill_node=None,
             timeout_s=123.5, router="router-a", resume_ids=[7, 8]),
    Tokens(rid="r1", ids=[4, 5], logprobs=[[-0.5, [[4, -0.5], [9, -1.25]]], [-0.1, []]], finish="length",
           num_prompt_tokens=3, num_cached_tokens=0, prefill_path="local"),
    Reject(rid="r2", reason="queue full", retry_after=0.5),
    Abort(rid="r3"),
    Prefill(rid="r4", prompt_ids=[1] * 40, sampling={}, dst={"addr": "shm://x", "blocks": [1, 2]},
            decode_node="d0", timeout_s=1.0, skip_blocks=1),
    PrefillDone(rid="r4", first_token=11, logprobs=None, checksum=99, num_cached_tokens=16),
    Load(node_id="d0", role="decode", running=2, waiting=1, free_blocks=100, total_blocks=128,
         kv_events=[[0, 1, [1, 2, 3]]], kv_seq=2, kv_snapshot=True, timestamp=5.0),
    Ping(nonce=3),
    Pong(nonce=3),
]


async def _pair() -> tuple[RouterServer, DealerClient]:
    server = RouterServer()
    addr = server.bind("tcp://127.0.0.1:0")
    assert addr.startswith("tcp://127.0.0.1:") and not addr.endswith(":0")
    client = DealerClient()
    client.connect(addr)
    return server, client


async def test_round_trip_every_message_type() -> None:
    server, client = await _pair()
    try:
        for msg in SAMPLES:
            assert client.send(msg)
            identity, got = await asyncio.wait_for(server.recv(), 5)
            assert got == msg and type(got) is type(msg)
            assert server.send(identity, msg)
            back = await client.recv(timeout=5)
            assert back == msg
    finally:
        server.close()
        client.close()


async def test_garbage_frames_are_dropped_and_serving_continues() -> None:
    server = RouterServer()
    addr = server.bind("tcp://127.0.0.1:*")
    raw = zmq.asyncio.Context.instance().socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(addr)
    try:
        garbage = [
            [b"\xc1\xff\x00not msgpack"],
            [msgpack.packb([1, 2, 3])],
            [msgpack.packb({"v": 99, "t": "ping", "nonce": 1})],
            [msgpack.packb({"v": protocol.PROTOCOL_VERSION, "t": "nope"})],
            [msgpack.packb({"v": protocol.PROTOCOL_VERSION, "t": "abort", "rid": 5})],
            [protocol.encode(Ping(nonce=1)), b"extra frame"],
        ]
        for frames in garbage:
            await raw.send_multipart(frames)
        await raw.send(protocol.encode(Ping(nonce=42)))
        identity, msg = await asyncio.wait_for(server.recv(), 5)
        assert msg == Ping(nonce=42)  # everything before it was dropped, not raised
        assert server.send(identity, Pong(nonce=42))
        assert protocol.decode(await asyncio.wait_for(raw.recv(), 5)) == Pong(nonce=42)
    finally:
        raw.close()
        server.close()


async def test_dealer_drops_garbage_and_times_out() -> None:
    raw = zmq.asyncio.Context.instance().socket(zmq.ROUTER)
    raw.setsockopt(zmq.LINGER, 0)
    port = raw.bind_to_random_port("tcp://127.0.0.1")
    client = DealerClient()
    client.connect(f"tcp://127.0.0.1:{port}")
    try:
        assert await client.recv(timeout=0.2) is None
        assert client.send(Ping(nonce=1))
        identity, _ = await asyncio.wait_for(raw.recv_multipart(), 5)
        await raw.send_multipart([identity, b"garbage"])
        await raw.send_multipart([identity, protocol.encode(Pong(nonce=1))])
        assert await client.recv(timeout=5) == Pong(nonce=1)
    finally:
        client.close()
        raw.close()


async def test_send_to_gone_peer_returns_false_without_blocking() -> None:
    server, client = await _pair()
    try:
        assert server.send(b"nobody-has-this-identity", Ping()) is False
        client.send(Ping(nonce=7))
        identity, _ = await asyncio.wait_for(server.recv(), 5)
        client.close()
        for _ in range(100):  # the disconnect is noticed asynchronously
            if not server.send(identity, Pong(nonce=7)):
                break
            await asyncio.sleep(0.05)
        else:
            pytest.fail("send to a closed peer kept succeeding")
    finally:
        server.close()


async def test_dealer_to_dead_address_never_blocks() -> None:
    client = DealerClient(hwm=5)
    client.connect("tcp://127.0.0.1:9")  # nothing listens there
    try:
        results = [client.send(Ping(nonce=i)) for i in range(50)]
        assert results.count(False) >= 40  # queue bounded by HWM; sends return at once
    finally:
        client.close()


@pytest.mark.slow
async def test_load_reports_arrive_over_pub_sub() -> None:
    pub = LoadPublisher()
    addr = pub.bind("tcp://127.0.0.1:0")
    sub = LoadSubscriber()
    sub.connect(addr)
    count = 0

    def snapshot() -> Load:
        nonlocal count
        count += 1
        return Load(node_id="p0", role="prefill", queued_prefill_tokens=count, kv_events=[[0, 0, [5, 6]]])

    task = asyncio.create_task(pub.run(snapshot, interval=0.05))
    try:
        first = await sub.recv(timeout=5)
        second = await sub.recv(timeout=5)
        assert first is not None and second is not None
        assert first.node_id == "p0" and first.kv_events == [[0, 0, [5, 6]]] and first.timestamp > 0
        assert second.queued_prefill_tokens > first.queued_prefill_tokens
        sub.disconnect(addr)
        await asyncio.sleep(0.2)
        while await sub.recv(timeout=0.1) is not None:  # drain what was queued before disconnect
            pass
        assert await sub.recv(timeout=0.3) is None
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        pub.close()
        sub.close()


def test_load_fields_survive_encoding() -> None:
    load = Load(node_id="d1", role="decode", free_blocks=3)
    assert dataclasses.asdict(protocol.decode(protocol.encode(load))) == dataclasses.asdict(load)


async def test_peer_dealers_route_replies_and_reconnect_when_the_address_changes() -> None:
    old, new = RouterServer(), RouterServer()
    old_addr, new_addr = old.bind("tcp://127.0.0.1:0"), new.bind("tcp://127.0.0.1:0")
    got: list[tuple[str, protocol.Message]] = []
    peers = PeerDealers(lambda node_id, msg: got.append((node_id, msg)))
    try:
        assert not peers.send_existing("n1", Ping(nonce=0))  # no connection yet
        assert peers.send("n1", old_addr, Ping(nonce=1))
        identity, msg = await asyncio.wait_for(old.recv(), 5)
        assert msg == Ping(nonce=1)
        old.send(identity, Pong(nonce=1))
        for _ in range(100):
            if got:
                break
            await asyncio.sleep(0.02)
        assert got == [("n1", Pong(nonce=1))]

        assert peers.send("n1", new_addr, Ping(nonce=2))  # the node moved: a new connection
        identity, msg = await asyncio.wait_for(new.recv(), 5)
        assert msg == Ping(nonce=2)
        assert peers.send_existing("n1", Abort(rid="x"))
        assert (await asyncio.wait_for(new.recv(), 5))[1] == Abort(rid="x")
        peers.drop("n1")
        assert not peers.send_existing("n1", Abort(rid="y"))
    finally:
        peers.close()
        old.close()
        new.close()


async def test_a_frame_over_the_size_limit_is_refused_by_zmq_before_it_is_buffered(monkeypatch) -> None:
    from pdcluster.control import transport

    monkeypatch.setattr(transport, "MAX_FRAME_BYTES", 1024)   # read when a socket is made
    server = RouterServer()
    addr = server.bind("tcp://127.0.0.1:*")
    big, small = (zmq.asyncio.Context.instance().socket(zmq.DEALER) for _ in range(2))
    for sock in (big, small):
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(addr)
    try:
        await big.send(protocol.encode(Prefill(rid="huge", prompt_ids=[7] * 2000, sampling={}, dst={},
                                               decode_node="d0", timeout_s=1.0)))
        await small.send(protocol.encode(Ping(nonce=7)))
        identity, msg = await asyncio.wait_for(server.recv(), 5)
        assert msg == Ping(nonce=7)   # the oversized Prefill never reached the application
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(server.recv(), 0.5)
        assert server.dropped.count == 0   # not read and then dropped: refused by zmq
    finally:
        big.close()
        small.close()
        server.close()
