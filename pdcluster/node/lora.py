"""A node's side of Multi-LoRA: adapter ids for the engine, loads and unloads a router asks for (LoraAdapter ->
LoraDone), and the adapter names its Load reports list (routers send an adapter's requests to nodes holding it).

The engine keeps the adapters (engine/lora/: loaded once per name, then in its host cache and device slots); the
list here is the engine's, refreshed after every load or unload this node makes.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from typing import TYPE_CHECKING, Callable

from pdcluster.control.protocol import LoraAdapter, LoraDone
from pdcluster.engine.lora.request import LoRARequest

if TYPE_CHECKING:
    from pdcluster.engine.engine_thread import EngineThread
    from pdcluster.engine.llm_engine import LLMEngine

log = logging.getLogger(__name__)


class NodeLoras:
    def __init__(self, engine: LLMEngine, engine_thread: EngineThread,
                 reply: Callable[[bytes, LoraDone], object]) -> None:
        self.engine_thread = engine_thread
        self.reply = reply
        lora = engine.args.lora_config()
        self.max_loras = lora.max_loras if lora is not None else 0   # 0: the engine runs without enable_lora
        self.names: list[str] = [r.lora_name for r in engine.list_loras()] if lora is not None else []
        self._ids: dict[str, int] = {r.lora_name: r.lora_int_id for r in engine.list_loras()} if lora else {}
        self._next_id = itertools.count(max(self._ids.values(), default=0) + 1)
        self._tasks: set[asyncio.Task] = set()

    def request(self, name: str, path: str = "") -> LoRARequest:
        """The engine's request for adapter `name` (a stable id per name on this node)."""
        if name not in self._ids:
            self._ids[name] = next(self._next_id)
        return LoRARequest(name, self._ids[name], path)

    async def load(self, name: str, path: str) -> str:
        """Load `name` from `path` (if not held yet) on the engine thread; its content hash. ValueError if the node
        cannot serve it (no enable_lora, a bad checkpoint, a rank over max_lora_rank)."""
        lora = self.request(name, path)
        digest = await self.engine_thread.call(lambda e: e.add_lora(lora))
        await self._refresh()
        return digest

    def handle(self, identity: bytes, msg: LoraAdapter) -> None:
        """On the event loop: a router's load (path given) or unload."""
        task = asyncio.create_task(self._run(identity, msg), name=f"lora:{msg.name}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run(self, identity: bytes, msg: LoraAdapter) -> None:
        error = None
        try:
            if msg.path:
                await self.load(msg.name, msg.path)
            else:
                name = msg.name
                if not await self.engine_thread.call(lambda e: e.remove_lora(name)):
                    raise ValueError(f"LoRA adapter {name!r} is not loaded")
                await self._refresh()
        except Exception as exc:   # ValueError from the engine: a bad adapter, one in use, no enable_lora
            error = str(exc)
            log.warning("LoRA adapter %s: %s failed: %s", msg.name, "load" if msg.path else "unload", error)
        self.reply(identity, LoraDone(rid=msg.rid, error=error))

    async def _refresh(self) -> None:
        held = await self.engine_thread.call(lambda e: e.list_loras())
        self.names = [r.lora_name for r in held]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
