"""KV tiers in node processes (real etcd, router, one prefill and one decode node, the official openai client):
with pools too small to keep a conversation's prefix, its next turn is served from the host and disk tiers
instead of recomputed; the answers equal the cold run's; every block is back in the pool afterwards."""

from __future__ import annotations

import asyncio
import random

import pytest
from cluster_helpers import client, complete, node_metrics, total, wait_idle

from pdcluster.cli.supervisor import LocalCluster

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(240)]

MODEL_NAME = "tiny-llama"
PROMPT, OUTPUT = 100, 12


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    from pdcluster.engine.testing import make_tiny_model

    model = make_tiny_model(str(tmp_path_factory.mktemp("tiers") / MODEL_NAME), "llama")
    work = tmp_path_factory.mktemp("cluster")
    c = LocalCluster(model=model, work_dir=work, num_prefill=1, num_decode=1, port=0, cluster="tiers",
                     lease_ttl=2, threads_per_node=1,
                     node_config={"num_gpu_blocks_override": 24, "block_size": 16, "max_num_seqs": 4,
                                  "device": "cpu", "kv_offload_host_bytes": 4 * 49152,   # ~2 blocks of this model
                                  "kv_offload_disk_path": str(work / "kv-tier"), "kv_offload_disk_bytes": "64MiB"},
                     router_config={"disagg_min_tokens": 0, "routing_policy": "least_loaded"})
    with c:
        yield c


def test_a_conversation_prefix_comes_back_from_the_tiers(cluster):
    rng = random.Random(3)
    turns = [[rng.randrange(3, 400) for _ in range(PROMPT)] for _ in range(5)]

    async def run():
        api = client(cluster)
        cold = [await complete(api, MODEL_NAME, t, OUTPUT) for t in turns]   # the last four evict the first
        before = node_metrics(cluster, "prefill")
        again = await complete(api, MODEL_NAME, turns[0], OUTPUT)
        # the next turn of the first conversation: its history (prompt + answer) and a question
        follow = turns[0] + [rng.randrange(3, 400) for _ in range(20)]
        longer = await complete(api, MODEL_NAME, follow, OUTPUT)
        return cold, before, again, longer

    cold, before, again, longer = asyncio.run(run())
    assert again.text == cold[0].text and again.tokens == cold[0].tokens and len(again.tokens) == OUTPUT
    assert len(longer.tokens) == OUTPUT
    after = wait_idle(cluster)   # every block back in the pools, nothing loading
    prefill = {n: m for n, m in after.items() if n in before}

    def delta(key):
        return total(prefill, key) - total(before, key)

    full = (PROMPT - 1) // 16
    assert delta("pdcluster_node_kv_tier_loaded_blocks_total{") == full   # the rerun loads all; the next turn hits
    assert total(prefill, 'pdcluster_node_kv_tier_loaded_blocks_total{tier="disk"}') > 0
    # computed: the rerun's tail, then the next turn past its cached blocks
    assert delta("pdcluster_node_prefill_tokens_total") == (PROMPT - full * 16) + (PROMPT + 20 - full * 16)
    assert total(prefill, "pdcluster_node_kv_tier_failed_loads_total") == 0
    assert total(after, "pdcluster_node_loading_kv_requests") == 0
