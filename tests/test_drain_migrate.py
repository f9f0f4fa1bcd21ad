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
from migration_helpers import BLOCK, CLUSTER, MODEL_NAME, decode_cluster, metric, only, reference

from pdcluster.cli.admin import drain_node, set_state

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(240)]

# OUTPUT long enough that the stream still runs when the drain moves it (1200 ended first once decode steps got
# faster: engine/cpu_decode.py)
PROMPT, OUTPUT = 60, 3000


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from pdcluster.engine.testing import make_tiny_model

    return make_tiny_model(str(tmp_path_factory.mktemp("migrate") / MODEL_NAME), "llama", max_position_embeddings=4096)


@pytest.fixture(scope="module")
def setup(model, tmp_path_factory):
    with decode_cluster(model, tmp_path_factory.mktemp("cluster")) as c:
        yield c, model


async def only_decode_0(cluster) -> None:
    await only(cluster, "decode-0")


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
    drain = asyncio.create_task(drain_node([cluster.etcd], CLUSTER, "decode-0", timeout=60, migrate=True))
    await asyncio.sleep(0.3)
    assert not stream.done(), "the stream ended before the drain: make OUTPUT longer"
    await set_state([cluster.etcd], CLUSTER, "decode-1", "active")
    took = await asyncio.wait_for(drain, 90)
    out = await asyncio.wait_for(stream, 120)
    assert out.text == want and out.usage == OUTPUT and out.finish == "length"
    fetched = metric(cluster, "decode-1", "pdcluster_node_kv_fetched_blocks_total")
    recomputed = metric(cluster, "decode-1", "pdcluster_node_prefill_tokens_total") - computed
    assert fetched >= (PROMPT + 24) // BLOCK - 1, (fetched, recomputed)
    # pre-copied while it decoded on, handed back at a block boundary: only the last token is computed (it
    # samples the next one), nothing of the history
    assert metric(cluster, "decode-1", 'pdcluster_node_pre_copies_total{outcome="ok"}') == 1
    assert recomputed == 1, (fetched, recomputed)
    assert not cluster.service("decode-0").alive or cluster.service("decode-0").proc.wait(20) == 0
    assert took < 60
    wait_idle(cluster)


async def test_rebalancing_moves_streams_to_an_idle_node_with_their_kv(model, tmp_path):
    rng = random.Random(4)
    prompts = [[rng.randrange(3, 400) for _ in range(PROMPT)] for _ in range(3)]
    output = OUTPUT   # (1200 tokens ended before the first move on a fast CPU)
    want = reference(model, prompts, output)
    with decode_cluster(model, tmp_path, rebalance_threshold=1) as cluster:
        await only_decode_0(cluster)   # all three start on decode-0
        progress = [0, 0, 0]
        api = client(cluster)
        streams = [asyncio.create_task(complete(api, MODEL_NAME, p, output, progress=progress, slot=i))
                   for i, p in enumerate(prompts)]
        while min(progress) < 16:
            await asyncio.sleep(0.02)
        await set_state([cluster.etcd], CLUSTER, "decode-1", "active")   # 3 vs 0: the router moves one or more
        deadline = time.monotonic() + 60
        while metric(cluster, "decode-0", 'pdcluster_node_handbacks_total{reason="rebalance"}') < 1:
            assert not all(s.done() for s in streams), "every stream ended before any moved: make them longer"
            assert time.monotonic() < deadline, "no stream moved in 60 s"
            await asyncio.sleep(0.1)
        outs = await asyncio.wait_for(asyncio.gather(*streams), 120)
        assert [o.text for o in outs] == want and all(o.usage == output for o in outs)
        moved = metric(cluster, "decode-0", 'pdcluster_node_handbacks_total{reason="rebalance"}')
        assert moved >= 1
        assert metric(cluster, "decode-1", "pdcluster_node_kv_fetched_blocks_total") >= moved * (PROMPT + 16) // BLOCK
        wait_idle(cluster)


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory):
    """Slower steps than `model`: a stream grows slowly enough that the router lists a node made active after the
    streams started before the pool runs short."""
    from pdcluster.engine.testing import make_tiny_model

    return make_tiny_model(str(tmp_path_factory.mktemp("migrate-wide") / MODEL_NAME), "llama", hidden_size=256,
                           intermediate_size=512, num_hidden_layers=4, max_position_embeddings=2048)


async def test_a_node_short_of_kv_blocks_moves_a_stream_instead_of_preempting(wide_model, tmp_path):
    """`preempt_migrate`: three long streams (3 x 1060 tokens = 199 blocks) on a 128-block pool would preempt; the
    node asks the router to move the newest one away with its KV first. All three outputs exact, at least one moved
    for pressure, none preempted. The pool leaves each stream ~500 tokens of growth while the router learns that
    decode-1 is active (64 blocks left ~200: a busy 2-core CI host used them up)."""
    model = wide_model
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 400) for _ in range(PROMPT)] for _ in range(3)]
    output = 1000
    want = reference(model, prompts, output)
    cluster = decode_cluster(model, tmp_path, node={"num_gpu_blocks_override": 128, "preempt_migrate": True})
    with cluster:
        await only_decode_0(cluster)   # all three start on decode-0
        progress = [0, 0, 0]
        api = client(cluster)
        streams = [asyncio.create_task(complete(api, MODEL_NAME, p, output, progress=progress, slot=i))
                   for i, p in enumerate(prompts)]
        while min(progress) < 8:
            await asyncio.sleep(0.02)
        await only(cluster, "decode-0", "decode-1")
        assert cluster.health() and metric(cluster, "decode-0", "pdcluster_node_kv_blocks_free") > 12, \
            "the pool ran short before the router listed decode-1: the test's margin is gone"
        outs = await asyncio.wait_for(asyncio.gather(*streams), 120)
        assert [o.text for o in outs] == want and all(o.usage == output for o in outs)
        assert metric(cluster, "decode-0", 'pdcluster_node_handbacks_total{reason="pressure"}') >= 1
        assert metric(cluster, "decode-0", "pdcluster_node_preemptions") == 0
        assert metric(cluster, "decode-1", 'pdcluster_node_pre_copies_total{outcome="ok"}') >= 1
        wait_idle(cluster)
