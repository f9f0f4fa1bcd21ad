"""Prefix KV fetched between node processes (real etcd, a router, two decode nodes, the official openai client):
a prompt whose prefix one decode node computed, sent to the other one (the first is cordoned), is fetched from the
first over the KV channel (the router names the holder from its per-tier index) and only its tail computed, with
the cold run's answer; a holder that stops and dies with the fetch in flight costs a recompute, never the answer.
Every block is back in the pools afterwards."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time

import pytest
from cluster_helpers import client, complete, wait_idle

from pdcluster.cli.admin import set_state
from pdcluster.cli.smoke import scrape_metrics
from pdcluster.cli.supervisor import LocalCluster

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(240)]

MODEL_NAME = "tiny-llama"
BLOCK, OUTPUT = 16, 8


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    from pdcluster.engine.testing import make_tiny_model

    model = make_tiny_model(str(tmp_path_factory.mktemp("fetch") / MODEL_NAME), "llama")
    c = LocalCluster(model=model, work_dir=tmp_path_factory.mktemp("cluster"), num_prefill=0, num_decode=2,
                     port=0, cluster="fetch", lease_ttl=2, threads_per_node=1,
                     node_config={"num_gpu_blocks_override": 64, "block_size": BLOCK, "max_num_seqs": 4,
                                  "device": "cpu", "kv_landing_timeout": 20.0},
                     router_config={"routing_policy": "prefix_aware"})
    with c:
        yield c


async def only(cluster: LocalCluster, node_id: str) -> None:
    """Cordon the other decode node (uncordon this one); return once the router sends new work to `node_id` only."""
    other = "decode-1" if node_id == "decode-0" else "decode-0"
    await set_state([cluster.etcd], "fetch", node_id, "active")
    await set_state([cluster.etcd], "fetch", other, "cordoned")
    end = time.monotonic() + 20
    while (cluster.health() or {}).get("decode_nodes") != [node_id]:
        assert time.monotonic() < end, f"the router did not see {other} cordoned: {cluster.health()}"
        await asyncio.sleep(0.1)


def metric(node_id: str, cluster: LocalCluster, name: str) -> float:
    return scrape_metrics(cluster.service(node_id).metrics_url).get(name, 0.0)


async def until(predicate, what: str, timeout: float = 20.0) -> None:
    end = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < end, what
        await asyncio.sleep(0.1)


async def test_a_prefix_computed_on_one_node_is_fetched_by_the_other(cluster):
    api = client(cluster)
    model = MODEL_NAME
    rng = random.Random(5)
    first = [rng.randrange(3, 400) for _ in range(100)]
    second = first + [rng.randrange(3, 400) for _ in range(30)]     # the next turn: 130 tokens, 8 full blocks
    await only(cluster, "decode-0")
    cold = await complete(api, model, second, OUTPUT)                # decode-0 computes it all, keeps the blocks
    await complete(api, model, first, OUTPUT)
    # the router learns decode-0's blocks from its next Load reports (~2 Hz)
    await asyncio.sleep(1.5)
    await only(cluster, "decode-1")
    computed = metric("decode-1", cluster, "pdcluster_node_prefill_tokens_total")
    again = await complete(api, model, second, OUTPUT)
    assert again.tokens == cold.tokens and again.finish == cold.finish
    assert metric("decode-1", cluster, "pdcluster_node_kv_fetched_blocks_total") == (130 - 1) // BLOCK
    assert metric("decode-1", cluster, 'pdcluster_node_kv_fetches_total{outcome="ok"}') == 1
    assert metric("decode-1", cluster, "pdcluster_node_prefill_tokens_total") - computed == 130 - 8 * BLOCK
    assert metric("decode-0", cluster, "pdcluster_node_kv_lent_blocks_total") == 8
    wait_idle(cluster)


async def test_holder_dying_mid_fetch_costs_a_recompute_not_the_answer(cluster):
    api = client(cluster)
    model = MODEL_NAME
    rng = random.Random(6)
    prompt = [rng.randrange(3, 400) for _ in range(120)]             # 7 full blocks
    await only(cluster, "decode-0")
    cold = await complete(api, model, prompt, OUTPUT)
    await asyncio.sleep(1.5)
    await only(cluster, "decode-1")
    failed = metric("decode-1", cluster, 'pdcluster_node_kv_fetches_total{outcome="failed"}')
    missed = metric("decode-1", cluster, "pdcluster_node_kv_fetch_missed_blocks_total")
    holder = cluster.service("decode-0")
    # The holder stops: it still looks fresh to the router for a moment, so it is named as the holder; the fetch it
    # never answers is in flight when it dies.
    os.kill(holder.proc.pid, signal.SIGSTOP)
    try:
        request = asyncio.create_task(complete(api, model, prompt, OUTPUT))
        await until(lambda: metric("decode-1", cluster, "pdcluster_node_loading_kv_requests") == 1,
                    "decode-1 to start the fetch", timeout=10)
    finally:
        os.kill(holder.proc.pid, signal.SIGKILL)
        os.kill(holder.proc.pid, signal.SIGCONT)
    again = await asyncio.wait_for(request, 60)
    assert again.tokens == cold.tokens
    assert metric("decode-1", cluster, 'pdcluster_node_kv_fetches_total{outcome="failed"}') == failed + 1
    assert metric("decode-1", cluster, "pdcluster_node_kv_fetch_missed_blocks_total") == missed + 7
    holder.proc.wait(10)
    wait_idle(cluster)
