"""Routers as cluster members, for real: `pdcluster router` processes (one, or `--workers 2` on one port) with
etcd, serving the official `openai` client from a fake decode node registered in etcd; their own records and
stats (`pdcluster status`), and `pdcluster drain ROUTER` (no new connections, open streams finish, exit 0)."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import threading

import httpx
import openai
import pytest
from router_fakes import FakeDecodeNode, make_tokenizer_dir, wait_until

from pdcluster.cli import admin
from pdcluster.control.etcd_client import close_quietly, connect
from pdcluster.control.records import node_key

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

TEXT = "The quick brown fox jumps over the lazy dog."


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tokenizer_dir(str(tmp_path_factory.mktemp("tiny")), max_position_embeddings=256)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _put(endpoint: str, key: str, value: str) -> None:
    client = await connect([endpoint])
    try:
        await client.put(key.encode(), value.encode())
    finally:
        await close_quietly(client)


class Routers:
    """`pdcluster router` (workers as given) in cluster `cluster`, with one fake decode node registered."""

    def __init__(self, etcd, cluster: str, model_dir: str, workers: int, delay: float = 0.01) -> None:
        from pdcluster.router.tokenizer import Tokenizer

        tok = Tokenizer(model_dir)
        self.script = tok.encode(TEXT, add_special_tokens=False) + [tok.eos_token_id]
        self.node = FakeDecodeNode(f"d-{cluster}", self.script, batch=True, delay=delay)
        asyncio.run(_put(etcd.endpoint, node_key(cluster, "decode", self.node.node_id), self.node.info.to_json()))
        self.etcd, self.cluster, self.port = etcd, cluster, _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pdcluster", "router", "--etcd", etcd.endpoint, "--cluster", cluster,
             "--model", model_dir, "--served-model-name", "tiny", "--port", str(self.port), "--workers", str(workers),
             "--node-id", f"r-{cluster}", "--lease-ttl", "3", "--stall-timeout", "5"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONUNBUFFERED="1"))
        self.output: list[bytes] = []
        threading.Thread(target=lambda: self.output.extend(self.proc.stdout), daemon=True).start()
        assert wait_until(self._ready, timeout=60), self.log()

    def _ready(self) -> bool:
        try:
            return httpx.get(self.url + "/health", timeout=1).json()["status"] == "ok"
        except (httpx.HTTPError, ValueError):
            return False

    def log(self) -> str:
        return b"".join(self.output).decode(errors="replace")[-4000:]

    def status(self) -> list[admin.NodeStatus]:
        return asyncio.run(admin.cluster_status([self.etcd.endpoint], self.cluster, load_wait=2.0))

    def routers(self) -> dict[str, admin.NodeStatus]:
        return {n.info.node_id: n for n in self.status() if n.info.role == "router"}

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.node.stop()


def _complete(url: str, max_tokens: int = 5) -> str:
    with openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=30) as client:
        return client.completions.create(model="tiny", prompt="Hello", max_tokens=max_tokens).choices[0].text


def test_workers_share_a_port_register_each_and_drain_one(etcd, cluster, model_dir) -> None:
    routers = Routers(etcd, cluster, model_dir, workers=2)
    try:
        ids = {f"r-{cluster}-w0", f"r-{cluster}-w1"}
        assert wait_until(lambda: set(routers.routers()) == ids, timeout=20), routers.log()
        status = routers.routers()
        assert all(s.state == "serving" and s.info.version and s.info.metrics_addr for s in status.values())
        # The official client, a new connection per request: the kernel spreads them over both workers.
        for _ in range(16):
            assert _complete(routers.url) == " The quick brown fox jumps"
        assert {g.router for g in routers.node.generates} == ids
        served = routers.routers()
        assert sum(s.load.errors for s in served.values()) == 0 and all(s.load.streams == 0 for s in served.values())
        # Draining one worker leaves the other serving on the same port.
        took = asyncio.run(admin.drain_node([etcd.endpoint], cluster, f"r-{cluster}-w0", timeout=20))
        assert took < 20 and set(routers.routers()) == {f"r-{cluster}-w1"}
        before = len(routers.node.generates)
        for _ in range(4):
            assert _complete(routers.url) == " The quick brown fox jumps"
        assert {g.router for g in routers.node.generates[before:]} == {f"r-{cluster}-w1"}
        assert routers.proc.poll() is None
        routers.proc.send_signal(signal.SIGTERM)
        assert routers.proc.wait(20) == 0, routers.log()
        assert wait_until(lambda: routers.routers() == {}, timeout=10)
    finally:
        routers.close()


def test_drain_lets_an_open_stream_finish_and_refuses_new_connections(etcd, cluster, model_dir) -> None:
    routers = Routers(etcd, cluster, model_dir, workers=1, delay=0.15)
    router_id = f"r-{cluster}"   # one worker: the router process itself, under its own id
    try:
        assert wait_until(lambda: router_id in routers.routers(), timeout=20), routers.log()
        chunks: list[str] = []
        first = threading.Event()

        def stream() -> None:
            with openai.OpenAI(base_url=routers.url + "/v1", api_key="x", max_retries=0, timeout=30) as client:
                for c in client.completions.create(model="tiny", prompt="Hello", max_tokens=40, stream=True):
                    chunks.append(c.choices[0].text)
                    first.set()

        reader = threading.Thread(target=stream)
        reader.start()
        assert first.wait(10)
        drained: list[float] = []
        drainer = threading.Thread(target=lambda: drained.append(asyncio.run(
            admin.drain_node([etcd.endpoint], cluster, router_id, timeout=30))))
        drainer.start()
        assert wait_until(lambda: getattr(routers.routers().get(router_id), "state", "") == "draining", timeout=5)
        with pytest.raises(httpx.ConnectError):   # the listener is closed: no new connections
            httpx.get(routers.url + "/health", timeout=2)
        reader.join(30)
        drainer.join(30)
        assert "".join(chunks) == " The quick brown fox jumps over the lazy dog."
        assert drained and routers.proc.wait(20) == 0, routers.log()
        assert routers.routers() == {}
    finally:
        routers.close()
