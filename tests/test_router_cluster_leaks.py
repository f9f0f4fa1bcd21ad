"""Issue #35: the router runs for weeks while decode nodes come and go (their ids carry the pid, so every restart is
a new node); nothing it keeps per node may outlive the node's place in the view."""

from __future__ import annotations

import asyncio
import time

import pytest
from router_fakes import FakeDecodeNode

from pdcluster.control.records import NodeInfo
from pdcluster.router.cluster import RouterCluster, StaticNodeSource
from pdcluster.router.decode_client import DecodeClient, NoCapacity
from pdcluster.router.metrics import RouterMetrics
from pdcluster.router.policies import make_policy
from pdcluster.router.settings import RouterSettings

SCRIPT = list(range(300, 340))


def node_series(metrics: RouterMetrics, node_id: str) -> list[str]:
    return [s.name for family in metrics.registry.collect() for s in family.samples if s.labels.get("node") == node_id]


@pytest.mark.slow
async def test_a_node_that_leaves_takes_its_metric_children_along() -> None:
    done, slow = FakeDecodeNode("d-1", SCRIPT), FakeDecodeNode("d-2", SCRIPT, delay=0.5)
    source = StaticNodeSource([done.info])
    cluster = RouterCluster(source, sync_interval=3600)   # synced by hand below
    await cluster.start()
    settings = RouterSettings(node_id="router-leaks", request_timeout=30.0, stall_timeout=5.0, max_retries=0)
    metrics = RouterMetrics()
    client = DecodeClient(cluster, make_policy(settings.routing_policy), settings, metrics)
    try:
        stream = client.stream([1, 2, 3], {"max_tokens": 3}, deadline=time.monotonic() + 20)
        await asyncio.wait_for(stream.start(), 10)
        while not stream.finished:
            await asyncio.wait_for(stream.next(), 10)
        assert metrics.registry.get_sample_value("pdcluster_router_backend_requests_total",
                                                 {"node": "d-1", "outcome": "ok"}) == 1
        assert node_series(metrics, "d-1")

        source.set_nodes([slow.info])   # d-1 restarts as d-2, which is in the middle of a request when it goes
        cluster.sync()
        assert node_series(metrics, "d-1") == []
        stream = client.stream([1, 2, 3], {"max_tokens": 10}, deadline=time.monotonic() + 20)
        await asyncio.wait_for(stream.start(), 10)
        source.set_nodes([])
        cluster.sync()
        await stream.next()   # the first tokens, read by start()
        with pytest.raises(NoCapacity):   # migrates off the gone node (counted as failed), finds none
            await asyncio.wait_for(stream.next(), 10)
        assert node_series(metrics, "d-2") == [], "an attempt on a gone node made its children again"
    finally:
        client.close()
        await cluster.stop()
        done.stop()
        slow.stop()


async def test_a_changed_load_address_disconnects_the_old_one() -> None:
    source = StaticNodeSource([NodeInfo(node_id="d0", role="decode", load_addr="tcp://127.0.0.1:1")])
    cluster = RouterCluster(source, sync_interval=3600)
    await cluster.start()
    try:
        subscriber = cluster._subscriber
        assert subscriber is not None and subscriber.addresses == {"tcp://127.0.0.1:1"}
        source.add(NodeInfo(node_id="d0", role="decode", load_addr="tcp://127.0.0.1:2"))
        cluster.sync()
        assert subscriber.addresses == {"tcp://127.0.0.1:2"}
        source.add(NodeInfo(node_id="d0", role="decode"))   # no Load publisher any more
        cluster.sync()
        assert subscriber.addresses == set()
    finally:
        await cluster.stop()
