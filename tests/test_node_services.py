"""The decode and prefill node services in this process, on a tiny random model and a real etcd, with
fake peers over real zmq that the test drives: the remote-prefill branches (error, timeout, abort, late
reply, peer gone) that subprocess clusters reach only by chance.

The fakes and setups are tests/node_helpers.py's. Every wait is bounded by WAIT; every test ends with all the
engine's KV blocks free."""

from __future__ import annotations

import asyncio
import time

import pytest
from node_helpers import (
    MAX_TOKENS,
    PREFILL_PEER,
    PROMPT,
    WAIT,
    SilentKVListener,
    assert_idle,
    decode_setup,
    destination,
    local_tokens,
    node_config,
    nothing_more,
    prefill,
    prefill_setup,
    recv,
    remote_failures,
    remote_prefill_sent,
    serving,
    stream,
    wait_until,
)

from pdcluster.control.protocol import Abort, PrefillDone

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


async def test_prefill_error_falls_back_to_local_prefill_and_streams(etcd, cluster, tiny_llama):
    async with decode_setup(etcd, cluster, tiny_llama) as (node, peer, router):
        identity = await remote_prefill_sent(node, peer, router, "r-error")
        assert peer.server.send(identity, PrefillDone(rid="r-error", error="prefill engine failure"))
        ids, first = await stream(router, "r-error")
        assert first.prefill_path == "local" and first.num_prompt_tokens == len(PROMPT)
        assert remote_failures(node, "prefill_error") == 1
        _, abort = await peer.recv(Abort)  # the decode node also tells the peer to drop its job
        assert abort.rid == "r-error"
        assert ids == await local_tokens(router, "r-local")  # greedy: the fallback computed the same text


@pytest.mark.parametrize("bad", [{"first_token": 10 ** 9}, {"first_token": -3},
                                 {"first_token": 7, "logprobs": [["not a float", "nor a list"]]}])
async def test_a_bad_first_token_from_the_prefill_peer_never_reaches_the_router(etcd, cluster, tiny_llama, bad):
    """The first token goes to the router ahead of the engine step, so it is checked before that: outside the
    vocabulary or with malformed logprobs, the request is prefilled here and streams only its own tokens."""
    async with decode_setup(etcd, cluster, tiny_llama) as (node, peer, router):
        identity = await remote_prefill_sent(node, peer, router, "r-bad")
        assert peer.server.send(identity, PrefillDone(rid="r-bad", kv_backend="tcp", **bad))
        ids, first = await stream(router, "r-bad")
        assert first.prefill_path == "local" and first.pos == 0
        assert remote_failures(node, "prefill_error") == 1
        assert ids == await local_tokens(router, "r-local")


async def test_no_answer_times_out_into_local_prefill_and_a_late_prefill_done_is_ignored(etcd, cluster, tiny_llama):
    async with decode_setup(etcd, cluster, tiny_llama, prefill_timeout=1.0) as (node, peer, router):
        identity = await remote_prefill_sent(node, peer, router, "r-slow")
        ids, first = await stream(router, "r-slow")  # after prefill_timeout, prefilled here
        assert first.prefill_path == "local"
        assert remote_failures(node, "timeout") == 1
        _, abort = await peer.recv(Abort)
        assert abort.rid == "r-slow"
        assert peer.server.send(identity, PrefillDone(rid="r-slow", first_token=7, kv_backend="tcp"))
        await nothing_more(router)
        assert "r-slow" not in node.requests
        assert ids == await local_tokens(router, "r-after")


async def test_kv_that_never_lands_after_prefill_done_falls_back_after_kv_landing_timeout(etcd, cluster, tiny_llama):
    """PrefillDone came but the receiver never saw the KV: after `kv_landing_timeout` the reservation is given
    up (reason "transfer") and the engine prefills the same request locally (remote_kv_failed, no re-add)."""
    from node_helpers import FakePrefill

    from pdcluster.control.transport import DealerClient
    from pdcluster.decode_node.node import DecodeNode

    peer = FakePrefill(etcd, cluster)
    assert await peer.registration.start(wait=WAIT)
    config = node_config("decode", tiny_llama, etcd, cluster)
    config.kv_landing_timeout = 0.5
    router = DealerClient()
    try:
        node = DecodeNode(config)
        async with serving(node):
            assert await node.view.wait_for(lambda v: PREFILL_PEER in v.nodes, WAIT)
            router.connect(node.control.address)
            identity = await remote_prefill_sent(node, peer, router, "r-lost")
            answered = time.monotonic()
            assert peer.server.send(identity, PrefillDone(rid="r-lost", first_token=7, kv_backend="tcp"))
            ids, first = await stream(router, "r-lost")
            assert time.monotonic() - answered >= config.kv_landing_timeout
            assert first.prefill_path == "local" and len(ids) == MAX_TOKENS
            assert remote_failures(node, "transfer") == 1 and remote_failures(node, "timeout") == 0
            assert node.registry.get_sample_value("pdcluster_kv_transfer_failures_total", {"backend": "tcp"}) == 1
            assert node.registry.get_sample_value("pdcluster_node_prefills_total", {"path": "local"}) == 1
            _, abort = await peer.recv(Abort)
            assert abort.rid == "r-lost"
            assert ids == await local_tokens(router, "r-after")
    finally:
        router.close()
        await peer.close()


async def test_router_abort_during_remote_prefill_aborts_the_peer_and_frees_the_reservation(
        etcd, cluster, tiny_llama):
    async with decode_setup(etcd, cluster, tiny_llama) as (node, peer, router):
        await remote_prefill_sent(node, peer, router, "r-abort")
        await wait_until(lambda: node.engine_stats().num_reserved_blocks > 0, "blocks reserved for the remote KV")
        assert router.send(Abort(rid="r-abort"))
        _, abort = await peer.recv(Abort)
        assert abort.rid == "r-abort"
        await nothing_more(router)  # an aborted request gets no Tokens
        await assert_idle(node)
        assert node.registry.get_sample_value("pdcluster_node_requests_total", {"outcome": "abort"}) == 1


async def test_prefill_peer_leaving_etcd_mid_request_falls_back_to_local_prefill(etcd, cluster, tiny_llama):
    async with decode_setup(etcd, cluster, tiny_llama) as (node, peer, router):
        await remote_prefill_sent(node, peer, router, "r-gone")
        await peer.registration.deregister()
        ids, first = await stream(router, "r-gone")
        assert first.prefill_path == "local" and len(ids) == MAX_TOKENS
        assert PREFILL_PEER not in node.view.nodes
        assert remote_failures(node, "prefill_error") == 1


# ---------------------------------------------------------------------------------------------- prefill node

async def test_prefill_node_answers_a_bad_destination_with_an_error(etcd, cluster, tiny_llama):
    async with prefill_setup(etcd, cluster, tiny_llama) as (node, decode):
        assert decode.send(prefill("p-garbage", {"address": "nowhere"}))
        done = await recv(decode, PrefillDone)
        assert done.rid == "p-garbage" and done.error.startswith("bad Prefill")
        # well-formed, but 2 destination blocks for a prompt of 3 blocks
        assert decode.send(prefill("p-short", destination(node, "p-short", "127.0.0.1:9", num_blocks=2)))
        done = await recv(decode, PrefillDone)
        assert done.rid == "p-short" and done.error.startswith("bad Prefill") and "block" in done.error
        assert not node.jobs


async def test_prefill_node_answers_abort_and_deadline_while_its_transfer_hangs(etcd, cluster, tiny_llama):
    async with prefill_setup(etcd, cluster, tiny_llama) as (node, decode):
        listener = SilentKVListener()
        address = await listener.start()
        try:
            assert decode.send(prefill("p-abort", destination(node, "p-abort", address)))
            await wait_until(lambda: listener.connections > 0, "the prefill node to start the KV transfer")
            assert decode.send(Abort(rid="p-abort"))
            done = await recv(decode, PrefillDone)
            assert done.rid == "p-abort" and "abort" in done.error

            # queued behind the hanging transfer, its deadline already past: the deadline check answers it
            assert decode.send(prefill("p-late", destination(node, "p-late", address), timeout_s=-1))
            done = await recv(decode, PrefillDone)
            assert done.rid == "p-late" and "deadline" in done.error
            assert not node.jobs
        finally:
            await listener.release()
        await nothing_more(decode)  # each job was answered once, even after its transfer failed


async def test_garbage_on_the_control_socket_is_dropped_counted_and_the_node_keeps_serving(etcd, cluster, tiny_llama):
    import msgpack
    import zmq
    import zmq.asyncio

    garbage = [msgpack.packb({"v": 1, "t": [1]}), b"", b"\xc1", b"\x00" * 1000, msgpack.packb([1, 2, 3]),
               msgpack.packb({"v": 1, "t": "generate", "rid": 5})]
    async with decode_setup(etcd, cluster, tiny_llama) as (node, peer, router):
        raw = zmq.asyncio.Context.instance().socket(zmq.DEALER)
        raw.connect(node.control.address)
        try:
            for frame in garbage:
                await raw.send(frame)
            await raw.send_multipart([b"two", b"frames"])
            want = len(garbage) + 1
            deadline = time.monotonic() + WAIT
            while node.control.dropped.count < want and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            assert node.control.dropped.count == want
            assert node.registry.get_sample_value("pdcluster_node_dropped_frames_total",
                                                  {"socket": "control"}) == want
            assert len(await local_tokens(router, "after-garbage")) == MAX_TOKENS
            assert all(not t.done() for t in node._tasks)   # the supervised loops still run
        finally:
            raw.close(linger=0)


async def test_a_supervised_task_that_dies_takes_the_node_out_of_the_cluster_with_an_error_code(
        etcd, cluster, tiny_llama):
    from pdcluster.control.etcd_client import close_quietly, connect
    from pdcluster.control.queries import list_nodes
    from pdcluster.decode_node.node import DecodeNode

    node = DecodeNode(node_config("decode", tiny_llama, etcd, cluster))
    task = asyncio.create_task(node.serve())
    await wait_until(lambda: node.registration is not None and node.registration.registered, "registration")

    async def broken_loop() -> None:
        raise RuntimeError("a receive loop hit a bug")

    node.supervised(broken_loop(), "broken")
    await asyncio.wait_for(task, 30)   # serve() returns: the node stopped by itself
    assert node.exit_code == 1
    client = await connect([etcd.endpoint])
    try:
        assert [n.node_id for n in await list_nodes(client, cluster)] == []
    finally:
        await close_quietly(client)


async def test_a_stopped_node_ends_its_tensor_parallel_ranks(etcd, cluster, tiny_llama):
    from pdcluster.decode_node.node import DecodeNode

    config = node_config("decode", tiny_llama, etcd, cluster)
    config.tensor_parallel_size = 2
    config.validate()
    node = DecodeNode(config)
    async with serving(node):
        ranks = node.engine.runner.workers.procs
        assert ranks and all(p.is_alive() for p in ranks)
    assert not any(p.is_alive() for p in ranks)   # ended by the node's stop, not left to interpreter exit
