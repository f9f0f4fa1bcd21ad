"""Moving running streams with their KV, with node processes (real etcd, a router, two decode nodes, the official
openai client). `pdcluster drain NODE --migrate`: a stream running on the drained node moves to the other one
mid-generation, which fetches the KV of the prompt and the tokens so far from the draining node (it lingers to lend
them) and computes at most the last partial block; the client sees one stream, token for token the undisturbed
greedy output; the drained node exits. The router's rebalancing (`rebalance_threshold`): streams piled on one node
move to an idle one the same way."""

from __future__ import annotations

import asyncio
import random
import time

import pytest
from cluster_helpers import client, complete, wait_idle

from pdcluster.cli.admin import drain_node, set_state
from pdcluster.cli.smoke import scrape_metrics
from pdcluster.cli.supervisor import LocalCluster

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(240)]

MODEL_NAME = "tiny-llama"
BLOCK, PROMPT, OUTPUT = 16, 60, 1200


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from pdcluster.engine.testing import make_tiny_model

    return make_tiny_model(str(tmp_path_factory.mktemp("migrate") / MODEL_NAME), "llama", max_position_embeddings=2048)


def two_decode_nodes(model: str, work, **router) -> LocalCluster:
    return LocalCluster(model=model, work_dir=work, num_prefill=0, num_decode=2, port=0, cluster="mig", lease_ttl=2,
                        threads_per_node=1,
                        node_config={"num_gpu_blocks_override": 256, "block_size": BLOCK, "max_num_seqs": 4,
                                     "device": "cpu", "dtype": "float32", "kv_landing_timeout": 20.0},
                        router_config={"routing_policy": "prefix_aware", **router})


@pytest.fixture(scope="module")
def setup(model, tmp_path_factory):
    with two_decode_nodes(model, tmp_path_factory.mktemp("cluster")) as c:
        yield c, model


def reference(model: str, prompts: list[list[int]], max_tokens: int) -> list[str]:
    from transformers import AutoTokenizer

    from pdcluster.engine import LLM, SamplingParams

    llm = LLM(model=model, dtype="float32", device="cpu", num_gpu_blocks_override=256)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    llm.shutdown()
    tok = AutoTokenizer.from_pretrained(model)
    return [tok.decode(o.outputs[0].token_ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
            for o in outs]


async def only_decode_0(cluster: LocalCluster) -> None:
    await set_state([cluster.etcd], "mig", "decode-1", "cordoned")
    end = time.monotonic() + 20
    while (cluster.health() or {}).get("decode_nodes") != ["decode-0"]:
        assert time.monotonic() < end, cluster.health()
        await asyncio.sleep(0.1)


def metric(cluster: LocalCluster, node_id: str, name: str) -> float:
    return scrape_metrics(cluster.service(node_id).metrics_url).get(name, 0.0)


async def test_drain_migrate_moves_a_running_stream_with_its_kv(setup):
    cluster, model = setup
    rng = random.Random(3)
    prompt = [rng.randrange(3, 400) for _ in range(PROMPT)]
    (want,) = reference(model, [prompt], OUTPUT)
    await only_decode_0(cluster)   # the stream starts on decode-0
    progress = [0]
    stream = asyncio.create_task(complete(client(cluster), MODEL_NAME, prompt, OUTPUT, progress=progress))
    while progress[0] < 24:
        assert not stream.done(), stream.result()
        await asyncio.sleep(0.02)
    computed = metric(cluster, "decode-1", "pdcluster_node_prefill_tokens_total")
    # decode-0 drains with migration while decode-1 is still cordoned: nowhere to go, its stream stays; once
    # decode-1 is back it moves there
    drain = asyncio.create_task(drain_node([cluster.etcd], "mig", "decode-0", timeout=60, migrate=True))
    await asyncio.sleep(0.3)
    assert not stream.done(), "the stream ended before the drain: make OUTPUT longer"
    await set_state([cluster.etcd], "mig", "decode-1", "active")
    took = await asyncio.wait_for(drain, 90)
    out = await asyncio.wait_for(stream, 120)
    assert out.text == want and out.usage == OUTPUT and out.finish == "length"
    fetched = metric(cluster, "decode-1", "pdcluster_node_kv_fetched_blocks_total")
    recomputed = metric(cluster, "decode-1", "pdcluster_node_prefill_tokens_total") - computed
    assert fetched >= (PROMPT + 24) // BLOCK - 1, (fetched, recomputed)
    assert recomputed <= 2 * BLOCK, (fetched, recomputed)        # the partial tail, never the history
    assert not cluster.service("decode-0").alive or cluster.service("decode-0").proc.wait(20) == 0
    assert took < 60
    wait_idle(cluster)


async def test_rebalancing_moves_streams_to_an_idle_node_with_their_kv(model, tmp_path):
    rng = random.Random(4)
    prompts = [[rng.randrange(3, 400) for _ in range(PROMPT)] for _ in range(3)]
    output = 1200
    want = reference(model, prompts, output)
    with two_decode_nodes(model, tmp_path, rebalance_threshold=1) as cluster:
        await only_decode_0(cluster)   # all three start on decode-0
        progress = [0, 0, 0]
        api = client(cluster)
        streams = [asyncio.create_task(complete(api, MODEL_NAME, p, output, progress=progress, slot=i))
                   for i, p in enumerate(prompts)]
        while min(progress) < 16:
            await asyncio.sleep(0.02)
        await set_state([cluster.etcd], "mig", "decode-1", "active")   # 3 vs 0: the router moves one or more
        outs = await asyncio.wait_for(asyncio.gather(*streams), 120)
        assert [o.text for o in outs] == want and all(o.usage == output for o in outs)
        moved = metric(cluster, "decode-0", 'pdcluster_node_handbacks_total{reason="rebalance"}')
        assert moved >= 1
        assert metric(cluster, "decode-1", "pdcluster_node_kv_fetched_blocks_total") >= moved * (PROMPT + 16) // BLOCK
        wait_idle(cluster)
