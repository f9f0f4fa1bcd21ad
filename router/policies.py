"""Routing policies: which decode node runs a request, and which prefill node (if any) prefills it.

Candidates come from `RouterCluster.candidates` (cordoned/draining nodes already removed).
"""

from __future__ import annotations

import math

from pdcluster.control.block_hash import block_hashes, cached_prefix_blocks
from pdcluster.router.cluster import NodeState


class Prompt:
    """A prompt's token ids and, lazily per block size, its chained block hashes."""

    def __init__(self, token_ids: list[int]) -> None:
        self.token_ids = token_ids
        self._hashes: dict[int, list[int]] = {}

    def __len__(self) -> int:
        return len(self.token_ids)

    def cached_tokens(self, node: NodeState) -> int:
        """Leading prompt tokens already in `node`'s prefix cache (per its last Load report)."""
        if not node.cached:
            return 0
        size = node.block_size
        if size not in self._hashes:
            self._hashes[size] = block_hashes(self.token_ids, size)
        return cached_prefix_blocks(self._hashes[size], node.cached) * size


def decode_load(node: NodeState) -> int:
    load = node.load
    return (load.running + load.waiting if load else 0) + node.assigned_since_report


def has_room(node: NodeState, num_tokens: int) -> bool:
    if node.load is None:
        return True  # no report yet: let the node decide (it rejects fast when full)
    return node.load.free_blocks >= math.ceil(num_tokens / node.load.block_size)


class RoutingPolicy:
    name = ""

    def pick_decode(self, nodes: list[NodeState], num_tokens: int) -> NodeState | None:
        raise NotImplementedError

    def pick_prefill(self, nodes: list[NodeState], prompt: Prompt) -> NodeState | None:
        raise NotImplementedError


class RoundRobinPolicy(RoutingPolicy):
    name = "round_robin"

    def __init__(self) -> None:
        self._turn = {"decode": 0, "prefill": 0}

    def _next(self, role: str, nodes: list[NodeState]) -> NodeState | None:
        if not nodes:
            return None
        nodes = sorted(nodes, key=lambda n: n.id)
        node = nodes[self._turn[role] % len(nodes)]
        self._turn[role] += 1
        return node

    def pick_decode(self, nodes: list[NodeState], num_tokens: int) -> NodeState | None:
        return self._next("decode", nodes)

    def pick_prefill(self, nodes: list[NodeState], prompt: Prompt) -> NodeState | None:
        return self._next("prefill", nodes)


class LeastLoadedPolicy(RoutingPolicy):
    """Decode: among nodes with KV room for prompt + max_tokens (any node if none has), the one
    with the fewest running + waiting sequences, then the most free blocks.
    Prefill: the fewest queued prefill tokens."""

    name = "least_loaded"

    def pick_decode(self, nodes: list[NodeState], num_tokens: int) -> NodeState | None:
        pool = [n for n in nodes if has_room(n, num_tokens)] or nodes
        if not pool:
            return None
        return min(pool, key=lambda n: (decode_load(n), -(n.load.free_blocks if n.load else 0), n.id))

    def prefill_cost(self, node: NodeState, prompt: Prompt) -> int:
        queued = node.load.queued_prefill_tokens if node.load else 0
        return queued + node.prefill_tokens_since_report

    def pick_prefill(self, nodes: list[NodeState], prompt: Prompt) -> NodeState | None:
        if not nodes:
            return None
        return min(nodes, key=lambda n: (self.prefill_cost(n, prompt), n.id))


class PrefixAwarePolicy(LeastLoadedPolicy):
    """Prefill: the node that finishes this prompt soonest in tokens of work:
    queued prefill tokens + the part of this prompt it does not have cached."""

    name = "prefix_aware"

    def prefill_cost(self, node: NodeState, prompt: Prompt) -> int:
        return super().prefill_cost(node, prompt) + len(prompt) - prompt.cached_tokens(node)


POLICIES: dict[str, type[RoutingPolicy]] = {
    cls.name: cls for cls in (RoundRobinPolicy, LeastLoadedPolicy, PrefixAwarePolicy)
}


def make_policy(name: str) -> RoutingPolicy:
    if name not in POLICIES:
        raise ValueError(f"routing_policy must be one of {sorted(POLICIES)}, got {name!r}")
    return POLICIES[name]()


def choose_prefill(policy: RoutingPolicy, nodes: list[NodeState], prompt: Prompt,
                   disagg_min_tokens: int) -> NodeState | None:
    """Conditional disaggregation: a short prompt no prefill node has cached is prefilled on the
    decode node itself (None); so is every prompt when no prefill node is available."""
    if not nodes:
        return None
    if len(prompt) < disagg_min_tokens and not any(prompt.cached_tokens(n) for n in nodes):
        return None
    return policy.pick_prefill(nodes, prompt)


def note_assignment(decode: NodeState, prefill: NodeState | None, num_prompt_tokens: int) -> None:
    decode.assigned_since_report += 1
    if prefill is not None:
        prefill.prefill_tokens_since_report += num_prompt_tokens
