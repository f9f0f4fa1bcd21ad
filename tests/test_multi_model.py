"""One router, several models: requests go only to nodes of the `model` they name, `/v1/models` lists
every served model, an unknown one is a 404 `model_not_found`. First against fake decode nodes (real
zmq sockets), then against real node processes of two different tiny models, with real etcd."""

from __future__ import annotations

import uuid

import httpx
import openai
import pytest
from router_fakes import FakeDecodeNode, ServerThread, make_tokenizer_dir, wait_until

from pdcluster.control.records import NodeInfo
from pdcluster.router.app import create_app
from pdcluster.router.cluster import StaticNodeSource
from pdcluster.router.settings import RouterSettings
from pdcluster.router.tokenizer import Tokenizer


@pytest.mark.slow
def test_fake_nodes_of_two_models(tmp_path) -> None:
    alpha_dir = make_tokenizer_dir(str(tmp_path / "alpha-dir"), max_position_embeddings=256)
    beta_dir = make_tokenizer_dir(str(tmp_path / "beta"), max_position_embeddings=128)
    tokenizer = Tokenizer(alpha_dir)
    script = tokenizer.encode("The quick brown fox", add_special_tokens=False) + [tokenizer.eos_token_id]
    settings = RouterSettings(model=alpha_dir, served_model_name="alpha", models=[beta_dir],
                              routing_policy="round_robin", node_id="router-mm", disagg_min_tokens=0,
                              queue_timeout=0.5)
    assert [name for name, _ in settings.served_models()] == ["alpha", "beta"]
    source = StaticNodeSource()
    tag = uuid.uuid4().hex[:6]
    a = FakeDecodeNode(f"a-{tag}", script, model="alpha")
    b = FakeDecodeNode(f"b-{tag}", script, model="beta")
    server = ServerThread(create_app(settings, source)).start()
    http = httpx.Client(base_url=server.url, timeout=30)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=30)
    try:
        # A prefill node of the other model is never chosen, whatever the prompt.
        source.set_nodes([a.info, b.info, NodeInfo(node_id=f"p-{tag}", role="prefill", model="beta")])
        assert wait_until(lambda: http.get("/health").json()["models"] == {"alpha": [a.node_id],
                                                                            "beta": [b.node_id]})
        models = {m.id: m.model_extra["max_model_len"] for m in client.models.list().data}
        assert models == {"alpha": 256, "beta": 128}
        for _ in range(3):
            out = client.completions.create(model="alpha", prompt="Hello world", max_tokens=3)
            assert out.model == "alpha" and out.choices[0].text == " The quick brown"
        assert len(a.generates) == 3 and not b.generates
        assert all(g.prefill_node is None for g in a.generates)
        chat = client.chat.completions.create(model="beta", messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=2)
        assert chat.model == "beta" and chat.choices[0].message.content == " The quick"
        assert len(b.generates) == 1 and len(a.generates) == 3
        with pytest.raises(openai.NotFoundError) as info:
            client.completions.create(model="gamma", prompt="Hello", max_tokens=2)
        assert info.value.body["code"] == "model_not_found" and info.value.body["param"] == "model"
        # No node of a served model: /health 503 and the model unlisted; a request for it waits queue_timeout
        # for one, then 503, never sent to the other model's node.
        source.set_nodes([a.info])
        assert wait_until(lambda: http.get("/health").json()["models"]["beta"] == [])
        health = http.get("/health")
        assert health.status_code == 503 and "'beta'" in health.json()["error"]["message"]
        assert [m.id for m in client.models.list().data] == ["alpha"]
        r = http.post("/v1/completions", json={"model": "beta", "prompt": "Hello", "max_tokens": 2})
        assert r.status_code == 503 and len(a.generates) == 3
    finally:
        http.close()
        server.stop()
        a.stop()
        b.stop()


@pytest.mark.cluster
@pytest.mark.timeout(240)
def test_real_nodes_of_two_models_behind_one_router(tmp_path) -> None:
    from pdcluster.cli.supervisor import LocalCluster
    from pdcluster.engine.testing import make_tiny_model

    alpha = make_tiny_model(str(tmp_path / "alpha"), "llama")
    beta = make_tiny_model(str(tmp_path / "beta"), "qwen2")
    (tmp_path / "cluster").mkdir()  # the nodes' logs and configs
    node = {"kv_cache_memory": "8MiB", "max_num_seqs": 8, "device": "cpu"}
    with LocalCluster(model=alpha, work_dir=tmp_path / "cluster", num_prefill=0, num_decode=1, port=0,
                      cluster=f"mm-{uuid.uuid4().hex[:6]}", lease_ttl=2, threads_per_node=1, node_config=node,
                      router_config={"models": [beta]}) as cluster:
        cluster.start_node("decode", "decode-beta", model=beta)
        health = cluster.wait_ready(0, 2, timeout=120)
        assert wait_until(lambda: cluster.health()["models"] == {"alpha": ["decode-0"], "beta": ["decode-beta"]},
                          timeout=30), health
        client = openai.OpenAI(base_url=cluster.url + "/v1", api_key="x", max_retries=0, timeout=60)
        assert sorted(m.id for m in client.models.list().data) == ["alpha", "beta"]
        for name in ("alpha", "beta"):
            out = client.completions.create(model=name, prompt="Hello world", max_tokens=4, temperature=0)
            assert out.model == name and out.usage.completion_tokens == 4
            chat = client.chat.completions.create(model=name, messages=[{"role": "user", "content": "Hi"}],
                                                  max_tokens=3, temperature=0)
            assert chat.model == name and chat.choices[0].finish_reason in ("length", "stop")
        with pytest.raises(openai.NotFoundError) as info:
            client.completions.create(model="gamma", prompt="Hello", max_tokens=2)
        assert info.value.body["code"] == "model_not_found"
        # Each model's requests ran on its own node (the node logs name the requests they admitted).
        logs = {s.node_id: s.log_path.read_text() for s in cluster.services if s.kind == "decode"}
        assert logs["decode-0"].count(" admitted from router ") == 2
        assert logs["decode-beta"].count(" admitted from router ") == 2
