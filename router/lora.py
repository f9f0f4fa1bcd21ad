"""Multi-LoRA on the router: which adapters exist (loaded through this router's endpoints, or reported by the nodes
that hold them in their Load reports), their base model, and placing / removing one on every node of its base
model that runs with `enable_lora` (`POST /v1/load_lora_adapter`, `/v1/unload_lora_adapter`, vLLM's endpoints).

A request names an adapter by `model`; the router serves it as a view of its base model (same tokenizer and
limits) and sends it to decode (and prefill) nodes that hold the adapter, or, when none does but its path is known,
to ones that may load it (the node loads it on arrival: `Generate.lora_path`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
from dataclasses import dataclass

from pdcluster.control.protocol import LoraAdapter, LoraDone
from pdcluster.router.cluster import NodeState, RouterCluster
from pdcluster.router.errors import APIError, bad_request
from pdcluster.router.tokenizer import ServedModel

LORA_OP_TIMEOUT_S = 60.0   # a node loading an adapter from disk (or unloading it) answers within this
_ops = itertools.count(1)


@dataclass(frozen=True)
class Adapter:
    name: str
    parent: str   # the served name of its base model
    path: str     # where nodes load it from ("": only nodes that hold it already serve it)


def holds(node: NodeState, name: str) -> bool:
    return node.load is not None and name in node.load.loras


def runs_lora(node: NodeState) -> bool:
    return node.load is not None and node.load.max_loras > 0


def lora_nodes(nodes: list[NodeState], adapter: Adapter) -> list[NodeState]:
    """Of `nodes`, the ones that hold `adapter`; when none does and its path is known, the ones that can load it."""
    holding = [n for n in nodes if holds(n, adapter.name)]
    if holding or not adapter.path:
        return holding
    return [n for n in nodes if runs_lora(n)]


class LoraRegistry:
    def __init__(self, cluster: RouterCluster, models: dict[str, ServedModel]) -> None:
        self.cluster = cluster
        self.models = models
        self.loaded: dict[str, Adapter] = {}   # through this router's endpoint

    def find(self, name: str) -> Adapter | None:
        """The adapter `name`: loaded here, or held by a node (its base model: that node's)."""
        if name in self.loaded:
            return self.loaded[name]
        for node in self.cluster.nodes("decode"):
            if holds(node, name) and node.info.model in self.models:
                return Adapter(name, node.info.model, "")
        return None

    def view(self, name: str) -> ServedModel | None:
        """The served model a request for adapter `name` runs as: its base model's, named `name`."""
        adapter = self.find(name)
        if adapter is None or adapter.parent not in self.models:
            return None
        base = self.models[adapter.parent]
        return ServedModel(dataclasses.replace(base.info, name=name), base.tokenizer, adapter=adapter)

    def listed(self) -> list[Adapter]:
        """Every adapter some decode node holds or may load, by name."""
        found = dict(self.loaded)
        for node in self.cluster.nodes("decode"):
            for name in node.load.loras if node.load is not None else []:
                if name not in found and node.info.model in self.models:
                    found[name] = Adapter(name, node.info.model, "")
        return [found[n] for n in sorted(found)]

    async def load(self, dealers, replies: dict[str, asyncio.Future], name: str, path: str, parent: str) -> None:
        """Load adapter `name` from `path` on every node of `parent` that runs with enable_lora; APIError (400)
        naming the nodes that refused."""
        if name in self.models or self.find(name) is not None:   # here, or held by a node (lora_modules, a router)
            raise bad_request(f"The lora adapter '{name}' has already been loaded.", param="lora_name")
        nodes = [n for role in ("decode", "prefill") for n in self.cluster.nodes(role)
                 if n.serves(parent) and runs_lora(n)]
        if not any(n.info.role == "decode" for n in nodes):
            raise bad_request(f"no decode node of model '{parent}' runs with enable_lora", param="lora_name")
        errors = await self._each(dealers, replies, nodes, name, path)
        if errors:   # leave no node holding half of it: unload where it loaded
            failed = {e.split(":", 1)[0] for e in errors}
            await self._each(dealers, replies, [n for n in nodes if n.id not in failed], name, "")
            raise bad_request(f"LoRA adapter '{name}' could not be loaded: " + "; ".join(errors), param="lora_path")
        self.loaded[name] = Adapter(name, parent, path)

    async def unload(self, dealers, replies: dict[str, asyncio.Future], name: str) -> None:
        adapter = self.find(name)
        if adapter is None:
            raise APIError(404, f"The lora adapter '{name}' cannot be found.", param="lora_name",
                           code="model_not_found")
        nodes = [n for role in ("decode", "prefill") for n in self.cluster.nodes(role)
                 if n.serves(adapter.parent) and holds(n, name)]
        self.loaded.pop(name, None)
        errors = await self._each(dealers, replies, nodes, name, "")
        if errors:
            raise bad_request(f"LoRA adapter '{name}' could not be unloaded: " + "; ".join(errors),
                              param="lora_name")

    async def _each(self, dealers, replies: dict[str, asyncio.Future], nodes: list[NodeState], name: str,
                    path: str) -> list[str]:
        """Send the op to every node at once; the errors ("node: why"), a node that does not answer in time
        included."""
        if not nodes:
            return []
        loop = asyncio.get_running_loop()
        waits: dict[str, asyncio.Future] = {}
        for node in nodes:
            rid = f"lora-{next(_ops)}"
            replies[rid] = waits[node.id] = loop.create_future()
            if not dealers.send(node.id, node.info.control_addr, LoraAdapter(rid=rid, name=name, path=path)):
                waits[node.id].set_result(LoraDone(rid=rid, error="could not send"))
        errors = []
        try:
            done, _ = await asyncio.wait(waits.values(), timeout=LORA_OP_TIMEOUT_S)
            for node_id, fut in waits.items():
                if fut not in done:
                    errors.append(f"{node_id}: no answer in {LORA_OP_TIMEOUT_S:g} s")
                elif fut.result().error:
                    errors.append(f"{node_id}: {fut.result().error}")
        finally:
            for rid in [r for r, f in replies.items() if f in waits.values()]:
                del replies[rid]
        return errors
