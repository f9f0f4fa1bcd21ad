"""OpenAI request bodies (pydantic). Unknown fields are ignored, as OpenAI does.

Types are checked strictly (no "5" for 5, no true for 1); value ranges are checked by
`pdcluster.control.sampling_params.SamplingParams`, so the router and the engines agree on them.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from fastapi import Request
from pydantic import BaseModel, ConfigDict, Field

from pdcluster.control.sampling_params import SamplingParams
from pdcluster.router.errors import APIError


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Body):
    include_usage: bool = False


class _SamplingFields(_Body):
    model: str
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    min_tokens: int | None = None
    skip_special_tokens: bool | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, Any] | None = None  # token id (a string) -> bias in [-100, 100]
    # structured output (router/structured_output.py): at most one of these
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def sampling_kwargs(self) -> dict[str, Any]:
        """The vLLM-named sampling fields the client set (None = engine default)."""
        names = ("temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids",
                 "presence_penalty", "frequency_penalty", "repetition_penalty", "ignore_eos",
                 "min_tokens", "skip_special_tokens", "logit_bias")
        return {k: getattr(self, k) for k in names if getattr(self, k) is not None}


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = SamplingParams.max_tokens   # the engines' default (chat's: the rest of the context)
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    prompt_logprobs: int | None = None   # vLLM: per prompt token its logprob and the top-N, in each choice


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    model_config = ConfigDict(extra="allow", strict=True)  # name, tool_call_id, ... go to the template
    role: str
    content: str | list[TextPart] | None = None

    def template_dict(self) -> dict[str, Any]:
        d = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            d["content"] = "".join(part.text for part in self.content)
        if isinstance(d.get("tool_calls"), list):   # an assistant's calls coming back: arguments as a dict
            d["tool_calls"] = [arguments_as_dict(call) for call in d["tool_calls"]]
        return d


def arguments_as_dict(call: Any) -> Any:
    """A tool call as chat templates read it (transformers, vLLM): `function.arguments` parsed to a dict."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = json.loads(function["arguments"])
    except ValueError:
        return call
    return {**call, "function": {**function, "arguments": arguments}} if isinstance(arguments, dict) else call


class FunctionDefinition(_Body):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None   # a JSON schema (None: no parameters)
    strict: bool | None = None


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None  # None: auto with tools
    parallel_tool_calls: bool = True


class TokenizeRequest(_Body):
    """vLLM's /tokenize: either `prompt` (text) or `messages` (rendered by the chat template, as chat does)."""

    model: str | None = None   # None: the router's first served model
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: bool = True          # prompt only: BOS etc. from the tokenizer's post-processor
    add_generation_prompt: bool = True       # messages only
    return_token_strs: bool = False


class DetokenizeRequest(_Body):
    """vLLM's /detokenize."""

    model: str | None = None
    tokens: list[int]


class LoadLoRAAdapterRequest(_Body):
    """vLLM's /v1/load_lora_adapter; `base_model`: ours, which served model it adapts (needed only when the router
    serves several)."""

    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1, max_length=4096)
    base_model: str | None = None


class UnloadLoRAAdapterRequest(_Body):
    """vLLM's /v1/unload_lora_adapter (`lora_int_id` accepted and ignored: names identify adapters here)."""

    lora_name: str = Field(min_length=1, max_length=256)
    lora_int_id: int | None = None


def openapi_components(served: list[str]) -> dict[str, Any]:
    """OpenAPI component schemas of the request bodies, `model` limited to the `served` names."""
    out: dict[str, Any] = {}
    from pdcluster.router.responses_api import ResponsesRequest  # (it builds on the chat request above)

    for body in (CompletionRequest, ChatCompletionRequest, TokenizeRequest, DetokenizeRequest, ResponsesRequest):
        schema = body.model_json_schema(ref_template="#/components/schemas/{model}")
        out.update(schema.pop("$defs", {}))
        model = schema["properties"]["model"]
        if "anyOf" in model:   # optional: a served name or null
            model["anyOf"] = [{"type": "string", "enum": list(served)}, {"type": "null"}]
        else:
            model["enum"] = list(served)
        out[body.__name__] = schema
    for lora_body in (LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest):
        out[lora_body.__name__] = lora_body.model_json_schema(ref_template="#/components/schemas/{model}")
    return out


def request_body(component: str) -> dict[str, Any]:
    """A route's `openapi_extra` for a JSON body it parses itself (so the body limit applies before reading)."""
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{component}"}}}}}


async def parse_body(request: Request, body: type[BaseModel], limit: int) -> Any:
    """The request's JSON body as `body`; 413 as soon as it is known to exceed `limit` bytes: before it is
    read when Content-Length says so, else while it streams in (chunked bodies too)."""
    too_large = APIError(413, f"request body larger than {limit} bytes", code="request_too_large")
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    return body.model_validate_json(b"".join(chunks) or b"{}")  # ValidationError -> 400 via the handlers
