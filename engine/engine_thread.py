"""One thread that owns an `LLMEngine` and drives `step()` whenever there is work.

Other threads hand it work as callables (`call` from an event loop, awaitable; `post` from anywhere);
it runs them between steps, so the engine itself stays single-threaded. Each step's outputs go to
`on_outputs`, called on the engine thread. Used by `AsyncLLMEngine` and by the node services. Importing
this module does not import torch (the thread does).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from typing import TYPE_CHECKING, Any, Callable

from pdcluster.engine.stats import EngineStats

if TYPE_CHECKING:
    from pdcluster.engine.llm_engine import LLMEngine
    from pdcluster.engine.outputs import RequestOutput

log = logging.getLogger(__name__)


class EngineThread:
    """`on_outputs(outputs)` gets each step's non-empty outputs, `on_outputs(exc)` a failed step. After a
    failed step the thread stops (`stop_on_error`: a broken step would repeat forever) or aborts every
    request in the engine and keeps serving."""

    def __init__(self, engine: LLMEngine, on_outputs: Callable[[list[RequestOutput] | BaseException], None],
                 stop_on_error: bool = True, idle_wait: float = 0.05, name: str = "engine") -> None:
        self.engine = engine
        self.on_outputs = on_outputs
        self.stop_on_error = stop_on_error
        self.idle_wait = idle_wait
        self.stats: EngineStats = engine.get_stats()   # refreshed by the thread after each step and when idle
        self.error: BaseException | None = None
        self._queue: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        """Start stepping. The calling thread (which built the engine, in a node) gives its OpenMP workers back
        first: a second team on the same cores makes every parallel region of the engine's slower (openmp.py)."""
        from pdcluster.engine.openmp import release_thread_team

        release_thread_team()
        self._thread.start()

    @property
    def stopped(self) -> bool:
        return self._stop.is_set() or self.error is not None

    def call(self, fn: Callable[[LLMEngine], Any]) -> asyncio.Future:
        """Run `fn(engine)` on the engine thread; the returned future (of the running loop) gets its result."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._queue.put((fn, fut, loop))
        return fut

    def post(self, fn: Callable[[LLMEngine], Any]) -> None:
        """Run `fn(engine)` on the engine thread; errors are logged. Callable from any thread."""
        self._queue.put((fn, None, None))

    def stop(self, timeout: float = 5.0) -> bool:
        """Stop after the step under way; whether the thread ended within `timeout`."""
        self._stop.set()
        self._queue.put(None)
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _run(self) -> None:
        import torch

        from pdcluster.device import bind_thread

        torch.set_grad_enabled(False)
        engine = self.engine
        bind_thread(engine.device)   # Ascend: device contexts are per thread
        while not self._stop.is_set():
            self._run_commands(block=not engine.has_unfinished_requests())
            try:
                if self._stop.is_set() or not engine.has_unfinished_requests():
                    self.stats = engine.get_stats()
                    engine.check_health()   # e.g. a tensor-parallel rank died while idle
                    continue
                outputs = engine.step()
            except Exception as exc:
                self.stats = engine.get_stats()
                if self.stop_on_error or getattr(exc, "fatal", False):
                    log.exception("engine step failed; the engine thread stops")
                    self.error = exc
                    self.on_outputs(exc)
                    return
                log.exception("engine step failed; every request in flight fails")
                engine.abort_all()
                self.on_outputs(exc)
                continue
            self.stats = engine.get_stats()
            if outputs:
                self.on_outputs(outputs)

    def _run_commands(self, block: bool) -> None:
        try:
            item = self._queue.get(timeout=self.idle_wait) if block else self._queue.get_nowait()
        except queue.Empty:
            return
        while item is not None:
            fn, fut, loop = item
            try:
                result = fn(self.engine)
            except Exception as exc:
                if fut is None:
                    log.exception("engine command failed")
                else:
                    loop.call_soon_threadsafe(_resolve, fut, None, exc)
            else:
                if fut is not None:
                    loop.call_soon_threadsafe(_resolve, fut, result, None)
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return


def _resolve(fut: asyncio.Future, result: Any, exc: BaseException | None) -> None:
    if fut.done():
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(result)
