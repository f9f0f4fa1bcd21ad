"""One choice of a request: token stream -> text deltas with stop strings and logprobs applied."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from pdcluster.control.protocol import logprob_from_wire
from pdcluster.router.decode_client import RequestStream
from pdcluster.router.detokenizer import IncrementalDetokenizer, StopMatcher
from pdcluster.router.metrics import RouterMetrics
from pdcluster.router.tokenizer import Tokenizer


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float | None   # None: the prompt's first token (nothing before it to score it)
    top: list[tuple[int, float]]


@dataclass
class ChoiceDelta:
    index: int
    text: str
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_logprobs: list[TokenLogprob] | None = None   # vLLM's prompt_logprobs, on a choice's first delta


@dataclass
class Echo:
    """Completions' echo: the prompt text that leads a choice, with its tokens' logprobs (`logprobs`: top-N)
    when logprobs are asked; `only` (max_tokens 0): nothing generated is shown."""

    text: str
    logprobs: int | None
    only: bool


class ChoiceRun:
    def __init__(self, index: int, stream: RequestStream, tokenizer: Tokenizer, stop: list[str],
                 skip_special_tokens: bool, metrics: RouterMetrics, arrival: float, echo: Echo | None = None,
                 prompt_logprobs: int | None = None) -> None:
        self.index = index
        self.echo = echo
        self.prompt_logprobs = prompt_logprobs   # top-N of the choice's `prompt_logprobs` (None: not asked)
        self.stream = stream
        self.detokenizer = IncrementalDetokenizer(tokenizer, stream.prompt_ids, skip_special_tokens)
        self.stop = StopMatcher(stop)
        self.metrics = metrics
        self.arrival = arrival
        self.first_token_time = 0.0
        self.num_tokens = 0

    async def deltas(self) -> AsyncIterator[ChoiceDelta]:
        """Text deltas until the choice finishes; the last one carries finish_reason."""
        last = time.monotonic()
        first = True
        while True:
            msg = await self.stream.next()
            if first:
                first = False
                head = self._head()
                if head is not None:
                    yield head
                    if head.finish_reason is not None:
                        self.stream.abort("client")   # a no-op: max_tokens was 1, it finished on this message
                        return
            now = time.monotonic()
            if msg.ids:
                if not self.first_token_time:
                    self.first_token_time = now
                    self.metrics.ttft.observe(now - self.arrival)
                else:
                    self.metrics.itl.observe(now - last)
                last = now
                self.num_tokens += len(msg.ids)
            logprobs = _parse_logprobs(msg.ids, msg.logprobs)
            emit, stopped, kept = self._text(msg.ids, msg.finish is not None)
            if stopped:
                self.num_tokens -= len(msg.ids) - kept
                self.stream.abort("stop_string")
                yield ChoiceDelta(self.index, emit, logprobs[:kept], "stop")
                return
            if msg.finish is not None:
                yield ChoiceDelta(self.index, emit + self.stop.flush(), logprobs, msg.finish)
                return
            if emit or logprobs:
                yield ChoiceDelta(self.index, emit, logprobs)

    def _text(self, ids: list[int], last: bool) -> tuple[str, bool, int]:
        """(text to emit, a stop string matched, tokens kept) of one message's ids. A message of several tokens
        (a decode step that accepted speculative drafts, or a backlog) meets the stop strings token by token:
        the tokens after the one that completes a stop string are dropped, as if they had come one by one."""
        if len(ids) > 1 and self.stop.stops:
            emitted = []
            for i, token in enumerate(ids):
                piece = self.detokenizer.add([token])
                if last and i == len(ids) - 1:
                    piece += self.detokenizer.flush()
                emit, stopped = self.stop.feed(piece)
                emitted.append(emit)
                if stopped:
                    return "".join(emitted), True, i + 1
            return "".join(emitted), False, len(ids)
        text = self.detokenizer.add(ids) if ids else ""
        if last:
            text += self.detokenizer.flush()
        emit, stopped = self.stop.feed(text)
        return emit, stopped, len(ids)

    def _head(self) -> ChoiceDelta | None:
        """The delta before the generated text: the echoed prompt and the prompt logprobs, once the first
        message brought them (the engines send them with the request's first tokens)."""
        if self.echo is None and self.prompt_logprobs is None:
            return None
        entries = prompt_entries(self.stream.prompt_ids, self.stream.prompt_logprobs)
        head = ChoiceDelta(self.index, "")
        if self.prompt_logprobs is not None:
            head.prompt_logprobs = _top(entries, self.prompt_logprobs)
        if self.echo is not None:
            head.text = self.echo.text
            head.logprobs = _top(entries, self.echo.logprobs) if self.echo.logprobs is not None else []
            head.finish_reason = "length" if self.echo.only else None
        return head

    def observe_end(self) -> None:
        if self.first_token_time and self.num_tokens > 1:
            self.metrics.tpot.observe((time.monotonic() - self.first_token_time) / (self.num_tokens - 1))


def _parse_logprobs(ids: list[int], raw: list[Any] | None) -> list[TokenLogprob]:
    """Tokens.logprobs: per token [sampled_logprob, [[token_id, logprob], ...]]; tolerate junk."""
    if not raw:
        return []
    out = []
    for token_id, entry in zip(ids, raw, strict=False):   # junk of another length: the shorter
        try:
            parsed = logprob_from_wire(entry)
        except (TypeError, ValueError, IndexError):
            parsed = None
        logprob, top = parsed if parsed is not None else (float("nan"), [])
        out.append(TokenLogprob(token_id, logprob, top))
    return out


def prompt_entries(prompt_ids: list[int], raw: list[Any] | None) -> list[TokenLogprob]:
    """Per prompt token its logprob from the wire entries: None for the first, and where an entry is missing
    or malformed (an engine that sent none) — null in the response, never a NaN the JSON could not hold."""
    raw = raw or []
    out = []
    for j, token_id in enumerate(prompt_ids):
        try:
            parsed = logprob_from_wire(raw[j]) if 0 < j < len(raw) else None
        except (TypeError, ValueError, IndexError):
            parsed = None
        out.append(TokenLogprob(token_id, *parsed) if parsed is not None else TokenLogprob(token_id, None, []))
    return out


def _top(entries: list[TokenLogprob], n: int) -> list[TokenLogprob]:
    return [TokenLogprob(e.token_id, e.logprob, e.top[:n]) for e in entries]


async def merge(runs: list[ChoiceRun]) -> AsyncIterator[ChoiceDelta]:
    """Interleave the deltas of n choices as they come; errors propagate; abort all on exit."""
    if len(runs) == 1:   # the common case: no pump task, no queue between the stream and the response
        run = runs[0]
        try:
            async for delta in run.deltas():
                yield delta
            run.observe_end()
        finally:
            run.stream.abort("client")
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(run: ChoiceRun) -> None:
        try:
            async for delta in run.deltas():
                await queue.put(delta)
            await queue.put(run)  # this choice is done
        except Exception as exc:
            await queue.put(exc)

    tasks = [asyncio.create_task(pump(run)) for run in runs]
    try:
        remaining = len(runs)
        while remaining:
            item = await queue.get()
            if isinstance(item, Exception):
                raise item
            if isinstance(item, ChoiceRun):
                remaining -= 1
                item.observe_end()
                continue
            yield item
    finally:
        for task in tasks:
            task.cancel()
        for run in runs:
            run.stream.abort("client")
