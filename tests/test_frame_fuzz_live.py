"""Bad frames against running processes (docs/reliability.md): hypothesis-generated frames, at least 500 per
port kind, sent by an authenticated peer (the cluster secret's CURVE keys, the KV handshake's HMAC) so they
reach the decoders behind the authentication: a node's control socket (decode and prefill), the router's
Load subscriber (through a cordoned stand-in node registered in etcd), the decode node's KV receiver.

Each must drop what it cannot decode, count it, and keep serving: after the frames every process still
runs, answers a real request, and every KV pool is back to 0 blocks used or reserved.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import time
import uuid
from typing import Iterator

import msgpack
import pytest
import zmq
from cluster_helpers import router_metrics, wait_idle
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from protocol_strategies import message_like, values

from pdcluster.cli.smoke import scrape_metrics, smoke_request
from pdcluster.cli.supervisor import LocalCluster
from pdcluster.control.keys import load_secret
from pdcluster.control.protocol import Ping, Pong, ProtocolError, decode, encode

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(240)]

CASES = 500
FUZZ = settings(max_examples=CASES, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
DROPPED = 'pdcluster_node_dropped_frames_total{socket="%s"}'
wire_frames = st.one_of(st.binary(max_size=256), message_like.map(lambda m: msgpack.packb(m, use_bin_type=True)))
KV_FIELDS = ("rid", "token", "xid", "blocks", "runs", "l0", "l1", "nbytes", "checksum", "writes", "reason")
kv_frames = st.fixed_dictionaries(
    {"op": st.one_of(st.sampled_from(["open", "write", "done", "abort"]), values)},
    optional={name: values for name in KV_FIELDS})


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_llama):
    c = LocalCluster(model=tiny_llama, work_dir=tmp_path_factory.mktemp("cluster"), num_prefill=1, num_decode=1, port=0,
                     cluster="fuzz", lease_ttl=2, threads_per_node=1,
                     node_config={"kv_cache_memory": "8MiB", "max_num_seqs": 8, "device": "cpu", "block_size": 16},
                     router_config={"disagg_min_tokens": 0})
    with c:
        yield c


@contextlib.contextmanager
def fuzz_peer(kind: str, cluster: LocalCluster, address: str = "") -> Iterator[object]:
    """An authenticated peer on one port kind; the one place that knows how a cluster member authenticates.
    control: a zmq DEALER connected to `address` as a CURVE client of the cluster. load: a zmq PUB, bound on
    loopback, speaking CURVE as the cluster's servers do (its `last_endpoint` is what routers connect to).
    kv: a TCP connection to the KV receiver at `address` ("host:port") after a valid handshake (tcp backend)."""
    keys = load_secret(cluster.cluster_secret)
    if kind == "kv":
        from pdcluster.kv_transfer.handshake import client_handshake
        from pdcluster.kv_transfer.tcp import WIRE_VERSION, Wire

        host, port = address.rsplit(":", 1)
        wire = Wire(socket.create_connection((host, int(port)), timeout=10))
        try:
            client_handshake(wire, keys.kv_key, {"op": "hello", "version": WIRE_VERSION, "backend": "tcp",
                                                 "session": uuid.uuid4().hex, "layout": kv_layout(cluster),
                                                 "stream": 0}, address)
            yield wire.sock
        finally:
            wire.close()
        return
    sock = zmq.Context.instance().socket(zmq.DEALER if kind == "control" else zmq.PUB)
    sock.setsockopt(zmq.LINGER, 0)
    if kind == "control":
        sock.setsockopt(zmq.CURVE_SERVERKEY, keys.server_public)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.client_public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, keys.client_secret)
        sock.connect(address)
    else:
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_SECRETKEY, keys.server_secret)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.server_public)
        sock.bind("tcp://127.0.0.1:0")
    try:
        yield sock
    finally:
        sock.close()


def kv_layout(cluster: LocalCluster) -> dict:
    """The KV layout a sender of this model declares in its hello (the receiver checks it)."""
    import json

    from pdcluster.kv_transfer.layout import LAYOUT_VERSION

    config = json.loads(open(os.path.join(cluster.model, "config.json")).read())
    heads = config["num_attention_heads"]
    return {"version": LAYOUT_VERSION, "dtype": "float32", "num_blocks": 1, "num_layers": config["num_hidden_layers"],
            "block_size": cluster.node_config["block_size"], "num_kv_heads": config["num_key_value_heads"],
            "head_dim": config["hidden_size"] // heads}


def node_record(cluster: LocalCluster, node_id: str):
    async def get():
        from pdcluster.control.etcd_client import close_quietly, connect
        from pdcluster.control.queries import list_nodes

        etcd = await connect([cluster.etcd])
        try:
            return next(n for n in await list_nodes(etcd, cluster.cluster) if n.node_id == node_id)
        finally:
            await close_quietly(etcd)

    return asyncio.run(get())


def undecodable(frame: bytes) -> bool:
    try:
        decode(frame)
        return False
    except ProtocolError:
        return True


def serves(cluster: LocalCluster) -> None:
    """Every process still runs, a real request goes through, and every KV pool is empty again."""
    assert not cluster.dead_services(), [s.node_id for s in cluster.dead_services()]
    reply = smoke_request(cluster.url, os.path.basename(cluster.model), timeout=60)
    assert reply["choices"][0]["finish_reason"] == "length"
    wait_idle(cluster, timeout=60)


@pytest.mark.parametrize("role", ["decode", "prefill"])
def test_control_socket_drops_every_undecodable_frame_and_serves_on(cluster, role):
    node = cluster.service(f"{role}-0")
    record = node_record(cluster, node.node_id)
    before = scrape_metrics(node.metrics_url)[DROPPED % "control"]
    sent = expected = 0
    with fuzz_peer("control", cluster, record.control_addr) as sock:
        @FUZZ
        @given(frames=st.lists(wire_frames, min_size=1, max_size=2))
        def case(frames: list[bytes]) -> None:
            nonlocal sent, expected
            sock.send_multipart(frames)
            sent += 1
            expected += len(frames) != 1 or undecodable(frames[0])

        case()
        # The control loop handles frames in order: our Pong means it went through every one before.
        nonce = int.from_bytes(os.urandom(4), "big")
        sock.send(encode(Ping(nonce=nonce)))
        deadline = time.monotonic() + 30
        while True:
            assert sock.poll(max(0, int(1000 * (deadline - time.monotonic())))), "no Pong: the control loop is gone"
            reply = sock.recv_multipart()
            with contextlib.suppress(ProtocolError):
                msg = decode(reply[-1])
                if isinstance(msg, Pong) and msg.nonce == nonce:
                    break
    assert sent >= CASES
    assert scrape_metrics(node.metrics_url)[DROPPED % "control"] - before == expected > 0
    print(f"\nFUZZ control/{role}: {sent} cases, {expected} dropped")   # `pytest -s`: docs/reliability.md
    serves(cluster)


def test_router_load_subscriber_drops_every_undecodable_frame_and_serves_on(cluster):
    from pdcluster.control.etcd_client import close_quietly, connect
    from pdcluster.control.queries import set_admin_state
    from pdcluster.control.records import NodeInfo, admin_key, node_key

    key = 'pdcluster_router_dropped_frames_total{socket="load"}'
    fake = f"fuzz-{uuid.uuid4().hex[:6]}"

    def dropped() -> float:
        return router_metrics(cluster).get(key, 0.0)

    def wait_dropped(target: float, what: str) -> None:
        deadline = time.monotonic() + 30
        while dropped() < target:
            assert time.monotonic() < deadline, what
            time.sleep(0.05)

    async def etcd(op: str, load_addr: str = "") -> None:
        client = await connect([cluster.etcd])
        try:
            if op == "add":   # cordoned, another model: the router never sends it work, only reads its Load
                await set_admin_state(client, cluster.cluster, fake, "cordoned", reason="frame fuzzing")
                info = NodeInfo(node_id=fake, role="decode", model="fuzz-only", host="127.0.0.1",
                                control_addr="tcp://127.0.0.1:9", load_addr=load_addr)
                await client.put(node_key(cluster.cluster, "decode", fake).encode(), info.to_json().encode())
            else:
                await client.delete(node_key(cluster.cluster, "decode", fake).encode())
                await client.delete(admin_key(cluster.cluster, fake).encode())
        finally:
            await close_quietly(client)

    sent = expected = 0
    with fuzz_peer("load", cluster) as pub:
        asyncio.run(etcd("add", pub.getsockopt(zmq.LAST_ENDPOINT).decode()))
        try:
            start = dropped()
            deadline = time.monotonic() + 30
            while dropped() == start:   # until the router's subscriber is connected (PUB drops until then)
                assert time.monotonic() < deadline, "the router never subscribed to the stand-in node"
                pub.send(b"\xc1")
                time.sleep(0.05)
            base = dropped()

            @FUZZ
            @given(frame=wire_frames)
            def case(frame: bytes) -> None:
                nonlocal sent, expected
                pub.send(frame)
                sent += 1
                expected += undecodable(frame)
                if sent % 50 == 0:   # pace: a PUB drops what its subscriber's queue cannot hold
                    wait_dropped(base + expected, "the router fell behind or stopped reading Load reports")

            case()
            wait_dropped(base + expected, "the router did not drop every undecodable Load frame")
        finally:
            asyncio.run(etcd("remove"))
    assert sent >= CASES and dropped() - base >= expected > 0
    print(f"\nFUZZ load: {sent} cases, {dropped() - base:.0f} dropped ({expected} undecodable)")
    serves(cluster)


def test_kv_receiver_survives_bad_frames_from_an_authenticated_sender(cluster):
    decode_node = cluster.service("decode-0")
    record = node_record(cluster, decode_node.node_id)
    before = scrape_metrics(decode_node.metrics_url)[DROPPED % "kv"]
    sent = 0

    @FUZZ
    @given(frame=kv_frames, payload=st.binary(max_size=64), raw=st.booleans())
    def case(frame: dict, payload: bytes, raw: bool) -> None:
        nonlocal sent
        with fuzz_peer("kv", cluster, record.kv_addr) as sock:
            body = msgpack.packb(frame, use_bin_type=True)
            try:
                sock.sendall(payload if raw else len(body).to_bytes(4, "big") + body + payload)
                sock.shutdown(socket.SHUT_WR)
                while sock.recv(65536):   # until the receiver closes its side: each case ends before the next
                    pass
            except TimeoutError:
                raise   # the receiver neither answered nor closed: a hang
            except OSError:
                pass    # it closed (reset) before we were done: the frame was refused
        sent += 1

    case()
    assert sent >= CASES
    dropped = scrape_metrics(decode_node.metrics_url)[DROPPED % "kv"] - before
    assert dropped > 0
    print(f"\nFUZZ kv: {sent} cases, {dropped:.0f} connections dropped for a malformed frame")
    serves(cluster)
