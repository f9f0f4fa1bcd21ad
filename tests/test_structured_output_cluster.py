"""Structured output through a real 1P1D cluster on the default model (SmolLM2-135M-Instruct) with the official
`openai` client: every request's prompt runs on the prefill node, which samples the first token under the
grammar; the decode node rebuilds the matcher from it. `chat.completions.parse(response_format=<pydantic
model>)` must return a valid object for every one of 50 varied requests at temperature 0.8; regex and choice
outputs match; bad schemas / regexes are a 400 naming the field."""

from __future__ import annotations

import asyncio
import re

import pytest
from pydantic import BaseModel, Field

from pdcluster.engine.convert import convert_model, default_model_source

pytestmark = [pytest.mark.slow, pytest.mark.cluster, pytest.mark.timeout(900)]

TOPICS = ["a cat", "the moon", "a red car", "Paris", "a teacher", "an old tree", "the sea", "a robot", "coffee",
          "a mountain"]


class Thing(BaseModel):
    name: str = Field(max_length=24)
    kind: str = Field(max_length=16)
    legs: int = Field(ge=0, le=100)
    alive: bool


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> str:
    try:
        source = default_model_source()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    return convert_model(source, str(tmp_path_factory.mktemp("so") / "smollm2-fp32"), dtype="float32")


@pytest.fixture(scope="module")
def cluster(converted, tmp_path_factory):
    from pdcluster.cli.supervisor import LocalCluster

    c = LocalCluster(model=converted, work_dir=tmp_path_factory.mktemp("so-cluster"), num_prefill=1, num_decode=1,
                     port=0, threads_per_node=1,
                     node_config={"kv_cache_memory": "512MiB", "dtype": "float32", "device": "cpu",
                                  "served_model_name": "smollm2"},
                     router_config={"disagg_min_tokens": 0, "served_model_name": "smollm2"})
    with c:
        yield c


def _remote_prefills(cluster) -> float:
    from pdcluster.cli.smoke import scrape_metrics

    return sum(scrape_metrics(s.metrics_url).get('pdcluster_node_prefills_total{path="remote"}', 0.0)
               for s in cluster.services if s.kind == "decode")


async def test_parse_returns_a_valid_object_for_50_requests(cluster):
    import openai

    api = openai.AsyncOpenAI(base_url=cluster.url + "/v1", api_key="x", max_retries=0, timeout=600)
    before = _remote_prefills(cluster)

    async def ask(i: int):
        resp = await api.chat.completions.parse(
            model="smollm2", temperature=0.8, seed=i, max_tokens=120, response_format=Thing,
            messages=[{"role": "user", "content": f"Describe {TOPICS[i % len(TOPICS)]} as JSON (variant {i})."}])
        return resp.choices[0]

    choices = await asyncio.gather(*(ask(i) for i in range(50)))
    await api.close()
    for choice in choices:
        assert choice.finish_reason == "stop", choice.message.content
        assert isinstance(choice.message.parsed, Thing), choice.message.content
    assert len({c.message.content for c in choices}) > 10   # sampled, not one answer repeated
    assert _remote_prefills(cluster) - before == 50   # every first token came from the prefill node's grammar


async def test_regex_choice_and_guided_fields_match(cluster):
    import openai

    api = openai.AsyncOpenAI(base_url=cluster.url + "/v1", api_key="x", max_retries=0, timeout=300)
    chat = [{"role": "user", "content": "Pick a colour and a phone number."}]
    regex = r"(red|green|blue)-[0-9]{3}-[0-9]{4}"
    reqs = [api.chat.completions.create(model="smollm2", messages=chat, temperature=0.8, seed=i, max_tokens=40,
                                        extra_body={"structured_outputs": {"regex": regex}}) for i in range(6)]
    reqs += [api.completions.create(model="smollm2", prompt="My favourite animal is", temperature=0.8, seed=i,
                                    max_tokens=20, extra_body={"guided_choice": ["cat", "dog", "sea horse"]})
             for i in range(6)]
    out = await asyncio.gather(*reqs)
    await api.close()
    for r in out[:6]:
        assert re.fullmatch(regex, r.choices[0].message.content), r.choices[0].message.content
    for r in out[6:]:
        assert r.choices[0].text in ("cat", "dog", "sea horse")


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"guided_regex": "a+", "guided_choice": ["a"]}, "guided_choice"),
])
async def test_invalid_structured_output_is_a_400_naming_the_field(cluster, body, param):
    import httpx

    async with httpx.AsyncClient(timeout=60) as http:
        r = await http.post(cluster.url + "/v1/chat/completions",
                            json={"model": "smollm2", "messages": [{"role": "user", "content": "hi"}], **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


async def test_grammar_only_the_engine_refuses_is_a_400_and_not_retried(cluster):
    """An EBNF grammar that passes the router's cheap check (it has a rule) but not xgrammar's parser: the node's
    engine fails it, the decode node answers finish "invalid", and the client gets a 400 naming the field, whole
    or streamed, not a retry on another node ending in a 5xx."""
    import httpx

    body = {"model": "smollm2", "messages": [{"role": "user", "content": "hi"}], "guided_grammar": 'root ::= ("a"'}
    async with httpx.AsyncClient(timeout=120) as http:
        for stream in (False, True):   # a stream starts only with its first tokens: a plain 400 too
            r = await http.post(cluster.url + "/v1/chat/completions", json={**body, "stream": stream})
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert error["code"] == "invalid_request" and "structured_outputs.grammar" in error["message"]


def _prefills(cluster, path: str) -> float:
    from pdcluster.cli.smoke import scrape_metrics

    return sum(scrape_metrics(s.metrics_url).get(f'pdcluster_node_prefills_total{{path="{path}"}}', 0.0)
               for s in cluster.services if s.kind == "decode")


async def test_local_prefill_path_obeys_the_grammar(cluster):
    """Requests with prompt_logprobs are prefilled on the decode node itself: the whole output, its first token
    included, comes from the decode node's grammar."""
    import openai

    api = openai.AsyncOpenAI(base_url=cluster.url + "/v1", api_key="x", max_retries=0, timeout=300)
    before = _prefills(cluster, "local")
    schema = Thing.model_json_schema()
    out = await asyncio.gather(*(api.completions.create(
        model="smollm2", prompt=f"A JSON description of {TOPICS[i]}:", temperature=0.8, seed=i, max_tokens=120,
        extra_body={"guided_json": schema, "prompt_logprobs": 0}) for i in range(8)))
    await api.close()
    for r in out:
        assert r.choices[0].finish_reason == "stop", r.choices[0].text
        Thing.model_validate_json(r.choices[0].text)
    assert _prefills(cluster, "local") - before == 8
