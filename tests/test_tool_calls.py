"""Tool calling and reasoning in chat (router side): the parsers on whole and streamed text, the request's
checks and structured output, tools rendered by the chat template, and end to end through the real router
and the official openai client against fake decode nodes that play a scripted output."""

from __future__ import annotations

import json
import os

import openai
import pytest
from router_fakes import HERMES, TEMPLATE, make_tokenizer_dir
from router_helpers import Env

from pdcluster.router.chat_output import ChatOutput, ChatPlan, message, plan_chat
from pdcluster.router.errors import APIError
from pdcluster.router.openai_protocol import ChatCompletionRequest
from pdcluster.router.reasoning import split_reasoning
from pdcluster.router.settings import RouterSettings
from pdcluster.router.tokenizer import ServedModel
from pdcluster.router.validation import chat_prompt

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
CLOCK = {"type": "function", "function": {"name": "get_time"}}



def streamed(plan: ChatPlan, text: str, step: int) -> dict:
    """`text` fed `step` characters at a time, its deltas assembled as the openai SDK assembles them."""
    output = ChatOutput(plan)
    deltas = []
    for i in range(0, len(text), step):
        deltas += output.feed(text[i:i + step])
    deltas += output.finish()
    content, reasoning, calls = "", "", {}
    for d in deltas:
        assert len(d) == 1, d   # one kind of piece per delta
        content += d.get("content", "")
        reasoning += d.get("reasoning_content", "")
        for c in d.get("tool_calls", []):
            entry = calls.setdefault(c["index"], {"name": "", "arguments": ""})
            entry["name"] += c.get("function", {}).get("name", "")
            entry["arguments"] += c["function"]["arguments"]
    return {"content": content, "reasoning": reasoning, "calls": [calls[i] for i in sorted(calls)]}


def whole(plan: ChatPlan, text: str) -> dict:
    msg = message(ChatOutput(plan), text)
    return {"content": msg["content"] or "", "reasoning": msg.get("reasoning_content") or "",
            "calls": [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                      for c in msg.get("tool_calls", [])]}


PARSED = [
    ("hermes", HERMES, "Let me check.", [("get_weather", {"city": "Paris"}), ("get_time", {})]),
    ("hermes", "No tools needed: 2 < 3.", "No tools needed: 2 < 3.", []),
    ("hermes", 'x<tool_call>{"name": "get_weather", "argum', 'x<tool_call>{"name": "get_weather", "argum', []),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}; '
                    '{"name": "get_time", "parameters": {}}', "", [("get_weather", {"city": "Oslo"}),
                                                                ("get_time", {})]),
    ("llama3_json", ' {"name": "get_time", "parameters": {}}', "", [("get_time", {})]),
    ("llama3_json", "Hi {there}", "Hi {there}", []),
    ("mistral", 'Sure[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Rome"}}]', "Sure",
     [("get_weather", {"city": "Rome"})]),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Rome"}[TOOL_CALLS]get_time[ARGS]{}', "",
     [("get_weather", {"city": "Rome"}), ("get_time", {})]),
    ("mistral", "[TOOL_CALLS]not json", "[TOOL_CALLS]not json", []),
]


@pytest.mark.parametrize("parser,text,content,calls", PARSED)
def test_tool_parsers_whole_and_streamed_at_any_split(parser, text, content, calls) -> None:
    plan = ChatPlan(tool_parser=parser)
    got = whole(plan, text)
    assert got["content"].strip() == content.strip()
    assert [(c["name"], json.loads(c["arguments"])) for c in got["calls"]] == calls
    for step in (1, 2, 3, 7, len(text)):
        assert streamed(plan, text, step) == {**got, "reasoning": ""}, step


def test_parallel_tool_calls_false_keeps_the_first_call() -> None:
    got = whole(ChatPlan(tool_parser="hermes", parallel=False), HERMES)
    assert [c["name"] for c in got["calls"]] == ["get_weather"]
    assert streamed(ChatPlan(tool_parser="hermes", parallel=False), HERMES, 1)["calls"] == got["calls"]


REASONED = [
    ("deepseek_r1", "", "<think>Paris is in France.</think>It is sunny.", "Paris is in France.", "It is sunny."),
    ("deepseek_r1", "", "Paris is in France.</think>\n\nIt is sunny.", "Paris is in France.", "\n\nIt is sunny."),
    ("deepseek_r1", "", "still thinking <thi", "still thinking <thi", ""),
    ("qwen3", "", "<think>\nhm\n</think>\n\nYes.", "\nhm\n", "\n\nYes."),
    ("qwen3", "", "Yes, <think> is a tag.", "", "Yes, <think> is a tag."),
    ("qwen3", "<s>assistant:<think>\n", "hm</think>Yes.", "hm", "Yes."),
    ("qwen3", "", "   ", "", "   "),
]


@pytest.mark.parametrize("style,prompt,text,reasoning,content", REASONED)
def test_reasoning_split_whole_and_streamed(style, prompt, text, reasoning, content) -> None:
    r, c = split_reasoning(style, text, prompt)
    assert (r or "", c) == (reasoning, content)
    plan = ChatPlan(reasoning_parser=style, prompt_text=prompt)
    for step in (1, 2, 5, len(text)):
        assert streamed(plan, text, step) == {"content": content, "reasoning": reasoning, "calls": []}


def test_reasoning_then_tool_calls() -> None:
    plan = ChatPlan(reasoning_parser="qwen3", tool_parser="hermes")
    text = "<think>need the weather</think>" + HERMES
    got = whole(plan, text)
    assert got["reasoning"] == "need the weather" and got["content"] == "Let me check."
    assert [c["name"] for c in got["calls"]] == ["get_weather", "get_time"]
    assert streamed(plan, text, 1) == got


def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                                 **fields})


@pytest.mark.parametrize("fields,param", [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [WEATHER]}, "tool_choice"),            # auto with no tool_call_parser for the model
    ({"tools": [WEATHER], "tool_choice": "auto"}, "tool_choice"),
])
def test_tool_choice_refusals_name_the_field(fields, param) -> None:
    with pytest.raises(APIError) as info:
        plan_chat(chat(**fields), "", "", "")
    assert info.value.status == 400 and info.value.param == param


def test_tool_choice_none_and_auto_plans() -> None:
    plan, structured = plan_chat(chat(tools=[WEATHER], tool_choice="none"), "hermes", "", "")
    assert structured is None and not plan.active
    plan, structured = plan_chat(chat(tools=[WEATHER]), "hermes", "qwen3", "")
    assert structured is None and plan.tool_parser == "hermes" and plan.reasoning_parser == "qwen3"


def test_required_and_named_choice_build_vllm_json_schemas() -> None:
    from dataclasses import fields

    from pdcluster.control.sampling_params import SamplingParams
    if "structured_outputs" not in {f.name for f in fields(SamplingParams)}:
        with pytest.raises(APIError) as info:
            plan_chat(chat(tools=[WEATHER], tool_choice="required"), "", "", "")
        assert info.value.status == 400 and "structured output" in info.value.message
        pytest.skip("this tree's SamplingParams has no structured_outputs yet")
    plan, structured = plan_chat(chat(tools=[WEATHER, CLOCK], tool_choice="required", parallel_tool_calls=False),
                                 "", "", "")
    schema = structured["json"]
    assert plan.guided == "required" and schema["minItems"] == 1 and schema["maxItems"] == 1
    names = [item["properties"]["name"]["enum"] for item in schema["items"]["anyOf"]]
    assert names == [["get_weather"], ["get_time"]]
    assert schema["items"]["anyOf"][0]["properties"]["parameters"] == WEATHER["function"]["parameters"]
    plan, structured = plan_chat(chat(tools=[WEATHER], tool_choice={"type": "function",
                                                                     "function": {"name": "get_weather"}}), "", "", "")
    assert plan.guided == "named" and structured == {"json": WEATHER["function"]["parameters"]}


def test_guided_outputs_become_tool_calls() -> None:
    required = ChatPlan(guided="required")
    text = '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time", "parameters": {}}]'
    got = whole(required, text)
    assert [(c["name"], json.loads(c["arguments"])) for c in got["calls"]] == [("get_weather", {"city": "Paris"}),
                                                                              ("get_time", {})]
    assert streamed(required, text, 3) == got
    assert whole(required, '[{"name": "get_wea')["calls"] == []   # cut short by max_tokens: content
    named = ChatPlan(guided="named", function="get_weather")
    got = whole(named, '{"city": "Paris"}')
    assert got["calls"] == [{"name": "get_weather", "arguments": '{"city": "Paris"}'}]
    assert streamed(named, '{"city": "Paris"}', 2) == got
    output = ChatOutput(named)
    message(output, "{}")
    assert output.finish_reason("stop") == "stop"   # OpenAI: a named tool_choice finishes with "stop"
    output = ChatOutput(required)
    message(output, text)
    assert output.finish_reason("stop") == "tool_calls" and output.finish_reason("length") == "length"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    path = make_tokenizer_dir(str(tmp_path_factory.mktemp("tools")), max_position_embeddings=4096)
    with open(os.path.join(path, "chat_template.jinja"), "w") as f:
        f.write(TEMPLATE)
    return path


def test_tools_and_tool_messages_render_through_the_chat_template(model_dir) -> None:
    model = ServedModel.load("m", model_dir)
    req = ChatCompletionRequest.model_validate({"model": "m", "tools": [WEATHER], "messages": [
        {"role": "user", "content": "weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]})
    text = model.tokenizer.decode(chat_prompt(model, req), skip_special_tokens=False)
    assert 'tools: get_weather {"type": "object", "properties": {"city": {"type": "string"}}' in text
    assert "<call>get_weather city=Paris</call>" in text   # arguments reach the template as a dict
    assert "tool: sunny (call_1)" in text
    req = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    assert "tools:" not in model.tokenizer.decode(chat_prompt(model, req), skip_special_tokens=False)


def test_parser_knobs_per_served_model() -> None:
    s = RouterSettings(tool_call_parser=["hermes", "big=mistral"], reasoning_parser=["big=deepseek_r1"])
    s.validate()
    assert s.model_parser("tool_call_parser", "small") == "hermes"
    assert s.model_parser("tool_call_parser", "big") == "mistral"
    assert (s.model_parser("reasoning_parser", "small"), s.model_parser("reasoning_parser", "big")) == ("",
                                                                                                        "deepseek_r1")
    with pytest.raises(ValueError, match="tool_call_parser: unknown parser 'pythonic'"):
        RouterSettings(tool_call_parser=["pythonic"]).validate()


# --- end to end: the real router app and the openai client against a fake decode node's scripted output


@pytest.fixture(scope="module")
def env(model_dir):
    e = Env(model_dir, tool_call_parser=["hermes"], reasoning_parser=["qwen3"])
    yield e
    e.close()


def play(env: Env, text: str) -> None:
    tok = env.tokenizer
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text   # the fake node's output is exactly this text
    env.use_nodes("ok", script=ids + [tok.eos_token_id], chunk=2)


@pytest.mark.slow
def test_tool_calls_through_the_router_whole_and_streamed(env) -> None:
    text = "<think>weather?</think>" + HERMES
    play(env, text)
    messages = [{"role": "user", "content": "weather in Paris?"}]
    done = env.client.chat.completions.create(model="tiny", messages=messages, tools=[WEATHER, CLOCK])
    choice = done.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check."
    assert choice.message.reasoning_content == "weather?"
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls]
    assert calls == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert all(c.id.startswith("call_") and c.type == "function" for c in choice.message.tool_calls)

    with env.client.chat.completions.stream(model="tiny", messages=messages, tools=[WEATHER, CLOCK]) as stream:
        reasoning = "".join(getattr(e.chunk.choices[0].delta, "reasoning_content", None) or ""
                            for e in stream if e.type == "chunk" and e.chunk.choices)
        final = stream.get_final_completion().choices[0]
    assert reasoning == "weather?"
    assert final.finish_reason == "tool_calls" and final.message.content == "Let me check."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in final.message.tool_calls] == calls

    # The assistant's calls and the tool's answer go back in the next turn.
    back = messages + [choice.message.model_dump(exclude_none=True),
                       {"role": "tool", "tool_call_id": choice.message.tool_calls[0].id, "content": "sunny"}]
    assert env.client.chat.completions.create(model="tiny", messages=back, tools=[WEATHER]).choices[0].message


@pytest.mark.slow
def test_reasoning_through_the_router_template_opens_think(env) -> None:
    play(env, "It is warm.</think>Sunny, 25 degrees.")   # the template ends the prompt with <think>
    messages = [{"role": "user", "content": "weather?"}]
    msg = env.client.chat.completions.create(model="tiny", messages=messages).choices[0].message
    # (the tiny tokenizer's metaspace gives the first generated word a leading space)
    assert (msg.reasoning_content.lstrip(), msg.content) == ("It is warm.", "Sunny, 25 degrees.")
    reasoning, content = "", ""
    for chunk in env.client.chat.completions.create(model="tiny", messages=messages, stream=True):
        for c in chunk.choices:
            reasoning += getattr(c.delta, "reasoning_content", None) or ""
            content += c.delta.content or ""
    assert (reasoning, content) == (msg.reasoning_content, msg.content)


@pytest.mark.slow
def test_structured_output_holds_only_the_answer_after_thinking(env) -> None:
    """response_format with a reasoning parser: the node is asked to hold the grammar only after </think> (its
    token ids as structured_outputs.after), and the answer splits into reasoning_content and the JSON content."""
    tok = env.tokenizer
    ids = tok.encode('Think about it.</think>{"a": 1}', add_special_tokens=False)
    [node] = env.use_nodes("ok", script=ids + [tok.eos_token_id], chunk=2)
    msg = env.client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "json?"}],
                                             response_format={"type": "json_object"}).choices[0].message
    assert msg.reasoning_content.lstrip() == "Think about it." and json.loads(msg.content) == {"a": 1}
    spec = node.generates[-1].sampling["structured_outputs"]
    assert spec == {"json_object": True, "after": tok.encode("</think>", add_special_tokens=False)}


@pytest.mark.slow
@pytest.mark.parametrize("body,param", [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
    ({"tools": [{"type": "code"}]}, "tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "other"}}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
])
def test_bad_tool_fields_get_400_naming_them(env, body, param) -> None:
    play(env, "ok")
    with pytest.raises(openai.BadRequestError) as info:
        env.client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], **body)
    assert info.value.status_code == 400 and param in (info.value.body or {}).get("param", "")
