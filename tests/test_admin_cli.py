"""`pdcluster status|nodes|cordon|uncordon|drain|health` as real subprocesses against a live local
cluster (real etcd, 1 router, 1 prefill, 2 decode nodes), under load where it matters.

Order matters (one cluster for the module): status/nodes, cordon/uncordon, health, then drain
(which removes decode-1 for good).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from pdcluster.cli.smoke import scrape_metrics
from pdcluster.cli.supervisor import LocalCluster
from pdcluster.control.etcd_server import free_port

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(240)]

PDCLUSTER = str(Path(sys.executable).with_name("pdcluster"))
MODEL_NAME = "tiny-llama"
CLUSTER = "admin"
DONE = ("stop", "length")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    from pdcluster.engine.testing import make_tiny_model

    model = make_tiny_model(str(tmp_path_factory.mktemp("admin") / MODEL_NAME), "llama")
    c = LocalCluster(model=model, work_dir=tmp_path_factory.mktemp("cluster"), num_prefill=1, num_decode=2,
                     port=0, cluster=CLUSTER, lease_ttl=2, threads_per_node=1,
                     node_config={"kv_cache_memory": "8MiB", "max_num_seqs": 16, "device": "cpu"},
                     router_config={"disagg_min_tokens": 0, "routing_policy": "round_robin"})
    with c:
        yield c


def cli(cluster: LocalCluster, *args: str, timeout: float = 60, etcd: str | None = None) -> subprocess.CompletedProcess:
    cmd = [PDCLUSTER, *args, "--etcd", etcd or cluster.etcd, "--cluster", CLUSTER]
    env = {**os.environ, "PDCLUSTER_CLUSTER_SECRET": cluster.cluster_secret}   # to read the nodes' Load reports
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


def status(cluster: LocalCluster) -> dict[str, dict]:
    r = cli(cluster, "status", "--json")
    assert r.returncode == 0, r.stderr
    return {n["node_id"]: n for n in json.loads(r.stdout)["nodes"]}


def finished(m: dict[str, float]) -> float:
    """Requests a decode node completed (any terminal outcome except a Reject)."""
    return sum(v for k, v in m.items() if k.startswith("pdcluster_node_requests_total{") and "rejected" not in k)


def wait_until(predicate, timeout: float, what: str, interval: float = 0.2):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(interval)


class Traffic:
    """Keeps `concurrency` completion requests running until stopped; counts outcomes."""

    def __init__(self, cluster: LocalCluster, concurrency: int = 3, max_tokens: int = 8) -> None:
        self.url, self.concurrency, self.max_tokens = cluster.url, concurrency, max_tokens
        self.ok = 0
        self.failures: list[str] = []
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task] = []

    async def _worker(self, http: httpx.AsyncClient, i: int) -> None:
        while not self._stop.is_set():
            body = {"model": MODEL_NAME, "prompt": f"Request {i} {self.ok} of a steady load on the cluster",
                    "max_tokens": self.max_tokens, "temperature": 0, "ignore_eos": True}
            try:
                r = await http.post("/v1/completions", json=body)
                if r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in DONE:
                    self.ok += 1
                else:
                    self.failures.append(f"{r.status_code}: {r.text[:200]}")
            except httpx.HTTPError as exc:
                self.failures.append(repr(exc))

    async def __aenter__(self) -> "Traffic":
        self._http = httpx.AsyncClient(base_url=self.url, timeout=60)
        self._tasks = [asyncio.create_task(self._worker(self._http, i)) for i in range(self.concurrency)]
        return self

    async def __aexit__(self, *exc) -> None:
        self._stop.set()
        await asyncio.wait_for(asyncio.gather(*self._tasks), 60)
        await self._http.aclose()


async def in_thread(fn, *args):
    return await asyncio.get_running_loop().run_in_executor(None, fn, *args)


def test_status_json_and_nodes_list_every_node_with_live_numbers(cluster):
    everyone = status(cluster)
    routers = {k: v for k, v in everyone.items() if v["role"] == "router"}
    nodes = {k: v for k, v in everyone.items() if v["role"] != "router"}
    assert set(nodes) == {"prefill-0", "decode-0", "decode-1"}
    (router,) = routers.values()   # the router registers too, with its own stats
    assert router["state"] == "serving" and router["running"] == 0 and router["errors"] == 0
    assert router["streams"] == 0 and router["version"]
    for node_id, n in nodes.items():
        assert n["role"] == node_id.split("-")[0]
        assert n["state"] == "serving" and n["admin_state"] == "active"
        assert n["kv_blocks_total"] > 0 and n["kv_blocks_free"] > 0
        assert n["kv_blocks_used"] + n["kv_blocks_free"] == n["kv_blocks_total"]
        assert n["running"] == 0 and n["uptime_s"] > 0 and n["version"] and n["model"].endswith(MODEL_NAME)
    table = cli(cluster, "status")
    assert table.returncode == 0 and "decode-1" in table.stdout and "serving" in table.stdout

    listed = cli(cluster, "nodes", "--json")
    assert listed.returncode == 0, listed.stderr
    records = {n["node_id"]: n for n in json.loads(listed.stdout)["nodes"]}
    assert set(records) == set(everyone)
    assert records["decode-0"]["control_addr"].startswith("tcp://") and records["decode-0"]["kv_backends"]
    assert "prefill-0" in cli(cluster, "nodes").stdout


def test_unknown_node_is_a_clear_error(cluster):
    for command in ("cordon", "uncordon", "drain"):
        r = cli(cluster, command, "no-such-node")
        assert r.returncode != 0
        assert "unknown node 'no-such-node'" in r.stderr and "decode-0" in r.stderr
    assert status(cluster)["decode-0"]["admin_state"] == "active"


async def test_cordon_stops_new_traffic_and_uncordon_restores_it(cluster):
    d0, d1 = cluster.service("decode-0"), cluster.service("decode-1")
    async with Traffic(cluster) as load:
        await in_thread(wait_until, lambda: load.ok >= 4, 60, "the load to start")
        # Live numbers come from the Load reports: generated tokens/s, prefill tokens/s and KV transfer GB/s.
        await in_thread(wait_until, lambda: (lambda n: n["decode-1"]["tokens_per_s"] > 0
                                             and n["prefill-0"]["transfer_gbps"] > 0)(status(cluster)),
                        30, "live rates in status")
        await in_thread(wait_until, lambda: status(cluster)["prefill-0"]["prefill_tokens_per_s"] > 0, 30,
                        "prefill tokens/s in status")
        assert status(cluster)["decode-0"]["prefill_tokens_per_s"] is None   # a prefill-node figure
        r = await in_thread(cli, cluster, "cordon", "decode-0", "--reason", "test")
        assert r.returncode == 0, r.stderr
        # The node itself reports it, and its requests already admitted drain out.
        await in_thread(wait_until, lambda: status(cluster)["decode-0"]["state"] == "cordoned", 10, "cordoned state")
        def d0_idle() -> bool:
            m = scrape_metrics(d0.metrics_url)
            return m["pdcluster_node_running_requests"] == 0 and m["pdcluster_node_waiting_requests"] == 0

        await in_thread(wait_until, d0_idle, 30, "decode-0 to finish its admitted requests")
        base0, base1 = finished(scrape_metrics(d0.metrics_url)), finished(scrape_metrics(d1.metrics_url))
        await in_thread(wait_until, lambda: finished(scrape_metrics(d1.metrics_url)) >= base1 + 6, 60,
                        "decode-1 to keep serving")
        assert finished(scrape_metrics(d0.metrics_url)) == base0, "the cordoned node got new requests"
        assert status(cluster)["decode-0"]["admin_state"] == "cordoned"

        r = await in_thread(cli, cluster, "uncordon", "decode-0")
        assert r.returncode == 0, r.stderr
        await in_thread(wait_until, lambda: finished(scrape_metrics(d0.metrics_url)) >= base0 + 3, 60,
                        "decode-0 to get traffic again")
    assert load.failures == []
    assert status(cluster)["decode-0"]["state"] == "serving"


def test_health_exit_codes(cluster):
    ok = cli(cluster, "health", "--json")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert json.loads(ok.stdout)["healthy"] is True
    assert cli(cluster, "health").returncode == 0

    dead = cli(cluster, "health", "--json", etcd=f"127.0.0.1:{free_port()}")
    assert dead.returncode == 1
    assert "etcd unreachable" in json.loads(dead.stdout)["reasons"][0]

    empty = subprocess.run([PDCLUSTER, "health", "--etcd", cluster.etcd, "--cluster", "nobody-here"],
                           capture_output=True, text=True, timeout=60)
    assert empty.returncode == 1 and "no decode node registered" in empty.stdout

    # Every decode node cordoned: registered but no decode path left.
    try:
        for node in ("decode-0", "decode-1"):
            assert cli(cluster, "cordon", node).returncode == 0
        none_left = wait_until(lambda: (lambda r: r if r.returncode == 1 else None)(cli(cluster, "health", "--json")),
                               10, "health to fail")
        assert "no decode node is active" in json.loads(none_left.stdout)["reasons"][0]
    finally:
        for node in ("decode-0", "decode-1"):
            cli(cluster, "uncordon", node)
    wait_until(lambda: cli(cluster, "health").returncode == 0, 10, "health to recover")


async def test_drain_under_load_finishes_in_flight_requests_and_the_node_leaves(cluster):
    node = cluster.service("decode-1")
    async with Traffic(cluster, concurrency=4, max_tokens=24) as load:
        await in_thread(wait_until, lambda: scrape_metrics(node.metrics_url)["pdcluster_node_running_requests"] > 0,
                        60, "decode-1 to run requests")
        before = load.ok
        r = await in_thread(lambda: cli(cluster, "drain", "decode-1", "--timeout", "90", timeout=120))
        assert r.returncode == 0, r.stdout + r.stderr
        assert "drained" in r.stdout
        await in_thread(wait_until, lambda: load.ok >= before + 4, 60, "the load to continue on decode-0")
    assert load.failures == []
    assert node.proc.wait(30) == 0
    cluster.services.remove(node)
    nodes = status(cluster)
    assert "decode-1" not in nodes and "decode-0" in nodes
    # The drained node stays cordoned (a restarted instance must not take traffic before uncordon).
    from pdcluster.control.etcd_client import close_quietly, connect
    from pdcluster.control.queries import get_admin_state

    async def admin_state() -> str:
        client = await connect([cluster.etcd])
        try:
            return (await get_admin_state(client, CLUSTER, "decode-1")).state
        finally:
            await close_quietly(client)

    assert await admin_state() == "cordoned"
    r = cli(cluster, "uncordon", "decode-1")  # allowed while it is down: it has an admin record
    assert r.returncode == 0, r.stderr
    assert await admin_state() == "active"
    assert cli(cluster, "drain", "decode-1").returncode == 1  # no longer registered


def test_drain_timeout_exits_non_zero(cluster):
    """A drain that cannot finish in time: exit 1, node left marked draining (it finishes later)."""
    node = cluster.start_node("decode", "decode-slow")
    cluster.wait_ready(0, 0, timeout=60, nodes={"decode-slow"})
    node.proc.send_signal(19)  # SIGSTOP: it can neither drain nor refresh... until its lease expires
    try:
        r = cli(cluster, "drain", "decode-slow", "--timeout", "0.5")
        assert r.returncode == 1 and "still registered" in r.stderr
    finally:
        node.proc.kill()
        node.proc.wait(10)
        cluster.services.remove(node)
