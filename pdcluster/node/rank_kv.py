"""A node whose engine's KV pool is sliced per tensor-parallel rank (a device, or `kv_pool_per_rank` on CPU): rank 0's
pool is one slice, so every rank moves its own slice over its own channel (kv_transfer/per_rank/).

`RankKV.start` has the engine run a KV endpoint in every other rank's process (`LLMEngine.start_rank_agents`:
a receiver on a decode node, listening on `kv_port + rank`, its slice in shared memory on CPU as rank 0's is, and
a sender made on first use) and connects rank 0's
links to them; `sender` and `receiver` then wrap rank 0's own `KVSender` / `KVReceiver` into the ranked ones the
node uses in their place. The node closes it after its engine stopped using it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pdcluster.kv_transfer import KVReceiver, KVSender
from pdcluster.kv_transfer.per_rank import RankedReceiver, RankedSender, RankEndpointSpec, RankLinks

if TYPE_CHECKING:
    from pdcluster.engine.llm_engine import LLMEngine
    from pdcluster.node.config import NodeConfig


class RankKV:
    def __init__(self, engine: LLMEngine, links: RankLinks, kv_addresses: list[str]) -> None:
        self.engine, self.links = engine, links
        self.kv_addresses = kv_addresses   # the other ranks' KV receivers, rank 1 first ("" where none)

    @classmethod
    def start(cls, engine: LLMEngine, config: NodeConfig, auth_key: bytes | None, receive: bool) -> "RankKV":
        spec = RankEndpointSpec(receive=receive, shared_memory=engine.device.type == "cpu", host=config.host,
                                kv_port=config.kv_port, backend=config.kv_backend,
                                connect_timeout=config.kv_connect_timeout, auth_key=auth_key,
                                finish_timeout=config.kv_ack_timeout, model_kv_heads=engine.model_config.num_kv_heads)
        infos = engine.start_rank_agents(spec)
        return cls(engine, RankLinks([info["link"] for info in infos]), [info["kv_addr"] for info in infos])

    @property
    def rank_slice(self) -> tuple[int, int, int]:
        """Rank 0's place among the slices, and the model's KV heads (fewer than slices: each holds a copy of one)."""
        return 0, self.links.size, self.engine.model_config.num_kv_heads

    def sender(self, local: KVSender) -> RankedSender:
        """Rank 0's `local` sender (on its slice, `rank_slice`) with every other rank's; starts made on the engine
        thread reach the ranks in order with its steps."""
        return RankedSender(local, self.links, self.engine.tell_rank_agent)

    def receiver(self, local: KVReceiver) -> RankedReceiver:
        return RankedReceiver(local, self.links, self.kv_addresses)

    def close(self) -> None:
        self.links.close()
