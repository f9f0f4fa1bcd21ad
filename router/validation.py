"""Request validation: a parsed OpenAI body → `Prepared` (prompt token ids + one engine request per choice).

Every refusal is a 400 in OpenAI's shape naming the field (`errors.bad_request`); value ranges are
`SamplingParams`' own checks, so the router and the engines agree on them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

from pdcluster.control.sampling_params import MAX_LOGPROBS, SamplingParams
from pdcluster.router.chat_output import ChatPlan
from pdcluster.router.errors import bad_request
from pdcluster.router.openai_protocol import ChatCompletionRequest, CompletionRequest
from pdcluster.router.settings import RouterSettings
from pdcluster.router.structured_output import structured_outputs_of
from pdcluster.router.tokenizer import ServedModel

_INT64 = 1 << 64


@dataclass
class Prepared:
    """A validated request, ready to send: what both endpoints share."""

    model: ServedModel
    prompt_ids: list[int]
    sampling: list[dict[str, Any]]  # one engine request per choice
    stop: list[str]
    skip_special_tokens: bool
    stream: bool
    include_usage: bool
    echo: str | None = None             # completions' echo: the prompt text that leads each choice
    echo_only: bool = False             # echo with max_tokens 0: the prompt (and its logprobs), nothing generated
    prompt_logprobs: int | None = None  # vLLM's field as the client asked it (returned per choice)
    chat: ChatPlan | None = None        # chat: reasoning and tool-call handling of the output (chat_output.py)


def check_request(settings: RouterSettings, req: CompletionRequest | ChatCompletionRequest) -> None:
    """What the router refuses before tokenizing: unsupported fields, and its caps on a request's lists
    (the engines refuse anything above theirs too)."""
    if isinstance(req, CompletionRequest):
        if req.max_tokens == 0 and not req.echo:
            raise bad_request("max_tokens must be >= 1, got 0 (0 is allowed with echo: the prompt is scored, "
                              "nothing generated)", param="max_tokens")
        if req.prompt_logprobs is not None and not 0 <= req.prompt_logprobs <= MAX_LOGPROBS:
            raise bad_request(f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {req.prompt_logprobs}",
                              param="prompt_logprobs")
        if req.suffix:
            raise bad_request("suffix is not supported", param="suffix")
    elif req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs requires logprobs to be true", param="top_logprobs")
    s = settings
    stops = [req.stop] if isinstance(req.stop, str) else req.stop or []
    if len(stops) > s.max_stop_strings:
        raise bad_request(f"stop: at most {s.max_stop_strings} stop strings, got {len(stops)}", param="stop")
    if any(len(stop) > s.max_stop_chars for stop in stops):
        raise bad_request(f"stop: stop strings may be at most {s.max_stop_chars} characters", param="stop")
    stop_ids = req.stop_token_ids or []
    if len(stop_ids) > s.max_stop_token_ids:
        raise bad_request(f"stop_token_ids: at most {s.max_stop_token_ids} ids, got {len(stop_ids)}",
                          param="stop_token_ids")


def has_text(prompt: Any) -> bool:
    """Whether a completion prompt needs the tokenizer (else it is token ids, checked inline)."""
    # A list is all ids or holds one prompt (validated as a whole: a mixed list is refused either way).
    return isinstance(prompt, str) or (isinstance(prompt, list) and bool(prompt) and not isinstance(prompt[0], int))


def completion_prompt(model: ServedModel, req: CompletionRequest) -> list[int]:
    """Token ids of the prompt (runs on the tokenizer pool when `has_text`)."""
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise bad_request("batched prompts are not supported: send one prompt per request", param="prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        return model.tokenizer.encode(prompt)
    return check_ids(model, cast(list[int], prompt), "prompt")   # the request model's union: ids by now


def echo_text(model: ServedModel, req: CompletionRequest, prompt_ids: list[int]) -> str:
    """What echo puts before the completion: the prompt as sent when it is text, else its ids decoded."""
    prompt = req.prompt
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    return prompt if isinstance(prompt, str) else model.tokenizer.decode(prompt_ids, skip_special_tokens=False)


def chat_prompt(model: ServedModel, req: ChatCompletionRequest) -> list[int]:
    """Token ids of the rendered chat template (runs on the tokenizer pool)."""
    try:
        tools = {"tools": [t.model_dump(exclude_none=True) for t in req.tools]} if req.tools else {}
        return model.tokenizer.apply_chat_template([m.template_dict() for m in req.messages], **tools)
    except Exception as exc:  # template errors (bad roles, missing fields) are the client's
        raise bad_request(f"messages: the chat template failed: {exc}", param="messages") from None


def check_ids(model: ServedModel, ids: list[int], param: str) -> list[int]:
    vocab = model.tokenizer.vocab_size
    bad = [i for i in ids if not 0 <= i < vocab]
    if bad:
        raise bad_request(f"{param}: token ids must be in [0, {vocab}), got {bad[:5]}", param=param)
    return list(ids)


def prepare(settings: RouterSettings, model: ServedModel, req: CompletionRequest | ChatCompletionRequest,
            prompt_ids: list[int], limit: int, max_tokens: int | None, logprobs: int | None,
            prompt_param: str, echo: str | None = None) -> Prepared:
    """Check the prompt against the context `limit` and the sampling fields; one sampling dict per choice.
    `echo`: the prompt text each choice starts with (completions' echo); with logprobs the engines score the
    prompt too (`prompt_logprobs`), and max_tokens 0 runs one token that is dropped (as vLLM does)."""
    if not prompt_ids:
        raise bad_request("the prompt is empty", param=prompt_param)
    if len(prompt_ids) >= limit:
        raise bad_request(f"This model's maximum context length is {limit} tokens; the prompt has "
                          f"{len(prompt_ids)} tokens", param=prompt_param, code="context_length_exceeded")
    if max_tokens is None:
        max_tokens = limit - len(prompt_ids)
    if isinstance(max_tokens, int) and max_tokens >= 1 and len(prompt_ids) + max_tokens > limit:
        raise bad_request(f"This model's maximum context length is {limit} tokens; you requested "
                          f"{len(prompt_ids) + max_tokens} tokens ({len(prompt_ids)} in the prompt, "
                          f"{max_tokens} for the completion)", param="max_tokens",
                          code="context_length_exceeded")
    if not 1 <= req.n <= settings.max_n:
        raise bad_request(f"n must be in [1, {settings.max_n}], got {req.n}", param="n")
    kwargs = req.sampling_kwargs()
    echo_only = echo is not None and max_tokens == 0
    asked = req.prompt_logprobs if isinstance(req, CompletionRequest) else None
    wanted = [n for n in (asked, logprobs if echo is not None else None) if n is not None]
    kwargs.update(max_tokens=1 if echo_only else max_tokens, logprobs=logprobs,
                  prompt_logprobs=max(wanted) if wanted else None)
    if echo_only:
        kwargs.pop("min_tokens", None)
    structured = structured_outputs_of(req)
    if structured is not None:
        kwargs["structured_outputs"] = structured
    if req.stop_token_ids:
        check_ids(model, req.stop_token_ids, "stop_token_ids")
    try:
        base = SamplingParams(**kwargs)
    except ValueError as exc:
        message = str(exc)
        raise bad_request(message, param=message.split(" ", 1)[0]) from None
    if base.logit_bias:
        check_ids(model, list(base.logit_bias), "logit_bias")
    per_choice = []
    for i in range(req.n):
        d = base.to_dict()
        d["n"] = 1
        if base.seed is not None:  # seed + i, wrapped into the signed 64-bit range
            d["seed"] = (base.seed + i + _INT64 // 2) % _INT64 - _INT64 // 2
        per_choice.append(d)
    return Prepared(model=model, prompt_ids=prompt_ids, sampling=per_choice, stop=list(base.stop),
                    skip_special_tokens=base.skip_special_tokens, stream=req.stream,
                    include_usage=bool(req.stream_options and req.stream_options.include_usage),
                    echo=echo, echo_only=echo_only, prompt_logprobs=asked)
