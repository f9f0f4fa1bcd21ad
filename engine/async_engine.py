"""Asyncio front for the engine: many concurrent requests on one event loop.

A background thread runs `LLMEngine.step()` whenever there is work; new requests and aborts are
handed to it through a queue (the engine itself stays single-threaded), and each step's outputs are
delivered to the waiting coroutines with `loop.call_soon_threadsafe`. Cancelling a consumer aborts
its request.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
from typing import TYPE_CHECKING, AsyncIterator

from pdcluster.control.sampling_params import SamplingParams
from pdcluster.engine.args import AsyncEngineArgs, EngineArgs
from pdcluster.engine.outputs import RequestOutput

if TYPE_CHECKING:
    from pdcluster.engine.llm_engine import LLMEngine

log = logging.getLogger(__name__)


class _Stream:
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, _Stream] = {}
        self._ids = itertools.count()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="engine-loop", daemon=True)
        self._thread.start()

    @classmethod
    def from_engine_args(cls, args: AsyncEngineArgs | EngineArgs) -> "AsyncLLMEngine":
        from pdcluster.engine.llm_engine import LLMEngine  # torch; importing this module stays torch-free

        return cls(LLMEngine(args))

    # ---- engine thread --------------------------------------------------------------------------

    def _loop(self) -> None:
        import torch

        torch.set_grad_enabled(False)
        while not self._stopped.is_set():
            block = not self.engine.has_unfinished_requests()
            try:
                cmd = self._commands.get(timeout=0.1) if block else self._commands.get_nowait()
            except queue.Empty:
                cmd = None
            while cmd is not None:
                self._apply(cmd)
                try:
                    cmd = self._commands.get_nowait()
                except queue.Empty:
                    cmd = None
            if not self.engine.has_unfinished_requests():
                continue
            try:
                outputs = self.engine.step()
            except Exception as exc:  # a broken step fails every in-flight request, the loop keeps serving
                log.exception("engine step failed")
                for rid in list(self._streams):
                    self.engine.abort(rid)
                    self._deliver(rid, exc)
                continue
            for out in outputs:
                self._deliver(out.request_id, out)

    def _apply(self, cmd) -> None:
        kind, rid, *rest = cmd
        if kind == "add":
            ids, params = rest
            try:
                self.engine.add_request(rid, ids, params)
            except Exception as exc:
                self._deliver(rid, exc)
        else:
            self.engine.abort(rid)

    def _deliver(self, rid: str, item) -> None:
        stream = self._streams.get(rid)
        if stream is None:
            return
        if isinstance(item, RequestOutput) and item.finished or isinstance(item, BaseException):
            self._streams.pop(rid, None)
        stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)

    # ---- public API -----------------------------------------------------------------------------

    async def generate_stream(self, prompt: str | list[int], params: SamplingParams,
                              request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Yields a RequestOutput per engine step that produced tokens; the last one has finished=True."""
        if self._stopped.is_set():
            raise RuntimeError("engine is shut down")
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise ValueError("prompt: the prompt is empty")
        rid = request_id or f"async-{next(self._ids)}"
        if rid in self._streams:
            raise ValueError(f"request_id {rid!r} is already in use")
        stream = _Stream(asyncio.get_running_loop())
        self._streams[rid] = stream
        self._commands.put(("add", rid, ids, params))
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                completion = item.outputs[0]
                completion.text = self.tokenizer.decode(completion.token_ids, skip_special_tokens=params.skip_special_tokens)
                item.prompt = prompt if isinstance(prompt, str) else None
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self._streams.pop(rid, None)
                self._commands.put(("abort", rid))

    async def generate(self, prompt: str | list[int], params: SamplingParams,
                       request_id: str | None = None) -> RequestOutput:
        """The final RequestOutput of one request."""
        last = None
        async for out in self.generate_stream(prompt, params, request_id):
            last = out
        assert last is not None
        return last

    async def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))

    def shutdown(self, timeout: float = 5.0) -> None:
        self._stopped.set()
        self._thread.join(timeout)
