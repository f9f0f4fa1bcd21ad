"""The router end to end: real uvicorn + FastAPI app, the official openai client and raw httpx,
against fake decode nodes that are real zmq ROUTER sockets speaking pdcluster.control.protocol."""

from __future__ import annotations

import json
import re
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from router_fakes import make_tokenizer_dir, wait_until
from router_helpers import BODY_LIMIT, QUEUE_TIMEOUT, SCRIPT_TEXT, Env, expected

from pdcluster.cli.supervisor import LocalCluster
from pdcluster.control.records import NodeInfo
from pdcluster.router.app import create_app
from pdcluster.router.cluster import StaticNodeSource
from pdcluster.router.settings import RouterSettings

pytestmark = pytest.mark.slow  # real processes or sockets: each test takes most of a second

MAX_LEN = 256


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    e = Env(make_tokenizer_dir(str(tmp_path_factory.mktemp("tiny")), max_position_embeddings=MAX_LEN))
    yield e
    e.close()


@pytest.fixture(autouse=True)
def _stop_nodes(env):
    yield
    # Every path (finish, stop string, disconnect, failure) releases its request in the router.
    router = env.app.state.router
    assert wait_until(lambda: env.http.get("/health").json()["in_flight"] == 0, timeout=5)
    assert wait_until(lambda: not router.decode.queues, timeout=5)
    for n in env.nodes:
        n.stop()
    env.nodes.clear()
    env.source.set_nodes([])


def test_models_health_metrics(env: Env) -> None:
    env.use_nodes("ok")
    models = env.client.models.list()
    assert [m.id for m in models.data] == ["tiny"]
    health = env.http.get("/health").json()
    assert health["status"] == "ok" and len(health["decode_nodes"]) == 1
    assert "pdcluster_router_requests_total" in env.http.get("/metrics").text


def test_completion_non_streaming(env: Env) -> None:
    (node,) = env.use_nodes("ok")
    out = env.client.completions.create(model="tiny", prompt="Hello world", max_tokens=5, temperature=0)
    assert out.choices[0].text == " The quick brown fox jumps"
    assert out.choices[0].finish_reason == "length"
    prompt_ids = env.tokenizer.encode("Hello world")
    assert out.usage.prompt_tokens == len(prompt_ids)
    assert out.usage.completion_tokens == 5 and out.usage.total_tokens == len(prompt_ids) + 5
    (gen,) = node.generates
    assert gen.prompt_ids == prompt_ids and gen.router == "router-test" and gen.prefill_node is None
    assert gen.sampling["max_tokens"] == 5 and gen.sampling["temperature"] == 0.0 and gen.resume_ids == []


def test_completion_streaming_with_usage_and_eos(env: Env) -> None:
    env.use_nodes("ok", chunk=2)
    chunks = list(env.client.completions.create(model="tiny", prompt=[375, 356], max_tokens=50, stream=True,
                                                stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == " " + SCRIPT_TEXT
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["stop"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(env.script)
    assert chunks[-1].usage.prompt_tokens == 2
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_non_streaming_and_streaming(env: Env) -> None:
    (node,) = env.use_nodes("ok")
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "Hello"}]
    out = env.client.chat.completions.create(model="tiny", messages=messages, max_completion_tokens=4)
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == " The quick brown fox"
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 4
    assert node.generates[0].prompt_ids == env.tokenizer.apply_chat_template(messages)
    stream = env.client.chat.completions.create(model="tiny", messages=messages, max_tokens=3, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == " The quick brown"
    assert chunks[-1].choices[0].finish_reason == "length"
    assert node.generates[1].sampling["max_tokens"] == 3


def test_n_choices_fan_out_with_seeds(env: Env) -> None:
    node, other = env.use_nodes("ok", "ok")
    out = env.client.completions.create(model="tiny", prompt="Hello", max_tokens=3, n=2, seed=7)
    assert sorted(c.index for c in out.choices) == [0, 1]
    assert all(c.text == " The quick brown" for c in out.choices)
    seeds = sorted(g.sampling["seed"] for g in node.generates + other.generates)
    assert seeds == [7, 8] and all(g.sampling["n"] == 1 for g in node.generates + other.generates)
    assert out.usage.completion_tokens == 6


def test_completion_logprobs_format(env: Env) -> None:
    env.use_nodes("ok")
    out = env.client.completions.create(model="tiny", prompt="Hello", max_tokens=3, logprobs=2)
    lp = out.choices[0].logprobs
    ids = env.script[:3]
    assert lp.tokens == [env.tokenizer.token_text(i) for i in ids] == [" The", " quick", " brown"]
    assert lp.token_logprobs == [-0.25, -0.5, -0.75]
    assert lp.top_logprobs[0] == {env.tokenizer.token_text(ids[0]): -0.25,
                                  env.tokenizer.token_text(ids[0] + 1): -0.5}
    assert lp.text_offset == [0, 4, 10]


def test_chat_logprobs_format_streaming_and_not(env: Env) -> None:
    env.use_nodes("ok")
    msgs = [{"role": "user", "content": "hi"}]
    out = env.client.chat.completions.create(model="tiny", messages=msgs, max_tokens=2, logprobs=True,
                                             top_logprobs=3)
    content = out.choices[0].logprobs.content
    assert [c.token for c in content] == [" The", " quick"]
    assert content[0].logprob == -0.25 and content[0].bytes == list(b" The")
    assert len(content[0].top_logprobs) == 3 and content[0].top_logprobs[1].logprob == -0.5
    plain = env.client.chat.completions.create(model="tiny", messages=msgs, max_tokens=2)
    assert plain.choices[0].logprobs is None
    chunks = list(env.client.chat.completions.create(model="tiny", messages=msgs, max_tokens=2, logprobs=True,
                                                     stream=True))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [" The", " quick"] and all(e.top_logprobs == [] for e in streamed)


def test_stop_strings_split_across_tokens(env: Env) -> None:
    (node,) = env.use_nodes("ok", delay=0.02)
    # "brown f" spans the tokens "▁brown" and "▁fox": matched across messages and held back meanwhile
    out = env.client.completions.create(model="tiny", prompt="Hello", max_tokens=40, stop=["brown f", "zzz"])
    assert out.choices[0].text == " The quick " and out.choices[0].finish_reason == "stop"
    chunks = list(env.client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                                     max_tokens=40, stop="jumps", stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == " The quick brown fox "
    assert chunks[-1].choices[0].finish_reason == "stop"
    # the decode node was told to stop both requests early
    assert wait_until(lambda: {a.rid for a in node.aborts} == {g.rid for g in node.generates}, timeout=5)


def test_multibyte_utf8_streamed_one_byte_token_at_a_time(env: Env) -> None:
    text = "héllo 日本 🦊!"
    script = env.tokenizer.encode(text, add_special_tokens=False) + [env.tokenizer.eos_token_id]
    env.use_nodes("ok", script=script)
    chunks = list(env.client.completions.create(model="tiny", prompt="Hello", max_tokens=60, stream=True))
    pieces = [c.choices[0].text for c in chunks]
    assert "".join(pieces) == " " + text
    assert not any("\ufffd" in p for p in pieces)


BAD_REQUESTS = [
    ("/v1/completions", b"{not json", None),
    ("/v1/completions", {"prompt": "hi"}, "model"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi " * 300}, "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": MAX_LEN}, "max_tokens"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": "5"}, "max_tokens"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "n": 0}, "n"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "temperature": "hot"}, "temperature"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "temperature": -1}, "temperature"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "top_p": 0}, "top_p"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "logprobs": 50}, "logprobs"),
    ("/v1/completions", {"model": "tiny", "prompt": 123}, "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": [1, 99999]}, "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": []}, "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": ["a", "b"]}, "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "stop": 5}, "stop"),
    # limits: caps (router knobs), integers msgpack cannot carry, non-finite numbers
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "stop": ["x"] * 17}, "stop"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "stop": "x" * 257}, "stop"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "stop_token_ids": [5] * 65}, "stop_token_ids"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "stop_token_ids": [2 ** 64]}, "stop_token_ids"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "logit_bias": {"5": 101}}, "logit_bias"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "seed": 2 ** 64}, "seed"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "top_k": 10 ** 30}, "top_k"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 10 ** 30}, "max_tokens"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "temperature": 10 ** 400}, "temperature"),
    ("/v1/completions", {"model": "tiny", "prompt": [2 ** 70]}, "prompt"),
    ("/v1/completions", b'{"model": "tiny", "prompt": "hi", "top_p": NaN}', "top_p"),
    ("/v1/completions", b'{"model": "tiny", "prompt": "hi", "temperature": Infinity}', "temperature"),
    ("/v1/completions", [1, 2], None),
    ("/v1/chat/completions", {"model": "tiny", "messages": "hi"}, "messages"),
    ("/v1/chat/completions", {"model": "tiny", "messages": []}, "messages"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"content": "x"}]}, "messages.0.role"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                              "top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                              "max_completion_tokens": -3}, "max_tokens"),
]


@pytest.mark.parametrize("path,body,param", BAD_REQUESTS, ids=range(len(BAD_REQUESTS)))
def test_bad_input_gets_400_with_openai_error_body(env: Env, path: str, body, param) -> None:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = env.http.post(path, content=content, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["message"]
    if param is not None:
        assert error["param"] == param, error


def test_server_keeps_serving_after_bad_input_and_ignores_unknown_fields(env: Env) -> None:
    env.use_nodes("ok")
    for body in (b"\xff\xfe", b"{", b'{"model": "tiny", "prompt": {"a": 1}}'):
        assert env.http.post("/v1/completions", content=body).status_code == 400
    r = env.http.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2,
                                               "some_future_field": {"x": 1}, "best_of": 1})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == " The quick"
    assert env.http.get("/v1/nothing").json()["error"]["type"] == "not_found_error"


def test_reject_is_retried_on_another_node(env: Env) -> None:
    rejecting, ok = env.use_nodes("reject", "ok")
    for _ in range(4):
        out = env.client.completions.create(model="tiny", prompt="Hello", max_tokens=2)
        assert out.choices[0].text == " The quick"
    assert rejecting.generates, "the rejecting node was never tried"
    retried = {g.rid.rsplit(".", 1)[0] for g in rejecting.generates}
    assert retried <= {g.rid.rsplit(".", 1)[0] for g in ok.generates}
    assert env.metric("pdcluster_router_retries_total") >= len(rejecting.generates)


def test_all_nodes_rejecting_gives_429_with_retry_after(env: Env) -> None:
    env.use_nodes("reject", "reject")
    queued = env.metric("pdcluster_router_queued_total")
    r = env.http.post("/v1/completions", json={"model": "tiny", "prompt": "Hello", "max_tokens": 2})
    assert r.status_code == 429 and r.headers["retry-after"] == "2"
    assert r.json()["error"]["type"] == "rate_limit_error"
    r = env.http.post("/v1/completions", json={"model": "tiny", "prompt": "Hello", "max_tokens": 2,
                                               "stream": True})
    assert r.status_code == 429  # streaming too: the status is known before any byte is sent
    assert env.metric("pdcluster_router_queued_total") == queued   # nodes that are full: no waiting for one


def no_decode_node(env: Env) -> None:
    env.source.set_nodes([])
    assert wait_until(lambda: env.http.get("/health").status_code == 503, timeout=5)


def test_health_and_models_wait_for_a_decode_node(env: Env) -> None:
    """Until a decode node serves the model, /health is a 503 in the error shape with its fields beside the
    error and /v1/models lists nothing (a prefill node is not enough); both turn as a decode node registers."""
    no_decode_node(env)
    env.source.add(NodeInfo(node_id="p0", role="prefill", model="tiny"))
    assert wait_until(lambda: env.http.get("/health").json()["prefill_nodes"] == ["p0"], timeout=5)
    r = env.http.get("/health")
    body = r.json()
    assert r.status_code == 503 and r.headers["retry-after"] == "2"
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["type"] == "service_unavailable_error" and body["error"]["code"] == "no_decode_nodes"
    assert "'tiny'" in body["error"]["message"]
    assert (body["status"], body["router"], body["decode_nodes"], body["models"], body["in_flight"]) == (
        "no_decode_nodes", "router-test", [], {"tiny": []}, 0)
    assert env.client.models.list().data == []
    (node,) = env.use_nodes("ok")
    r = env.http.get("/health")
    assert r.status_code == 200 and "error" not in r.json() and r.json()["status"] == "ok"
    assert r.json()["models"] == {"tiny": [node.node_id]}
    assert [m.id for m in env.client.models.list().data] == ["tiny"]


def test_local_cluster_reads_the_503_health_and_waits_for_the_200(env: Env) -> None:
    no_decode_node(env)
    cluster = LocalCluster(port=env.server.port)
    assert cluster.health()["status"] == "no_decode_nodes" and cluster.health()["decode_nodes"] == []
    with pytest.raises(TimeoutError, match="no_decode_nodes"):
        cluster.wait_ready(0, 0, timeout=0.5, serving=True)
    assert cluster.wait_ready(0, 0, timeout=5)["status"] == "no_decode_nodes"   # counted, not serving
    (node,) = env.use_nodes("ok")
    assert cluster.wait_ready(0, 1, timeout=5, serving=True)["decode_nodes"] == [node.node_id]


def test_a_request_sent_before_any_decode_node_is_served_once_one_joins(env: Env) -> None:
    no_decode_node(env)
    queued = env.metric("pdcluster_router_queued_total")
    with ThreadPoolExecutor(2) as pool:
        whole = pool.submit(env.client.completions.create, model="tiny", prompt="Hello world", max_tokens=5)
        streamed = pool.submit(lambda: list(env.client.completions.create(model="tiny", prompt="Hello world",
                                                                          max_tokens=5, stream=True)))
        assert wait_until(lambda: env.metric("pdcluster_router_queued_total") == queued + 2, timeout=5)
        (node,) = env.use_nodes("ok")   # well within queue_timeout
        assert whole.result(10).choices[0].text == " The quick brown fox jumps"
        assert "".join(c.choices[0].text for c in streamed.result(10)) == " The quick brown fox jumps"
    assert len(node.generates) == 2


def test_no_decode_node_gives_503_with_retry_after_once_queue_timeout_passed(env: Env) -> None:
    no_decode_node(env)
    t0 = time.monotonic()
    r = env.http.post("/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "user", "content": "x"}]})
    assert QUEUE_TIMEOUT <= time.monotonic() - t0 < QUEUE_TIMEOUT + 2
    assert r.status_code == 503 and r.headers["retry-after"] == "2"
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert "no decode node available" in r.json()["error"]["message"]


def test_a_client_that_leaves_while_waiting_for_a_decode_node_is_dropped(env: Env) -> None:
    no_decode_node(env)
    gone = env.metric('pdcluster_router_requests_total{outcome="client_disconnected"}')
    t0 = time.monotonic()
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(env.server.url + "/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 2},
                   timeout=0.3)
    # Released at the disconnect, not when queue_timeout would have ended the wait.
    assert wait_until(lambda: env.http.get("/health").json()["in_flight"] == 0, timeout=QUEUE_TIMEOUT)
    assert time.monotonic() - t0 < QUEUE_TIMEOUT
    assert env.metric('pdcluster_router_requests_total{outcome="client_disconnected"}') == gone + 1
    (node,) = env.use_nodes("ok")
    time.sleep(0.5)
    assert not node.generates


def test_decode_node_dies_mid_stream_request_migrates(env: Env) -> None:
    dying, survivor = env.use_nodes("die", "ok", die_after=3)
    chunks = list(env.client.completions.create(model="tiny", prompt="Hello world", max_tokens=8, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == expected(env, 8)
    assert chunks[-1].choices[0].finish_reason == "length"
    assert dying.dead.is_set() and len(dying.generates) == 1
    (resumed,) = survivor.generates
    assert resumed.resume_ids == env.script[:3]
    assert resumed.prompt_ids == dying.generates[0].prompt_ids
    assert env.metric("pdcluster_router_migrations_total") >= 1


def test_node_leaving_the_view_mid_stream_migrates(env: Env) -> None:
    slow, other = env.use_nodes("ok", "ok", delay=0.3)
    with env.http.stream("POST", "/v1/completions", json={"model": "tiny", "prompt": "Hello", "max_tokens": 6,
                                                          "stream": True}) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        texts = []
        for line in lines:
            if line.startswith("data: {"):
                texts.append(json.loads(line[6:])["choices"][0]["text"])
                if len(texts) == 2:
                    env.source.remove(slow.node_id)  # e.g. its etcd lease expired
            if line == "data: [DONE]":
                break
    assert "".join(texts) == expected(env, 6)
    assert other.generates and other.generates[0].resume_ids == env.script[:len(other.generates[0].resume_ids)]
    assert len(other.generates[0].resume_ids) >= 2


def test_client_disconnect_sends_abort(env: Env) -> None:
    (node,) = env.use_nodes("ok", delay=0.05)
    with env.http.stream("POST", "/v1/completions", json={"model": "tiny", "prompt": "Hello", "max_tokens": 200,
                                                          "stream": True}) as r:
        got = 0
        for line in r.iter_lines():
            if line.startswith("data: {"):
                got += 1
                if got == 2:
                    break
    assert wait_until(lambda: [a.rid for a in node.aborts] == [g.rid for g in node.generates], timeout=5)
    assert env.metric('pdcluster_router_requests_total{outcome="client_disconnected"}') >= 1


def test_non_streaming_client_disconnect_sends_abort(env: Env) -> None:
    (node,) = env.use_nodes("ok", delay=0.3)  # 10 script tokens: ~3 s, far past the client's timeout
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(env.server.url + "/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 200},
                   timeout=0.5)
    assert wait_until(lambda: node.aborts and node.aborts[0].rid == node.generates[0].rid, timeout=5)


def test_long_prompts_go_through_a_prefill_node_short_ones_do_not(env: Env) -> None:
    (node,) = env.use_nodes("ok")
    env.source.add(NodeInfo(node_id="p0", role="prefill", model="tiny"))
    assert wait_until(lambda: env.http.get("/health").json()["prefill_nodes"] == ["p0"], timeout=5)
    env.client.completions.create(model="tiny", prompt="Hello", max_tokens=1)
    env.client.completions.create(model="tiny", prompt="Hello world " * 30, max_tokens=1)
    assert [g.prefill_node for g in node.generates] == [None, "p0"]


def test_api_key_and_router_config(env: Env) -> None:
    from fastapi.testclient import TestClient

    from pdcluster.router.settings import RouterConfig

    config = RouterConfig(model=env.tokenizer.path, api_key="sekret", served_model_name="tiny")
    settings = RouterSettings.from_config(config)
    assert settings.routing_policy == "prefix_aware" and settings.api_key == "sekret"
    with TestClient(create_app(settings, StaticNodeSource([NodeInfo(node_id="d0", role="decode", model="tiny")]))) \
            as client:
        r = client.get("/v1/models")
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert client.get("/v1/models", headers={"Authorization": "Bearer sekret"}).json()["data"][0]["id"] == "tiny"


def test_garbage_on_a_load_port_is_dropped_counted_and_the_router_keeps_serving(env: Env) -> None:
    import zmq

    (node,) = env.use_nodes("ok")
    pub = zmq.Context.instance().socket(zmq.PUB)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    bogus = NodeInfo(node_id=f"p-garbage-{uuid.uuid4().hex[:6]}", role="prefill",
                     control_addr="tcp://127.0.0.1:1", load_addr=f"tcp://127.0.0.1:{port}")
    env.source.set_nodes([node.info, bogus])
    try:
        def dropped() -> float:
            return env.metric('pdcluster_router_dropped_frames_total{socket="load"}')

        def flood() -> bool:   # PUB drops frames until the router's SUB has joined
            for frame in (b"\xc1", b"", b"\x81\xa1v\x01", b'\x82\xa1v\x01\xa1t\x91\x01'):
                pub.send(frame)
            return dropped() >= 4

        assert wait_until(flood, timeout=10)
        out = env.client.completions.create(model="tiny", prompt="Hello world", max_tokens=5, temperature=0)
        assert out.choices[0].text == " The quick brown fox jumps"
    finally:
        env.source.set_nodes([node.info])
        pub.close(linger=0)


def test_unknown_model_gets_404_model_not_found(env: Env) -> None:
    env.use_nodes("ok")
    with pytest.raises(openai.NotFoundError) as info:
        env.client.completions.create(model="nope", prompt="hi", max_tokens=2)
    assert info.value.body["code"] == "model_not_found" and info.value.body["param"] == "model"
    r = env.http.post("/v1/chat/completions", json={"model": "nope", "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def _raw_request(env: Env, head: str, chunks: list[bytes] = ()) -> tuple[str, dict]:
    """Send a request head (then chunks, stopping if the peer closed) on a raw socket: (status line, JSON body)."""
    import socket

    with socket.create_connection(("127.0.0.1", env.server.port), timeout=10) as sock:
        sock.sendall(head.encode())
        for chunk in chunks:
            try:
                sock.sendall(chunk)
            except OSError:
                break
        reply = b""
        while b"\r\n\r\n" not in reply:
            reply += sock.recv(65536)
        header, _, body = reply.partition(b"\r\n\r\n")
        length = int(re.search(rb"(?i)content-length: *(\d+)", header).group(1))
        while len(body) < length:
            body += sock.recv(65536)
    return header.decode().split("\r\n", 1)[0], json.loads(body)


def test_body_over_the_limit_gets_413_before_it_is_read(env: Env) -> None:
    env.use_nodes("ok")
    # Content-Length says 1 GB and no byte of it is sent: the answer cannot have waited for the body.
    status, body = _raw_request(env, "POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                                     "Content-Type: application/json\r\nContent-Length: 1000000000\r\n\r\n")
    assert status == "HTTP/1.1 413 Request Entity Too Large", status
    assert body["error"]["code"] == "request_too_large" and body["error"]["type"] == "invalid_request_error"
    # Chunked: more than the limit arrives, the last chunk never does; the count answers.
    piece = b"x" * 8192
    chunk = f"{len(piece):x}\r\n".encode() + piece + b"\r\n"
    status, body = _raw_request(env, "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked"
                                     "\r\nContent-Type: application/json\r\n\r\n",
                                [chunk] * (2 * BODY_LIMIT // len(piece)))
    assert status.startswith("HTTP/1.1 413") and body["error"]["code"] == "request_too_large"
    # Under the limit all is as usual.
    r = env.http.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2,
                                               "user": "u" * (BODY_LIMIT - 200)})
    assert r.status_code == 200, r.text


def test_tokenization_does_not_block_other_requests(env: Env, monkeypatch) -> None:
    """A prompt whose tokenization is stuck (a tokenizer patched to wait on an Event) holds only its own
    request: /health and a small completion are answered meanwhile, and the stuck one finishes after."""
    import threading

    env.use_nodes("ok")
    tokenizer = env.app.state.router.models["tiny"].tokenizer
    entered, release = threading.Event(), threading.Event()
    encode = tokenizer.encode

    def slow_encode(text: str, add_special_tokens: bool = True) -> list[int]:
        if text.startswith("BIG"):
            entered.set()
            release.wait(30)
        return encode(text, add_special_tokens)

    monkeypatch.setattr(tokenizer, "encode", slow_encode)
    result = {}

    def big() -> None:
        result["big"] = httpx.post(env.server.url + "/v1/completions", timeout=60,
                                   json={"model": "tiny", "prompt": "BIG hello", "max_tokens": 2})

    thread = threading.Thread(target=big)
    thread.start()
    try:
        assert entered.wait(10), "the big request never reached the tokenizer"
        assert env.http.get("/health").status_code == 200
        small = env.client.completions.create(model="tiny", prompt="Hello", max_tokens=2)
        assert small.choices[0].text == " The quick"
        assert thread.is_alive() and "big" not in result  # still tokenizing while the others were served
    finally:
        release.set()
        thread.join(30)
    assert result["big"].status_code == 200 and result["big"].json()["choices"][0]["text"] == " The quick"


def test_nodes_max_model_len_routes_and_refuses_with_400(env: Env) -> None:
    small, big = env.use_nodes("ok", "ok")
    small.max_model_len, big.max_model_len = 32, 128  # registered in NodeInfo.capacity
    env.source.set_nodes([small.info, big.info])
    assert wait_until(lambda: env.client.models.list().data[0].model_extra["max_model_len"] == 128, timeout=5)
    for _ in range(3):  # 20 + 40 tokens fit only the big node
        env.client.completions.create(model="tiny", prompt=[375] * 20, max_tokens=40)
    assert len(big.generates) == 3 and not small.generates
    with pytest.raises(openai.BadRequestError) as info:  # fits the router's limit (256), no node's
        env.client.completions.create(model="tiny", prompt=[375] * 100, max_tokens=40)
    assert info.value.body["code"] == "context_length_exceeded" and "128" in info.value.body["message"]
    with pytest.raises(openai.BadRequestError) as info:
        env.client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi " * 150}])
    assert info.value.body["code"] == "context_length_exceeded" and info.value.body["param"] == "messages"
    # chat without max_tokens: the rest of the largest node's context
    out = env.client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])
    assert out.choices[0].finish_reason == "stop"
    assert big.generates[-1].sampling["max_tokens"] == 128 - len(big.generates[-1].prompt_ids)


def test_stop_string_inside_a_multi_token_message_counts_as_token_by_token(env: Env) -> None:
    """A decode step that accepted speculative drafts sends several tokens in one message: the tokens after the
    one that completes a stop string are dropped (usage, logprobs), as if they had come one by one."""
    seen = {}
    for chunk in (1, 4):
        env.use_nodes("ok", delay=0.01, chunk=chunk)
        out = env.client.completions.create(model="tiny", prompt="Hello", max_tokens=40, stop=["brown f"],
                                            logprobs=1)
        choice = out.choices[0]
        seen[chunk] = (choice.text, choice.finish_reason, out.usage.completion_tokens, choice.logprobs.tokens)
    assert seen[4] == seen[1]
    assert seen[1][:2] == (" The quick ", "stop") and seen[1][2] == len(seen[1][3]) == 4
