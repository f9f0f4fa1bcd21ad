"""End to end: real etcd, one router, 2 prefill + 2 decode node processes, the official openai client.

One cluster per module (each process imports torch: seconds). Every request goes through a prefill
node (router `disagg_min_tokens: 0`), which the nodes' /metrics prove; greedy output must equal the
offline engine's for the same prompt ids. Fault cases: a node joining, a node draining on SIGTERM,
a client disconnect, bad HTTP input (nodes that hang or are killed, etcd down: tests/test_fault_drills.py).
"""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest
from cluster_helpers import client, node_metrics, total, wait_idle

from pdcluster.cli.smoke import scrape_metrics
from pdcluster.cli.supervisor import LocalCluster

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(240)]

MODEL_NAME = "tiny-llama"
PROMPTS = [
    "Hello world! How are you today?",
    "The quick brown fox",
    "A paged KV cache stores keys and values in fixed-size blocks. Prefill is compute bound",
    "Once upon a time there was a cluster of machines",
    "0123456789 + - * / = ( )",
    "I am a tiny language model made of random numbers.",
    "decode is memory bound, so a disaggregated cluster runs them on different nodes.",
    "user assistant system",
]
CHATS = [
    [{"role": "user", "content": "Hello world! How are you?"}],
    [{"role": "system", "content": "You are a tiny model."}, {"role": "user", "content": "Tell me a story."}],
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    from pdcluster.engine.testing import make_tiny_model

    return make_tiny_model(str(tmp_path_factory.mktemp("e2e") / MODEL_NAME), "llama")


@pytest.fixture(scope="module")
def cluster(model_dir, tmp_path_factory):
    # work_dir under pytest's tmp: the nodes' logs survive a failure.
    c = LocalCluster(model=model_dir, work_dir=tmp_path_factory.mktemp("cluster"),
                     num_prefill=2, num_decode=2, port=0, cluster="e2e", lease_ttl=2,
                     threads_per_node=1,
                     node_config={"kv_cache_memory": "8MiB", "max_num_seqs": 32, "device": "cpu"},
                     router_config={"disagg_min_tokens": 0, "routing_policy": "least_loaded"})
    with c:
        yield c


@pytest.fixture(scope="module")
def offline(model_dir):
    """Greedy reference outputs from the offline engine, by prompt ids."""
    from pdcluster.engine import LLM, SamplingParams

    llm = LLM(model=model_dir, dtype="float32", device="cpu", num_gpu_blocks_override=512)
    cache: dict[tuple, list[int]] = {}

    def generate(prompt_ids: list[int], max_tokens: int) -> list[int]:
        key = (tuple(prompt_ids), max_tokens)
        if key not in cache:
            out = llm.generate([prompt_ids], SamplingParams(temperature=0, max_tokens=max_tokens))[0]
            cache[key] = list(out.outputs[0].token_ids)
        return cache[key]

    return generate


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def chat_ids(tokenizer, messages) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def expected_text(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


async def run_request(api: openai.AsyncOpenAI, kind: str, prompt, stream: bool,
                      max_tokens: int) -> tuple[str, str, int]:
    """(text, finish_reason, completion tokens) of one greedy request."""
    common = dict(model=MODEL_NAME, max_tokens=max_tokens, temperature=0)
    if kind == "chat":
        if stream:
            text, finish, usage = "", None, 0
            async for chunk in await api.chat.completions.create(
                    messages=prompt, stream=True, stream_options={"include_usage": True}, **common):
                if chunk.choices:
                    text += chunk.choices[0].delta.content or ""
                    finish = chunk.choices[0].finish_reason or finish
                if chunk.usage:
                    usage = chunk.usage.completion_tokens
            return text, finish, usage
        r = await api.chat.completions.create(messages=prompt, **common)
        return r.choices[0].message.content, r.choices[0].finish_reason, r.usage.completion_tokens
    if stream:
        text, finish, usage = "", None, 0
        async for chunk in await api.completions.create(prompt=prompt, stream=True,
                                                        stream_options={"include_usage": True}, **common):
            if chunk.choices:
                text += chunk.choices[0].text
                finish = chunk.choices[0].finish_reason or finish
            if chunk.usage:
                usage = chunk.usage.completion_tokens
        return text, finish, usage
    r = await api.completions.create(prompt=prompt, **common)
    return r.choices[0].text, r.choices[0].finish_reason, r.usage.completion_tokens


async def test_concurrent_requests_match_offline_and_go_through_prefill(cluster, offline, tokenizer):
    before = {**node_metrics(cluster, "prefill"), **node_metrics(cluster, "decode")}
    cases = []
    for i, text in enumerate(PROMPTS):
        ids = tokenizer.encode(text)
        cases.append(("completion", ids, ids, i % 2 == 0, 8 + i))  # token-id prompts: exact ids
        cases.append(("completion", text, ids, i % 2 == 1, 12))  # string prompts: tokenized by the router
    for i, messages in enumerate(CHATS):
        cases.append(("chat", messages, chat_ids(tokenizer, messages), i % 2 == 0, 10))
    # one token: the decode node streams the prefill node's first token as its KV lands, then only the finish
    ids = tokenizer.encode(PROMPTS[0])
    cases += [("completion", ids, ids, True, 1), ("completion", ids, ids, False, 1)]
    assert len(cases) >= 16
    api = client(cluster)
    results = await asyncio.gather(*(run_request(api, kind, prompt, stream, n)
                                     for kind, prompt, _, stream, n in cases))
    for (kind, prompt, ids, stream, n), (text, finish, usage) in zip(cases, results, strict=True):
        want = offline(ids, n)
        assert text == expected_text(tokenizer, want), (kind, prompt, stream)
        assert usage == len(want)
        assert finish == ("length" if len(want) == n else "stop")

    after = wait_idle(cluster)
    def delta(key: str, kind: str) -> float:
        return (total({k: v for k, v in after.items() if k.startswith(kind)}, key)
                - total({k: v for k, v in before.items() if k.startswith(kind)}, key))

    # Every request's KV was computed on a prefill node and moved by a KV transfer.
    assert delta('pdcluster_node_prefills_total{path="remote"}', "decode") == len(cases)
    assert delta('pdcluster_node_prefills_total{path="local"}', "decode") == 0
    assert delta('pdcluster_node_prefill_requests_total{outcome="ok"}', "prefill") == len(cases)
    def transfers(metrics: dict) -> float:
        return sum(v for m in metrics.values() for k, v in m.items() if k.startswith("pdcluster_kv_transfers_total{"))

    assert transfers(after) - transfers(before) == len(cases)
    assert any(m.get('pdcluster_kv_transfer_bytes_total{backend="shm"}', 0) > 0 for m in after.values())
    assert total(after, "pdcluster_kv_transfer_failures_total") == 0
    # Both prefill nodes and both decode nodes did some of the work.
    for name, m in after.items():
        kind = "prefill" if name.startswith("prefill") else "decode"
        key = f"pdcluster_node_{kind}_tokens_total"
        assert m[key] > before[name].get(key, 0), f"{name} got no work"


async def test_bad_http_input_is_4xx_with_openai_error_body(cluster):
    async with httpx.AsyncClient(base_url=cluster.url, timeout=10) as http:
        r = await http.post("/v1/completions", content=b"{not json", headers={"Content-Type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
        r = await http.post("/v1/completions", json={"model": "nope", "prompt": "hi"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        r = await http.post("/v1/chat/completions", json={"model": MODEL_NAME, "messages": [], "max_tokens": 0})
        assert r.status_code == 400 and "message" in r.json()["error"]
        r = await http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200  # still serving


async def test_client_disconnect_aborts_and_frees_blocks(cluster):
    before = node_metrics(cluster, "decode")
    async with httpx.AsyncClient(base_url=cluster.url, timeout=30) as http:
        body = {"model": MODEL_NAME, "prompt": "Once upon a time", "max_tokens": 400, "temperature": 0,
                "ignore_eos": True, "stream": True}
        async with http.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            chunks = 0
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    chunks += 1
                if chunks >= 3:
                    break  # leaving the block closes the connection mid-stream
    after = wait_idle(cluster)
    aborted = total(after, 'pdcluster_node_requests_total{outcome="abort"}') - total(
        before, 'pdcluster_node_requests_total{outcome="abort"}')
    assert aborted == 1
    decoded = total(after, "pdcluster_node_decode_tokens_total") - total(before, "pdcluster_node_decode_tokens_total")
    assert decoded < 400


async def test_new_node_gets_traffic_then_drains_on_sigterm_without_failures(cluster, offline, tokenizer):
    node = cluster.start_node("decode", "decode-late")
    cluster.wait_ready(0, 0, timeout=60, nodes={"decode-late"})
    api = client(cluster)
    ids = tokenizer.encode(PROMPTS[0])
    want = expected_text(tokenizer, offline(ids, 8))
    # The router sees the new node as soon as etcd does; least-loaded routing sends it work at once.
    deadline = time.monotonic() + 5
    while scrape_metrics(node.metrics_url).get('pdcluster_node_requests_total{outcome="length"}', 0) == 0:
        assert time.monotonic() < deadline, "the new decode node got no traffic"
        texts = await asyncio.gather(*(run_request(api, "completion", ids, False, 8) for _ in range(4)))
        assert all(t == want for t, _, _ in texts)

    # SIGTERM while requests stream: they finish, new ones go elsewhere, none fails.
    long_ids = tokenizer.encode(PROMPTS[2])
    long_want = expected_text(tokenizer, offline(long_ids, 48))
    inflight = [asyncio.create_task(run_request(api, "completion", long_ids, True, 48)) for _ in range(6)]
    await asyncio.sleep(0.3)
    node.proc.send_signal(15)
    later = []
    for _ in range(10):
        later.append(asyncio.create_task(run_request(api, "completion", ids, False, 8)))
        await asyncio.sleep(0.1)
    for text, _finish, _ in await asyncio.gather(*inflight):
        assert text == long_want
    for text, _, _ in await asyncio.gather(*later):
        assert text == want
    assert node.proc.wait(30) == 0
    cluster.services.remove(node)
    health = cluster.wait_ready(2, 2, timeout=10)
    assert "decode-late" not in health["decode_nodes"]
    wait_idle(cluster)
