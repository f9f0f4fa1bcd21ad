"""Continuous-batching scheduler (vLLM v1 style).

Each step every sequence just needs "its uncomputed tokens": a decoding sequence has one, a new or
preempted one has its prompt (+ outputs so far). Running sequences go first (oldest first), then
waiting ones join while the token budget, `max_num_seqs` and free blocks allow; prompts are chunked
to fit the budget when chunked prefill is on. When blocks run out, the newest running sequence is
preempted (its blocks freed, recomputed later) instead of failing.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from pdcluster.engine.block_manager import BlockManager
from pdcluster.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def __len__(self) -> int:
        return len(self.seqs)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 enable_chunked_prefill: bool) -> None:
        self.bm = block_manager
        self.block_size = block_manager.block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not self._grow(seq, n):
                victim = self.running.pop()
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            else:
                batch.seqs.append(seq)
                batch.num_new_tokens.append(n)
                budget -= n
                i += 1
        if preempted:
            return batch
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            hits, hashes = self.bm.match_prefix(seq.token_ids, (seq.num_tokens - 1) // self.block_size)
            num_cached = len(hits) * self.block_size
            remaining = seq.num_tokens - num_cached
            n = min(remaining, budget)
            if n < remaining and not self.enable_chunked_prefill:
                break
            need = -(-(num_cached + n) // self.block_size) - len(hits)
            if need + self.bm.num_reclaimable(hits) > self.bm.num_free_blocks:
                break
            self.bm.acquire(hits)
            seq.block_table = hits + self.bm.allocate(need)
            seq.block_hashes = hashes
            seq.num_computed_tokens = num_cached
            if not seq.output_token_ids:
                seq.num_cached_tokens = num_cached
                self.bm.prefix_query_tokens += seq.num_tokens
                self.bm.prefix_hit_tokens += num_cached
            seq.status = SequenceStatus.RUNNING
            self.waiting.popleft()
            self.running.append(seq)
            batch.seqs.append(seq)
            batch.num_new_tokens.append(n)
            budget -= n
        return batch

    def _grow(self, seq: Sequence, n: int) -> bool:
        need = -(-(seq.num_computed_tokens + n) // self.block_size) - len(seq.block_table)
        if need <= 0:
            return True
        blocks = self.bm.allocate(need)
        if blocks is None:
            return False
        seq.block_table.extend(blocks)
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.bm.free(seq.block_table)
        seq.reset_for_recompute()
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def finish(self, seq: Sequence) -> None:
        """Drop a finished sequence from the running set; free its blocks unless the caller holds them."""
        self.running.remove(seq)
        seq.status = SequenceStatus.FINISHED
        if not seq.hold_blocks:
            self.bm.free(seq.block_table)
            seq.block_table = []

    def remove(self, seq: Sequence) -> None:
        """Abort: take the sequence out of whichever queue holds it and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if seq.block_table:
            self.bm.free(seq.block_table)
            seq.block_table = []
        seq.status = SequenceStatus.FINISHED
