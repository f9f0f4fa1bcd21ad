"""A decode node sends its prompt to the prefill node before its engine has reserved the KV blocks (`Prefill`
with no destination), and the destination once they are reserved (`PrefillDestination`): the prefill overlaps
the reservation, which waits for the decode engine's step boundary (up to a decode step).

Prefill node: the prompt is computed at once; its transfer starts wherever the destination finds it: before the
prompt's step (layer by layer), during it (the layers done so far at once, the rest layer by layer), or after the
prompt is done (every layer at once). Each way the KV that lands is the one sent with the prompt. A pool sliced
per tensor-parallel rank starts a destination that came mid-step at the step's end (its other ranks hear of a
transfer only between steps). A destination
from another peer, a second one, or a malformed one moves nothing; a prompt whose destination never comes is
answered with an error by its deadline and frees its blocks.

Decode node: the prompt leaves before the reservation; a failure the peer reports meanwhile (or the peer leaving)
falls back to the local prefill once the blocks are reserved; an abort meanwhile, or a reservation that finds
no blocks, tells the peer. The nodes run in this process (tests/node_helpers.py)."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch
from node_helpers import (
    PREFILL_PEER,
    PROMPT,
    WAIT,
    assert_idle,
    decode_setup,
    generate,
    local_tokens,
    node_config,
    nothing_more,
    prefill,
    prefill_setup,
    recv,
    remote_failures,
    stream,
    wait_until,
)

from pdcluster.control.protocol import Abort, Prefill, PrefillDestination, PrefillDone
from pdcluster.control.transport import DealerClient
from pdcluster.kv_transfer import KVReceiver
from pdcluster.prefill_node.job import JobState

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

BLOCKS = [0, 1, 2]   # the destination blocks of PROMPT (3 blocks of 16)


class Receiver:
    """A decode node's KV receiver, as a prefill node sees it: a pool of the prefill node's layout."""

    def __init__(self, node) -> None:
        self.pool = torch.zeros_like(node.engine.kv_pool.tensor)
        self.rx = KVReceiver(self.pool, host="127.0.0.1")

    def destination(self, rid: str, blocks: list[int] = BLOCKS) -> dict:
        return self.rx.reserve(rid, blocks, timeout_s=WAIT).to_dict()

    async def landed(self, rid: str, done: PrefillDone) -> torch.Tensor:
        """The prompt's KV as it landed (checked against the sender's checksum); zeroed here for the next one."""
        assert done.rid == rid and done.error is None, done
        result = await self.rx.wait(rid, timeout=WAIT)
        assert result.ok and result.checksum == done.checksum
        kv = self.pool[:, :, BLOCKS].clone()
        self.pool.zero_()
        return kv

    def close(self) -> None:
        self.rx.close()


async def reference_kv(node, decode: DealerClient, rx: Receiver) -> torch.Tensor:
    """PROMPT's KV sent the old way, its destination with the prompt."""
    assert decode.send(prefill("ref", rx.destination("ref")))
    kv = await rx.landed("ref", await recv(decode, PrefillDone))
    assert kv.abs().sum() > 0 and all(kv[layer].abs().sum() > 0 for layer in range(kv.shape[0]))
    return kv


def close_to(a: torch.Tensor, b: torch.Tensor) -> bool:
    # the prefix cache spares the later prompts' full blocks: their last block's KV is computed in a smaller batch
    return torch.allclose(a, b, rtol=1e-4, atol=1e-5)


def hold_steps(engine) -> threading.Event:
    """The engine's steps wait until the returned event is set."""
    gate, step = threading.Event(), engine.step

    def held():
        gate.wait(WAIT)
        return step()

    engine.step = held
    return gate


async def test_a_destination_before_the_prompts_step_streams_it_layer_by_layer(etcd, cluster, tiny_llama):
    async with prefill_setup(etcd, cluster, tiny_llama) as (node, decode):
        rx = Receiver(node)
        try:
            ref = await reference_kv(node, decode, rx)
            gate = hold_steps(node.engine)
            assert decode.send(prefill("a", {}))
            await wait_until(lambda: "a" in node._held, "the prompt in the engine")
            assert decode.send(PrefillDestination(rid="a", dst=rx.destination("a")))
            await wait_until(lambda: node.jobs["a"].unrouted is None, "the destination handed to the engine thread")
            gate.set()
            assert close_to(await rx.landed("a", await recv(decode, PrefillDone)), ref)
        finally:
            rx.close()


async def test_a_destination_during_the_prompts_step_sends_the_layers_done_and_streams_the_rest(
        etcd, cluster, tiny_llama):
    async with prefill_setup(etcd, cluster, tiny_llama) as (node, decode):
        rx = Receiver(node)
        try:
            ref = await reference_kv(node, decode, rx)
            in_step, go, started_at = threading.Event(), threading.Event(), []
            on_layer_done = node.connector.on_layer_done

            def layer_done(layer: int) -> None:   # on the engine thread, mid-step
                if layer == 1 and not go.is_set():
                    in_step.set()
                    go.wait(WAIT)
                on_layer_done(layer)
                if node.connector.streaming and not started_at:
                    started_at.append(layer)

            node.connector.on_layer_done = layer_done
            assert decode.send(prefill("m", {}))
            assert await asyncio.to_thread(in_step.wait, WAIT)   # layers 0 and 1 computed, nothing sent
            assert not node.connector.streaming
            assert decode.send(PrefillDestination(rid="m", dst=rx.destination("m")))
            await wait_until(lambda: node.jobs["m"].unrouted is None, "the destination handed to the engine thread")
            go.set()
            assert close_to(await rx.landed("m", await recv(decode, PrefillDone)), ref)
            assert started_at == [1]   # started in the step, after layer 1
        finally:
            rx.close()


async def test_a_destination_after_the_prompt_is_done_sends_every_layer(etcd, cluster, tiny_llama):
    async with prefill_setup(etcd, cluster, tiny_llama) as (node, decode):
        rx = Receiver(node)
        try:
            ref = await reference_kv(node, decode, rx)
            assert decode.send(prefill("late", {}))
            await wait_until(lambda: "late" in node.jobs and node.jobs["late"].state is JobState.SENDING,
                             "the prompt computed")
            assert node.jobs["late"].outgoing.transfer is None
            assert await decode.recv(timeout=0.3) is None   # nothing to answer yet
            assert decode.send(PrefillDestination(rid="late", dst=rx.destination("late")))
            assert close_to(await rx.landed("late", await recv(decode, PrefillDone)), ref)
        finally:
            rx.close()


async def test_destinations_from_another_peer_twice_or_malformed_move_nothing(etcd, cluster, tiny_llama):
    async with prefill_setup(etcd, cluster, tiny_llama) as (node, decode):
        rx = Receiver(node)
        other = DealerClient()
        other.connect(node.control.address)
        try:
            ref = await reference_kv(node, decode, rx)
            dropped = node.control.dropped.count
            assert decode.send(prefill("p", {}))
            await wait_until(lambda: "p" in node.jobs, "the prompt queued")
            assert other.send(PrefillDestination(rid="p", dst=rx.destination("p-other", [3, 4, 5])))   # not its own
            assert other.send(PrefillDestination(rid="nobody", dst=rx.destination("nobody", [6, 7, 8])))
            await wait_until(lambda: node.jobs["p"].state is JobState.SENDING, "the prompt computed")
            assert node.jobs["p"].dst is None and await decode.recv(timeout=0.3) is None
            assert await other.recv(timeout=0.1) is None
            assert decode.send(PrefillDestination(rid="p", dst=rx.destination("p")))
            assert decode.send(PrefillDestination(rid="p", dst=rx.destination("p-twice", [9, 10, 11])))   # ignored
            done = await recv(decode, PrefillDone)
            assert rx.pool[:, :, 3:12].abs().sum() == 0   # nothing written but into the owner's first destination
            assert close_to(await rx.landed("p", done), ref)
            assert node.control.dropped.count - dropped == 3   # each counted

            assert decode.send(prefill("bad", {}))
            assert decode.send(PrefillDestination(rid="bad", dst=rx.destination("bad"), skip_blocks=3))
            done = await recv(decode, PrefillDone)
            assert done.rid == "bad" and "bad PrefillDestination" in done.error
            await assert_idle(node)
        finally:
            other.close()
            rx.close()


async def test_a_prompt_whose_destination_never_comes_is_answered_by_its_deadline(etcd, cluster, tiny_llama):
    async with prefill_setup(etcd, cluster, tiny_llama) as (node, decode):
        assert decode.send(prefill("never", {}, timeout_s=1.0))
        done = await recv(decode, PrefillDone)
        assert done.rid == "never" and done.error
        await assert_idle(node)   # its held blocks freed


async def test_an_abort_before_the_destination_frees_the_prompt(etcd, cluster, tiny_llama):
    async with prefill_setup(etcd, cluster, tiny_llama) as (node, decode):
        assert decode.send(prefill("gone", {}))
        await wait_until(lambda: "gone" in node.jobs and node.jobs["gone"].state is JobState.SENDING,
                         "the prompt computed")
        assert decode.send(Abort(rid="gone"))
        done = await recv(decode, PrefillDone)
        assert done.rid == "gone" and done.error
        await assert_idle(node)


# ---------------------------------------------------------------------------------------------- decode node

def hold_engine(node) -> threading.Event:
    """The decode engine's thread waits (as in a long decode step) until the returned event is set."""
    gate = threading.Event()
    node.engine_thread.post(lambda e: gate.wait(WAIT))
    return gate


async def test_the_prompt_leaves_before_the_decode_engine_reserves_its_blocks(etcd, cluster, tiny_llama):
    async with decode_setup(etcd, cluster, tiny_llama) as (node, peer, router):
        gate = hold_engine(node)
        generate(router, "r", PREFILL_PEER)
        _, msg = await peer.recv(Prefill)
        assert msg.rid == "r" and msg.dst == {} and msg.prompt_ids == PROMPT
        with pytest.raises(asyncio.TimeoutError):   # no destination while the engine cannot reserve
            await asyncio.wait_for(peer.server.recv(), 0.3)
        assert node.engine_stats().num_reserved_blocks == 0
        gate.set()
        _, dst = await peer.recv(PrefillDestination)
        assert dst.rid == "r" and len(dst.dst["block_ids"]) == 3 and dst.skip_blocks == 0
        router.send(Abort(rid="r"))
        assert (await peer.recv(Abort))[1].rid == "r"
        await assert_idle(node)


async def test_a_peer_failing_while_the_blocks_are_reserved_falls_back_once_they_are(etcd, cluster, tiny_llama):
    async with decode_setup(etcd, cluster, tiny_llama) as (node, peer, router):
        gate = hold_engine(node)
        generate(router, "f", PREFILL_PEER)
        identity, _ = await peer.recv(Prefill)
        assert peer.server.send(identity, PrefillDone(rid="f", error="prefill queue full"))
        await asyncio.sleep(0.2)
        gate.set()
        ids, first = await stream(router, "f")
        assert first.prefill_path == "local" and remote_failures(node, "prefill_error") == 1
        assert (await peer.recv(Abort))[1].rid == "f"   # no destination was sent
        assert ids == await local_tokens(router, "f-local")


async def test_an_abort_while_reserving_tells_the_peer(etcd, cluster, tiny_llama):
    async with decode_setup(etcd, cluster, tiny_llama) as (node, peer, router):
        gate = hold_engine(node)
        generate(router, "a", PREFILL_PEER)
        await peer.recv(Prefill)
        assert router.send(Abort(rid="a"))
        assert (await peer.recv(Abort))[1].rid == "a"
        gate.set()
        await nothing_more(router)
        await assert_idle(node)   # the reservation made after the abort was freed by the engine's abort


async def test_no_blocks_to_reserve_tells_the_peer_and_prefills_here(etcd, cluster, tiny_llama):
    async with decode_setup(etcd, cluster, tiny_llama) as (node, peer, router):
        add = node.engine.add_request

        def add_without_blocks(*args, **kwargs):
            return False if kwargs.get("remote_kv") else add(*args, **kwargs)

        node.engine.add_request = add_without_blocks
        generate(router, "nb", PREFILL_PEER)
        await peer.recv(Prefill)
        assert (await peer.recv(Abort))[1].rid == "nb"
        ids, first = await stream(router, "nb")
        assert first.prefill_path == "local" and remote_failures(node, "no_blocks") == 1
        node.engine.add_request = add
        assert ids == await local_tokens(router, "nb-local")


async def test_a_pool_sliced_per_rank_starts_a_destination_that_came_mid_step_after_the_step(
        etcd, cluster, tiny_llama):
    """Tensor parallel, a KV slice per rank: the other ranks hear of a transfer only between steps, so a destination
    that comes during the prompt's step starts at its end (every layer at once from every rank), not mid-step."""
    config = node_config("prefill", tiny_llama, etcd, cluster)
    config.tensor_parallel_size, config.kv_pool_per_rank = 2, True
    engines = []
    try:
        await sliced_prefill_node_mid_step(etcd, cluster, tiny_llama, config, engines)
    finally:   # a node process ends its ranks at exit; this test process must leave their group for the next tests
        for engine in engines:
            engine.shutdown()


async def sliced_prefill_node_mid_step(etcd, cluster, tiny_llama, config, engines: list) -> None:
    async with prefill_setup(etcd, cluster, tiny_llama, config=config) as (node, decode):
        engines.append(node.engine)
        pool = torch.zeros_like(node.engine.kv_pool.tensor)   # rank 0's slice: half the KV heads
        whole = pool.new_zeros(*pool.shape[:-2], 2 * pool.shape[-2], pool.shape[-1])
        rx = KVReceiver(whole, host="127.0.0.1")   # one pool holding every head: both ranks write into it
        try:
            def destination(rid: str) -> dict:
                return rx.reserve(rid, BLOCKS, timeout_s=WAIT, sender_slices=2).to_dict()

            assert decode.send(prefill("ref", destination("ref")))
            done = await recv(decode, PrefillDone)
            assert done.error is None and (await rx.wait("ref", timeout=WAIT)).checksum == done.checksum
            ref = whole[:, :, BLOCKS].clone()
            whole.zero_()

            in_step, go, midstep = threading.Event(), threading.Event(), []
            on_layer_done = node.connector.on_layer_done

            def layer_done(layer: int) -> None:
                if layer == 1 and not go.is_set():
                    in_step.set()
                    go.wait(WAIT)
                on_layer_done(layer)
                midstep.append(bool(node.connector.streaming))

            node.connector.on_layer_done = layer_done
            assert decode.send(prefill("m", {}))
            assert await asyncio.to_thread(in_step.wait, WAIT)
            assert decode.send(PrefillDestination(rid="m", dst=destination("m")))
            await wait_until(lambda: node.jobs["m"].unrouted is None, "the destination handed to the engine thread")
            go.set()
            done = await recv(decode, PrefillDone)
            assert done.error is None and (await rx.wait("m", timeout=WAIT)).checksum == done.checksum
            assert close_to(whole[:, :, BLOCKS], ref) and ref.abs().sum() > 0
            assert midstep and not any(midstep)   # nothing streamed during the step
        finally:
            rx.close()
