"""Continuous-batching scheduler (vLLM v1 style); the one owner of the requests and their queues.

Each step every sequence just needs "its uncomputed tokens": a decoding sequence has one, a new or
preempted one has its prompt (+ outputs so far). Running sequences go first (oldest first), then
waiting ones join while the token budget, `max_num_seqs` and free blocks allow; prompts are chunked
to fit the budget when chunked prefill is on. When blocks run out, the newest running sequence is
preempted (its blocks freed, recomputed later) instead of failing. A sequence waiting for remote KV
holds its blocks but is never scheduled until `add_prefilled` moves it to the running set.
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
        self.requests: dict[str, Sequence] = {}   # every request not yet gone, finished hold_blocks ones included
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.waiting_for_kv: dict[str, Sequence] = {}
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.requests[seq.request_id] = seq
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- scheduling -----------------------------------------------------------------------------

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not self.bm.allocate(seq, seq.num_computed_tokens + n):
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
            hits = self.bm.match_prefix(seq)
            num_cached = len(hits) * self.block_size
            remaining = seq.num_tokens - num_cached
            n = min(remaining, budget)
            if n < remaining and not self.enable_chunked_prefill:
                break
            if not self.bm.allocate(seq, num_cached + n, hits):
                break
            seq.num_computed_tokens = num_cached
            if not seq.output_token_ids:
                self._count_prefix_hit(seq, num_cached)
            seq.status = SequenceStatus.RUNNING
            self.waiting.popleft()
            self.running.append(seq)
            batch.seqs.append(seq)
            batch.num_new_tokens.append(n)
            budget -= n
        return batch

    def _preempt(self, seq: Sequence) -> None:
        """Free the blocks; everything (prompt + outputs so far) is recomputed later."""
        self.bm.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def _count_prefix_hit(self, seq: Sequence, num_cached: int) -> None:
        seq.num_cached_tokens = num_cached
        self.bm.prefix_query_tokens += seq.num_tokens
        self.bm.prefix_hit_tokens += num_cached

    # ---- results --------------------------------------------------------------------------------

    def update_from_output(self, batch: ScheduledBatch, sampled: list[Sequence], tokens: list[int],
                           logprobs: list) -> list[Sequence]:
        """Apply a step: the scheduled tokens are computed (full blocks go to the prefix cache), the sampled
        sequences get their token, the ones that stopped finish. Returns the sampled sequences."""
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            seq.num_computed_tokens += n
            self.bm.cache_full_blocks(seq)
        for seq, token, lp in zip(sampled, tokens, logprobs):
            self._append(seq, token, lp)
        return sampled

    def _append(self, seq: Sequence, token: int, logprob) -> None:
        seq.append_token(token, logprob)
        if seq.stopped:
            self.running.remove(seq)
            seq.status = SequenceStatus.FINISHED
            if not seq.hold_blocks:
                self.bm.free(seq)
                del self.requests[seq.request_id]

    # ---- remote prefill (decode node) -----------------------------------------------------------

    def reserve(self, seq: Sequence) -> bool:
        """Blocks for `seq`'s whole prompt (leading prefix-cache hits shared), held while another node
        writes the rest of its KV. False when too few blocks are free."""
        hits = self.bm.match_prefix(seq)
        if not self.bm.allocate(seq, seq.num_prompt_tokens, hits):
            return False
        self._count_prefix_hit(seq, len(hits) * self.block_size)
        seq.num_computed_tokens = seq.num_cached_tokens
        seq.status = SequenceStatus.WAITING_FOR_REMOTE_KV
        self.requests[seq.request_id] = seq
        self.waiting_for_kv[seq.request_id] = seq
        return True

    def add_prefilled(self, seq: Sequence, first_token: int, logprob) -> None:
        """The remote KV of `seq`'s prompt landed: it runs from its first sampled token on."""
        del self.waiting_for_kv[seq.request_id]
        seq.num_computed_tokens = seq.num_prompt_tokens
        self.bm.cache_full_blocks(seq)
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        self._append(seq, first_token, logprob)

    def num_reserved_blocks(self) -> int:
        return sum(len(seq.block_table) for seq in self.waiting_for_kv.values())

    # ---- removal --------------------------------------------------------------------------------

    def abort(self, request_id: str) -> None:
        """Take the request out of whichever queue holds it and free its blocks. Unknown ids are a no-op."""
        seq = self.requests.pop(request_id, None)
        if seq is None:
            return
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        elif seq.status is SequenceStatus.WAITING_FOR_REMOTE_KV:
            del self.waiting_for_kv[request_id]
        self.bm.free(seq)
        seq.status = SequenceStatus.FINISHED
