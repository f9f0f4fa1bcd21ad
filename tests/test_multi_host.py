"""Multi-host for real, on one machine: etcd, the router, a prefill and a decode node each on its own "host"
(tests/netns.py: network namespace, own address, own loopback, own /dev/shm). Root only; skipped otherwise."""

from __future__ import annotations

import asyncio
import sys
import time

import pytest
import yaml
from cluster_helpers import client, complete, wait_until_async
from netns import Host, free_subnet, hosts  # noqa: F401  (hosts: the fixture)

from pdcluster.cli.smoke import scrape_metrics
from pdcluster.control.etcd_server import etcd_binary, health_ok

MODEL_NAME = "tiny-llama"
PROMPTS = ["Hello world! How are you today?", "A paged KV cache stores keys and values in fixed-size blocks."]
FETCH = """
import sys, time, urllib.request
for _ in range(50):
    try:
        print(urllib.request.urlopen(sys.argv[1], timeout=2).status)
        break
    except OSError:
        time.sleep(0.1)
else:
    sys.exit(1)
"""
HOST_ID = "from pdcluster.kv_transfer.destination import host_id; print(host_id())"


def test_hosts_are_separate_and_tell_each_other_apart(hosts):  # noqa: F811
    a, b = hosts(2)
    b.popen([sys.executable, "-m", "http.server", "8123", "--bind", b.address], "http.log")
    fetch = a.run([sys.executable, "-c", FETCH, f"http://{b.address}:8123/"])
    assert fetch.returncode == 0 and fetch.stdout.strip() == "200", fetch.stdout + fetch.stderr
    here = a.run([sys.executable, "-c", FETCH, "http://127.0.0.1:8123/"])  # a's loopback is its own
    assert here.returncode != 0
    # each host has its own /dev/shm: a segment made on one is not there on the other
    assert a.run(["sh", "-c", "touch /dev/shm/pdcluster-probe && ls /dev/shm"]).stdout.split() == ["pdcluster-probe"]
    assert b.run(["ls", "/dev/shm"]).stdout.split() == []
    # so their host identities differ, and no sender between them picks shm (ShmChannel.auto_rank)
    ids = [h.run([sys.executable, "-c", HOST_ID]).stdout.strip() for h in (a, b, a)]
    assert ids[0] and ids[0] != ids[1], ids


async def test_a_bridge_left_by_a_killed_run_does_not_take_the_tests_packets(hosts):  # noqa: F811
    """A killed run leaves its bridge and namespaces behind, its route to its test range with them; new hosts
    take another range, so what the test itself sends to them still arrives (CI once failed every
    etcd-up wait this way)."""
    import subprocess
    import urllib.request
    import uuid

    def answers(url: str) -> bool:
        try:
            return urllib.request.urlopen(url, timeout=2).status == 200
        except OSError:
            return False

    stale, bridge = free_subnet(), f"pdst{uuid.uuid4().hex[:6]}"
    subprocess.run(["ip", "link", "add", bridge, "type", "bridge"], check=True)
    try:
        subprocess.run(["ip", "addr", "add", f"10.{stale}.0.254/16", "dev", bridge], check=True)
        subprocess.run(["ip", "link", "set", bridge, "up"], check=True)
        (host,) = hosts(1)
        assert not host.address.startswith(f"10.{stale}."), host.address
        host.popen([sys.executable, "-m", "http.server", "8123", "--bind", host.address], "http.log")
        await wait_until_async(lambda: answers(f"http://{host.address}:8123/"), 20, "the host's server, from here")
    finally:
        subprocess.run(["ip", "link", "del", bridge], check=False)


def _write_config(host: Host, name: str, config: dict) -> str:
    path = host.work_dir / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


@pytest.mark.cluster
@pytest.mark.timeout(300)
async def test_four_hosts_disaggregate_over_tcp_and_match_offline(hosts, tmp_path):  # noqa: F811
    from transformers import AutoTokenizer

    from pdcluster.engine import LLM, SamplingParams
    from pdcluster.engine.testing import make_tiny_model

    model = make_tiny_model(str(tmp_path / MODEL_NAME), "llama")
    etcd_host, router_host, prefill_host, decode_host = hosts(4)
    etcd = f"{etcd_host.address}:2379"
    etcd_host.popen([str(etcd_binary()), "--data-dir", str(etcd_host.work_dir / "data"),
                     "--listen-client-urls", f"http://{etcd}", "--advertise-client-urls", f"http://{etcd}",
                     "--listen-peer-urls", "http://127.0.0.1:2380", "--log-level", "warn"], "etcd.log")
    common = {"etcd": [etcd], "cluster": "mh", "model": model, "log_level": "INFO"}
    router = _write_config(router_host, "router", {**common, "host": router_host.address, "port": 8000,
                                                   "disagg_min_tokens": 0})
    node = {**common, "device": "cpu", "kv_cache_memory": "8MiB", "metrics_port": 9100, "lease_ttl": 2}
    prefill = _write_config(prefill_host, "prefill", {**node, "host": prefill_host.address, "node_id": "p0"})
    decode = _write_config(decode_host, "decode", {**node, "host": decode_host.address, "node_id": "d0"})
    env = {"OMP_NUM_THREADS": "1"}
    await wait_until_async(lambda: health_ok(f"http://{etcd}/health"), 30, "etcd up")
    router_host.popen([sys.executable, "-m", "pdcluster", "router", "--config", router], "router.log", env)
    prefill_host.popen([sys.executable, "-m", "pdcluster", "prefill", "--config", prefill], "prefill.log", env)
    decode_host.popen([sys.executable, "-m", "pdcluster", "decode", "--config", decode], "decode.log", env)
    url = f"http://{router_host.address}:8000"

    def ready() -> bool:
        try:
            import httpx

            health = httpx.get(url + "/health", timeout=2).json()
            return {"p0", "d0"} <= set(health.get("prefill_nodes", [])) | set(health.get("decode_nodes", []))
        except Exception:
            return False

    try:
        await wait_until_async(ready, 150, "router sees both nodes")
    except AssertionError:
        for h in (router_host, prefill_host, decode_host):
            for log in h.work_dir.glob("*.log"):
                print(log, log.read_text()[-3000:])
        raise

    tokenizer = AutoTokenizer.from_pretrained(model)
    llm = LLM(model=model, dtype="float32", device="cpu", num_gpu_blocks_override=256)
    api = client(type("C", (), {"url": url})())
    for text in PROMPTS:
        ids = tokenizer.encode(text)
        want = list(llm.generate([ids], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
                    .outputs[0].token_ids)
        got = await asyncio.wait_for(complete(api, MODEL_NAME, ids, max_tokens=8, stream=False), 60)
        assert got.text == tokenizer.decode(want, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    deadline = time.monotonic() + 10
    while True:
        metrics = scrape_metrics(f"http://{prefill_host.address}:9100/metrics")
        if metrics.get('pdcluster_kv_transfers_total{backend="tcp"}', 0) >= len(PROMPTS) or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.2)
    assert metrics.get('pdcluster_kv_transfers_total{backend="tcp"}', 0) == len(PROMPTS), metrics
    assert not any(k.startswith("pdcluster_kv_transfers_total") and "shm" in k and v for k, v in metrics.items())
