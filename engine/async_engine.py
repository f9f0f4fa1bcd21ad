"""Asyncio front for the engine: many concurrent requests on one event loop.

An `EngineThread` runs `LLMEngine.step()` whenever there is work; new requests and aborts are handed
to it as commands (the engine itself stays single-threaded), and each step's outputs are delivered to
the waiting coroutines with `loop.call_soon_threadsafe`. Cancelling a consumer aborts its request; a
failing step fails the requests in flight and the engine keeps serving.
"""

from __future__ import annotations

import asyncio
import itertools
from typing import TYPE_CHECKING, AsyncIterator

from pdcluster.control.sampling_params import SamplingParams
from pdcluster.engine.args import AsyncEngineArgs, EngineArgs
from pdcluster.engine.engine_thread import EngineThread
from pdcluster.engine.lora.request import LoRARequest
from pdcluster.engine.outputs import RequestOutput
from pdcluster.engine.prompts import PromptType, resolve_prompt
from pdcluster.engine.stats import EngineStats

if TYPE_CHECKING:
    from pdcluster.engine.llm_engine import LLMEngine


class _Stream:
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()


class AsyncLLMEngine:
    """`AsyncLLMEngine(engine)` around a built `LLMEngine`, or `AsyncLLMEngine(model=..., **AsyncEngineArgs
    fields)` (same as `from_engine_args`)."""

    def __init__(self, engine: LLMEngine | None = None, **engine_args) -> None:
        if engine is None:
            from pdcluster.engine.llm_engine import LLMEngine  # torch; importing this module stays torch-free

            engine = LLMEngine(AsyncEngineArgs(**engine_args))
        elif engine_args:
            raise ValueError(f"AsyncLLMEngine: pass an engine or engine arguments, not both ({sorted(engine_args)})")
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self._streams: dict[str, _Stream] = {}
        self._ids = itertools.count()
        self._shut_down = False
        self._thread = EngineThread(engine, self._on_outputs, stop_on_error=False, idle_wait=0.1, name="engine-loop")
        self._thread.start()

    @classmethod
    def from_engine_args(cls, args: AsyncEngineArgs | EngineArgs) -> "AsyncLLMEngine":
        from pdcluster.engine.llm_engine import LLMEngine  # torch; importing this module stays torch-free

        return cls(LLMEngine(args))

    def _on_outputs(self, outputs: list[RequestOutput] | BaseException) -> None:
        """On the engine thread."""
        if isinstance(outputs, BaseException):   # the engine thread aborted every request
            for rid in list(self._streams):
                self._deliver(rid, outputs)
            return
        for out in outputs:
            self._deliver(out.request_id, out)

    def _deliver(self, rid: str, item: RequestOutput | BaseException) -> None:
        stream = self._streams.get(rid)
        if stream is None:
            return
        if isinstance(item, BaseException) or item.finished:
            self._streams.pop(rid, None)
        stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)

    # ---- public API -----------------------------------------------------------------------------

    async def generate_stream(self, prompt: PromptType, params: SamplingParams, request_id: str | None = None,
                              lora_request: LoRARequest | None = None) -> AsyncIterator[RequestOutput]:
        """Yields a RequestOutput per engine step that produced tokens (`new_token_ids`, `logprobs`: that step's);
        the last one has finished=True and the whole completion in `outputs[0]`, its text decoded. `lora_request`:
        run under that LoRA adapter (enable_lora)."""
        if self._thread.stopped:
            raise RuntimeError("engine is shut down")
        ids, text = resolve_prompt(prompt, self.tokenizer)
        if not ids:
            raise ValueError("prompt: the prompt is empty")
        rid = request_id or f"async-{next(self._ids)}"
        if rid in self._streams:
            raise ValueError(f"request_id {rid!r} is already in use")
        stream = _Stream(asyncio.get_running_loop())
        self._streams[rid] = stream
        finished = False
        try:
            await self._thread.call(lambda engine: engine.add_request(rid, ids, params, lora=lora_request))
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                item.prompt = text
                finished = item.finished
                if finished:   # the one output that carries the whole completion: detokenized once
                    completion = item.outputs[0]
                    completion.text = self.tokenizer.decode(completion.token_ids,
                                                            skip_special_tokens=params.skip_special_tokens)
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self._streams.pop(rid, None)
                self._thread.post(lambda engine: engine.abort(rid))

    async def generate(self, prompt: PromptType, params: SamplingParams, request_id: str | None = None,
                       lora_request: LoRARequest | None = None) -> RequestOutput:
        """The final RequestOutput of one request."""
        last = None
        async for out in self.generate_stream(prompt, params, request_id, lora_request):
            last = out
        assert last is not None
        return last

    def get_stats(self) -> EngineStats:
        """The engine thread's latest snapshot (refreshed after every step and while idle)."""
        return self._thread.stats

    async def abort(self, request_id: str) -> None:
        self._thread.post(lambda engine: engine.abort(request_id))

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stop the engine thread, then release the tensor-parallel ranks, their shared memory and the
        torch.distributed group (another engine may be built in this process after). Idempotent."""
        if self._shut_down:
            return
        self._shut_down = True
        if self._thread.stop(timeout):   # never under a step still running
            self.engine.shutdown()

    def __enter__(self) -> "AsyncLLMEngine":
        return self

    def __exit__(self, *exc_info) -> None:
        self.shutdown()

    async def __aenter__(self) -> "AsyncLLMEngine":
        return self

    async def __aexit__(self, *exc_info) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.shutdown)
