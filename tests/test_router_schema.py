"""Bad HTTP, generated: schemathesis draws requests from the router's own OpenAPI schema (the request
bodies are the pydantic models the endpoints parse), valid ones and invalid ones, and sends them to the
real app under uvicorn with a fake decode node answering. No response may be a 5xx."""

from __future__ import annotations

import uuid

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, given, settings
from router_fakes import FakeDecodeNode, ServerThread, make_tokenizer_dir, wait_until

from pdcluster.router.app import create_app
from pdcluster.router.cluster import StaticNodeSource
from pdcluster.router.settings import RouterSettings
from pdcluster.router.tokenizer import Tokenizer

pytestmark = pytest.mark.slow

# Examples per operation and generation mode.
EXAMPLES = {"POST": {"positive": 200, "negative": 100}, "GET": {"positive": 5}}  # no parameters: nothing to break
MIN_CASES = 500


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model_dir = make_tokenizer_dir(str(tmp_path_factory.mktemp("schema") / "tiny"), max_position_embeddings=256)
    tokenizer = Tokenizer(model_dir)
    script = tokenizer.encode("The quick brown fox", add_special_tokens=False) + [tokenizer.eos_token_id]
    node = FakeDecodeNode(f"d-{uuid.uuid4().hex[:6]}", script, delay=0.0, chunk=8)
    source = StaticNodeSource([node.info])
    app = create_app(RouterSettings(model=model_dir, served_model_name="tiny", node_id="router-schema",
                                    request_timeout=30.0, max_body_bytes=1 << 20), source)
    srv = ServerThread(app).start()
    assert wait_until(lambda: requests.get(srv.url + "/health", timeout=5).json()["decode_nodes"] == [node.node_id])
    yield srv, app
    srv.stop()
    node.stop()


def test_schema_describes_the_request_bodies(server) -> None:
    _, app = server
    schema = app.openapi()
    body = schema["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    chat = schema["components"]["schemas"][body["$ref"].rsplit("/", 1)[1]]
    assert {"model", "messages", "max_tokens", "stop", "seed"} <= set(chat["properties"])
    assert chat["properties"]["model"]["enum"] == ["tiny"] and set(chat["required"]) == {"model", "messages"}


def test_generated_requests_never_get_a_5xx(server) -> None:
    srv, app = server
    schema = schemathesis.openapi.from_dict(app.openapi())
    session = requests.Session()
    cases: list[int] = []
    for result in schema.get_all_operations():
        operation = result.ok()
        for mode, examples in EXAMPLES[operation.method.upper()].items():
            strategy = operation.as_strategy(generation_mode=schemathesis.GenerationMode(mode))

            @given(case=strategy)
            @settings(max_examples=examples, deadline=None, derandomize=True, database=None,
                      suppress_health_check=list(HealthCheck))
            def check(case) -> None:
                response = case.call(base_url=srv.url, session=session, timeout=30)
                cases.append(response.status_code)
                assert response.status_code < 500, (case.method, case.path, case.body, response.text[:500])

            check()
    assert len(cases) >= MIN_CASES
    assert any(code == 200 for code in cases) and any(400 <= code < 500 for code in cases)
