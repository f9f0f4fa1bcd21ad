"""/metrics of every process kind and JSON request logs, on a live local cluster (real etcd,
1 router, 1 prefill, 1 decode node, `log_format: json`). Every request takes the disaggregated path,
so one load moves the router's latency histograms, the KV transfer counters on both node kinds and
the per-request log lines of all three services."""

from __future__ import annotations

import asyncio
import json
import urllib.request

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdcluster.cli.supervisor import LocalCluster

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(180)]

MODEL_NAME = "tiny-llama"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    from pdcluster.engine.testing import make_tiny_model

    model = make_tiny_model(str(tmp_path_factory.mktemp("metrics") / MODEL_NAME), "llama")
    c = LocalCluster(model=model, work_dir=tmp_path_factory.mktemp("cluster"), num_prefill=1, num_decode=1,
                     port=0, cluster="metrics", lease_ttl=2, threads_per_node=1,
                     node_config={"kv_cache_memory": "8MiB", "max_num_seqs": 16, "device": "cpu",
                                  "log_format": "json"},
                     router_config={"disagg_min_tokens": 0, "log_format": "json"})
    with c:
        yield c


def scrape(url: str) -> dict[str, dict]:
    """{family name: {"type": ..., "samples": {(sample name, sorted labels): value}}}, via the official parser."""
    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode()
    families = {}
    for family in text_string_to_metric_families(text):
        families[family.name] = {"type": family.type, "samples": {
            (s.name, tuple(sorted(s.labels.items()))): s.value for s in family.samples}}
    return families


def value(families: dict[str, dict], family: str, sample: str | None = None, **labels: str) -> float:
    """Sum of the samples `sample` (default: the family name) of `family` matching `labels`."""
    samples = families.get(family, {}).get("samples", {})
    want = sample or family
    return sum(v for (name, lbls), v in samples.items()
               if name == want and all(dict(lbls).get(k) == x for k, x in labels.items()))


def urls(cluster: LocalCluster) -> dict[str, str]:
    return {s.kind: s.metrics_url for s in cluster.services}


async def send_load(cluster: LocalCluster, n: int = 6, max_tokens: int = 8) -> list[str]:
    async with httpx.AsyncClient(base_url=cluster.url, timeout=60) as http:
        async def one(i: int) -> str:
            body = {"model": MODEL_NAME, "prompt": f"Metrics request number {i}: the quick brown fox",
                    "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": i % 2 == 0}
            r = await http.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            return r.text
        return await asyncio.gather(*(one(i) for i in range(n)))


async def test_every_process_exports_parseable_metrics_that_move_under_load(cluster):
    u = urls(cluster)
    before = {kind: scrape(url) for kind, url in u.items()}
    for kind, families in before.items():
        assert value(families, "pdcluster_etcd_connected") >= 1, f"{kind}: etcd not reported connected"
        assert families["pdcluster_etcd_connected"]["type"] == "gauge"
        assert not any(name.startswith("pdcluster_device_") for name in families), "device metrics on CPU"
    n = 6
    await send_load(cluster, n)
    after = {kind: scrape(url) for kind, url in u.items()}

    r0, r1 = before["router"], after["router"]
    for hist in ("pdcluster_router_ttft_seconds", "pdcluster_router_tpot_seconds", "pdcluster_router_itl_seconds",
                 "pdcluster_router_e2e_seconds", "pdcluster_router_backend_first_token_seconds"):
        assert r1[hist]["type"] == "histogram"
        assert value(r1, hist, hist + "_count") > value(r0, hist, hist + "_count"), hist
    assert value(r1, "pdcluster_router_requests", "pdcluster_router_requests_total", outcome="ok") \
        - value(r0, "pdcluster_router_requests", "pdcluster_router_requests_total", outcome="ok") == n
    assert value(r1, "pdcluster_router_backend_requests", "pdcluster_router_backend_requests_total",
                 node="decode-0", outcome="ok") >= n
    assert value(r1, "pdcluster_router_generation_tokens", "pdcluster_router_generation_tokens_total") \
        - value(r0, "pdcluster_router_generation_tokens", "pdcluster_router_generation_tokens_total") == n * 8

    d0, d1 = before["decode"], after["decode"]
    assert value(d1, "pdcluster_node_requests", "pdcluster_node_requests_total", outcome="length") \
        - value(d0, "pdcluster_node_requests", "pdcluster_node_requests_total", outcome="length") == n
    assert value(d1, "pdcluster_kv_received_bytes", "pdcluster_kv_received_bytes_total") \
        > value(d0, "pdcluster_kv_received_bytes", "pdcluster_kv_received_bytes_total")
    hist = "pdcluster_node_remote_prefill_seconds"
    assert value(d1, hist, hist + "_count") - value(d0, hist, hist + "_count") == n
    assert value(d1, "pdcluster_node_decode_tokens", "pdcluster_node_decode_tokens_total") \
        > value(d0, "pdcluster_node_decode_tokens", "pdcluster_node_decode_tokens_total")
    total = value(d1, "pdcluster_node_kv_blocks_total")
    assert total > 0 and value(d1, "pdcluster_node_kv_blocks_free") <= total
    assert value(d1, "pdcluster_node_kv_blocks_reserved") == 0   # every request done: no block waits for KV
    assert value(d1, "pdcluster_node_engine_steps", "pdcluster_node_engine_steps_total") \
        > value(d0, "pdcluster_node_engine_steps", "pdcluster_node_engine_steps_total")
    for gauge in ("pdcluster_node_running_requests", "pdcluster_node_waiting_requests",
                  "pdcluster_node_kv_blocks_used", "pdcluster_node_prefix_cache_hit_ratio"):
        assert d1[gauge]["type"] == "gauge", gauge
    assert "pdcluster_node_preemptions" in d1

    p0, p1 = before["prefill"], after["prefill"]

    def sent(f):
        return value(f, "pdcluster_kv_transfer_bytes", "pdcluster_kv_transfer_bytes_total", backend="shm")

    assert sent(p1) > sent(p0)
    # What the prefill node sent is what the decode node received.
    assert sent(p1) - sent(p0) == value(d1, "pdcluster_kv_received_bytes", "pdcluster_kv_received_bytes_total") \
        - value(d0, "pdcluster_kv_received_bytes", "pdcluster_kv_received_bytes_total")
    hist = "pdcluster_kv_transfer_seconds"
    assert value(p1, hist, hist + "_count") - value(p0, hist, hist + "_count") == n
    assert value(p1, "pdcluster_node_prefill_requests", "pdcluster_node_prefill_requests_total", outcome="ok") \
        - value(p0, "pdcluster_node_prefill_requests", "pdcluster_node_prefill_requests_total", outcome="ok") == n
    assert value(p1, "pdcluster_node_prefill_tokens", "pdcluster_node_prefill_tokens_total") \
        > value(p0, "pdcluster_node_prefill_tokens", "pdcluster_node_prefill_tokens_total")


def json_records(cluster: LocalCluster, node_id: str) -> list[dict]:
    records = []
    for line in cluster.service(node_id).log_path.read_text(errors="replace").splitlines():
        if line.startswith("{"):
            records.append(json.loads(line))
    return records


async def test_one_request_id_is_in_the_json_logs_of_router_decode_and_prefill(cluster):
    await send_load(cluster, n=1, max_tokens=4)
    await asyncio.sleep(0.5)  # let the log lines reach the files
    router = json_records(cluster, "router-0")
    assert router and all({"ts", "level", "logger", "msg", "node_id"} <= r.keys() for r in router)
    admitted = [r for r in router if "admitted" in r["msg"] and r.get("request_id")]
    assert admitted, "the router logged no admitted request"
    request_id = admitted[-1]["request_id"]
    rid = f"{request_id}.1"  # the router's first attempt: the rid of Generate and Prefill
    router_events = [r["msg"] for r in router if r.get("request_id") == rid]
    decode_events = [r["msg"] for r in json_records(cluster, "decode-0") if r.get("request_id") == rid]
    prefill_events = [r["msg"] for r in json_records(cluster, "prefill-0") if r.get("request_id") == rid]
    assert any("attempt 1" in m for m in router_events) and any("finished" in m for m in router_events)
    assert any("admitted" in m for m in decode_events)
    assert any("prefill sent" in m for m in decode_events) and any("prefill done" in m for m in decode_events)
    assert any("finished" in m for m in decode_events)
    assert any("queued" in m for m in prefill_events) and any("done" in m for m in prefill_events)
    assert {r["node_id"] for r in json_records(cluster, "decode-0") if r.get("request_id") == rid} == {"decode-0"}
