"""Shared by the live-migration tests (tests/test_drain_migrate.py, tests/test_migration_faults.py): a cluster of
decode nodes on one tiny model, the offline reference, node metrics, steering streams to one node."""

from __future__ import annotations

import asyncio
import time

from cluster_helpers import wait_until_async

from pdcluster.cli.admin import AdminError, set_state
from pdcluster.cli.smoke import scrape_metrics
from pdcluster.cli.supervisor import LocalCluster

MODEL_NAME = "tiny-llama"
BLOCK = 16
CLUSTER = "mig"


def decode_cluster(model: str, work, num_decode: int = 2, node: dict | None = None, **router) -> LocalCluster:
    return LocalCluster(model=model, work_dir=work, num_prefill=0, num_decode=num_decode, port=0, cluster=CLUSTER,
                        lease_ttl=2, threads_per_node=1,
                        node_config={"num_gpu_blocks_override": 256, "block_size": BLOCK, "max_num_seqs": 4,
                                     "device": "cpu", "dtype": "float32", "kv_landing_timeout": 20.0, **(node or {})},
                        router_config={"routing_policy": "prefix_aware", **router})


def reference(model: str, prompts: list[list[int]], max_tokens: int) -> list[str]:
    from transformers import AutoTokenizer

    from pdcluster.engine import LLM, SamplingParams

    llm = LLM(model=model, dtype="float32", device="cpu", num_gpu_blocks_override=512)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    llm.shutdown()
    tok = AutoTokenizer.from_pretrained(model)
    return [tok.decode(o.outputs[0].token_ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
            for o in outs]


async def only(cluster: LocalCluster, *serving: str) -> None:
    """Cordon every other decode node; until the router lists exactly `serving`."""
    for s in cluster.services:
        if s.kind == "decode":
            await set_admin_state(cluster, s.node_id, "active" if s.node_id in serving else "cordoned")
    await wait_until_async(lambda: sorted((cluster.health() or {}).get("decode_nodes", [])) == sorted(serving), 20,
                           f"the router lists {serving}")


async def set_admin_state(cluster: LocalCluster, node_id: str, state: str, tries: int = 3) -> None:
    """`pdcluster cordon/uncordon` as a drill's setup step, retried: in full-suite runs on 2 cores, with a stream
    busy, a call has timed out reaching etcd (10 s) a few times, never in the drills alone; the step is setup, not
    what the drills test."""
    for attempt in range(tries):
        try:
            await set_state([cluster.etcd], CLUSTER, node_id, state)
            return
        except AdminError as exc:
            if attempt == tries - 1:
                raise
            print(f"{time.strftime('%H:%M:%S')} {state} {node_id}: {exc}; again")


def metric(cluster: LocalCluster, node_id: str, name: str) -> float:
    return scrape_metrics(cluster.service(node_id).metrics_url).get(name, 0.0)


def router_metric(cluster: LocalCluster, name: str) -> float:
    return scrape_metrics(cluster.url + "/metrics").get(name, 0.0)


async def until_progress(progress: list[int], n: int, stream: asyncio.Task | None = None) -> None:
    end = time.monotonic() + 60
    while min(progress) < n:
        assert stream is None or not stream.done(), stream.result()
        assert time.monotonic() < end, progress
        await asyncio.sleep(0.02)
