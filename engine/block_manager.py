"""Block allocator with reference counts and automatic prefix caching.

A full block whose KV has been computed is published under its chained hash (`pdcluster.control.block_hash`,
the same stable hash the router uses for prefix-aware routing). Later requests whose prompts start with the
same blocks share them (ref count). A block whose ref count drops to zero keeps its hash and stays reusable
until it is evicted, least recently freed first, when fresh blocks run out. Free-block counts include these
cached blocks.

Sliding-window models (`ModelConfig.kv_window`): blocks that fell out of every layer's window are released
while the request runs (`free_outside_window`). Their block-table entries become `FREED_BLOCK`, so entries
stay positional (entry i holds tokens i*block_size..); the first `seq.num_freed_blocks` entries are freed.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict, deque

from pdcluster.engine.kv_events import EVICTED, POOL, STORED, KVEventLog
from pdcluster.engine.sequence import Sequence

# What a freed block-table entry holds: a valid id (attention may index it) that is never read, because the
# window mask hides those positions and the paged kernels start at the window.
FREED_BLOCK = 0


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.hash_to_block: OrderedDict[int, int] = OrderedDict()   # least recently used first
        self.free_ids: deque[int] = deque(range(num_blocks))        # never hashed, or evicted
        self.cached_free: OrderedDict[int, None] = OrderedDict()     # ref 0 but hash kept; LRU order
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0
        self.published: list[tuple[int, int]] | None = None   # (block, hash) published since `take_published`
        self.events: KVEventLog | None = None                  # stored / evicted hashes, for a cluster index

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_ids) + len(self.cached_free)

    def disable_prefix_caching(self) -> None:
        """No more lookups or publishing (StreamingLLM: moved blocks change content)."""
        self.enable_prefix_caching = False

    def record_prefix_lookup(self, query_tokens: int, hit_tokens: int) -> None:
        """Count one admission's prefix-cache lookup: `query_tokens` asked for, `hit_tokens` served by hits."""
        self.prefix_query_tokens += query_tokens
        self.prefix_hit_tokens += hit_tokens

    def match_prefix(self, seq: Sequence) -> list[int]:
        """Leading cached blocks of `seq`'s tokens, leaving at least its last token to compute. Reference
        counts are not touched: pass the result to `allocate`."""
        if not self.enable_prefix_caching:
            return []
        return self.cached_blocks(seq.block_hashes(self.block_size)[:(seq.num_tokens - 1) // self.block_size])

    def cached_blocks(self, hashes: list[int]) -> list[int]:
        """The blocks published under the leading `hashes`, up to the first one not cached."""
        hits: list[int] = []
        for h in hashes:
            block = self.hash_to_block.get(h)
            if block is None:
                break
            hits.append(block)
        return hits

    def allocate(self, seq: Sequence, num_tokens: int, cached: list[int] | None = None) -> bool:
        """Blocks so that `seq` can hold its first `num_tokens` tokens. A sequence without blocks may start
        with the prefix-cache hits `cached` (from `match_prefix`), shared instead of fresh. False, changing
        nothing, when too few blocks are free. The one allocation path: admission, growth, reservations."""
        cached = cached or []
        if cached and seq.block_table:
            raise ValueError("prefix-cache hits can only start an empty block table")
        need = -(-num_tokens // self.block_size) - len(seq.block_table) - len(cached)
        if need + sum(1 for b in cached if self.ref_counts[b] == 0) > self.num_free_blocks:
            return False
        for b in cached:
            if self.ref_counts[b] == 0:
                del self.cached_free[b]
            self.ref_counts[b] += 1
            h = self.block_hash[b]
            assert h is not None   # a prefix hit is a published block
            self.hash_to_block.move_to_end(h)
        if cached:
            seq.block_table, seq.num_cached_blocks = list(cached), len(cached)
        for _ in range(need):
            seq.block_table.append(self._fresh())
        return True

    def _fresh(self) -> int:
        if self.free_ids:
            b = self.free_ids.popleft()
        else:
            b, _ = self.cached_free.popitem(last=False)
            self._forget(b)
        self.ref_counts[b] = 1
        return b

    def free(self, seq: Sequence) -> None:
        """Drop `seq`'s references to its blocks; blocks that were published stay in the prefix cache."""
        # Reverse order: a sequence's tail blocks become the least recently used, so they go first.
        for b in reversed(seq.block_table[seq.num_freed_blocks:]):
            self._release(b)
        seq.block_table = []
        seq.num_cached_blocks = 0
        seq.num_freed_blocks = 0

    def free_tail(self, seq: Sequence, num_tokens: int) -> None:
        """Release `seq`'s trailing blocks past those that hold its first `num_tokens` tokens (rejected drafts)."""
        keep = -(-num_tokens // self.block_size)
        while len(seq.block_table) > keep:
            self._release(seq.block_table.pop())

    def free_outside_window(self, seq: Sequence, window: int) -> int:
        """Release `seq`'s leading blocks that no later token can attend to: the next token computed sits at
        position `num_computed_tokens` and sees positions above it minus `window`. Returns how many were
        released. Call after `cache_full_blocks`, so released full blocks stay in the prefix cache."""
        first_needed = seq.num_computed_tokens - window + 1
        end = min(max(first_needed, 0) // self.block_size, len(seq.block_table))
        start = seq.num_freed_blocks
        for i in range(start, end):
            self._release(seq.block_table[i])
            seq.block_table[i] = FREED_BLOCK
        seq.num_freed_blocks = max(start, end)
        return max(0, end - start)

    def drop_block(self, seq: Sequence, index: int) -> None:
        """Release entry `index` of `seq`'s block table and remove it (later entries move down; StreamingLLM)."""
        self._release(seq.block_table.pop(index))

    def _release(self, b: int) -> None:
        if self.ref_counts[b] <= 0:
            raise RuntimeError(f"block {b} freed more often than allocated")
        self.ref_counts[b] -= 1
        if self.ref_counts[b] == 0:
            if self.block_hash[b] is not None:
                self.cached_free[b] = None
            else:
                self.free_ids.append(b)

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Publish `seq`'s blocks that became full and computed since the last call in the prefix cache."""
        full = min(seq.num_computed_tokens // self.block_size, len(seq.block_table))
        if not self.enable_prefix_caching or full <= seq.num_cached_blocks:
            return
        hashes = seq.block_hashes(self.block_size)
        for i in range(max(seq.num_cached_blocks, seq.num_freed_blocks), full):
            b, h = seq.block_table[i], hashes[i]
            if h not in self.hash_to_block and self.block_hash[b] is None:   # else that content is cached already
                self.block_hash[b] = h
                self.hash_to_block[h] = b
                if self.published is not None:
                    self.published.append((b, h))
                if self.events is not None:
                    self.events.add(STORED, POOL, h)
        seq.num_cached_blocks = full

    def record_published(self) -> None:
        """From now on remember the blocks `cache_full_blocks` publishes, for `take_published` (the KV tiers)."""
        self.published = []

    def take_published(self) -> list[tuple[int, int]]:
        """(block, hash) of the blocks published since the last call."""
        if not self.published:
            return []
        out, self.published = self.published, []
        return out

    def pin(self, b: int) -> None:
        """One more reference to block `b` for a copy in flight (the KV tiers): the allocator cannot hand it out
        until `unpin`. A cached free block stays published."""
        if self.ref_counts[b] == 0:
            if self.block_hash[b] is not None:
                del self.cached_free[b]
            else:
                raise RuntimeError(f"block {b} is free: nothing to pin")
        self.ref_counts[b] += 1

    def unpin(self, b: int) -> None:
        self._release(b)

    def cached_hashes(self, limit: int) -> list[int]:
        """Hashes of up to `limit` blocks in the prefix cache, most recently used first."""
        return list(itertools.islice(reversed(self.hash_to_block), limit))

    def _forget(self, b: int) -> None:
        h = self.block_hash[b]
        if h is not None and self.hash_to_block.get(h) == b:
            del self.hash_to_block[h]
            if self.events is not None:
                self.events.add(EVICTED, POOL, h)
        self.block_hash[b] = None
