"""Block allocator with reference counts and automatic prefix caching.

A full block whose KV has been computed gets a chained hash (hash of the previous block's hash and
its own token ids). Later requests whose prompts start with the same blocks share them (ref count).
A block whose ref count drops to zero keeps its hash and stays reusable until it is evicted, least
recently freed first, when fresh blocks run out. Free-block counts include these cached blocks.
"""

from __future__ import annotations

from collections import OrderedDict, deque


def chain_hash(prev_hash: int | None, token_ids) -> int:
    return hash((prev_hash, tuple(token_ids)))


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.block_tokens: list[tuple[int, ...] | None] = [None] * num_blocks
        self.hash_to_block: dict[int, int] = {}
        self.free_ids: deque[int] = deque(range(num_blocks))        # never hashed, or evicted
        self.cached_free: OrderedDict[int, None] = OrderedDict()     # ref 0 but hash kept; LRU order
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_ids) + len(self.cached_free)

    def match_prefix(self, token_ids: list[int], max_blocks: int) -> tuple[list[int], list[int]]:
        """Leading cached blocks for these tokens (at most max_blocks): (block ids, their hashes).
        Reference counts are not touched; call `acquire` to take them."""
        if not self.enable_prefix_caching:
            return [], []
        bs = self.block_size
        ids: list[int] = []
        hashes: list[int] = []
        prev = None
        for i in range(max_blocks):
            tokens = tuple(token_ids[i * bs:(i + 1) * bs])
            h = chain_hash(prev, tokens)
            block = self.hash_to_block.get(h)
            if block is None or self.block_tokens[block] != tokens:
                break
            ids.append(block)
            hashes.append(h)
            prev = h
        return ids, hashes

    def num_reclaimable(self, block_ids: list[int]) -> int:
        """How many of these blocks currently count as free (cached with ref 0)."""
        return sum(1 for b in block_ids if self.ref_counts[b] == 0)

    def acquire(self, block_ids: list[int]) -> None:
        for b in block_ids:
            if self.ref_counts[b] == 0:
                del self.cached_free[b]
            self.ref_counts[b] += 1

    def allocate(self, n: int) -> list[int] | None:
        """n fresh blocks (ref 1), evicting least recently used cached blocks if needed; None if short."""
        if n > self.num_free_blocks:
            return None
        out = []
        for _ in range(n):
            if self.free_ids:
                b = self.free_ids.popleft()
            else:
                b, _ = self.cached_free.popitem(last=False)
                self._forget(b)
            self.ref_counts[b] = 1
            out.append(b)
        return out

    def free(self, block_ids: list[int]) -> None:
        # Reverse order: a sequence's tail blocks become the least recently used, so they go first.
        for b in reversed(block_ids):
            if self.ref_counts[b] <= 0:
                raise RuntimeError(f"block {b} freed more often than allocated")
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                if self.block_hash[b] is not None:
                    self.cached_free[b] = None
                else:
                    self.free_ids.append(b)

    def register(self, block_id: int, block_hash: int, token_ids) -> None:
        """Publish a full, computed block in the prefix cache (no-op if that content is already cached)."""
        if not self.enable_prefix_caching or block_hash in self.hash_to_block or self.block_hash[block_id] is not None:
            return
        self.block_hash[block_id] = block_hash
        self.block_tokens[block_id] = tuple(token_ids)
        self.hash_to_block[block_hash] = block_id

    def _forget(self, b: int) -> None:
        h = self.block_hash[b]
        if h is not None and self.hash_to_block.get(h) == b:
            del self.hash_to_block[h]
        self.block_hash[b] = None
        self.block_tokens[b] = None
