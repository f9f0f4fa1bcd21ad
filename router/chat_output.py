"""What a chat response makes of each choice's text: reasoning (`reasoning_parser`) split out, tool calls
(`tools` / `tool_choice` / `tool_call_parser`) turned into `tool_calls`, whole or as OpenAI's stream deltas.

`ChatPlan` is decided once per request (`plan_chat`); `ChatOutput` is one choice's state. The whole body runs
the same `ChatOutput` over the whole text, so a streamed answer assembles to the non-streamed one.

tool_choice `required` and a named function are enforced by the engine's structured output (a JSON schema
built here, vLLM's shape): the whole output is then JSON, parsed here into calls. `auto` parses free output
with the model's `tool_call_parser`. With response_format / structured_outputs and a reasoning parser, the
grammar holds only after `</think>` (its token ids go with the request as `structured_outputs.after`): the
reasoning is free and split out, the answer is held to the grammar. With tool_choice `required` / named the
grammar holds from the first token (the whole output is the calls' JSON): the reasoning parser is off.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

from pdcluster.control.sampling_params import SamplingParams
from pdcluster.router.errors import bad_request
from pdcluster.router.openai_protocol import ChatCompletionRequest, NamedToolChoice
from pdcluster.router.reasoning import END, ReasoningSplitter
from pdcluster.router.settings import RouterSettings
from pdcluster.router.tool_parsers import ToolCall, ToolCallStream, get_parser, make_call, new_call_id

if TYPE_CHECKING:   # validation.Prepared holds a ChatPlan
    from pdcluster.router.tokenizer import ServedModel
    from pdcluster.router.validation import Prepared

_NO_PARAMETERS = {"type": "object", "properties": {}}


@dataclass
class ChatPlan:
    reasoning_parser: str = ""   # "" = no reasoning split
    prompt_text: str = ""        # the prompt's end (qwen3: thinking is on when it opens <think>)
    tool_parser: str = ""        # auto: parse free output with it ("" = no parsing)
    guided: str = ""             # "required" | "named": the output is the JSON the schema below asked for
    function: str = ""           # the named function
    parallel: bool = True

    @property
    def active(self) -> bool:
        return bool(self.reasoning_parser or self.tool_parser or self.guided)


def plan_chat(req: ChatCompletionRequest, tool_parser: str, reasoning_parser: str,
              prompt_text: str) -> tuple[ChatPlan, dict[str, Any] | None]:
    """The request's plan and the structured output (vLLM's `structured_outputs`) its tool_choice needs."""
    choice = req.tool_choice
    if choice is not None and choice != "none" and not req.tools:
        raise bad_request("tool_choice needs tools", param="tool_choice")
    plan = ChatPlan(reasoning_parser=reasoning_parser, prompt_text=prompt_text, parallel=req.parallel_tool_calls)
    if not req.tools or choice == "none":
        return plan, None
    tools = {t.function.name: t.function.parameters or _NO_PARAMETERS for t in req.tools}
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in tools:
            raise bad_request(f"tool_choice: no tool named {choice.function.name!r} in tools", param="tool_choice")
        plan.guided, plan.function = "named", choice.function.name
        return plan, _checked({"json": tools[choice.function.name]})
    if choice == "required":
        items = [{"type": "object", "properties": {"name": {"type": "string", "enum": [name]}, "parameters": schema},
                  "required": ["name", "parameters"]} for name, schema in tools.items()]
        array: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
        if not req.parallel_tool_calls:
            array["maxItems"] = 1
        plan.guided = "required"
        return plan, _checked({"json": array})
    if not tool_parser:   # auto
        raise bad_request('"auto" tool choice needs a tool_call_parser set for this model on the router '
                          '(or send tool_choice "none", "required" or a named function)', param="tool_choice")
    plan.tool_parser = tool_parser
    return plan, None


def _checked(structured: dict[str, Any]) -> dict[str, Any]:
    """The structured output as the engines will check it: a 400 naming tools now, not a failed stream later."""
    if "structured_outputs" not in {f.name for f in fields(SamplingParams)}:
        raise bad_request("tool_choice required or a named function needs structured output, which this "
                          "build's engines do not support", param="tool_choice")
    try:
        SamplingParams(structured_outputs=structured)
    except ValueError as exc:
        raise bad_request(f"tools: a function's parameters are not a usable JSON schema: {exc}",
                          param="tools") from None
    return structured


class ChatOutput:
    """One choice: text deltas in, OpenAI delta dicts out (`reasoning_content`, `content`, `tool_calls`)."""

    def __init__(self, plan: ChatPlan) -> None:
        self.plan = plan
        self.reasoning = (ReasoningSplitter(plan.reasoning_parser, plan.prompt_text)
                          if plan.reasoning_parser and not plan.guided else None)
        self.tools = ToolCallStream(get_parser(plan.tool_parser)) if plan.tool_parser else None
        self.guided_text = ""
        self.num_calls = 0

    def feed(self, text: str) -> list[dict[str, Any]]:
        if self.plan.guided:
            return self._guided(text)
        pieces = self.reasoning.feed(text) if self.reasoning is not None else [("content", text)]
        return self._pieces(pieces, final=False)

    def finish(self) -> list[dict[str, Any]]:
        if self.plan.guided == "required":
            try:
                calls = [make_call("", c.get("name"), c.get("parameters")) for c in json.loads(self.guided_text)]
            except (ValueError, AttributeError, TypeError):   # cut short (max_tokens): left as content
                return [{"content": self.guided_text}] if self.guided_text else []
            return self._calls(calls)
        if self.plan.guided:
            return []
        pieces = self.reasoning.finish() if self.reasoning is not None else []
        return self._pieces(pieces, final=True)

    def finish_reason(self, finish: str | None) -> str | None:
        """OpenAI's: "tool_calls" when the model called tools (a named tool_choice keeps "stop", as OpenAI)."""
        return "tool_calls" if finish == "stop" and self.num_calls and self.plan.guided != "named" else finish

    def _guided(self, text: str) -> list[dict[str, Any]]:
        if self.plan.guided == "required":   # the array parses at the end; its calls go out then
            self.guided_text += text
            return []
        out: list[dict[str, Any]] = []
        if not self.num_calls:   # named: one call whose arguments are the output, streamed as they come
            self.num_calls = 1
            out.append({"tool_calls": [ToolCall(self.plan.function, "", new_call_id()).openai() | {"index": 0}]})
        if text:
            out.append({"tool_calls": [{"index": 0, "function": {"arguments": text}}]})
        return out

    def _pieces(self, pieces: list[tuple[str, str]], final: bool) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for kind, text in pieces:
            if kind == "reasoning":
                out.append({"reasoning_content": text})
            elif self.tools is None:
                out.append({"content": text})
            else:
                content, calls = self.tools.feed(text)
                if content:
                    out.append({"content": content})
                out += self._calls(calls)
        if final and self.tools is not None:
            content, calls = self.tools.finish()
            if content:
                out.append({"content": content})
            out += self._calls(calls)
        return out

    def _calls(self, calls: list[ToolCall]) -> list[dict[str, Any]]:
        if not self.plan.parallel:
            calls = calls[:max(0, 1 - self.num_calls)]
        out = [{"tool_calls": [call.openai() | {"index": self.num_calls + i}]} for i, call in enumerate(calls)]
        self.num_calls += len(calls)
        return out


def message(output: ChatOutput, text: str) -> dict[str, Any]:
    """A whole choice's `message`: the deltas of `text` assembled."""
    content, reasoning, calls = "", "", []
    for delta in output.feed(text) + output.finish():
        content += delta.get("content", "")
        reasoning += delta.get("reasoning_content", "")
        for call in delta.get("tool_calls", []):
            if "id" in call:
                calls.append({k: v for k, v in call.items() if k != "index"})
            else:
                calls[call["index"]]["function"]["arguments"] += call["function"]["arguments"]
    msg: dict[str, Any] = {"role": "assistant", "content": content or (None if calls else "")}
    if output.plan.reasoning_parser:
        msg["reasoning_content"] = reasoning or None
    if calls:
        msg["tool_calls"] = calls
    return msg


def thinking_end_ids(model: ServedModel, prompt_text: str) -> list[int] | None:
    """The token ids of `</think>` when the output is expected to think first (the prompt does not already end
    with a closed thinking part, as Qwen3's template writes it with thinking off); else None."""
    if prompt_text.rstrip().endswith(END):
        return None
    ids = model.tokenizer.encode(END, add_special_tokens=False)
    return ids or None


def attach(settings: RouterSettings, prep: Prepared, req: ChatCompletionRequest) -> None:
    """Decide the chat request's plan (`prep.chat`) and put the structured output its tool_choice needs in
    every choice's sampling."""
    model = prep.model
    prompt_text = model.tokenizer.decode(prep.prompt_ids[-16:], skip_special_tokens=False)  # its end
    tool_parser = settings.model_parser("tool_call_parser", model.name)
    plan, structured = plan_chat(req, tool_parser, settings.model_parser("reasoning_parser", model.name),
                                 prompt_text)
    if any(d.get("structured_outputs") for d in prep.sampling):
        if structured is not None:
            raise bad_request("tool_choice required or a named function cannot be combined with another "
                              "structured output (response_format, structured_outputs)", param="tool_choice")
        after = thinking_end_ids(model, prompt_text) if plan.reasoning_parser else None
        if after:   # the grammar holds from the token after </think>: the reasoning is free, the answer is held
            for d in prep.sampling:
                d["structured_outputs"] = {**d["structured_outputs"], "after": after}
        else:
            plan.reasoning_parser = ""   # the grammar holds from the first token: no <think> part to split
    if structured is not None:
        plan.reasoning_parser = ""
        for d in prep.sampling:
            d["structured_outputs"] = structured
    if plan.tool_parser == "mistral" and req.skip_special_tokens is None:   # [TOOL_CALLS] is a special token
        prep.skip_special_tokens = False
        for d in prep.sampling:
            d["skip_special_tokens"] = False
    prep.chat = plan if plan.active else None
