"""The router's membership without etcd: it owns the drain state (the API answers 503 while it drains, open
streams finish, then it exits), its Load report counts generated tokens as they arrive, and request deadlines
do not move with the wall clock."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from router_fakes import FakeDecodeNode, ServerThread, make_tokenizer_dir, wait_until

from pdcluster.router.app import RouterAPI
from pdcluster.router.cluster import RouterCluster, StaticNodeSource
from pdcluster.router.decode_client import DecodeClient, StreamFailed
from pdcluster.router.membership import RouterMembership
from pdcluster.router.metrics import RouterMetrics
from pdcluster.router.policies import make_policy
from pdcluster.router.router import build_router
from pdcluster.router.settings import RouterSettings

pytestmark = pytest.mark.slow  # real sockets and a uvicorn thread

SCRIPT = list(range(300, 340))
ROUTER_ID = "r-drain"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return make_tokenizer_dir(str(tmp_path_factory.mktemp("tiny")), max_position_embeddings=256)


def completion(max_tokens: int, stream: bool) -> dict:
    return {"model": "tiny", "prompt": [375], "max_tokens": max_tokens, "stream": stream}


def test_membership_drains_the_router_and_reports_tokens_as_they_arrive(model_dir) -> None:
    node = FakeDecodeNode("d0", SCRIPT, delay=0.05)
    source = StaticNodeSource([node.info])
    router = build_router(RouterSettings(model=model_dir, served_model_name="tiny", node_id=ROUTER_ID,
                                         retry_after=2.0), source)
    events: list[str] = []
    membership = RouterMembership(router, port=0, stop_listening=lambda: events.append("stop_listening"),
                                  exit_server=lambda: events.append("exit"))
    server = ServerThread(RouterAPI(router, membership).app).start()
    streaming, other = httpx.Client(base_url=server.url, timeout=30), httpx.Client(base_url=server.url, timeout=30)
    try:
        assert wait_until(lambda: other.get("/health").json()["decode_nodes"] == ["d0"])
        assert other.post("/v1/completions", json=completion(5, stream=False)).status_code == 200
        assert router.tokens_received == 5
        t0 = time.monotonic()
        membership.load()   # starts the window of the next report
        with streaming.stream("POST", "/v1/completions", json=completion(20, stream=True)) as r:
            lines = (line for line in r.iter_lines() if line.startswith("data: "))
            read = [next(lines) for _ in range(4)]   # 4 tokens in: the request is in flight, far from done
            load = membership.load()
            # Counted as they arrive (not when the request ends), over the window since the previous report.
            assert load.tokens_per_s >= len(read) / (time.monotonic() - t0) > 0
            assert load.state == "serving" and load.running == 1 and load.streams == 1

            source.set_admin_state(ROUTER_ID, "draining")
            assert wait_until(lambda: membership.draining)
            assert events == ["stop_listening"]
            health = other.get("/health")   # 503, its topology beside the error
            assert health.status_code == 503 and health.json()["status"] == "draining"
            assert health.json()["error"]["code"] == "draining" and health.json()["decode_nodes"] == ["d0"]
            refused = other.post("/v1/completions", json=completion(5, stream=False))
            assert refused.status_code == 503 and refused.headers["retry-after"] == "2"
            assert "is draining" in refused.json()["error"]["message"]
            assert membership.load().state == "draining"
            assert "exit" not in events   # the open stream goes on
            rest = list(lines)
        assert rest[-1] == "data: [DONE]" and not any('"error"' in line for line in rest)
        assert wait_until(lambda: events == ["stop_listening", "exit"])
        assert router.tokens_received == 25
        assert router.metrics.registry.get_sample_value("pdcluster_router_requests_total",
                                                        {"outcome": "unavailable"}) == 1
    finally:
        streaming.close()
        other.close()
        server.stop()
        node.stop()


async def test_a_wall_clock_step_moves_no_deadline(monkeypatch) -> None:
    """Deadlines are on time.monotonic(): the wall clock jumping a day ahead mid-request fails nothing, and the
    node is given the time that is really left."""
    node = FakeDecodeNode("d0", SCRIPT, delay=0.05)
    settings = RouterSettings(node_id="router-clock", request_timeout=60.0, stall_timeout=5.0)
    cluster = RouterCluster(StaticNodeSource([node.info]))
    await cluster.start()
    client = DecodeClient(cluster, make_policy(settings.routing_policy), settings, RouterMetrics())
    try:
        stream = client.stream([1, 2, 3], {"max_tokens": 10}, deadline=time.monotonic() + 30)
        await asyncio.wait_for(stream.start(), 10)
        real_time = time.time
        monkeypatch.setattr(time, "time", lambda: real_time() + 86400)
        while not stream.finished:
            await asyncio.wait_for(stream.next(), 10)
        assert stream.output_ids == SCRIPT[:10]
        (gen,) = node.generates
        assert 25 < gen.timeout_s <= 30

        late = client.stream([1, 2, 3], {"max_tokens": 10}, deadline=time.monotonic() - 1)
        with pytest.raises(StreamFailed, match="deadline"):
            await late.start()
    finally:
        client.close()
        await cluster.stop()
        node.stop()
