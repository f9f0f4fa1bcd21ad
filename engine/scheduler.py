"""Continuous-batching scheduler (vLLM v1 style); the one owner of the requests and their queues.

Each step every sequence just needs "its uncomputed tokens": a decoding sequence has one, a new or
preempted one has its prompt (+ outputs so far). Running sequences go first (oldest first), then
waiting ones join while the token budget, `max_num_seqs` and free blocks allow; prompts are chunked
to fit the budget when chunked prefill is on. When blocks run out, the newest running sequence is
preempted (its blocks freed, recomputed later) instead of failing.

Remote prefill (the decode node): `add_remote` reserves blocks for a new request's whole prompt (leading
prefix-cache hits shared) and parks it WAITING_FOR_REMOTE_KV: it holds its blocks and is never scheduled. When a
KV tier of this node or another node (`fetch`) holds blocks after its hits, those are loaded first (LOADING_KV)
and the reservation follows, announced by `on_reserved`.
`remote_kv_landed` moves it to the running set from its first token on; `remote_kv_failed` frees its blocks
and queues it as an ordinary waiting request (a local prefill). The scheduler owns its `BlockManager` and is
the one writer of every sequence's status (`Sequence.move_to`, the moves in sequence.py).

With `sliding_window` (the window that bounds every layer, `ModelConfig.kv_window`) a running sequence's
blocks that fell out of it are released after each step, so its block count stays bounded by the window plus
one step's tokens. Not for `hold_blocks` sequences: a prefill node sends (and its caller reads) whole block
tables.

StreamingLLM (`attention_sinks` k, `streaming_window` w; arXiv 2309.17453): after each step a running sequence
keeps its first k tokens (rounded up to whole blocks: the sinks) and its last >= w tokens; whole blocks in
between are dropped and everything after them moves down, so positions are cache positions: the sequence's
`token_ids` view and `num_computed_tokens` shrink by the dropped tokens, and `on_evict(blocks, -dropped)`
re-rotates the stored keys of the moved blocks (`layers.rotary.key_rerotator`). Its KV stays bounded and it
generates past `max_model_len`. Prefix caching is off then (moved blocks change content).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from pdcluster.engine.block_manager import BlockManager
from pdcluster.engine.kv_tiers import KVTiers
from pdcluster.engine.sequence import Sequence, SequenceStatus

AUTO_BATCHED_TOKENS = (2048, 4096)   # bounds of max_num_batched_tokens="auto" (docs/benchmarks.md#chunk-size-policy)


def resolve_batched_tokens(value: int | str, max_model_len: int, enable_chunked_prefill: bool = True) -> int:
    """The step token budget: `value`, or for "auto" a quarter of the context within AUTO_BATCHED_TOKENS (the
    whole context when prompts cannot be chunked)."""
    if value != "auto":
        return int(value)
    if not enable_chunked_prefill:
        return max_model_len
    low, high = AUTO_BATCHED_TOKENS
    return min(max(max_model_len // 4, low), high)


@dataclass
class SpecDecodeCounts:
    """Speculative decoding since the start (vLLM's spec_decode counters): steps that scored drafts, drafts,
    accepted drafts, and accepted drafts by position (index j: the (j+1)-th draft of a step passed)."""
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def count(self, drafted: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        if len(self.accepted_per_position) < drafted:
            self.accepted_per_position.extend([0] * (drafted - len(self.accepted_per_position)))
        for j in range(accepted):
            self.accepted_per_position[j] += 1


@dataclass
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.seqs)


MAX_TIER_LOADS = 2    # loads from the KV tiers per request (its loaded blocks evicted again before it ran: recompute)


class Scheduler:
    def __init__(self, num_blocks: int, block_size: int, max_num_seqs: int, max_num_batched_tokens: int,
                 enable_chunked_prefill: bool, enable_prefix_caching: bool = True, sliding_window: int = 0) -> None:
        self.block_manager = BlockManager(num_blocks, block_size, enable_prefix_caching)
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.sliding_window = sliding_window
        self.sink_tokens = 0
        self.streaming_window = 0
        self.on_evict: Callable[[list[int], int], None] | None = None   # moves the keys of blocks by a delta
        self.requests: dict[str, Sequence] = {}   # every request not yet gone, finished hold_blocks ones included
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.waiting_for_kv: dict[str, Sequence] = {}
        self.waiting_for_grammar: dict[str, Sequence] = {}   # structured output whose grammar still compiles
        self.tiers: KVTiers | None = None                   # host / disk KV tiers (engine/kv_tiers.py)
        self.loading: dict[str, Sequence] = {}              # LOADING_KV: prefixes being copied back from a tier
        # Another node's copy of a prefix (the node's connector): `fetch(request_id, blocks, hashes)` starts copying
        # those blocks into pinned `blocks`; the node reports the end with `prefix_load_done`.
        self.fetch: Callable[[str, list[int], list[int]], None] | None = None
        self.fetching: dict[str, Sequence] = {}             # LOADING_KV: prefixes being fetched from another node
        self.held: dict[str, Sequence] = {}                 # LOADING_KV: pre-copied prefixes held (`prefetch`)
        self.on_reserved: Callable[[Sequence], None] | None = None   # a deferred remote-KV reservation was made
        self.num_preemptions = 0
        self.max_loras = 0   # LoRA: most distinct adapters among the running (0: no limit; engine/lora/)
        self.spec = SpecDecodeCounts()

    def add(self, seq: Sequence) -> None:
        self.requests[seq.request_id] = seq
        self._queue(seq)

    def _queue(self, seq: Sequence) -> None:
        """A request with a grammar waits for its compile (`admit_compiled`) before it may be scheduled."""
        if seq.grammar is not None:
            seq.move_to(SequenceStatus.WAITING_FOR_GRAMMAR)
            self.waiting_for_grammar[seq.request_id] = seq
        else:
            self.waiting.append(seq)

    def admit_compiled(self) -> list[Sequence]:
        """Queue the requests whose grammar is compiled (and has accepted their outputs so far); finish, with
        finish_reason "abort" and `error` set, those whose grammar failed. Returns the failed ones."""
        failed: list[Sequence] = []
        for rid, seq in list(self.waiting_for_grammar.items()):
            if not seq.grammar.ready:
                continue
            del self.waiting_for_grammar[rid]
            try:
                seq.grammar.matcher_now()
            except ValueError as exc:
                seq.error, seq.finish_reason = str(exc), "abort"
                seq.move_to(SequenceStatus.FINISHED)
                del self.requests[rid]
                failed.append(seq)
                continue
            seq.move_to(SequenceStatus.WAITING)
            self.waiting.append(seq)
        return failed

    def has_work(self) -> bool:
        """Something to step for (a fetch from another node is not: the node's report of its end wakes the engine)."""
        return bool(self.waiting or self.running or self.waiting_for_grammar or self.loading)

    # ---- scheduling -----------------------------------------------------------------------------

    def schedule(self) -> ScheduledBatch:
        bm = self.block_manager
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        preempted = False
        loras: set[str] = set()   # the adapters of the sequences in this batch (at most max_loras: LoRASlots)
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if self.max_loras and seq.lora is not None and seq.lora.lora_name not in loras \
                    and len(loras) >= self.max_loras:
                i += 1   # its adapter waits for a slot (remote prefills land beside any adapter): a later step
                continue
            n = self._step_tokens(seq.num_tokens - seq.num_computed_tokens + len(seq.spec_token_ids), budget, batch)
            del seq.spec_token_ids[max(n - 1, 0):]   # drafts past the budget wait (a decoding sequence: n = 1 + drafts)
            while not bm.allocate(seq, seq.num_computed_tokens + n):
                if seq.spec_token_ids:   # drafts are given up before anyone is preempted
                    seq.spec_token_ids, n = [], 1
                    continue
                victim = self.running.pop()
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            else:
                batch.seqs.append(seq)
                batch.num_new_tokens.append(n)
                budget -= n
                if seq.lora is not None:
                    loras.add(seq.lora.lora_name)
                i += 1
        if preempted:
            return batch
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if self.max_loras and seq.lora is not None:   # its adapter needs a device slot (LoRASlots)
                loras = {r.lora.lora_name for r in self.running if r.lora is not None}
                if seq.lora.lora_name not in loras and len(loras) >= self.max_loras:
                    break
            hits = [] if seq.needs_prompt_logprobs else bm.match_prefix(seq)   # every prompt position's logits
            if (self.tiers is not None and self._load_from_tiers(seq, hits)) or self._fetch_prefix(seq, hits):
                self.waiting.popleft()
                continue
            if seq.remote_kv:   # its prefix loads are done: now its blocks for the remote prefill
                if not self._reserve_remote(seq, hits):
                    break
                self.waiting.popleft()
                continue
            num_cached = len(hits) * self.block_size
            remaining = seq.num_tokens - num_cached
            n = self._step_tokens(remaining, budget, batch)
            if n < remaining and not self.enable_chunked_prefill:
                break
            if not bm.allocate(seq, num_cached + n, hits):
                break
            seq.num_computed_tokens = num_cached
            if not seq.output_token_ids:
                self._count_prefix_hit(seq, num_cached)
            seq.move_to(SequenceStatus.RUNNING)
            self.waiting.popleft()
            self.running.append(seq)
            batch.seqs.append(seq)
            batch.num_new_tokens.append(n)
            budget -= n
        return batch

    @staticmethod
    def _step_tokens(remaining: int, budget: int, batch: ScheduledBatch) -> int:
        """A sequence's tokens in this step: up to what is left of the budget, or all `remaining` where the rest
        would be no more than the step's one-token rows. Those decodes then ride along the prompt's last chunk:
        a 2048-token prompt arriving beside 4 decoding sequences under a 2048 budget is prefilled in one step of
        2052 tokens instead of 2044 now and 4 in a step of its own (which delays its first token by that step).
        A step's prompt tokens stay within the budget; its total, within the budget plus its decodes."""
        if remaining <= budget:
            return remaining
        return remaining if remaining - budget <= batch.num_new_tokens.count(1) else budget

    def _load_from_tiers(self, seq: Sequence, hits: list[int]) -> bool:
        """When the blocks after `seq`'s pool hits are in a KV tier: blocks for them (the hits shared), pinned, a
        load submitted, `seq` LOADING_KV. False, changing nothing, when no tier holds the next block (or the
        blocks are not free, or it loaded twice already)."""
        bm = self.block_manager
        assert self.tiers is not None
        if seq.num_tier_loads >= MAX_TIER_LOADS or seq.needs_prompt_logprobs or not bm.enable_prefix_caching:
            return False
        hashes = seq.block_hashes(self.block_size)[len(hits):(seq.num_tokens - 1) // self.block_size]
        n = self.tiers.lookup(hashes) if hashes else 0
        if n == 0 or not bm.allocate(seq, (len(hits) + n) * self.block_size, hits):
            return False
        blocks = seq.block_table[len(hits):]
        for b in blocks:
            bm.pin(b)
        self.tiers.submit_load(seq.request_id, blocks, hashes[:n])
        seq.num_tier_loads += 1
        seq.move_to(SequenceStatus.LOADING_KV)
        self.loading[seq.request_id] = seq
        return True

    def _fetch_prefix(self, seq: Sequence, hits: list[int]) -> bool:
        """When another node holds more of `seq`'s leading blocks than this one (`seq.fetch_blocks`, the router's
        word): blocks for them (the hits shared), pinned, the fetch started, `seq` LOADING_KV. One try per
        request. False, changing nothing, when there is nothing to fetch or the blocks are not free."""
        bm = self.block_manager
        if self.fetch is None or seq.fetch_blocks <= len(hits) or seq.needs_prompt_logprobs \
                or not bm.enable_prefix_caching:
            return False
        end = min(seq.fetch_blocks, (seq.num_tokens - 1) // self.block_size)
        hashes = seq.block_hashes(self.block_size)[len(hits):end]
        if not hashes or not bm.allocate(seq, end * self.block_size, hits):
            return False
        seq.fetch_blocks = 0
        blocks = seq.block_table[len(hits):]
        for b in blocks:
            bm.pin(b)
        seq.move_to(SequenceStatus.LOADING_KV)
        self.fetching[seq.request_id] = seq
        self.fetch(seq.request_id, list(blocks), hashes)
        return True

    def prefetch(self, seq: Sequence) -> tuple[int, bool]:
        """A live migration's pre-copy: `seq` (never scheduled) takes its cached leading blocks and fetches the
        next ones up to `seq.fetch_blocks` from another node; once they landed it holds them all (`held`) until
        `abort`. (blocks it holds from this pool, whether a fetch started: `prefix_load_done` ends it)."""
        bm = self.block_manager
        seq.prefetch_only = True
        hits = bm.match_prefix(seq) if bm.enable_prefix_caching else []
        self.requests[seq.request_id] = seq
        if self._fetch_prefix(seq, hits):
            return len(hits), True
        seq.move_to(SequenceStatus.LOADING_KV)
        self.held[seq.request_id] = seq
        bm.allocate(seq, len(hits) * self.block_size, hits)   # cached blocks only: never short of free ones
        return len(hits), False

    def prefix_load_done(self, request_id: str, blocks: list[int], done: int) -> None:
        """A load from the KV tiers or a fetch from another node finished with its first `done` blocks copied:
        those are published in the prefix cache and the request waits again at the front, to be admitted with them
        as prefix hits (the rest of its prompt is computed). An aborted request's blocks are just released."""
        bm = self.block_manager
        for b in blocks:
            bm.unpin(b)
        seq = self.loading.pop(request_id, None) or self.fetching.pop(request_id, None)
        if seq is None:
            return
        seq.num_computed_tokens = (len(seq.block_table) - len(blocks) + done) * self.block_size
        bm.cache_full_blocks(seq)
        if seq.prefetch_only:   # a pre-copy: keep the blocks that landed (and the hits) until abort
            bm.free_tail(seq, seq.num_computed_tokens)
            self.held[request_id] = seq
            return
        bm.free(seq)
        seq.num_computed_tokens = 0
        seq.move_to(SequenceStatus.WAITING)
        self.waiting.appendleft(seq)

    def _preempt(self, seq: Sequence) -> None:
        """Free the blocks; everything (prompt + outputs so far) is recomputed later."""
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.spec_token_ids, seq.proposer_state = [], None
        seq.move_to(SequenceStatus.WAITING)
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def _count_prefix_hit(self, seq: Sequence, num_cached: int) -> None:
        seq.num_cached_tokens = num_cached
        self.block_manager.record_prefix_lookup(seq.num_tokens, num_cached)

    def enable_streaming(self, attention_sinks: int, streaming_window: int, pool, config, tp_size: int = 1) -> None:
        """StreamingLLM for every sequence of this engine (module docstring); `pool` and `config` give the keys
        to move and their rotary frequencies."""
        from pdcluster.engine.layers.rotary import key_rerotator

        if attention_sinks < 0 or streaming_window <= 0:
            raise ValueError(f"attention_sinks ({attention_sinks}) needs streaming_window > 0 (got "
                             f"{streaming_window}); attention_sinks must be >= 0")
        sink_tokens = -(-attention_sinks // self.block_size) * self.block_size
        longest = sink_tokens + streaming_window + self.block_size
        if longest > config.max_model_len:
            raise ValueError(f"attention_sinks + streaming_window: a sequence's KV reaches {longest} positions "
                             f"(sinks rounded up to whole blocks, one block of slack), beyond max_model_len "
                             f"{config.max_model_len}")
        self.on_evict = key_rerotator(pool, config.head_dim, config.rope_theta, config.rope_scaling, tp_size)
        self.sink_tokens, self.streaming_window = sink_tokens, streaming_window
        self.sliding_window = 0                   # the stream bounds the KV already: one positional scheme
        self.block_manager.disable_prefix_caching()   # moved blocks change content

    # ---- results --------------------------------------------------------------------------------

    def update_from_output(self, batch: ScheduledBatch, sampled: list[Sequence], tokens: list[list[int]],
                           logprobs: list[list]) -> list[Sequence]:
        """Apply a step: the scheduled tokens are computed (full blocks go to the prefix cache), the sampled
        sequences get their tokens (one, or with drafts the accepted ones and the token after them), the ones
        that stopped finish. Returns the sampled sequences."""
        bm = self.block_manager
        for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
            seq.num_computed_tokens += n - len(seq.spec_token_ids)   # drafts count once accepted (`_append`)
            bm.cache_full_blocks(seq)
            if self.sliding_window and not seq.hold_blocks:
                bm.free_outside_window(seq, self.sliding_window)
            if self.streaming_window and not seq.hold_blocks:
                self._evict_streaming(seq)
        for seq, token, lp in zip(sampled, tokens, logprobs, strict=True):
            self._append(seq, token, lp)
        return sampled

    def _evict_streaming(self, seq: Sequence) -> None:
        """Drop whole blocks after the sinks while at least `streaming_window` computed tokens stay after them."""
        sink, bs = self.sink_tokens, self.block_size
        dropped = 0
        while seq.num_computed_tokens - sink - bs >= self.streaming_window:
            self.block_manager.drop_block(seq, sink // bs)
            seq.drop_tokens(sink, bs)
            seq.num_computed_tokens -= bs
            dropped += bs
        if dropped and self.on_evict is not None:
            self.on_evict(seq.block_table[sink // bs:], -dropped)

    def _append(self, seq: Sequence, tokens: list[int], logprobs: list) -> None:
        """Append a step's tokens until one stops the sequence. With drafts, `tokens` are the accepted drafts and
        the token sampled after them: the accepted drafts' KV was written this step; the rejected ones' slots
        are past num_computed_tokens (rewritten before anything reads them) and their surplus blocks go back."""
        drafts, seq.spec_token_ids = seq.spec_token_ids, []
        seq.num_step_tokens = 0
        for token, logprob in zip(tokens, logprobs, strict=True):
            seq.append_token(token, logprob)
            seq.num_step_tokens += 1
            if seq.stopped:
                break
        if drafts:
            accepted = len(tokens) - 1
            self.spec.count(len(drafts), accepted)
            seq.spec_acceptance.record(len(drafts), accepted)   # what the draft policy reads (speculative/policy.py)
        if seq.stopped:
            self.running.remove(seq)
            seq.move_to(SequenceStatus.FINISHED)
            if not seq.hold_blocks:
                self.block_manager.free(seq)
                del self.requests[seq.request_id]
        elif drafts:
            seq.num_computed_tokens += seq.num_step_tokens - 1
            self.block_manager.cache_full_blocks(seq)
            self.block_manager.free_tail(seq, seq.num_tokens)

    # ---- speculative decoding -------------------------------------------------------------------

    def drafting(self) -> list[Sequence]:
        """Running sequences that decode next step (one uncomputed token): the ones a proposer may draft for."""
        return [s for s in self.running if s.num_tokens - s.num_computed_tokens == 1 and not s.hold_blocks]

    def set_drafts(self, seq: Sequence, drafts: list[int]) -> None:
        """The drafts `seq`'s next step scores after its last token (`schedule` may keep fewer)."""
        seq.spec_token_ids = list(drafts)

    def reserve_draft_slots(self, seq: Sequence, k: int) -> bool:
        """Blocks for `seq`'s next step with `k` drafts (a drafter writes its own KV at those positions first),
        taken only while every running sequence keeps a free block to grow into. False: no drafts for it."""
        need = -(-(seq.num_tokens + k) // self.block_size) - len(seq.block_table)
        if need > 0 and self.block_manager.num_free_blocks - need < len(self.running):
            return False
        return self.block_manager.allocate(seq, seq.num_tokens + k)

    # ---- remote prefill (decode node) -----------------------------------------------------------

    def add_remote(self, seq: Sequence) -> bool:
        """Admit a new `seq` whose prompt KV another node writes: blocks for its whole prompt (leading
        prefix-cache hits shared), status WAITING_FOR_REMOTE_KV. False, adding nothing, when too few blocks
        are free. When a KV tier or another node holds the blocks after its hits, it waits first (WAITING, then
        LOADING_KV) and its blocks are reserved once they are loaded (`on_reserved` tells)."""
        seq.remote_kv = True
        hits = self.block_manager.match_prefix(seq)
        if self._loadable(seq, hits):
            self.requests[seq.request_id] = seq
            self.waiting.append(seq)
            return True
        if not self._reserve_remote(seq, hits, deferred=False):
            return False
        self.requests[seq.request_id] = seq
        return True

    def _loadable(self, seq: Sequence, hits: list[int]) -> bool:
        if not self.block_manager.enable_prefix_caching:
            return False
        if self.fetch is not None and seq.fetch_blocks > len(hits):
            return True
        if self.tiers is None or seq.num_tier_loads >= MAX_TIER_LOADS:
            return False
        hashes = seq.block_hashes(self.block_size)[len(hits):(seq.num_tokens - 1) // self.block_size]
        return bool(hashes) and self.tiers.lookup(hashes[:1]) == 1

    def _reserve_remote(self, seq: Sequence, hits: list[int], deferred: bool = True) -> bool:
        if not self.block_manager.allocate(seq, seq.num_prompt_tokens, hits):
            return False
        self._count_prefix_hit(seq, len(hits) * self.block_size)
        seq.num_computed_tokens = seq.num_cached_tokens
        seq.move_to(SequenceStatus.WAITING_FOR_REMOTE_KV)
        self.waiting_for_kv[seq.request_id] = seq
        if deferred and self.on_reserved is not None:
            self.on_reserved(seq)
        return True

    def remote_kv_landed(self, request_id: str, first_token: int, logprob=None) -> Sequence:
        """The remote KV of the request's prompt is in its blocks: it runs from its first sampled token on
        (and may finish on it). ValueError when the request is not waiting for remote KV."""
        seq = self._waiting_for_kv(request_id)
        del self.waiting_for_kv[request_id]
        seq.remote_kv = False   # preempted later, it is recomputed here
        seq.num_computed_tokens = seq.num_prompt_tokens
        self.block_manager.cache_full_blocks(seq)
        seq.move_to(SequenceStatus.RUNNING)
        self.running.append(seq)
        self._append(seq, [first_token], [logprob])
        return seq

    def remote_kv_failed(self, request_id: str) -> None:
        """The remote prefill is given up: free the reserved blocks (nothing they hold was published) and queue
        the request as an ordinary waiting one; its prefix hits are matched again when it is scheduled. Unknown
        ids are a no-op; a known request that is not waiting for remote KV raises ValueError."""
        if request_id not in self.requests:
            return
        seq = self._waiting_for_kv(request_id)
        del self.waiting_for_kv[request_id]
        self.block_manager.free(seq)
        seq.num_computed_tokens = seq.num_cached_tokens = 0
        seq.remote_kv = False
        seq.move_to(SequenceStatus.WAITING)
        self._queue(seq)

    def _waiting_for_kv(self, request_id: str) -> Sequence:
        seq = self.waiting_for_kv.get(request_id)
        if seq is None:
            state = self.requests[request_id].status.value if request_id in self.requests else "unknown"
            raise ValueError(f"request_id {request_id!r} is not waiting for remote KV ({state})")
        return seq

    def num_reserved_blocks(self) -> int:
        return sum(len(seq.block_table) for seq in self.waiting_for_kv.values())

    # ---- removal --------------------------------------------------------------------------------

    def abort(self, request_id: str) -> None:
        """Take the request out of whichever queue holds it and free its blocks (a finished hold_blocks
        request's full blocks stay in the prefix cache). Unknown ids are a no-op."""
        seq = self.requests.pop(request_id, None)
        if seq is None:
            return
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        elif seq.status is SequenceStatus.WAITING_FOR_REMOTE_KV:
            del self.waiting_for_kv[request_id]
        elif seq.status is SequenceStatus.WAITING_FOR_GRAMMAR:
            del self.waiting_for_grammar[request_id]
        elif seq.status is SequenceStatus.LOADING_KV:   # its blocks stay pinned until the load finishes
            self.loading.pop(request_id, None)
            self.fetching.pop(request_id, None)
            self.held.pop(request_id, None)
        self.block_manager.free(seq)
        if seq.status is not SequenceStatus.FINISHED:
            seq.move_to(SequenceStatus.FINISHED)
