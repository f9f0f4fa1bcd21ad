"""Timeouts that do not fight each other.

* The router's stall timer measures silence: a decode node sends `Progress` while a request waits (queue,
  slow prefill), so a slow first token does not migrate it; a node that sends nothing still does.
* A router DEALER keeps its zmq identity across reconnects and the node's ROUTER hands the identity over to
  the newest connection, so a reconnect does not abort the streams on it: the node holds their tokens.
* A prefill node connects to KV receivers off its engine thread: a destination that never answers fails
  only its own prompt.
* `pdcluster up` refuses timeouts that contradict each other.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time

import pytest
import zmq
import zmq.asyncio
from node_helpers import (
    GREEDY,
    PREFILL_PEER,
    PROMPT,
    QUIET,
    WAIT,
    FakePrefill,
    SilentKVListener,
    assert_idle,
    node_config,
    recv,
    serving,
    wait_until,
)
from router_fakes import FakeDecodeNode

from pdcluster.control import protocol
from pdcluster.control.protocol import Abort, Generate, Ping, Pong, Prefill, PrefillDone, Progress, Tokens
from pdcluster.control.records import NodeInfo
from pdcluster.control.sampling_params import SamplingParams
from pdcluster.control.transport import DealerClient, PeerDealers, RouterServer
from pdcluster.router.cluster import RouterCluster, StaticNodeSource
from pdcluster.router.decode_client import DecodeClient, StreamFailed
from pdcluster.router.metrics import RouterMetrics
from pdcluster.router.policies import make_policy
from pdcluster.router.settings import RouterSettings

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

STALL = 0.5  # the router's stall_timeout in these tests; a "long" wait is several of it
SCRIPT = list(range(100, 140))


# ---------------------------------------------------------------------------------------------- protocol

def test_progress_round_trips_and_bad_ones_are_refused():
    msg = Progress(rids=["a.1", "b.1"], states=["queued", "waiting_kv"])
    assert protocol.decode(protocol.encode(msg)) == msg
    for rids, states in ((["a"], []), ([1], ["queued"]), (["a"], ["thinking"])):
        with pytest.raises(protocol.ProtocolError):
            protocol.decode(protocol.encode(Progress(rids=rids, states=states)))
    with pytest.raises(protocol.ProtocolError):
        protocol.decode(protocol.encode(Tokens(rid="r", ids=[1], pos=-2)))


# ---------------------------------------------------------------------------------------------- router side

@contextlib.asynccontextmanager
async def router_client(source: StaticNodeSource, stall: float = STALL, **extra):
    settings = RouterSettings(stall_timeout=stall, request_timeout=60.0, node_id="router-t", max_migrations=2,
                              routing_policy="round_robin", **extra)
    cluster = RouterCluster(source)
    await cluster.start()
    metrics = RouterMetrics()
    client = DecodeClient(cluster, make_policy(settings.routing_policy), settings, metrics)
    try:
        yield client
    finally:
        client.close()
        await cluster.stop()


def migrations(client: DecodeClient) -> float:
    return client.metrics.registry.get_sample_value("pdcluster_router_migrations_total") or 0.0


async def collect(stream) -> list[int]:
    await stream.start()
    return await collect_rest(stream)


async def test_progress_keeps_a_slow_first_token_from_migrating():
    slow = FakeDecodeNode("slow", SCRIPT, first_delay=4 * STALL, progress=STALL / 5)
    spare = FakeDecodeNode("spare", SCRIPT)
    try:
        async with router_client(StaticNodeSource([slow.info])) as client:
            stream = client.stream([1, 2, 3], {"max_tokens": 5}, deadline=time.monotonic() + 60)
            task = asyncio.create_task(collect(stream))
            await wait_until(lambda: slow.generates, "the Generate to reach the slow node")
            client.cluster.source.add(spare.info)   # somewhere to migrate to, were the router to give up
            client.cluster.sync()
            assert await asyncio.wait_for(task, WAIT) == SCRIPT[:5]
            assert migrations(client) == 0 and not spare.generates and not slow.aborts
    finally:
        slow.stop()
        spare.stop()


async def test_a_silent_node_still_migrates():
    silent = FakeDecodeNode("silent", SCRIPT, mode="silent")
    spare = FakeDecodeNode("spare", SCRIPT)
    try:
        async with router_client(StaticNodeSource([silent.info])) as client:
            stream = client.stream([1, 2, 3], {"max_tokens": 5}, deadline=time.monotonic() + 60)
            task = asyncio.create_task(collect(stream))
            await wait_until(lambda: silent.generates, "the Generate to reach the silent node")
            client.cluster.source.add(spare.info)
            client.cluster.sync()
            assert await asyncio.wait_for(task, WAIT) == SCRIPT[:5]
            assert migrations(client) == 1 and len(spare.generates) == 1
            await wait_until(lambda: silent.aborts, "the Abort of the stalled attempt")
    finally:
        silent.stop()
        spare.stop()


async def test_a_gap_in_the_token_stream_migrates_instead_of_streaming_a_hole():
    """Tokens lost in a reconnect show as a Tokens.pos gap: the router resumes elsewhere from what it has."""
    server = RouterServer()
    server.bind("tcp://127.0.0.1:0")
    spare = FakeDecodeNode("spare", SCRIPT)
    lossy = NodeInfo(node_id="lossy", role="decode", control_addr=server.address)
    try:
        async with router_client(StaticNodeSource([lossy])) as client:
            stream = client.stream([1, 2, 3], {"max_tokens": 6}, deadline=time.monotonic() + 60)
            task = asyncio.create_task(collect(stream))
            identity, gen = await asyncio.wait_for(server.recv(), WAIT)
            client.cluster.source.add(spare.info)
            client.cluster.sync()
            assert server.send(identity, Tokens(rid=gen.rid, ids=SCRIPT[:2], pos=0))
            assert server.send(identity, Tokens(rid=gen.rid, ids=SCRIPT[3:4], pos=3))  # SCRIPT[2] went missing
            assert await asyncio.wait_for(task, WAIT) == SCRIPT[:6]
            assert migrations(client) == 1 and spare.generates[0].resume_ids == SCRIPT[:2]
    finally:
        server.close()
        spare.stop()


async def test_a_reader_that_fell_behind_gets_the_queued_tokens_at_once_and_a_gap_after_them_migrates():
    """What queued while the reader was away comes out of one `next()`: in order, logprobs aligned (None for
    an item without); a Tokens that would end the attempt (here a gap) stays queued for the next call."""
    server = RouterServer()
    server.bind("tcp://127.0.0.1:0")
    spare = FakeDecodeNode("spare", SCRIPT)
    node = NodeInfo(node_id="behind", role="decode", control_addr=server.address)
    lp = [[-0.5, [[7, -0.5]]]]
    try:
        async with router_client(StaticNodeSource([node])) as client:
            stream = client.stream([1, 2, 3], {"max_tokens": 9, "logprobs": 1}, deadline=time.monotonic() + 60)
            start = asyncio.create_task(stream.start())
            identity, gen = await asyncio.wait_for(server.recv(), WAIT)
            server.send(identity, Tokens(rid=gen.rid, ids=SCRIPT[:1], pos=0))
            await asyncio.wait_for(start, WAIT)
            queued = [Tokens(rid=gen.rid, ids=SCRIPT[1:3], pos=1, logprobs=lp * 2), Progress(rids=[gen.rid],
                      states=["queued"]), Tokens(rid=gen.rid, ids=SCRIPT[3:4], pos=3),
                      Tokens(rid=gen.rid, ids=SCRIPT[4:5], pos=4, logprobs=lp),
                      Tokens(rid=gen.rid, ids=SCRIPT[7:8], pos=7, logprobs=lp)]   # 5 and 6 went missing
            for msg in queued:
                server.send(identity, msg)
            mailbox = client.queues[gen.rid]
            await wait_until(lambda: len(mailbox._items) == len(queued), "the messages to queue up")
            behind = await stream.next()   # start()'s message and all that queued behind it
            assert behind.ids == SCRIPT[:5] and behind.finish is None
            assert behind.logprobs == [None] + lp * 2 + [None] + lp
            client.cluster.source.add(spare.info)
            client.cluster.sync()
            rest = await asyncio.wait_for(collect_rest(stream), WAIT)   # the gap: resumed on the spare node
            assert stream.output_ids == SCRIPT[:9] and rest == SCRIPT[5:9]
            assert migrations(client) == 1 and spare.generates[0].resume_ids == SCRIPT[:5]
    finally:
        server.close()
        spare.stop()


async def test_waiting_for_a_decode_node_ends_at_the_request_deadline():
    """queue_timeout is a bound within the request's own deadline, not beside it."""
    async with router_client(StaticNodeSource(), queue_timeout=30.0) as client:
        t0 = time.monotonic()
        stream = client.stream([1, 2, 3], {"max_tokens": 5}, deadline=t0 + 0.5)
        with pytest.raises(StreamFailed, match="deadline"):
            await asyncio.wait_for(stream.start(), WAIT)
        assert 0.5 <= time.monotonic() - t0 < 2 and not client.queues


async def collect_rest(stream) -> list[int]:
    ids: list[int] = []
    while True:
        msg = await stream.next()
        ids += msg.ids
        if msg.finish is not None:
            return ids


# ---------------------------------------------------------------------------------------------- transport

def test_peer_dealer_identities_are_stable_and_unique_per_connection():
    a, b = PeerDealers(lambda *_: None, owner="router-1"), PeerDealers(lambda *_: None, owner="router-1")
    assert a.identity("decode-0") == a.identity("decode-0") != a.identity("decode-1")
    assert a.identity("decode-0") != b.identity("decode-0")   # two routers configured with one id
    assert a.identity("decode-0").startswith(b"router-1/decode-0/")
    long = PeerDealers(lambda *_: None, owner="r" * 300).identity("d")
    assert 0 < len(long) <= 255 and long[0] != 0


async def test_a_reconnect_with_the_same_identity_takes_over_a_connection_the_node_still_holds():
    """The old connection is half-open (the node has not noticed it died): with ROUTER_HANDOVER the new one
    gets the identity at once; without it, the node would refuse the newcomer and keep writing to the dead one."""
    server = RouterServer()
    server.bind("tcp://127.0.0.1:0")
    old = zmq.asyncio.Context.instance().socket(zmq.DEALER)
    old.setsockopt(zmq.LINGER, 0)
    old.setsockopt(zmq.IDENTITY, b"router-t/node")
    old.setsockopt(zmq.RECONNECT_IVL, -1)   # a dead peer does not come back on this connection
    new = DealerClient(identity=b"router-t/node")
    try:
        old.connect(server.address)
        await old.send(protocol.encode(Ping(nonce=1)))
        assert await asyncio.wait_for(server.recv(), WAIT) == (b"router-t/node", Ping(nonce=1))
        new.connect(server.address)
        assert new.send(Ping(nonce=2))
        assert await asyncio.wait_for(server.recv(), WAIT) == (b"router-t/node", Ping(nonce=2))
        assert server.send(b"router-t/node", Pong(nonce=3))
        assert await new.recv(timeout=WAIT) == Pong(nonce=3)
    finally:
        old.close(linger=0)
        new.close()
        server.close()


async def test_a_router_that_reconnects_with_its_identity_keeps_its_stream(etcd, cluster, tiny_llama):
    """The router's connection drops mid-stream; the node holds the tokens it cannot deliver (the request is
    not aborted) and sends them, in order, to the same identity once the router is back."""
    from pdcluster.decode_node.node import DecodeNode

    config = node_config("decode", tiny_llama, etcd, cluster)
    config.heartbeat_interval = 0.05
    config.router_reconnect_timeout = 4 * WAIT
    node = DecodeNode(config)
    identity = b"router-t/decode-under-test/1"
    sampling = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True).to_dict()
    gate = threading.Event()
    async with serving(node):
        step_outputs = node.engine_thread.on_outputs

        def pause_after_the_first_token(outputs) -> None:   # on the engine thread
            step_outputs(outputs)
            if not gate.is_set() and not isinstance(outputs, BaseException) and any(
                    o.request_id == "r" for o in outputs):
                gate.wait(WAIT)

        node.engine_thread.on_outputs = pause_after_the_first_token
        old = DealerClient(identity=identity)
        new = DealerClient(identity=identity)
        try:
            old.connect(node.control.address)
            assert old.send(Generate(rid="r", prompt_ids=PROMPT, sampling=sampling, prefill_node=None,
                                     timeout_s=60, router="router-t"))
            assert (await recv(old, Progress)).rids == ["r"]   # the acknowledgement of admission
            got = [await recv(old, Tokens)]
            assert got[0].finish is None   # the engine waits at the gate after the request's first step
            old.close()
            await wait_until(lambda: identity in node._unreachable, "the node to find the router gone")
            gate.set()
            await wait_until(lambda: node.requests["r"].outcome == "length", "the request to finish unheard")
            new.connect(node.control.address)
            while got[-1].finish is None:
                msg = await new.recv(timeout=WAIT)
                if isinstance(msg, Tokens):
                    got.append(msg)
            assert [m.pos for m in got] == [sum(len(m.ids) for m in got[:i]) for i in range(len(got))]
            ids = [t for m in got for t in m.ids]
            assert len(ids) == 12 and got[-1].finish == "length"
            assert node.registry.get_sample_value("pdcluster_node_requests_total", {"outcome": "abort"}) is None

            assert new.send(Generate(rid="again", prompt_ids=PROMPT, sampling=sampling, prefill_node=None,
                                     timeout_s=60, router="router-t"))
            again: list[int] = []
            while True:
                msg = await new.recv(timeout=WAIT)
                if isinstance(msg, Tokens):
                    again += msg.ids
                    if msg.finish:
                        break
            assert again == ids   # greedy: nothing was lost or repeated on the way
        finally:
            gate.set()
            old.close()
            new.close()


# ---------------------------------------------------------------------------------------------- decode node

async def test_a_decode_node_reports_progress_while_its_prefill_is_slow_and_the_router_waits(
        etcd, cluster, tiny_llama):
    """A real decode node whose prefill peer answers only after several stall timeouts: the router hears
    Progress meanwhile and does not migrate; the prompt is then prefilled locally and streamed."""
    from pdcluster.decode_node.node import DecodeNode

    peer = FakePrefill(etcd, cluster)
    assert await peer.registration.start(wait=WAIT)
    config = node_config("decode", tiny_llama, etcd, cluster)
    config.heartbeat_interval = STALL / 5
    node = DecodeNode(config, prefill_timeout=4 * WAIT)
    try:
        async with serving(node):
            assert await node.view.wait_for(lambda v: PREFILL_PEER in v.nodes, WAIT)
            watcher = DealerClient()   # a raw router: sees the Progress states
            watcher.connect(node.control.address)
            try:
                assert watcher.send(Generate(rid="w", prompt_ids=PROMPT, sampling=GREEDY, prefill_node=PREFILL_PEER,
                                             timeout_s=60, router="watcher"))
                identity, _, _ = await peer.recv_prompt()
                assert (await recv(watcher, Progress)).states == ["queued"]   # on admission
                states = [(await recv(watcher, Progress)).states for _ in range(3)]   # then while it waits
                assert states[-1] == ["prefilling"] and all(s in (["queued"], ["prefilling"]) for s in states)
                assert peer.server.send(identity, PrefillDone(rid="w", error="too slow"))
                while True:   # prefilled here now, and streamed
                    msg = await watcher.recv(timeout=WAIT)
                    assert isinstance(msg, (Tokens, Progress)), msg
                    if isinstance(msg, Tokens) and msg.finish:
                        break
            finally:
                watcher.close()
            assert (await peer.recv(Abort))[1].rid == "w"   # the decode node dropped its job on the peer
            await assert_idle(node)

            source = StaticNodeSource([node.node_info(), peer.registration.info])
            async with router_client(source, disagg_min_tokens=0) as client:
                stream = client.stream(PROMPT, GREEDY, deadline=time.monotonic() + 60)
                task = asyncio.create_task(collect(stream))
                identity, prefill, _ = await peer.recv_prompt()
                await asyncio.sleep(4 * STALL)   # the first token takes several stall timeouts
                assert not task.done() and migrations(client) == 0
                assert peer.server.send(identity, PrefillDone(rid=prefill.rid, error="too slow"))
                assert (await peer.recv(Abort))[1].rid == prefill.rid
                ids = await asyncio.wait_for(task, WAIT)
                assert len(ids) == GREEDY["max_tokens"] and stream.prefill_path == "local"
                assert migrations(client) == 0
    finally:
        await peer.close()


# ---------------------------------------------------------------------------------------------- prefill node

async def test_a_blackholed_kv_destination_fails_only_its_prompt_and_the_engine_thread_never_connects(
        etcd, cluster, tiny_llama, monkeypatch):
    import torch

    from pdcluster.kv_transfer import KVReceiver
    from pdcluster.kv_transfer import sender as sender_module
    from pdcluster.prefill_node.node import PrefillNode

    connected_on: list[str] = []
    real_stream_init = sender_module._Stream.__init__

    def stream_init(self, *args, **kwargs):
        connected_on.append(threading.current_thread().name)
        real_stream_init(self, *args, **kwargs)

    monkeypatch.setattr(sender_module._Stream, "__init__", stream_init)
    config = node_config("prefill", tiny_llama, etcd, cluster)
    config.kv_connect_timeout = 1.0
    node = PrefillNode(config)
    receiver = KVReceiver(torch.zeros_like(node.engine.kv_pool.tensor), host="127.0.0.1")
    blackhole = SilentKVListener()
    decode = DealerClient()
    try:
        bad_address = await blackhole.start()
        async with serving(node):
            decode.connect(node.control.address)
            bad = {"request_id": "bad", "address": bad_address, "block_ids": [0, 1, 2], "token": "t",
                   "deadline": time.time() + 60, "backends": ["tcp"], "layout": node.sender.layout.to_dict()}
            good = receiver.reserve("good", [3, 4, 5], timeout_s=60).to_dict()
            good["backends"] = ["tcp"]
            assert decode.send(Prefill(rid="bad", prompt_ids=PROMPT, sampling=GREEDY, dst=bad,
                                       decode_node="decode-fake", timeout_s=60))
            assert decode.send(Prefill(rid="good", prompt_ids=PROMPT, sampling=GREEDY, dst=good,
                                       decode_node="decode-fake", timeout_s=60))
            answers = {}
            for _ in range(2):
                done = await recv(decode, PrefillDone)
                answers[done.rid] = done
            assert answers["good"].error is None and answers["good"].checksum
            assert (await receiver.wait("good", timeout=WAIT)).checksum == answers["good"].checksum
            assert bad_address in answers["bad"].error and "unreachable" in answers["bad"].error
            assert blackhole.connections >= 1
            assert connected_on and "engine" not in connected_on, connected_on
            await asyncio.sleep(QUIET)
            assert not node.jobs
    finally:
        decode.close()
        await blackhole.release()
        receiver.close()


def test_a_sender_on_the_engine_thread_never_opens_a_connection():
    import torch

    from pdcluster.kv_transfer import KVReceiver, KVSender
    from pdcluster.kv_transfer.errors import TransferError

    pool = torch.zeros(2, 2, 8, 4, 1, 8)   # 2 layers, k|v, 8 blocks
    receiver = KVReceiver(pool.clone(), host="127.0.0.1")
    sender = KVSender(pool, backend="tcp")
    try:
        dst = receiver.reserve("r", [0, 1], timeout_s=30)
        with pytest.raises(TransferError, match=receiver.address):
            sender.start(dst, [2, 3], connect=False)
        sender.connect(dst)
        t = sender.start(dst, [2, 3], connect=False)
        t.send_all()
        assert t.finish(WAIT) == asyncio.run(receiver.wait("r", WAIT)).checksum
    finally:
        sender.close()
        receiver.close()


# ---------------------------------------------------------------------------------------------- config

def test_up_refuses_timeouts_that_fight_each_other():
    from pdcluster.cli.config import check_timeouts, load_config

    decode = load_config("decode", overrides={"model": "/m"}, env={})
    router = load_config("router", env={})
    check_timeouts(decode, router)   # the defaults agree
    assert decode.prefill_timeout < router.stall_timeout
    with pytest.raises(ValueError, match="prefill_timeout .* stall_timeout"):
        check_timeouts(load_config("decode", overrides={"model": "/m", "prefill_timeout": 30}, env={}), router)
    with pytest.raises(ValueError, match="heartbeat_interval"):
        check_timeouts(load_config("decode", overrides={"model": "/m", "prefill_timeout": 1}, env={}),
                       load_config("router", overrides={"stall_timeout": 2}, env={}))
    with pytest.raises(ValueError, match="kv_connect_timeout: must be > 0"):
        load_config("prefill", overrides={"model": "/m", "kv_connect_timeout": 0}, env={})
    assert load_config("router", overrides={"queue_timeout": 0}, env={}).queue_timeout == 0   # 0: 503 at once
    with pytest.raises(ValueError, match="queue_timeout: must be >= 0"):
        load_config("router", overrides={"queue_timeout": -1}, env={})
