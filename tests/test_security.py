"""Authentication inside the cluster (docs/security.md): the cluster secret file, CURVE on every zmq socket,
the KV receiver's challenge-response handshake and its bounded front door, and Abort honoured only from the
peer that owns the request. Unauthenticated peers are refused on every port: control, load and KV."""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import time

import pytest
import torch

from pdcluster.control.keys import SecretError, generate_secret, load_secret
from pdcluster.control.protocol import Abort, Generate, Load, Ping, Pong, PrefillDone, Tokens
from pdcluster.control.transport import DealerClient, LoadPublisher, LoadSubscriber, RouterServer
from pdcluster.kv_transfer import KVReceiver, KVSender, TransferError
from pdcluster.kv_transfer.handshake import HandshakeRefused
from pdcluster.kv_transfer.tcp import recv_frame

SHAPE = (2, 2, 8, 4, 2, 8)   # a small KV pool: 2 layers, 8 blocks
QUIET = 1.0   # how long "nothing arrives" is watched


@pytest.fixture
def secrets_(tmp_path):
    """(path of a cluster secret, its keys, the keys of another cluster's secret)."""
    path = tmp_path / "cluster.secret"
    keys = generate_secret(path)
    return str(path), keys, generate_secret(tmp_path / "other.secret")


# ---------------------------------------------------------------------------------------------- the secret file

def test_secret_file_is_private_atomic_and_not_overwritten(tmp_path):
    path = tmp_path / "s"
    keys = generate_secret(path)
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert load_secret(path) == keys   # the same file gives the same keys in every process
    assert [p.name for p in tmp_path.iterdir()] == ["s"]   # no temporary file left behind
    with pytest.raises(SecretError, match="exists; pass --force"):
        generate_secret(path)
    assert load_secret(path) == keys
    replaced = generate_secret(path, force=True)
    assert replaced != keys and load_secret(path) == replaced
    assert len({replaced.server_public, replaced.client_public, keys.server_public}) == 3


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o660])
def test_a_secret_readable_by_others_is_refused(tmp_path, mode):
    path = tmp_path / "s"
    generate_secret(path)
    os.chmod(path, mode)
    with pytest.raises(SecretError, match=f"permissions {mode:04o} .* too open.*chmod 600"):
        load_secret(path)


def test_missing_or_malformed_secret_is_refused(tmp_path):
    with pytest.raises(SecretError, match="does not exist.*pdcluster keys generate"):
        load_secret(tmp_path / "missing")
    bad = tmp_path / "bad"
    for text in ("", "pdcluster-secret-v1 abcd\n", "hello\n", "pdcluster-secret-v1 " + "zz" * 32 + "\n"):
        bad.write_text(text)
        os.chmod(bad, 0o600)
        with pytest.raises(SecretError, match="expected a line|must be 32 bytes"):
            load_secret(bad)


def test_config_refuses_an_unusable_secret(tmp_path):
    from pdcluster.cli.config import load_config

    path = tmp_path / "s"
    generate_secret(path)
    assert load_config("router", overrides={"cluster_secret": str(path)}, env={}).cluster_secret == str(path)
    os.chmod(path, 0o644)
    with pytest.raises(ValueError, match="cluster_secret: permissions 0644"):
        load_config("router", overrides={"cluster_secret": str(path)}, env={})


def test_keys_generate_command(tmp_path):
    from typer.testing import CliRunner

    from pdcluster.cli.main import app

    path = tmp_path / "cluster.secret"
    runner = CliRunner()
    first = runner.invoke(app, ["keys", "generate", str(path)])
    assert first.exit_code == 0 and "fingerprint" in first.output
    keys = load_secret(path)
    again = runner.invoke(app, ["keys", "generate", str(path)])
    assert again.exit_code == 1 and load_secret(path) == keys
    assert runner.invoke(app, ["keys", "generate", str(path), "--force"]).exit_code == 0
    assert load_secret(path) != keys


# ---------------------------------------------------------------------------------------------- zmq: CURVE

async def test_control_socket_takes_frames_only_from_cluster_members(secrets_):
    _, keys, other = secrets_
    server = RouterServer(keys=keys)
    address = server.bind("tcp://127.0.0.1:0")
    strangers = [DealerClient(), DealerClient(keys=other)]   # no key; another cluster's secret
    member = DealerClient(keys=keys)
    try:
        for i, client in enumerate(strangers):
            client.connect(address)
            assert client.send(Ping(nonce=i + 1))   # queued; the handshake fails, so it never leaves
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(server.recv(), QUIET)
        member.connect(address)
        assert member.send(Ping(nonce=7))
        identity, msg = await asyncio.wait_for(server.recv(), 10)
        assert msg == Ping(nonce=7)
        assert server.send(identity, Pong(nonce=7)) and await member.recv(timeout=10) == Pong(nonce=7)
        with pytest.raises(asyncio.TimeoutError):   # still nothing from the strangers
            await asyncio.wait_for(server.recv(), QUIET)
    finally:
        for client in [*strangers, member]:
            client.close()
        server.close()


async def test_load_reports_reach_only_cluster_members(secrets_):
    _, keys, other = secrets_
    pub = LoadPublisher(keys=keys)
    address = pub.bind("tcp://127.0.0.1:0")
    subs = {name: LoadSubscriber(keys=k) for name, k in (("member", keys), ("none", None), ("other", other))}
    try:
        for sub in subs.values():
            sub.connect(address)
        got: dict[str, Load | None] = {}

        async def listen(name: str) -> None:
            got[name] = await subs[name].recv(timeout=3 * QUIET)

        listeners = asyncio.gather(*(listen(name) for name in subs))
        for _ in range(int(3 * QUIET / 0.05)):
            pub.publish(Load(node_id="n1", role="decode"))
            await asyncio.sleep(0.05)
        await listeners
        assert got["member"] is not None and got["member"].node_id == "n1"
        assert got["none"] is None and got["other"] is None
    finally:
        for sub in subs.values():
            sub.close()
        pub.close()


# ---------------------------------------------------------------------------------------------- KV handshake

@pytest.fixture
def kv(secrets_):
    """A KV receiver that needs the cluster secret (small front door: 4 pending, 4 connections) + its pool."""
    _, keys, _ = secrets_
    pool = torch.zeros(SHAPE)
    rx = KVReceiver(pool, auth_key=keys.kv_key, max_pending=4, max_connections=4, auth_timeout=1.0)
    yield rx, pool, keys
    rx.close()


def source_pool() -> torch.Tensor:
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(1))


def send(dst, key: bytes | None, src: torch.Tensor) -> int:
    tx = KVSender(src, backend="tcp", auth_key=key)
    try:
        return tx.send(dst.to_dict(), [0, 1], timeout=10)
    finally:
        tx.close()


def test_kv_sender_with_the_secret_transfers(kv):
    rx, pool, keys = kv
    src = source_pool()
    dst = rx.reserve("ok", [2, 3])
    send(dst, keys.kv_key, src)
    assert asyncio.run(rx.wait("ok", 5)).ok
    assert torch.equal(pool[:, :, 2:4], src[:, :, 0:2])


@pytest.mark.parametrize("who", ["no secret", "another secret"])
def test_kv_sender_without_the_secret_is_refused_before_any_work(kv, secrets_, who):
    rx, pool, keys = kv
    key = None if who == "no secret" else secrets_[2].kv_key
    dst = rx.reserve("r", [2, 3])
    with pytest.raises(TransferError, match="requires the cluster secret|authentication failed"):
        send(dst, key, source_pool())
    assert rx.dropped.count >= (0 if key is None else 1)   # without a key the sender gives up by itself
    assert rx.num_active_reservations == 1 and not pool.any()   # the reservation is untouched ...
    assert connection_threads() == 0
    send(dst, keys.kv_key, source_pool())   # ... and still works for the member holding the token
    assert asyncio.run(rx.wait("r", 5)).ok


def test_kv_receiver_without_a_secret_is_not_trusted_by_a_sender_with_one(secrets_):
    rx = KVReceiver(torch.zeros(SHAPE))
    try:
        dst = rx.reserve("x", [0, 1])
        with pytest.raises(HandshakeRefused, match="does not authenticate"):
            send(dst, secrets_[1].kv_key, source_pool())
        assert rx.num_active_reservations == 1
    finally:
        rx.close()


def connection_threads() -> int:
    """The receiver's per-connection threads (only authenticated connections get one)."""
    return sum(1 for t in threading.enumerate() if t.name == "kv-recv-conn")


def raw_connection(rx: KVReceiver) -> socket.socket:
    host, port = rx.address.rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=5)


def test_kv_peer_that_never_says_hello_is_dropped_after_the_auth_timeout(kv):
    rx, _, _ = kv
    with raw_connection(rx) as s:
        challenge = recv_frame(s)
        assert challenge["op"] == "challenge" and challenge["auth"] is True and len(challenge["nonce"]) == 32
        t0 = time.monotonic()
        assert s.recv(1) == b""   # closed by the receiver, not by us
        assert time.monotonic() - t0 < 5
    assert rx.dropped.count == 1 and rx.num_active_reservations == 0


def test_kv_flood_of_unauthenticated_connections_exhausts_nothing(kv):
    rx, pool, keys = kv
    dst = rx.reserve("after-flood", [4, 5])
    threads = threading.active_count()
    flood = [raw_connection(rx) for _ in range(20)]   # 5x the pending cap, all silent
    try:
        time.sleep(0.3)
        assert len(rx._gate.pending) <= 4   # the oldest are dropped for newer ones
        assert threading.active_count() == threads and connection_threads() == 0   # no thread per peer
        src = source_pool()
        send(dst, keys.kv_key, src)   # a member still gets through while the flood holds its sockets
        assert asyncio.run(rx.wait("after-flood", 5)).ok and torch.equal(pool[:, :, 4:6], src[:, :, 0:2])
    finally:
        for s in flood:
            s.close()
    assert rx.dropped.count >= 16


def test_kv_connections_beyond_the_cap_are_closed_at_once(secrets_):
    _, keys, _ = secrets_
    rx = KVReceiver(torch.zeros(SHAPE), auth_key=keys.kv_key, max_connections=1)
    senders = [KVSender(source_pool(), backend="tcp", auth_key=keys.kv_key) for _ in range(2)]
    try:
        senders[0].send(rx.reserve("a", [0]).to_dict(), [0], timeout=10)
        with pytest.raises(TransferError, match="refused the connection: 1 connections already open"):
            senders[1].send(rx.reserve("b", [1]).to_dict(), [0], timeout=10)
        assert rx.dropped.count == 1
        assert asyncio.run(rx.wait("a", 5)).ok
    finally:
        for tx in senders:
            tx.close()
        rx.close()


# ---------------------------------------------------------------------------------------------- nodes

async def test_node_ports_refuse_unauthenticated_peers(etcd, cluster, tiny_llama, secrets_):
    """A node with a cluster secret: a Generate from a DEALER without it does nothing at all; from a member it
    streams; a SUB without it gets no Load; a KV connection without a valid proof is closed and counted."""
    from node_helpers import GREEDY, PROMPT, node_config, serving

    from pdcluster.decode_node.node import DecodeNode

    path, keys, other = secrets_
    config = node_config("decode", tiny_llama, etcd, cluster)
    config.cluster_secret = path
    node = DecodeNode(config)
    clients = {"none": DealerClient(), "other": DealerClient(keys=other), "member": DealerClient(keys=keys)}
    subs = {"none": LoadSubscriber(), "member": LoadSubscriber(keys=keys)}
    try:
        async with serving(node):
            def generate(name: str) -> None:
                clients[name].connect(node.control.address)
                assert clients[name].send(Generate(rid=f"r-{name}", prompt_ids=PROMPT, sampling=GREEDY,
                                                   timeout_s=60, router=name, prefill_node=None))
            generate("none")
            generate("other")
            for name in ("none", "other"):
                assert await clients[name].recv(timeout=QUIET) is None
            assert not node.requests and node.engine_stats().num_prefill_tokens == 0   # the engine saw nothing

            generate("member")
            finish = None
            while finish is None:
                msg = await clients["member"].recv(timeout=10)
                assert msg is not None, "no reply to a member's Generate"
                if isinstance(msg, Tokens):
                    finish = msg.finish
            assert finish == "length"

            for sub in subs.values():
                sub.connect(node.load_pub.address)
            assert (await subs["member"].recv(timeout=5)).node_id == node.node_id
            assert await subs["none"].recv(timeout=QUIET) is None

            with raw_connection(node.receiver) as s:
                assert recv_frame(s)["op"] == "challenge"
                s.sendall(b"\x00\x00\x00\x05hello")   # not a valid hello, and no proof
                assert s.recv(1) == b""
            assert node.registry.get_sample_value("pdcluster_node_dropped_frames_total", {"socket": "kv"}) == 1
    finally:
        for c in [*clients.values(), *subs.values()]:
            c.close()


async def test_decode_node_honours_abort_only_from_the_router_that_sent_the_request(etcd, cluster, tiny_llama):
    from node_helpers import decode_setup, remote_prefill_sent, wait_until

    async with decode_setup(etcd, cluster, tiny_llama) as (node, peer, router):
        await remote_prefill_sent(node, peer, router, "r-owned")
        await wait_until(lambda: node.engine_stats().num_reserved_blocks > 0, "blocks reserved for the remote KV")
        dropped = node.control.dropped.count
        stranger = DealerClient()
        try:
            stranger.connect(node.control.address)
            assert stranger.send(Abort(rid="r-owned"))
            await wait_until(lambda: node.control.dropped.count == dropped + 1, "the stranger's Abort dropped")
            assert "r-owned" in node.requests and not node.requests["r-owned"].aborted
        finally:
            stranger.close()
        assert router.send(Abort(rid="r-owned"))   # the owner's is honoured
        _, abort = await peer.recv(Abort)
        assert abort.rid == "r-owned"
        await wait_until(lambda: "r-owned" not in node.requests, "the owner's Abort")


async def test_prefill_node_honours_abort_only_from_the_decode_node_that_sent_the_prefill(etcd, cluster,
                                                                                         tiny_llama):
    from node_helpers import SilentKVListener, destination, prefill, prefill_setup, recv, wait_until

    async with prefill_setup(etcd, cluster, tiny_llama) as (node, decode):
        listener = SilentKVListener()
        address = await listener.start()
        stranger = DealerClient()
        try:
            assert decode.send(prefill("p-owned", destination(node, "p-owned", address)))
            await wait_until(lambda: listener.connections > 0, "the prefill node to start the KV transfer")
            dropped = node.control.dropped.count
            stranger.connect(node.control.address)
            assert stranger.send(Abort(rid="p-owned"))
            await wait_until(lambda: node.control.dropped.count == dropped + 1, "the stranger's Abort dropped")
            assert "p-owned" in node.jobs and not node.jobs["p-owned"].aborted
            assert decode.send(Abort(rid="p-owned"))
            done = await recv(decode, PrefillDone)
            assert done.rid == "p-owned" and "abort" in done.error
        finally:
            stranger.close()
            await listener.release()


# ---------------------------------------------------------------------------------------------- a real cluster

@pytest.mark.cluster
@pytest.mark.timeout(240)
async def test_cluster_with_a_secret_serves_and_refuses_strangers(tmp_path):
    """`pdcluster up`'s LocalCluster: every service holds the generated secret; a request through the router
    takes the disaggregated path (zmq CURVE + the KV handshake), and a raw peer without it gets nothing."""
    import httpx

    from pdcluster.cli.admin import cluster_status
    from pdcluster.cli.smoke import scrape_metrics
    from pdcluster.cli.supervisor import LocalCluster
    from pdcluster.engine.testing import make_tiny_model

    model = make_tiny_model(str(tmp_path / "tiny-llama"), "llama")
    c = LocalCluster(model=model, work_dir=tmp_path / "work", num_prefill=1, num_decode=1, port=0, lease_ttl=2,
                     threads_per_node=1, node_config={"kv_cache_memory": "8MiB", "device": "cpu"},
                     router_config={"disagg_min_tokens": 0}, cluster="secure")
    (tmp_path / "work").mkdir()
    with c:
        assert os.stat(c.cluster_secret).st_mode & 0o777 == 0o600
        async with httpx.AsyncClient(timeout=60) as http:
            r = await http.post(c.url + "/v1/completions", json={"model": "tiny-llama", "prompt": "Hello there",
                                                                 "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200, r.text
        decode = next(s for s in c.services if s.kind == "decode")
        assert scrape_metrics(decode.metrics_url).get('pdcluster_node_prefills_total{path="remote"}') == 1.0

        nodes = await cluster_status([c.etcd], "secure", load_wait=0.1)
        control = next(n.info.control_addr for n in nodes if n.info.role == "decode")
        keys = load_secret(c.cluster_secret)
        stranger, member = DealerClient(), DealerClient(keys=keys)
        try:
            stranger.connect(control)
            member.connect(control)
            assert stranger.send(Ping(nonce=1)) and member.send(Ping(nonce=2))
            assert await member.recv(timeout=10) == Pong(nonce=2)
            assert await stranger.recv(timeout=QUIET) is None
        finally:
            stranger.close()
            member.close()
