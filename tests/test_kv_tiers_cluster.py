"""KV tiers and the cluster-wide prefix index in node processes (real etcd, a router, two prefill nodes and one
decode node, the official openai client): with pools too small to keep a conversation's prefix, its next turn is
sent by the router to the prefill node whose tiers hold it (the router learns each node's blocks per tier from
their KV events) and served from there instead of recomputed; the answers equal the cold run's; every block is
back in the pools afterwards."""

from __future__ import annotations

import asyncio
import random
import time

import pytest
from cluster_helpers import client, complete, node_metrics, router_metrics, total, wait_idle

from pdcluster.cli.supervisor import LocalCluster

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(240)]

MODEL_NAME = "tiny-llama"
PROMPT, OUTPUT = 100, 12
# Between two turns: the nodes' next Load reports (~2 Hz) replace the queued prefill work of the previous turn,
# which a slow box may report while it is still queued; the choice then weighs the prefixes, not stale load.
REPORTS_S = 1.0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    from pdcluster.engine.testing import make_tiny_model

    model = make_tiny_model(str(tmp_path_factory.mktemp("tiers") / MODEL_NAME), "llama")
    work = tmp_path_factory.mktemp("cluster")
    c = LocalCluster(model=model, work_dir=work, num_prefill=2, num_decode=1, port=0, cluster="tiers",
                     lease_ttl=2, threads_per_node=1,
                     node_config={"num_gpu_blocks_override": 40, "block_size": 16, "max_num_seqs": 4,
                                  "device": "cpu", "kv_offload_host_bytes": 4 * 49152,   # ~2 blocks of this model
                                  "kv_offload_disk_path": str(work / "kv-tier"), "kv_offload_disk_bytes": "64MiB"},
                     router_config={"disagg_min_tokens": 0, "routing_policy": "prefix_aware"})
    with c:
        yield c


def test_conversations_come_back_from_the_tiers_of_the_node_that_holds_them(cluster):
    """Conversations spread over both prefill nodes, then pushed out of their pools by other traffic: each rerun
    of a first turn gives the cold run's answer and computes only its last partial block, each next turn only its
    new tokens: the router sent every one to the node whose pool or tiers held its history (picked by load alone,
    about half would be recomputed). The router's per-node, per-tier index agrees with the nodes' own counts."""
    rng = random.Random(11)
    firsts = [[rng.randrange(3, 400) for _ in range(PROMPT)] for _ in range(4)]
    others = [[rng.randrange(3, 400) for _ in range(PROMPT)] for _ in range(24)]
    full = (PROMPT - 1) // 16

    def agree():
        nodes, routed = node_metrics(cluster, "prefill"), router_metrics(cluster)
        return all(routed.get(f'pdcluster_router_prefix_index_blocks{{node="{n}",tier="{tier}"}}')
                   == m.get(f'pdcluster_node_kv_tier_blocks{{tier="{tier}"}}')
                   for n, m in nodes.items() for tier in ("host", "disk"))

    def wait_agree():
        end = time.monotonic() + 20
        while not agree():
            assert time.monotonic() < end, "the router's index does not match the nodes' tiers"
            time.sleep(0.3)

    async def run():
        api = client(cluster)
        cold = await asyncio.gather(*(complete(api, MODEL_NAME, t, OUTPUT) for t in firsts))   # spread over both
        for i in range(0, len(others), 2):   # pairs, so that both prefill nodes' pools overflow
            await asyncio.gather(*(complete(api, MODEL_NAME, t, OUTPUT) for t in others[i:i + 2]))
        wait_agree()   # the nodes' KV events reached the router (Load reports at ~2 Hz)
        before = node_metrics(cluster, "prefill")
        again = []
        for t in firsts:
            again.append(await complete(api, MODEL_NAME, t, OUTPUT))
            await asyncio.sleep(REPORTS_S)
        middle = node_metrics(cluster, "prefill")
        for t in firsts:   # the next turn: the history and a new question
            await complete(api, MODEL_NAME, t + [rng.randrange(3, 400) for _ in range(20)], OUTPUT)
            await asyncio.sleep(REPORTS_S)
        return cold, again, before, middle

    cold, again, before, middle = asyncio.run(run())
    assert [a.tokens for a in again] == [c.tokens for c in cold] and all(len(a.tokens) == OUTPUT for a in again)
    assert [a.text for a in again] == [c.text for c in cold]
    after = {n: m for n, m in wait_idle(cluster).items() if n in before}   # every block back in the pools

    def computed(m0, m1):
        return total(m1, "pdcluster_node_prefill_tokens_total") - total(m0, "pdcluster_node_prefill_tokens_total")

    assert computed(before, middle) == len(firsts) * (PROMPT - full * 16)
    assert computed(middle, after) == len(firsts) * (PROMPT + 20 - full * 16)
    loads = {n: sum(after[n].get(f'pdcluster_node_kv_tier_loaded_blocks_total{{tier="{t}"}}', 0) -
                    before[n].get(f'pdcluster_node_kv_tier_loaded_blocks_total{{tier="{t}"}}', 0)
                    for t in ("host", "disk")) for n in after}
    assert 0 < sum(loads.values()) <= len(firsts) * full, loads   # the rest: still in a pool
    assert total(after, 'pdcluster_node_kv_tier_loaded_blocks_total{tier="disk"}') > 0
    assert total(after, "pdcluster_node_kv_tier_failed_loads_total") == 0
    assert total(after, "pdcluster_node_loading_kv_requests") == 0
    wait_agree()
