"""A decode node starts a remote prefill only when its KV pool has room for the prompt beside every request it
holds, each with `kv_reserve_tokens` of room to grow (decode_node/node.py `_kv_room_for`); the others wait on the
node, and nothing is preempted and recomputed there.

First with fake peers in this process (the waiting prompt's Prefill goes out only when a request leaves; a
draining node sends its waiting prompts to another decode node), then a real 1 prefill + 1 decode cluster whose
decode pool cannot hold every stream to its end: every prompt is prefilled on the prefill node, none preempted,
every output the offline engine's."""

from __future__ import annotations

import asyncio

import pytest
from cluster_helpers import bounded, client, complete, node_metrics, total, wait_idle
from node_helpers import (
    MAX_TOKENS,
    PREFILL_PEER,
    PROMPT,
    QUIET,
    WAIT,
    FakePrefill,
    decode_setup,
    generate,
    nothing_more,
    recv,
    stream,
    wait_until,
)

from pdcluster.control.protocol import Abort, Generate, Prefill, PrefillDestination, Reject
from pdcluster.control.records import NodeInfo
from pdcluster.control.registration import Registration
from pdcluster.control.sampling_params import SamplingParams
from pdcluster.control.transport import DealerClient

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

LONG = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True).to_dict()   # 37 + 400 tokens: 28 blocks


def send(router: DealerClient, rid: str) -> None:
    assert router.send(Generate(rid=rid, prompt_ids=PROMPT, sampling=LONG, prefill_node=PREFILL_PEER,
                                timeout_s=60, router="router-fake"))


async def prompt_reaches(peer: FakePrefill, rid: str) -> None:
    _, prefill = await peer.recv(Prefill)
    assert prefill.rid == rid
    _, dst = await peer.recv(PrefillDestination)
    assert dst.rid == rid


async def no_prompt_reaches(peer: FakePrefill) -> None:
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(peer.server.recv(), QUIET)


async def test_a_prompt_without_kv_room_waits_until_a_request_leaves(etcd, cluster, tiny_llama):
    async with decode_setup(etcd, cluster, tiny_llama, kv_reserve_tokens=512) as (node, peer, router):
        for rid in ("r1", "r2"):   # 2 x 28 of the 64 blocks
            send(router, rid)
            await prompt_reaches(peer, rid)
        send(router, "r3")   # 28 more would not fit: it waits, and counts as waiting in the node's load
        await no_prompt_reaches(peer)
        assert node.load().waiting == 3 and [r.rid for r, _, _ in node.kv_queue] == ["r3"]
        send(router, "r4")   # behind r3, aborted while it waits: it never reaches the prefill node
        await no_prompt_reaches(peer)
        assert router.send(Abort(rid="r4"))
        await wait_until(lambda: "r4" not in node.requests, "the waiting request aborted")
        # a short prompt for this node itself (3 blocks) waits behind r3 too: first come, first served
        generate(router, "r5", None)
        await nothing_more(router)
        assert [r.rid for r, _, _ in node.kv_queue] == ["r3", "r5"]
        assert router.send(Abort(rid="r1"))   # room for r3 now, and then for r5 (28 + 28 + 3 of 64 blocks)
        _, abort = await peer.recv(Abort)
        assert abort.rid == "r1"
        await prompt_reaches(peer, "r3")
        ids, first = await stream(router, "r5")
        assert first.prefill_path == "local" and len(ids) == MAX_TOKENS
        await no_prompt_reaches(peer)
        assert not node.kv_queue
        for rid in ("r2", "r3"):
            assert router.send(Abort(rid=rid))
            await peer.recv(Abort)


async def test_without_a_reserve_every_prompt_starts_at_once(etcd, cluster, tiny_llama):
    async with decode_setup(etcd, cluster, tiny_llama, kv_reserve_tokens=0) as (node, peer, router):
        for rid in ("r1", "r2", "r3"):   # each prompt's 3 blocks fit: all reserved at once
            send(router, rid)
            await prompt_reaches(peer, rid)
        assert not node.kv_queue
        for rid in ("r1", "r2", "r3"):
            assert router.send(Abort(rid=rid))
            await peer.recv(Abort)


async def test_a_draining_node_sends_its_waiting_prompts_to_another_decode_node(etcd, cluster, tiny_llama):
    async with decode_setup(etcd, cluster, tiny_llama, kv_reserve_tokens=512) as (node, peer, router):
        for rid in ("r1", "r2"):
            send(router, rid)
            await prompt_reaches(peer, rid)
        send(router, "r3")
        await no_prompt_reaches(peer)
        node.begin_drain("test")   # no other decode node: r3 keeps waiting, to run here
        await nothing_more(router)
        assert [r.rid for r, _, _ in node.kv_queue] == ["r3"]
        other = Registration([etcd.endpoint], cluster, NodeInfo(node_id="decode-other", role="decode",
                                                                model=node.served_model_name()), ttl=2)
        assert await other.start(wait=WAIT)
        try:   # another decode node joins: r3 goes back to its router, which places it there; it never ran here
            reject = await recv(router, Reject)
            assert reject.rid == "r3" and "draining" in reject.reason
            assert not node.kv_queue and "r3" not in node.requests
            await no_prompt_reaches(peer)
            for rid in ("r1", "r2"):
                assert router.send(Abort(rid=rid))
                await peer.recv(Abort)
        finally:
            await other.deregister()


# ------------------------------------------------------------------------------------ a real 1P1D cluster

STREAMS = 6
PROMPT_TOKENS = 100   # 7 blocks
OUTPUT_TOKENS = 200   # 300 tokens in all: 19 blocks each, 114 for all six against a 64-block pool


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    from pdcluster.engine.testing import make_tiny_model

    return make_tiny_model(str(tmp_path_factory.mktemp("kv-room") / "kv-room-llama"), "llama")


def test_a_decode_pool_short_of_room_for_every_stream_preempts_none(model_dir, tmp_path):
    from transformers import AutoTokenizer

    from pdcluster.cli.supervisor import LocalCluster
    from pdcluster.engine import LLM
    from pdcluster.engine import SamplingParams as Params

    prompts = [[(7 * i + 13 * j) % 300 + 3 for j in range(PROMPT_TOKENS)] for i in range(STREAMS)]
    llm = LLM(model=model_dir, dtype="float32", device="cpu", num_gpu_blocks_override=512)
    expected = [list(o.outputs[0].token_ids) for o in
                llm.generate(prompts, Params(temperature=0, max_tokens=OUTPUT_TOKENS, ignore_eos=True))]
    del llm
    cluster = LocalCluster(model=model_dir, work_dir=tmp_path, num_prefill=1, num_decode=1, port=0,
                           cluster="kv-room", lease_ttl=2, threads_per_node=1,
                           node_config={"device": "cpu", "dtype": "float32", "block_size": 16,
                                        "num_gpu_blocks_override": 64, "max_num_seqs": 8},
                           router_config={"disagg_min_tokens": 0})
    with cluster:
        api = client(cluster)

        async def run():
            return await bounded([complete(api, "kv-room-llama", p, OUTPUT_TOKENS, stream=True) for p in prompts],
                                 120)

        results = asyncio.run(run())
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        for out, ids in zip(results, expected, strict=True):
            assert out.finish == "length" and out.usage == OUTPUT_TOKENS
            assert out.text == tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        decode = node_metrics(cluster, "decode")
        assert total(decode, "pdcluster_node_preemptions_total") == 0
        assert total(decode, 'pdcluster_node_prefills_total{path="remote"}') == STREAMS
        assert total(decode, 'pdcluster_node_prefills_total{path="local"}') == 0
        wait_idle(cluster)
