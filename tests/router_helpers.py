"""The router under test for end-to-end tests: a real uvicorn + FastAPI app in a server thread, the official openai
client and raw httpx, against fake decode nodes (router_fakes.py) that play SCRIPT_TEXT token by token."""

from __future__ import annotations

import uuid

import httpx
import openai
from router_fakes import FakeDecodeNode, ServerThread, wait_until

from pdcluster.router.app import create_app
from pdcluster.router.cluster import StaticNodeSource
from pdcluster.router.settings import RouterSettings
from pdcluster.router.tokenizer import Tokenizer

BODY_LIMIT = 1 << 16
QUEUE_TIMEOUT = 2.0   # a request for a model no decode node serves waits this long
SCRIPT_TEXT = "The quick brown fox jumps over the lazy dog."


class Env:
    def __init__(self, model_dir: str, **settings: object) -> None:
        self.tokenizer = Tokenizer(model_dir)
        self.script = self.tokenizer.encode(SCRIPT_TEXT, add_special_tokens=False) + [self.tokenizer.eos_token_id]
        self.source = StaticNodeSource()
        settings = RouterSettings(model=model_dir, served_model_name="tiny", routing_policy="least_loaded",
                                  stall_timeout=1.0, request_timeout=30.0, retry_after=2.0, max_retries=3,
                                  node_id="router-test", disagg_min_tokens=64, max_body_bytes=BODY_LIMIT,
                                  queue_timeout=QUEUE_TIMEOUT, **settings)  # type: ignore[arg-type]
        self.app = create_app(settings, self.source)
        self.server = ServerThread(self.app).start()
        self.http = httpx.Client(base_url=self.server.url, timeout=30)
        self.client = openai.OpenAI(base_url=self.server.url + "/v1", api_key="x", max_retries=0, timeout=30)
        self.nodes: list[FakeDecodeNode] = []

    def use_nodes(self, *modes: str, script: list[int] | None = None, **kwargs) -> list[FakeDecodeNode]:
        """Fresh fake decode nodes d0, d1, ... (ids sort in that order) as the only decode nodes."""
        tag = uuid.uuid4().hex[:6]
        nodes = [FakeDecodeNode(f"d{i}-{tag}", script or self.script, mode=mode, **kwargs)
                 for i, mode in enumerate(modes)]
        self.nodes += nodes
        self.source.set_nodes([n.info for n in nodes])
        ids = sorted(n.node_id for n in nodes)
        assert wait_until(lambda: self.http.get("/health").json()["decode_nodes"] == ids, timeout=5)
        return nodes

    def metric(self, name: str) -> float:
        total = 0.0
        for line in self.http.get("/metrics").text.splitlines():
            if line.startswith(name) and not line.startswith("#"):
                total += float(line.rsplit(" ", 1)[1])
        return total

    def close(self) -> None:
        for n in self.nodes:
            n.stop()
        self.http.close()
        self.server.stop()


def expected(env: Env, n: int) -> str:
    return env.tokenizer.decode([375] + env.script[:n])[len(env.tokenizer.decode([375])):]
