"""Tool calling on the real SmolLM2 model through a 1P1D cluster (every request prefilled on the prefill node)
and the official openai client: `tool_choice` "required" and a named function are enforced by structured
output, so every call's arguments validate against its tool's schema at temperature 0.8; streamed calls
assemble in the SDK."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import pytest
from cluster_helpers import client

from pdcluster.engine.convert import convert_model, default_model_source

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(600)]

NAME = "smollm2"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                   "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 20},
                                  "unit": {"enum": ["celsius", "fahrenheit"]}}}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["a", "b"],
                   "properties": {"a": {"type": "integer", "minimum": -1000, "maximum": 1000},
                                  "b": {"type": "integer", "minimum": -1000, "maximum": 1000}}}}}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, ADD)}
QUESTIONS = ["What is the weather in Paris?", "Add 2 and 3.", "Is it cold in Oslo right now?", "What is 17 + 25?",
             "Weather in Tokyo, in fahrenheit please.", "Sum of -4 and 9?", "Should I take an umbrella in London?",
             "Compute 100 plus 1."]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    from pdcluster.cli.supervisor import LocalCluster

    try:
        source = default_model_source()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    model = convert_model(source, str(tmp_path_factory.mktemp("tools") / "smollm2-fp32"), dtype="float32")
    c = LocalCluster(model=model, work_dir=tmp_path_factory.mktemp("cluster"), num_prefill=1, num_decode=1, port=0,
                     threads_per_node=1, node_config={"kv_cache_memory": "64MiB", "dtype": "float32", "device": "cpu",
                                                      "served_model_name": NAME},
                     router_config={"disagg_min_tokens": 0, "served_model_name": NAME})
    with c:
        yield c


def check(call) -> None:
    assert call.type == "function" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


async def test_required_tool_calls_always_validate_against_the_tool_schema(cluster) -> None:
    api = client(cluster, timeout=300)
    sem = asyncio.Semaphore(8)

    async def ask(i: int):
        async with sem:
            return await api.chat.completions.create(
                model=NAME, messages=[{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}],
                tools=[WEATHER, ADD], tool_choice="required", temperature=0.8, seed=i, max_tokens=200,
                parallel_tool_calls=False)   # a 135M model at 0.8 may add calls until max_tokens otherwise

    answers = await asyncio.gather(*(ask(i) for i in range(24)))
    for resp in answers:
        choice = resp.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        assert len(choice.message.tool_calls) == 1
        check(choice.message.tool_calls[0])
    await api.close()


async def test_streamed_and_named_tool_calls_assemble_in_the_sdk(cluster) -> None:
    api = client(cluster, timeout=300)
    for i, choice in enumerate(["required", {"type": "function", "function": {"name": "add"}}] * 2):
        async with api.chat.completions.stream(
                model=NAME, messages=[{"role": "user", "content": QUESTIONS[i]}], tools=[WEATHER, ADD],
                tool_choice=choice, temperature=0.8, seed=i, max_tokens=200, parallel_tool_calls=False) as stream:
            final = (await stream.get_final_completion()).choices[0]
        assert final.finish_reason == ("tool_calls" if choice == "required" else "stop")
        assert len(final.message.tool_calls) == 1
        check(final.message.tool_calls[0])
        if choice != "required":
            assert final.message.tool_calls[0].function.name == "add"
            # the SDK parsed the streamed arguments against the tool's schema too
            assert final.message.tool_calls[0].function.arguments
    await api.close()
