"""OpenAI request bodies (pydantic). Unknown fields are ignored, as OpenAI does.

Types are checked strictly (no "5" for 5, no true for 1); value ranges are checked by
`engine.sampling_params.SamplingParams`, so the router and the engines agree on them.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


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

    def sampling_kwargs(self) -> dict[str, Any]:
        """The vLLM-named sampling fields the client set (None = engine default)."""
        names = ("temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids",
                 "presence_penalty", "frequency_penalty", "repetition_penalty", "ignore_eos",
                 "min_tokens", "skip_special_tokens")
        return {k: getattr(self, k) for k in names if getattr(self, k) is not None}


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
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
