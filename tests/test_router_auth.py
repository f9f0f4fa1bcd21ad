"""The router's API keys: `api_key` plus a key file, compared in constant time against every key; what
/health and /metrics show with and without a key."""

from __future__ import annotations

import hmac

import pytest
from fastapi.testclient import TestClient
from router_fakes import make_tokenizer_dir

from pdcluster.cli.config import load_config
from pdcluster.router import auth
from pdcluster.router.app import create_app
from pdcluster.router.cluster import StaticNodeSource
from pdcluster.router.settings import RouterSettings

KEY_FILE = """\
# keys of the pdcluster router, one per line
team-a-0123456789

  team-b-abcdefghij   # not a comment: the whole stripped line is the key
# retired-key
"""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return make_tokenizer_dir(str(tmp_path_factory.mktemp("tiny")), max_position_embeddings=128)


@pytest.fixture
def key_file(tmp_path) -> str:
    path = tmp_path / "api_keys"
    path.write_text(KEY_FILE)
    path.chmod(0o600)
    return str(path)


def client_for(model_dir: str, **settings) -> TestClient:
    return TestClient(create_app(RouterSettings(model=model_dir, served_model_name="tiny", node_id="r-auth",
                                                **settings), StaticNodeSource()))


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_every_configured_key_is_accepted_and_others_get_401(model_dir, key_file):
    with client_for(model_dir, api_key="flag-key", api_key_file=key_file) as client:
        for key in ("flag-key", "team-a-0123456789", "team-b-abcdefghij   # not a comment: the whole stripped "
                    "line is the key"):
            r = client.get("/v1/models", headers=bearer(key))
            assert r.status_code == 200 and r.json() == {"object": "list", "data": []}, key   # no decode node
        for headers in ({}, bearer("retired-key"), bearer("team-a-012345678"), bearer("team-a-0123456789x"),
                        bearer(""), {"Authorization": "Basic team-a-0123456789"},
                        {"Authorization": "team-a-0123456789"}):
            r = client.get("/v1/models", headers=headers)
            assert r.status_code == 401, headers
            error = r.json()["error"]  # the OpenAI error shape
            assert error["type"] == "authentication_error" and error["code"] == "invalid_api_key"
            assert "API key" in error["message"]
        r = client.post("/v1/completions", json={"model": "tiny", "prompt": "hi"}, headers=bearer("nope"))
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        r = client.post("/v1/chat/completions", json={"model": "tiny", "messages": []}, headers=bearer("nope"))
        assert r.status_code == 401


def test_the_presented_key_is_compared_with_every_key(model_dir, key_file, monkeypatch):
    compared: list[bytes] = []
    real = hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        compared.append(b)
        return real(a, b)

    monkeypatch.setattr(auth.hmac, "compare_digest", spy)
    with client_for(model_dir, api_key="flag-key", api_key_file=key_file) as client:
        assert client.get("/v1/models", headers=bearer("flag-key")).status_code == 200  # the first key matches...
    assert len(compared) == 3 and compared[0] == b"flag-key"  # ...and the other two are compared all the same


def test_health_shows_only_the_status_without_a_key_and_metrics_need_one(model_dir, key_file):
    with client_for(model_dir, api_key_file=key_file) as client:
        probe = client.get("/health")   # 503 (no decode node yet): the status and the error, nothing more
        assert probe.status_code == 503 and set(probe.json()) == {"status", "error"}
        assert probe.json()["status"] == "no_decode_nodes" and "'tiny'" not in probe.json()["error"]["message"]
        detail = client.get("/health", headers=bearer("team-a-0123456789")).json()
        assert detail["router"] == "r-auth" and detail["decode_nodes"] == [] and detail["in_flight"] == 0
        assert detail["models"] == {"tiny": []} and "'tiny'" in detail["error"]["message"]
        assert client.get("/metrics").status_code == 401
        r = client.get("/metrics", headers=bearer("team-a-0123456789"))
        assert r.status_code == 200 and "pdcluster_router_requests_in_flight" in r.text
    with client_for(model_dir, api_key_file=key_file, metrics_require_key=False) as client:
        assert client.get("/metrics").status_code == 200  # for a scraper without credentials on a private network
        assert client.get("/v1/models").status_code == 401
    with client_for(model_dir) as client:  # no key configured: everything open, /health in full
        assert client.get("/metrics").status_code == 200
        assert client.get("/health").json()["router"] == "r-auth"
        assert client.get("/v1/models").status_code == 200


def test_key_file_is_checked_when_the_config_is_loaded(tmp_path, key_file):
    assert load_config("router", overrides={"api_key_file": key_file}, env={}).accepted_keys == (
        "team-a-0123456789", "team-b-abcdefghij   # not a comment: the whole stripped line is the key")
    empty = tmp_path / "empty"
    empty.write_text("# only a comment\n\n")
    with pytest.raises(ValueError, match="api_key_file: .* holds no key"):
        load_config("router", overrides={"api_key_file": str(empty)}, env={})
    with pytest.raises(ValueError, match="api_key_file: cannot read .*missing"):
        load_config("router", overrides={"api_key_file": str(tmp_path / "missing")}, env={})
