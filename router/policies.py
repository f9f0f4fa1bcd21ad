"""Routing policies: which decode node runs a request, and which prefill node (if any) prefills it.

Candidates come from `RouterCluster.candidates` (cordoned/draining nodes already removed).
"""

from __future__ import annotations

import math

from pdcluster.control.block_hash import block_hashes
from pdcluster.router.cluster import NodeState

# What reusing a cached block costs, as a fraction of computing it, by the tier that holds it (pool, host memory,
# disk): a pool hit is free, a host block a copy, a disk block a read (docs/benchmarks.md "KV cache tiers").
TIER_COST = (0.0, 0.1, 0.3)
DECODE_LOAD_SLACK = 2   # requests a decode node may have over the least loaded one and still win on its prefix
FETCH_MIN_BLOCKS = 2    # blocks a holder must have over the node that would compute, for a fetch from it to pay


class Prompt:
    """A prompt's token ids and, lazily per (block size, hash seed), its chained block hashes."""

    def __init__(self, token_ids: list[int]) -> None:
        self.token_ids = token_ids
        self._hashes: dict[tuple[int, int], list[int]] = {}
        self._tiers: dict[str, list[int]] = {}   # per node id: a Prompt lives for one placement (no await inside)

    def __len__(self) -> int:
        return len(self.token_ids)

    def cached_tiers(self, node: NodeState) -> list[int]:
        """The fastest tier holding each leading prompt block `node` has cached (per its Load reports' KV events;
        a block hashed with the node's own seed and block size)."""
        if not len(node.index):
            return []
        tiers = self._tiers.get(node.id)
        if tiers is None:
            size, seed = node.block_size, node.info.prefix_hash_seed
            if (size, seed) not in self._hashes:
                self._hashes[size, seed] = block_hashes(self.token_ids, size, seed)
            tiers = self._tiers[node.id] = node.index.leading_tiers(self._hashes[size, seed])
        return tiers

    def pool_blocks(self, node: NodeState) -> int:
        """Leading prompt blocks in `node`'s pool (what it lends to another node: pdcluster/node/kv_lender.py)."""
        tiers = self.cached_tiers(node)
        return next((i for i, t in enumerate(tiers) if t != 0), len(tiers))

    def cached_tokens(self, node: NodeState) -> int:
        """Leading prompt tokens `node` holds in any tier."""
        return len(self.cached_tiers(node)) * node.block_size

    def work_tokens(self, node: NodeState) -> float:
        """Tokens of prefill work this prompt costs on `node`: the uncached part, plus the cached blocks weighted by
        what loading them from their tier costs (TIER_COST)."""
        tiers = self.cached_tiers(node)
        return len(self) - node.block_size * sum(1.0 - TIER_COST[t] for t in tiers)


def decode_load(node: NodeState) -> int:
    load = node.load
    return (load.running + load.waiting if load else 0) + node.assigned_since_report


def has_room(node: NodeState, num_tokens: int) -> bool:
    if node.load is None:
        return True  # no report yet: let the node decide (it rejects fast when full)
    return node.load.free_blocks >= math.ceil(num_tokens / node.load.block_size)


class RoutingPolicy:
    name = ""

    def pick_decode(self, nodes: list[NodeState], num_tokens: int, prompt: Prompt | None = None) -> NodeState | None:
        """`prompt`: given when the decode node will prefill it (no prefill node), for policies that care."""
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

    def pick_decode(self, nodes: list[NodeState], num_tokens: int, prompt: Prompt | None = None) -> NodeState | None:
        return self._next("decode", nodes)

    def pick_prefill(self, nodes: list[NodeState], prompt: Prompt) -> NodeState | None:
        return self._next("prefill", nodes)


class LeastLoadedPolicy(RoutingPolicy):
    """Decode: among nodes with KV room for prompt + max_tokens (any node if none has), the one
    with the fewest running + waiting sequences, then the most free blocks.
    Prefill: the fewest queued prefill tokens."""

    name = "least_loaded"

    def pick_decode(self, nodes: list[NodeState], num_tokens: int, prompt: Prompt | None = None) -> NodeState | None:
        pool = [n for n in nodes if has_room(n, num_tokens)] or nodes
        if not pool:
            return None
        return min(pool, key=lambda n: (decode_load(n), -(n.load.free_blocks if n.load else 0), n.id))

    def prefill_cost(self, node: NodeState, prompt: Prompt) -> float:
        queued = node.load.queued_prefill_tokens if node.load else 0
        return queued + node.prefill_tokens_since_report

    def pick_prefill(self, nodes: list[NodeState], prompt: Prompt) -> NodeState | None:
        if not nodes:
            return None
        return min(nodes, key=lambda n: (self.prefill_cost(n, prompt), n.id))


class PrefixAwarePolicy(LeastLoadedPolicy):
    """Prefill: the node that finishes this prompt soonest in tokens of work: queued prefill tokens + the part of
    this prompt it does not have cached (cached blocks weighted by their tier's load cost).
    Decode, when the decode node prefills the prompt itself: among the nodes with room whose load is within
    DECODE_LOAD_SLACK of the least loaded, the one with the least prefill work for it; else least loaded."""

    name = "prefix_aware"

    def prefill_cost(self, node: NodeState, prompt: Prompt) -> float:
        return super().prefill_cost(node, prompt) + prompt.work_tokens(node)

    def pick_decode(self, nodes: list[NodeState], num_tokens: int, prompt: Prompt | None = None) -> NodeState | None:
        pool = [n for n in nodes if has_room(n, num_tokens)] or nodes
        if prompt is None or not pool:
            return super().pick_decode(nodes, num_tokens)
        least = min(decode_load(n) for n in pool)
        near = [n for n in pool if decode_load(n) <= least + DECODE_LOAD_SLACK]
        return min(near, key=lambda n: (prompt.work_tokens(n), decode_load(n),
                                        -(n.load.free_blocks if n.load else 0), n.id))


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


def prefix_holder(prompt: Prompt, nodes: list[NodeState], computing: NodeState | None = None,
                  exclude: str = "") -> tuple[NodeState, int] | None:
    """(node, blocks): the node of `nodes` (not `exclude`) whose pool holds the longest run of the prompt's leading
    blocks, when that is at least FETCH_MIN_BLOCKS more than `computing` holds in any tier and the node hashes
    blocks as `computing` does (so the hashes it is asked for are its own). None otherwise."""
    own = len(prompt.cached_tiers(computing)) if computing is not None else 0
    best: tuple[NodeState, int] | None = None
    for node in nodes:
        if node.id == exclude or (computing is not None and (
                node.block_size != computing.block_size
                or node.info.prefix_hash_seed != computing.info.prefix_hash_seed)):
            continue
        n = prompt.pool_blocks(node)
        if n >= own + FETCH_MIN_BLOCKS and (best is None or n > best[1]):
            best = (node, n)
    return best


def prefill_locally_pays(prompt: Prompt, prefill: NodeState, covered: int, block_size: int,
                         disagg_min_tokens: int) -> bool:
    """Conditional disaggregation on the uncached part: with `covered` leading blocks on the decode node (its own, in
    any tier, or fetched), is what is left shorter than `disagg_min_tokens` while `prefill` holds FETCH_MIN_BLOCKS
    fewer? Then the decode node prefills the tail itself (a conversation's next turn, whose history with the answers
    generated so far a decode node holds) instead of a round trip to the prefill node."""
    return covered >= len(prompt.cached_tiers(prefill)) + FETCH_MIN_BLOCKS \
        and len(prompt) - covered * block_size < disagg_min_tokens


def best_cover(prompt: Prompt, decode_nodes: list[NodeState], holders: list[NodeState]) -> int:
    """The most leading prompt blocks any decode node holds (any tier) or any holder could lend (its pool)."""
    return max([len(prompt.cached_tiers(n)) for n in decode_nodes] + [prompt.pool_blocks(n) for n in holders],
               default=0)


class PrefillWork:
    """Prefill work counted on a node since its last report (`note_assignment`), to take back once the prompt is
    done (its first token came), unless a report came in between (which no longer counted it as queued)."""

    def __init__(self, node: NodeState | None, tokens: int) -> None:
        self.node, self.tokens = node, tokens
        self.reports = node.reports if node is not None else 0

    def done(self) -> None:
        node, self.node = self.node, None
        if node is not None and node.reports == self.reports:
            node.prefill_tokens_since_report = max(0, node.prefill_tokens_since_report - self.tokens)


def note_assignment(decode: NodeState, prefill: NodeState | None, prefill_tokens: int) -> PrefillWork:
    """Count work sent since the nodes' last reports: a request on `decode`, `prefill_tokens` of prefill work (the
    prompt less what the prefill node has cached, `Prompt.work_tokens`) on `prefill`."""
    decode.assigned_since_report += 1
    if prefill is not None:
        prefill.prefill_tokens_since_report += prefill_tokens
    return PrefillWork(prefill, prefill_tokens)
