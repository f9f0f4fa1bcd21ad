"""OpenAI request bodies (pydantic). Unknown fields are ignored, as OpenAI does.

Types are checked strictly (no "5" for 5, no true for 1); value ranges are checked by
`pdcluster.control.sampling_params.SamplingParams`, so the router and the engines agree on them.
"""

from __future__ import annotations

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
    logit_bias: dict[str, Any] | None = None  # declared so that a non-empty one is refused, not ignored

    def sampling_kwargs(self) -> dict[str, Any]:
        """The vLLM-named sampling fields the client set (None = engine default)."""
        names = ("temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids",
                 "presence_penalty", "frequency_penalty", "repetition_penalty", "ignore_eos",
                 "min_tokens", "skip_special_tokens")
        return {k: getattr(self, k) for k in names if getattr(self, k) is not None}


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = SamplingParams.max_tokens   # the engines' default (chat's: the rest of the context)
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None


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
        return d


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None


def openapi_components(served: list[str]) -> dict[str, Any]:
    """OpenAPI component schemas of the request bodies, `model` limited to the `served` names."""
    out: dict[str, Any] = {}
    for body in (CompletionRequest, ChatCompletionRequest):
        schema = body.model_json_schema(ref_template="#/components/schemas/{model}")
        out.update(schema.pop("$defs", {}))
        schema["properties"]["model"]["enum"] = list(served)
        out[body.__name__] = schema
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
