"""OpenAI response shapes: logprobs, whole (non-streamed) bodies, SSE chunks and the SSE response."""

from __future__ import annotations

import time
import uuid
from typing import Any, AsyncIterator

import orjson
from fastapi.responses import StreamingResponse

from pdcluster.router.chat_output import ChatOutput
from pdcluster.router.chat_output import message as chat_message
from pdcluster.router.generation import ChoiceDelta, TokenLogprob
from pdcluster.router.tokenizer import Tokenizer
from pdcluster.router.validation import Prepared

DONE = b"data: [DONE]\n\n"


def completion_logprobs(tokenizer: Tokenizer, lps: list[TokenLogprob], offset: int) -> dict[str, Any]:
    """/v1/completions' `choice.logprobs`; `offset`: where this text starts in the choice's whole text."""
    tokens = [tokenizer.token_text(lp.token_id) for lp in lps]
    offsets = []
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in lps],
            "top_logprobs": [None if lp.logprob is None else {tokenizer.token_text(t): v for t, v in lp.top}
                             for lp in lps],
            "text_offset": offsets}


def vllm_prompt_logprobs(tokenizer: Tokenizer, lps: list[TokenLogprob]) -> list[dict[str, Any] | None]:
    """vLLM's `prompt_logprobs`: per prompt token None (the first) or {token id: {logprob, rank,
    decoded_token}} holding the prompt's token and the top-N (rank: 1-based among the top-N; null for the
    prompt's token when it is not among them)."""
    out: list[dict[str, Any] | None] = []
    for lp in lps:
        if lp.logprob is None:
            out.append(None)
            continue
        entry = {str(t): {"logprob": v, "rank": r, "decoded_token": tokenizer.token_text(t)}
                 for r, (t, v) in enumerate(lp.top, start=1)}
        entry.setdefault(str(lp.token_id), {"logprob": lp.logprob, "rank": None,
                                            "decoded_token": tokenizer.token_text(lp.token_id)})
        out.append(entry)
    return out


def chat_logprobs(tokenizer: Tokenizer, lps: list[TokenLogprob]) -> list[dict[str, Any]]:
    """/v1/chat/completions' `choice.logprobs.content`."""
    tt, tb = tokenizer.token_text, tokenizer.token_bytes
    return [{"token": tt(lp.token_id), "logprob": lp.logprob, "bytes": tb(lp.token_id),
             "top_logprobs": [{"token": tt(t), "logprob": v, "bytes": tb(t)} for t, v in lp.top]}
            for lp in lps]


def sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


def full_body(prep: Prepared, chat: bool, want_logprobs: bool, texts: list[str],
              logprobs: list[list[TokenLogprob]], finish: list[str | None], usage: dict[str, int],
              prompt_logprobs: list[list[TokenLogprob]] | None = None) -> dict[str, Any]:
    """A whole completion (chat or not) from each choice's text, logprobs and finish reason (and, asked,
    each completion choice's prompt logprobs)."""
    created = int(time.time())
    tok = prep.model.tokenizer
    choices: list[dict[str, Any]]
    if chat:
        choices = [{"index": i, "message": {"role": "assistant", "content": texts[i]},
                    "logprobs": {"content": chat_logprobs(tok, logprobs[i]), "refusal": None}
                    if want_logprobs else None,
                    "finish_reason": finish[i]} for i in range(len(texts))]
        if prep.chat is not None:   # reasoning and tool calls split out of the text
            for choice, text in zip(choices, texts, strict=True):
                output = ChatOutput(prep.chat)
                choice["message"] = chat_message(output, text)
                choice["finish_reason"] = output.finish_reason(choice["finish_reason"])
        return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": created,
                "model": prep.model.name, "choices": choices, "usage": usage}
    choices = [{"index": i, "text": texts[i],
                "logprobs": completion_logprobs(tok, logprobs[i], 0) if want_logprobs else None,
                "finish_reason": finish[i]} for i in range(len(texts))]
    if prep.prompt_logprobs is not None:
        for choice, lps in zip(choices, prompt_logprobs or [[] for _ in choices], strict=True):
            choice["prompt_logprobs"] = vllm_prompt_logprobs(tok, lps)
    return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": created,
            "model": prep.model.name, "choices": choices, "usage": usage}


class ChunkWriter:
    """The SSE chunks of one streamed response: a common head (id, object, created, model), per-choice
    text offsets (completions' logprobs count them over the whole text)."""

    def __init__(self, prep: Prepared, num_choices: int, chat: bool, want_logprobs: bool) -> None:
        self.chat = chat
        self.want_logprobs = want_logprobs
        self.include_usage = prep.include_usage
        self.tokenizer = prep.model.tokenizer
        rid = f"chatcmpl-{uuid.uuid4().hex}" if chat else f"cmpl-{uuid.uuid4().hex}"
        self.head = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                     "created": int(time.time()), "model": prep.model.name}
        self.offsets = [0] * num_choices
        self.outputs = [ChatOutput(prep.chat) for _ in range(num_choices)] if chat and prep.chat else None
        self._text_templates: dict[int, tuple[bytes, bytes]] = {}   # choice index -> chunk around its text

    def chunk(self, choices: list[dict[str, Any]], usage: dict | None = None) -> bytes:
        body: dict[str, Any] = {**self.head, "choices": choices}
        if self.include_usage:
            body["usage"] = usage
        return sse(body)

    def roles(self) -> bytes:
        """Chat's first chunk: every choice's assistant role."""
        return self.chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                            "finish_reason": None} for i in range(len(self.offsets))])

    def delta(self, delta: ChoiceDelta) -> bytes:
        if self.outputs is not None:
            return self._chat_output(delta)
        if delta.finish_reason is None and not self.want_logprobs and delta.prompt_logprobs is None:   # text only
            template = self._text_templates.get(delta.index)
            if template is None:
                template = self._text_templates[delta.index] = self._text_template(delta.index)
            return template[0] + orjson.dumps(delta.text) + template[1]
        return self.chunk([self._choice(delta)])

    def _text_template(self, index: int) -> tuple[bytes, bytes]:
        """This choice's text chunk as the bytes before and after its JSON text. The marker cannot occur
        elsewhere: inside a JSON string every quote is escaped."""
        marker = b'"content":""' if self.chat else b'"text":""'
        before, after = self.chunk([self._choice(ChoiceDelta(index, ""))]).split(marker)
        return before + marker[:-2], after

    def _chat_output(self, delta: ChoiceDelta) -> bytes:
        """A chat delta through its choice's `ChatOutput`: one chunk per reasoning / content / tool-call
        piece (logprobs on the first), the finish reason on the last; nothing while a piece is held back."""
        assert self.outputs is not None
        output = self.outputs[delta.index]
        pieces = output.feed(delta.text)
        if delta.finish_reason is not None:
            pieces += output.finish()
        lp = ({"content": chat_logprobs(self.tokenizer, delta.logprobs), "refusal": None}
              if self.want_logprobs and delta.logprobs else None)
        if delta.finish_reason is not None or (lp is not None and not pieces):
            pieces.append({})
        chunks: list[dict[str, Any]] = [{"index": delta.index, "delta": piece, "logprobs": lp if i == 0 else None,
                                         "finish_reason": None} for i, piece in enumerate(pieces)]
        if chunks and delta.finish_reason is not None:
            chunks[-1]["finish_reason"] = output.finish_reason(delta.finish_reason)
        return b"".join(self.chunk([c]) for c in chunks)

    def usage(self, usage: dict[str, int]) -> bytes:
        return self.chunk([], usage)

    def _choice(self, delta: ChoiceDelta) -> dict[str, Any]:
        if self.chat:
            lp = ({"content": chat_logprobs(self.tokenizer, delta.logprobs), "refusal": None}
                  if self.want_logprobs and delta.logprobs else None)
            content = {"content": delta.text} if delta.text or not delta.finish_reason else {}
            return {"index": delta.index, "delta": content, "logprobs": lp, "finish_reason": delta.finish_reason}
        lp = (completion_logprobs(self.tokenizer, delta.logprobs, self.offsets[delta.index])
              if self.want_logprobs else None)
        self.offsets[delta.index] += len(delta.text)
        choice = {"index": delta.index, "text": delta.text, "logprobs": lp, "finish_reason": delta.finish_reason}
        if delta.prompt_logprobs is not None:
            choice["prompt_logprobs"] = vllm_prompt_logprobs(self.tokenizer, delta.prompt_logprobs)
        return choice


class SSEResponse(StreamingResponse):
    """An SSE response that releases its request even when the body generator never started
    (the client left before the first byte): `cleanup` runs exactly once, however it ends."""

    def __init__(self, body: AsyncIterator[bytes], cleanup: Any) -> None:
        super().__init__(body, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._cleanup = cleanup

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._cleanup()
