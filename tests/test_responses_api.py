"""OpenAI's Responses API (`/v1/responses`, router/responses_api.py) through the real router app and the
official openai client (`client.responses.create`, `client.responses.stream`), against fake decode nodes that
play a scripted output: text whole and streamed, instructions and message lists, max_output_tokens, function
tools (calls out, function_call_output back in), reasoning items, and bad input refused with 400; and on a
real 1P1D cluster (etcd, router, prefill and decode processes, a tiny random checkpoint) a greedy response
equals the chat completion of the same messages, whole and streamed."""

from __future__ import annotations

import asyncio
import json
import os

import pytest
from cluster_helpers import client, wait_idle
from router_fakes import HERMES, TEMPLATE, make_tokenizer_dir
from router_helpers import Env

WEATHER = {"type": "function", "name": "get_weather", "description": "Weather of a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
CLOCK = {"type": "function", "name": "get_time"}


pytestmark = pytest.mark.slow   # real sockets and server threads


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    path = make_tokenizer_dir(str(tmp_path_factory.mktemp("responses")), max_position_embeddings=4096)
    with open(os.path.join(path, "chat_template.jinja"), "w") as f:
        f.write(TEMPLATE)
    e = Env(path, tool_call_parser=["hermes"], reasoning_parser=["qwen3"])
    yield e
    e.close()


def play(env: Env, text: str) -> list:
    tok = env.tokenizer
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    return env.use_nodes("ok", script=ids + [tok.eos_token_id], chunk=2)


def test_text_response_whole_and_streamed(env) -> None:
    play(env, "It is warm.</think>Sunny, 25 degrees.")
    resp = env.client.responses.create(model="tiny", input="weather?", instructions="Be brief.")
    assert resp.object == "response" and resp.status == "completed" and resp.id.startswith("resp_")
    assert resp.output_text == "Sunny, 25 degrees."
    kinds = [item.type for item in resp.output]
    assert kinds == ["reasoning", "message"]
    assert resp.output[0].content[0].text.lstrip() == "It is warm."
    assert resp.usage.output_tokens > 0 and resp.usage.input_tokens > 0
    assert resp.usage.total_tokens == resp.usage.input_tokens + resp.usage.output_tokens
    assert resp.instructions == "Be brief."

    events = list(env.client.responses.create(model="tiny", input="weather?", instructions="Be brief.", stream=True))
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"] and types[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == resp.output_text
    assert [e.text for e in events if e.type == "response.output_text.done"] == [resp.output_text]
    done = events[-1].response
    assert done.output_text == resp.output_text and done.usage.output_tokens == resp.usage.output_tokens
    # the reasoning item, then the message item: each added, its part added, its deltas, done
    added = [i for i, e in enumerate(events) if e.type == "response.output_item.added"]
    finished = [i for i, e in enumerate(events) if e.type == "response.output_item.done"]
    assert [events[i].item.type for i in added] == ["reasoning", "message"] and added[1] > finished[0]
    assert added[1] < types.index("response.output_text.delta") < finished[1]
    assert events[finished[1]].item.content[0].text == resp.output_text

    with env.client.responses.stream(model="tiny", input=[{"role": "user", "content": [
            {"type": "input_text", "text": "weather?"}]}]) as stream:
        text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert text == final.output_text == resp.output_text


def test_max_output_tokens_makes_an_incomplete_response(env) -> None:
    [node] = play(env, "one two three four five six seven eight nine ten")
    resp = env.client.responses.create(model="tiny", input="count", max_output_tokens=3, temperature=0.5, top_p=0.9)
    assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
    assert resp.usage.output_tokens == 3
    sampling = node.generates[-1].sampling   # what the decode node was asked for
    assert (sampling["max_tokens"], sampling["temperature"], sampling["top_p"]) == (3, 0.5, 0.9)
    events = list(env.client.responses.create(model="tiny", input="count", max_output_tokens=3, stream=True))
    assert events[-1].type == "response.incomplete" and events[-1].response.status == "incomplete"


def test_function_tools_whole_streamed_and_back(env) -> None:
    play(env, "<think>weather?</think>" + HERMES)
    resp = env.client.responses.create(model="tiny", input="weather in Paris?", tools=[WEATHER, CLOCK])
    calls = [item for item in resp.output if item.type == "function_call"]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"}),
                                                                 ("get_time", {})]
    assert all(c.call_id.startswith("call_") and c.status == "completed" for c in calls)
    assert resp.output_text == "Let me check."

    with env.client.responses.stream(model="tiny", input="weather in Paris?", tools=[WEATHER, CLOCK]) as stream:
        events = list(stream)
        final = stream.get_final_response()
    streamed = [item for item in final.output if item.type == "function_call"]
    assert [(c.name, json.loads(c.arguments)) for c in streamed] == [(c.name, json.loads(c.arguments)) for c in calls]
    done_args = [e.arguments for e in events if e.type == "response.function_call_arguments.done"]
    assert [json.loads(a) for a in done_args] == [{"city": "Paris"}, {}]

    # the calls and their outputs go back as input items, rendered by the chat template
    history = [{"role": "user", "content": "weather in Paris?"},
               {"type": "function_call", "call_id": calls[0].call_id, "name": calls[0].name,
                "arguments": calls[0].arguments},
               {"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny"}]
    play(env, "</think>It is sunny.")   # (the template opens <think>: qwen3's reasoning parser)
    again = env.client.responses.create(model="tiny", input=history, tools=[WEATHER])
    assert again.output_text.strip() == "It is sunny." and again.status == "completed"
    tokens = env.http.post("/tokenize", json={"model": "tiny", "messages": [
        {"role": "user", "content": "weather in Paris?"},
        {"role": "assistant", "tool_calls": [{"id": calls[0].call_id, "type": "function", "function": {
            "name": calls[0].name, "arguments": calls[0].arguments}}]},
        {"role": "tool", "tool_call_id": calls[0].call_id, "content": "sunny"}]}).json()
    assert again.usage.input_tokens >= tokens["count"] > 0


@pytest.mark.parametrize("body,param", [
    ({"input": []}, "input"),
    ({"input": 5}, "input"),
    ({"input": [{"role": "robot", "content": "hi"}]}, "input"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "hi", "max_output_tokens": 2**70}, "for the completion"),   # past 64 bits (found by schemathesis)
    ({"input": "hi", "temperature": -1.0}, "temperature"),
    ({"input": "hi", "tools": [{"type": "function", "name": "bad name!"}]}, "tools"),
    ({"input": "hi", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "other"}}, "tool_choice"),
    ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": "hi", "model": "nope"}, "model"),
])
def test_bad_input_gets_400(env, body, param) -> None:
    play(env, "ok")
    r = env.http.post("/v1/responses", json={"model": "tiny", **body})
    assert r.status_code in (400, 404), r.text
    error = r.json()["error"]
    assert param in (error.get("param") or "") + error["message"]


@pytest.mark.cluster
@pytest.mark.timeout(300)
def test_responses_on_a_real_cluster_equal_chat(tmp_path_factory) -> None:
    from pdcluster.cli.supervisor import LocalCluster
    from pdcluster.engine.testing import make_tiny_model

    model = make_tiny_model(str(tmp_path_factory.mktemp("resp") / "tiny-resp"), "llama")
    cluster = LocalCluster(model=model, work_dir=tmp_path_factory.mktemp("cluster"), num_prefill=1, num_decode=1,
                           port=0, cluster="responses", lease_ttl=2, threads_per_node=1,
                           node_config={"kv_cache_memory": "8MiB", "max_num_seqs": 8, "device": "cpu"},
                           router_config={"disagg_min_tokens": 0})   # every prompt prefills remotely

    async def go(api):
        messages = [{"role": "system", "content": "Answer briefly."},
                    {"role": "user", "content": "Name three colours of the rainbow."}]
        chat = await api.chat.completions.create(model="tiny-resp", messages=messages, temperature=0, max_tokens=12)
        resp = await api.responses.create(model="tiny-resp", instructions="Answer briefly.", temperature=0,
                                          input=messages[1]["content"], max_output_tokens=12)
        events = [e async for e in await api.responses.create(
            model="tiny-resp", input=[{"role": "developer", "content": "Answer briefly."}, messages[1]],
            temperature=0, max_output_tokens=12, stream=True)]
        return chat, resp, events

    with cluster:
        async def run():
            async with client(cluster) as api:
                return await go(api)

        chat, resp, events = asyncio.run(run())
        wait_idle(cluster)
    text = chat.choices[0].message.content
    assert text and resp.output_text == text
    assert resp.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    assert (resp.usage.input_tokens, resp.usage.output_tokens) == (chat.usage.prompt_tokens,
                                                                   chat.usage.completion_tokens)
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == text
    assert events[-1].response.output_text == text
