"""A prefill node whose queue is longer than the decode nodes' `prefill_timeout`: while its engine advances it renews
its prompts (their deadlines, their KV destinations) and tells their decode node (`Progress`), which extends its wait
and its KV reservation. So a busy prefill node keeps its prompts; a stuck one sends nothing and loses them to the
decode node's own prefill, as before.

Found under overload (docs/benchmarks.md "Serving vs `vllm serve`"): with 2k-token prompts at 0.5 req/s a one-core
prefill node queued past the 15 s timeout, and 23 of 24 prompts were then prefilled by the decode node (each after
15 s wasted, its decode steps stalled behind them).

The nodes run in this process on a tiny random model and a real etcd (tests/node_helpers.py); the prefill engine's
steps are slowed so that a few prompts queue past a one-second timeout."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch
from node_helpers import (
    GREEDY,
    MAX_TOKENS,
    PROMPT,
    WAIT,
    decode_setup,
    node_config,
    prefill,
    prefill_setup,
    recv,
    remote_failures,
    remote_prefill_sent,
    serving,
    stream,
    wait_until,
)

from pdcluster.control.protocol import Abort, Generate, PrefillDone, Progress, TokenBatch, Tokens
from pdcluster.control.transport import DealerClient
from pdcluster.kv_transfer import KVReceiver
from pdcluster.kv_transfer.destination import Destination
from pdcluster.kv_transfer.reservations import ReservationTable

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

TIMEOUT = 1.0   # the prefill timeout of every test here
STEP_DELAY = 0.3   # added to each prefill engine step: 6 prompts one at a time take ~2 timeouts


def slow_steps(engine, delay: float = STEP_DELAY, gate: threading.Event | None = None) -> None:
    """Every engine step of `engine` takes `delay` more; with `gate`, steps wait until it is set (a stuck engine)."""
    step = engine.step

    def slowed():
        if gate is not None:
            gate.wait(4 * WAIT)
        time.sleep(delay)
        return step()

    engine.step = slowed


def prefills(node, path: str) -> float:
    return node.registry.get_sample_value("pdcluster_node_prefills_total", {"path": path}) or 0.0


def test_a_reservation_is_extended_only_while_it_lives():
    now = [100.0]
    table = ReservationTable(num_blocks=8, clock=lambda: now[0])
    res = table.reserve("r", [1, 2], timeout_s=1.0)
    now[0] = 100.9
    assert table.extend("r", 1.0) and res.deadline == pytest.approx(101.9)
    assert table.extend("r", 0.1) and res.deadline == pytest.approx(101.9)   # never earlier
    now[0] = 101.5
    assert table.expire() == []
    now[0] = 102.0
    assert table.expire() == [res]
    assert not table.extend("r", 5.0)   # failed: stays failed
    assert not table.extend("nobody", 5.0)


def test_a_renewed_destination_expires_later():
    dst = Destination(request_id="r", address="h:1", block_ids=[0], token="t", deadline=0.0, backends=["tcp"],
                      layout={}, timeout_s=1.0)
    dst.ranks.append(Destination(request_id="r", address="h:2", block_ids=[0], token="u", deadline=0.0,
                                 backends=["tcp"], layout={}, timeout_s=1.0))
    before = dst.expires
    time.sleep(0.05)
    dst.renew(2.0)
    assert dst.expires > before + 1.0 and dst.ranks[0].expires == pytest.approx(dst.expires, abs=0.01)
    assert Destination.from_dict(dst.to_dict()).timeout_s == 2.0


async def test_a_decode_node_waits_while_its_prefill_peer_reports_progress_and_not_after(etcd, cluster, tiny_llama):
    """Progress from the peer that holds the prompt keeps the decode node waiting past its prefill_timeout, the KV
    reservation with it; Progress from anyone else, or for another request, does not; once the peer falls silent
    the prompt is prefilled here after one more prefill_timeout."""
    async with decode_setup(etcd, cluster, tiny_llama, prefill_timeout=TIMEOUT) as (node, peer, router):
        identity = await remote_prefill_sent(node, peer, router, "r-queued")
        started = time.monotonic()
        while time.monotonic() - started < 2.5 * TIMEOUT:
            assert peer.server.send(identity, Progress(rids=["r-queued", "r-other"], states=["prefilling"] * 2))
            await asyncio.sleep(TIMEOUT / 4)
        assert node.requests["r-queued"].state.value == "prefilling" and remote_failures(node, "timeout") == 0
        assert node.receiver.num_active_reservations == 1   # extended with the wait
        silent = time.monotonic()
        ids, first = await stream(router, "r-queued")
        assert first.prefill_path == "local" and len(ids) == MAX_TOKENS
        assert remote_failures(node, "timeout") == 1 and time.monotonic() - silent >= 0.9 * TIMEOUT
        assert (await peer.recv(Abort))[1].rid == "r-queued"


async def test_garbage_or_progress_for_other_requests_from_the_peer_keeps_nothing_waiting(etcd, cluster, tiny_llama):
    """A broken prefill peer: garbage frames, a malformed Progress (states not matching rids, counted as dropped),
    Progress for requests it does not hold. None of it renews the request: it is prefilled here one
    prefill_timeout after its Prefill, and the node goes on serving."""
    async with decode_setup(etcd, cluster, tiny_llama, prefill_timeout=TIMEOUT) as (node, peer, router):
        identity = await remote_prefill_sent(node, peer, router, "r-held")
        sent = time.monotonic()
        dropped = node.peers.dropped.count
        local = asyncio.create_task(stream(router, "r-held"))
        while not local.done() and time.monotonic() - sent < 3.5 * TIMEOUT:
            peer.server._sock.send_multipart([identity, b"\x00garbage"])
            assert peer.server.send(identity, Progress(rids=["r-held"], states=[]))   # malformed: dropped
            assert peer.server.send(identity, Progress(rids=["r-unknown", "r-held-not"], states=["queued"] * 2))
            await asyncio.sleep(TIMEOUT / 5)
        ids, first = await asyncio.wait_for(local, WAIT)
        waited = time.monotonic() - sent
        assert first.prefill_path == "local" and len(ids) == MAX_TOKENS
        assert 0.9 * TIMEOUT <= waited < 3 * TIMEOUT and remote_failures(node, "timeout") == 1   # never renewed
        assert node.peers.dropped.count >= dropped + 2
        assert (await peer.recv(Abort))[1].rid == "r-held"


async def test_a_prefill_node_renews_its_queued_prompts_while_its_engine_advances(etcd, cluster, tiny_llama):
    """One prompt at a time, each step slowed: six prompts with a one-second timeout take about two. The node
    sends Progress for those still waiting and answers every one with its KV (no deadline passes, here or at the
    receiver, which extends as a decode node does on Progress)."""
    config = node_config("prefill", tiny_llama, etcd, cluster)
    config.max_num_batched_tokens = len(PROMPT)   # one prompt a step
    async with prefill_setup(etcd, cluster, tiny_llama, config=config) as (node, decode):
        slow_steps(node.engine)
        rx = KVReceiver(torch.zeros_like(node.engine.kv_pool.tensor), host="127.0.0.1")
        try:
            rids = [f"q{i}" for i in range(6)]
            for i, rid in enumerate(rids):
                dst = rx.reserve(rid, [3 * i, 3 * i + 1, 3 * i + 2], timeout_s=TIMEOUT)
                job = prefill(rid, dst.to_dict(), timeout_s=TIMEOUT)
                job.prompt_ids = [p + i for p in PROMPT]   # no prefix-cache hits between them
                assert decode.send(job)
            started, done, renewed, checksums = time.monotonic(), {}, set(), {}
            while len(done) < len(rids):
                msg = await decode.recv(timeout=WAIT)
                assert msg is not None, f"answered {sorted(done)}"
                if isinstance(msg, Progress):
                    renewed.update(msg.rids)
                    for rid in msg.rids:
                        assert rx.extend(rid, TIMEOUT)
                else:
                    assert isinstance(msg, PrefillDone) and msg.error is None, msg
                    done[msg.rid] = time.monotonic() - started
                    checksums[msg.rid] = msg.checksum
            assert max(done.values()) > 1.5 * TIMEOUT   # the last ones waited past the timeout
            assert {"q4", "q5"} <= renewed
            for rid in rids:
                result = await rx.wait(rid, timeout=WAIT)
                assert result.ok and result.checksum == checksums[rid]
        finally:
            rx.close()


async def test_a_prefill_node_whose_engine_is_stuck_renews_nothing(etcd, cluster, tiny_llama):
    """The engine does not step: no Progress, the prompt's deadline passes and it is answered with an error (its
    decode node prefills it itself)."""
    gate = threading.Event()
    async with prefill_setup(etcd, cluster, tiny_llama) as (node, decode):
        slow_steps(node.engine, delay=0.0, gate=gate)
        rx = KVReceiver(torch.zeros_like(node.engine.kv_pool.tensor), host="127.0.0.1")
        try:
            dst = rx.reserve("stuck", [0, 1, 2], timeout_s=TIMEOUT)
            assert decode.send(prefill("stuck", dst.to_dict(), timeout_s=TIMEOUT))
            msg = await recv(decode, PrefillDone)
            assert msg.rid == "stuck" and "deadline" in (msg.error or "")
            assert await decode.recv(timeout=0.3) is None   # and no Progress came before or after
        finally:
            gate.set()
            rx.close()


async def test_a_queue_past_the_prefill_timeout_is_prefilled_remotely_end_to_end(etcd, cluster, tiny_llama):
    """A real decode node and a real prefill node (one prompt a prefill step, slowed steps), prefill_timeout one
    second: six requests at once all stream their tokens, every prompt prefilled on the prefill node, none timed
    out."""
    from pdcluster.decode_node.node import DecodeNode
    from pdcluster.prefill_node.node import PrefillNode

    pconfig = node_config("prefill", tiny_llama, etcd, cluster)
    pconfig.max_num_batched_tokens = len(PROMPT)   # one prompt a step
    pnode = PrefillNode(pconfig)
    slow_steps(pnode.engine)
    dconfig = node_config("decode", tiny_llama, etcd, cluster)
    dconfig.max_num_seqs = 8
    dnode = DecodeNode(dconfig, prefill_timeout=TIMEOUT)
    router = DealerClient()
    try:
        async with serving(pnode), serving(dnode):
            assert await dnode.view.wait_for(lambda v: pnode.node_id in v.nodes, WAIT)
            router.connect(dnode.control.address)
            rids = [f"e{i}" for i in range(6)]
            started = time.monotonic()
            for i, rid in enumerate(rids):
                prompt = [p + i for p in PROMPT]   # no prefix-cache hits between them
                assert router.send(Generate(rid=rid, prompt_ids=prompt, sampling=GREEDY,
                                            prefill_node=pnode.node_id, timeout_s=60, router="router-fake"))
            tokens: dict[str, list[int]] = {rid: [] for rid in rids}
            finished: set[str] = set()
            while len(finished) < len(rids):
                msg = await router.recv(timeout=WAIT)
                assert isinstance(msg, (Tokens, TokenBatch, Progress)), msg
                for item in msg.items if isinstance(msg, TokenBatch) else [msg] if isinstance(msg, Tokens) else []:
                    assert item.error is None, item
                    tokens[item.rid] += item.ids
                    if item.finish is not None:
                        finished.add(item.rid)
            assert time.monotonic() - started > 1.5 * TIMEOUT   # the queue outlasted the timeout
            assert all(len(ids) == MAX_TOKENS for ids in tokens.values())
            assert prefills(dnode, "remote") == len(rids) and prefills(dnode, "local") == 0
            assert remote_failures(dnode, "timeout") == 0
            await wait_until(lambda: not pnode.jobs, "the prefill node's jobs to end")
    finally:
        router.close()
