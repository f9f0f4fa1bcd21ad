"""OpenAI's Responses API (`POST /v1/responses`): its request shape turned into a chat request (the chat
path renders, samples and parses tool calls), and the chat output turned back into a `response` object,
whole or as the Responses streaming events (`response.created` ... `response.completed`).

Nothing is stored: `store` is accepted and ignored, `previous_response_id` is refused (send the history in
`input`, as stateless clients do).
"""

from __future__ import annotations

import json
import secrets
import time
from typing import Any, AsyncIterator, Callable, Literal

import orjson
from pydantic import Field, ValidationError

from pdcluster.router.chat_output import ChatOutput, message
from pdcluster.router.errors import bad_request
from pdcluster.router.generation import ChoiceDelta
from pdcluster.router.openai_protocol import ChatCompletionRequest, _Body

INCOMPLETE_REASONS = {"length": "max_output_tokens"}


class InputPart(_Body):
    type: Literal["input_text", "output_text", "text"]
    text: str


class InputMessage(_Body):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[InputPart]


class FunctionCallItem(_Body):
    """A call the model made earlier, sent back with the history."""
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(_Body):
    type: Literal["function_call_output"]
    call_id: str
    output: str


class FunctionTool(_Body):
    type: Literal["function"]
    name: str   # checked as chat's FunctionDefinition name (to_chat)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionToolChoice(_Body):
    type: Literal["function"]
    name: str


class ResponsesRequest(_Body):
    model: str
    input: str | list[InputMessage | FunctionCallItem | FunctionCallOutputItem] = Field(min_length=1)
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice | None = None
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    store: bool | None = None        # accepted, ignored: nothing is stored
    metadata: dict[str, str] | None = None
    user: str | None = None


def to_chat(req: ResponsesRequest) -> ChatCompletionRequest:
    """The chat request that generates this response."""
    if req.previous_response_id is not None:
        raise bad_request("previous_response_id: this server stores no responses; send the conversation in "
                          "input", param="previous_response_id")
    if req.max_output_tokens is not None and req.max_output_tokens < 1:
        raise bad_request(f"max_output_tokens must be >= 1, got {req.max_output_tokens}", param="max_output_tokens")
    messages: list[dict[str, Any]] = []
    if req.instructions:
        messages.append({"role": "system", "content": req.instructions})
    items = [InputMessage(role="user", content=req.input)] if isinstance(req.input, str) else req.input
    for item in items:
        if isinstance(item, InputMessage):
            text = item.content if isinstance(item.content, str) else "".join(p.text for p in item.content)
            messages.append({"role": "system" if item.role == "developer" else item.role, "content": text})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:   # parallel calls
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
    chat: dict[str, Any] = {"model": req.model, "messages": messages, "stream": req.stream,
                            "parallel_tool_calls": req.parallel_tool_calls}
    for name in ("temperature", "top_p", "user"):
        if getattr(req, name) is not None:
            chat[name] = getattr(req, name)
    if req.max_output_tokens is not None:
        chat["max_completion_tokens"] = req.max_output_tokens
    if req.tools:
        chat["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                         for t in req.tools]
    if isinstance(req.tool_choice, FunctionToolChoice):
        chat["tool_choice"] = {"type": "function", "function": {"name": req.tool_choice.name}}
    elif req.tool_choice is not None:
        chat["tool_choice"] = req.tool_choice
    try:
        # stdlib json: orjson refuses integers past 64 bits, which a client may send (validation then refuses them)
        return ChatCompletionRequest.model_validate_json(json.dumps(chat))
    except ValidationError as exc:   # a tool's name or schema chat refuses
        error = exc.errors()[0]
        raise bad_request(f"tools: {error['msg']}", param="tools") from None


def _id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


def _usage(usage: dict[str, int]) -> dict[str, Any]:
    return {"input_tokens": usage["prompt_tokens"], "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage["total_tokens"]}


class ResponseWriter:
    """One response's object and events. `output`: the chat output handling of the request (None: plain text)."""

    def __init__(self, req: ResponsesRequest, model: str, output: ChatOutput | None) -> None:
        self.req = req
        self.model = model
        self.output = output
        self.id = _id("resp")
        self.created_at = int(time.time())
        self.items: list[dict[str, Any]] = []
        self.seq = 0

    def response(self, status: str, usage: dict[str, int] | None = None, finish: str | None = None,
                 error: dict[str, Any] | None = None) -> dict[str, Any]:
        reason = INCOMPLETE_REASONS.get(finish or "")
        if status == "completed" and reason:
            status = "incomplete"
        req = self.req
        return {"id": self.id, "object": "response", "created_at": self.created_at, "model": self.model,
                "status": status, "error": error,
                "incomplete_details": {"reason": reason} if status == "incomplete" else None,
                "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
                "metadata": req.metadata or {}, "output": self.items, "parallel_tool_calls": req.parallel_tool_calls,
                "previous_response_id": None, "store": False, "temperature": req.temperature, "top_p": req.top_p,
                "text": {"format": {"type": "text"}}, "tool_choice": _tool_choice(req),
                "tools": [t.model_dump() for t in req.tools or []], "truncation": "disabled",
                "usage": _usage(usage) if usage is not None else None, "user": req.user}

    # ---- whole ----------------------------------------------------------------------------------

    def body(self, text: str, finish: str | None, usage: dict[str, int]) -> dict[str, Any]:
        msg: dict[str, Any] = message(self.output, text) if self.output is not None else {"content": text}
        if msg.get("reasoning_content"):
            self.items.append(_reasoning_item(_id("rs"), msg["reasoning_content"]))
        calls = msg.get("tool_calls") or []
        if msg.get("content") or not calls:
            self.items.append(_message_item(_id("msg"), msg.get("content") or "", "completed"))
        for call in calls:
            self.items.append(_call_item(_id("fc"), call["id"], call["function"]["name"],
                                         call["function"]["arguments"], "completed"))
        return self.response("completed", usage, finish)

    # ---- streamed -------------------------------------------------------------------------------

    def event(self, kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\n".encode() + b"data: " + orjson.dumps(payload) + b"\n\n"

    async def events(self, deltas: AsyncIterator[ChoiceDelta],
                     usage: Callable[[], dict[str, int]]) -> AsyncIterator[bytes]:
        """The whole event stream of one choice's deltas (generation errors propagate, for the caller's
        `failed` event)."""
        yield self.event("response.created", response=self.response("in_progress"))
        yield self.event("response.in_progress", response=self.response("in_progress"))
        stream = _ItemStream(self)
        finish = None
        async for delta in deltas:
            parts = self.output.feed(delta.text) if self.output is not None else [{"content": delta.text}]
            if delta.finish_reason:
                finish = self.output.finish_reason(delta.finish_reason) if self.output else delta.finish_reason
                if self.output is not None:
                    parts += self.output.finish()
            for part in parts:
                for chunk in stream.feed(part):
                    yield chunk
        for chunk in stream.close():
            yield chunk
        if not self.items:   # nothing generated: an empty message, as the whole body has
            for chunk in stream.feed({"content": ""}) + stream.close():
                yield chunk
        done = self.response("completed", usage(), finish)
        yield self.event("response.incomplete" if done["status"] == "incomplete" else "response.completed",
                         response=done)

    def failed(self, message_text: str) -> bytes:
        return self.event("response.failed", response=self.response(
            "failed", error={"code": "server_error", "message": message_text}))


class _ItemStream:
    """The output items as they stream: one open at a time (reasoning, message, or a function call), each
    added, filled by deltas, then done."""

    def __init__(self, writer: ResponseWriter) -> None:
        self.w = writer
        self.open: dict[str, Any] | None = None
        self.call_index = -1   # the chat delta index of the open function call

    def feed(self, part: dict[str, Any]) -> list[bytes]:
        out: list[bytes] = []
        if "reasoning_content" in part:
            out += self._ensure("reasoning")
            item = self.open
            assert item is not None
            item["content"][0]["text"] += part["reasoning_content"]
            out.append(self.w.event("response.reasoning_text.delta", item_id=item["id"], output_index=self._index,
                                    content_index=0, delta=part["reasoning_content"]))
        if "content" in part:
            out += self._ensure("message")
            item = self.open
            assert item is not None
            item["content"][0]["text"] += part["content"]
            if part["content"]:
                out.append(self.w.event("response.output_text.delta", item_id=item["id"], output_index=self._index,
                                        content_index=0, delta=part["content"], logprobs=[]))
        for call in part.get("tool_calls", []):
            if "id" in call or call["index"] != self.call_index:   # a new call opens
                out += self.close()
                self.call_index = call["index"]
                fn = call.get("function", {})
                self.open = _call_item(_id("fc"), call.get("id", _id("call")), fn.get("name", ""), "", "in_progress")
                self.w.items.append(self.open)
                out.append(self.w.event("response.output_item.added", output_index=self._index, item=self.open))
                arguments = fn.get("arguments", "")
            else:
                arguments = call["function"]["arguments"]
            if arguments:
                assert self.open is not None
                self.open["arguments"] += arguments
                out.append(self.w.event("response.function_call_arguments.delta", item_id=self.open["id"],
                                        output_index=self._index, delta=arguments))
        return out

    @property
    def _index(self) -> int:
        return len(self.w.items) - 1

    def _ensure(self, kind: str) -> list[bytes]:
        if self.open is not None and self.open["type"] == kind:
            return []
        out = self.close()
        if kind == "reasoning":
            self.open = _reasoning_item(_id("rs"), "")
        else:
            self.open = _message_item(_id("msg"), "", "in_progress")
        self.w.items.append(self.open)
        out.append(self.w.event("response.output_item.added", output_index=self._index,
                                item={**self.open, "content": []}))
        part = self.open["content"][0]
        out.append(self.w.event("response.content_part.added", item_id=self.open["id"], output_index=self._index,
                                content_index=0, part={**part, "text": ""}))
        return out

    def close(self) -> list[bytes]:
        item, self.open, self.call_index = self.open, None, -1
        if item is None:
            return []
        item["status"] = "completed"
        index, w = self._index, self.w
        out = []
        if item["type"] == "function_call":
            out.append(w.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                               name=item["name"], arguments=item["arguments"]))
        else:
            part = item["content"][0]
            if item["type"] == "message":
                out.append(w.event("response.output_text.done", item_id=item["id"], output_index=index,
                                   content_index=0, text=part["text"], logprobs=[]))
            else:
                out.append(w.event("response.reasoning_text.done", item_id=item["id"], output_index=index,
                                   content_index=0, text=part["text"]))
            out.append(w.event("response.content_part.done", item_id=item["id"], output_index=index,
                               content_index=0, part=part))
        out.append(w.event("response.output_item.done", output_index=index, item=item))
        return out


def _message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def _reasoning_item(item_id: str, text: str) -> dict[str, Any]:
    return {"type": "reasoning", "id": item_id, "summary": [], "status": "in_progress",
            "content": [{"type": "reasoning_text", "text": text}]}


def _call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def _tool_choice(req: ResponsesRequest) -> Any:
    if isinstance(req.tool_choice, FunctionToolChoice):
        return req.tool_choice.model_dump()
    return req.tool_choice or "auto"
