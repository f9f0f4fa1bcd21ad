"""Code of the serving node that runs in a tensor-parallel rank's own process, beside its model shard.

When each rank holds its own slice of the KV pool (a device, or `kv_pool_per_rank`), rank 0 cannot move a block's
KV alone: each rank's process must send or receive its slice. The engine does not know how KV moves (it imports
no kv_transfer); it runs what the node hands it: `LLMEngine.start_rank_agents(factory)` has every other rank call
`factory(its pool tensor, rank, size)` once (the factory is pickled to the rank: a module-level class; the agent
may hand back a tensor the pool moves into, `kv_pool`), and then

- hands the agent rank 0's messages in order with the steps (`LLMEngine.tell_rank_agent`, from the engine
  thread): the agent sees a message after the steps run before it was sent and before the next one, so a message
  about a step's KV reaches it exactly when that KV is (or is about to be) computed on its rank too;
- before each step asks the agent for a per-layer hook (`layer_hook`), called after each layer of that step wrote
  its KV on this rank (the layer-wise push);
- closes it when the rank stops.

An agent must not raise from these calls (the rank would stop serving): it reports its own failures to rank 0 by
its own means. What it needs besides (sockets, threads) it opens itself.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

import torch


class RankAgent(Protocol):
    info: Any   # picklable; handed back to rank 0 by start_rank_agents (e.g. the addresses the agent listens on)
    # None, or a tensor of the pool's shape and dtype that the rank's KV pool moves into as the agent starts (before
    # serving, the pool still empty): e.g. shared memory a sender on the same host writes into directly
    kv_pool: torch.Tensor | None

    def on_message(self, message: Any) -> None:
        """One of rank 0's messages, on the rank's main thread between steps; returns quickly."""

    def layer_hook(self) -> Callable[[int], None] | None:
        """Before a step: a callable for each of its layers once that layer's KV is written, or None."""

    def close(self) -> None:
        """The rank stops."""


RankAgentFactory = Callable[[torch.Tensor, int, int], RankAgent]   # (KV pool tensor of this rank, rank, size)
