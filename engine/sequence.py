"""A request's state inside the engine, and the stop rules (vLLM semantics)."""

from __future__ import annotations

import enum
from typing import Any

from pdcluster.control.block_hash import chain_hash
from pdcluster.control.lifecycle import check_move
from pdcluster.control.sampling_params import SamplingParams
from pdcluster.engine.lora.request import LoRARequest
from pdcluster.engine.speculative.policy import Acceptance


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"   # blocks held; another node writes the prompt's KV
    WAITING_FOR_GRAMMAR = "waiting_for_grammar"       # structured output: its grammar compiles (no blocks yet)
    LOADING_KV = "loading_kv"                         # blocks held; its prefix is copied from a KV tier / node
    FINISHED = "finished"


# The moves the scheduler makes (it is the one writer of a sequence's status):
#   WAITING ──admitted──► RUNNING ──stopped / aborted──► FINISHED
#      ▲                     │
#      └────preempted────────┘
#   new, remote_kv ──► WAITING_FOR_REMOTE_KV ──landed──► RUNNING;  ──failed──► WAITING;  ──aborted──► FINISHED
#   new, structured output ──► WAITING_FOR_GRAMMAR ──compiled──► WAITING;  ──compile failed / aborted──► FINISHED
#   WAITING ──prefix in a KV tier or on another node──► LOADING_KV ──loaded (or not)──► WAITING;  ──aborted──► FINISHED
#   new, remote_kv, prefix loadable ──► WAITING ──(loads)──► WAITING_FOR_REMOTE_KV (Scheduler.on_reserved)
_NEXT = {
    SequenceStatus.WAITING: {SequenceStatus.RUNNING, SequenceStatus.WAITING_FOR_REMOTE_KV,
                             SequenceStatus.WAITING_FOR_GRAMMAR, SequenceStatus.LOADING_KV, SequenceStatus.FINISHED},
    SequenceStatus.LOADING_KV: {SequenceStatus.WAITING, SequenceStatus.FINISHED},
    SequenceStatus.WAITING_FOR_GRAMMAR: {SequenceStatus.WAITING, SequenceStatus.FINISHED},
    SequenceStatus.RUNNING: {SequenceStatus.WAITING, SequenceStatus.FINISHED},
    SequenceStatus.WAITING_FOR_REMOTE_KV: {SequenceStatus.RUNNING, SequenceStatus.WAITING, SequenceStatus.FINISHED},
    SequenceStatus.FINISHED: set(),
}


class Sequence:
    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 eos_token_ids: list[int], max_model_len: int, arrival: int, hold_blocks: bool = False,
                 hash_seed: int = 0) -> None:
        self.request_id = request_id
        self.params = params
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.arrival = arrival
        self.hold_blocks = hold_blocks
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.token_ids = list(prompt_token_ids)     # prompt + outputs
        self.output_logprobs: list = []
        self.cumulative_logprob = 0.0               # sum of the sampled tokens' logprobs (when logprobs are asked)
        # params.prompt_logprobs: per prompt token (the first has none: None), filled by the model runner as
        # the prompt's chunks are computed; the one writer, on the engine thread
        self.prompt_logprobs: list | None = [None] if params.prompt_logprobs is not None else None
        self.status = SequenceStatus.WAITING
        self.block_table: list[int] = []
        self.num_computed_tokens = 0                # tokens whose KV is in the cache
        self.num_cached_tokens = 0                  # prompt tokens served by the prefix cache
        self.num_cached_blocks = 0                  # leading blocks of block_table published in the prefix cache
        self.num_freed_blocks = 0                   # leading entries released (out of the sliding window)
        self.num_evicted_tokens = 0                 # StreamingLLM: tokens dropped between the sinks and the window
        self.num_tier_loads = 0                     # times its prefix was loaded back from a KV tier (kv_tiers.py)
        self.fetch_blocks = 0                       # leading blocks another node holds: fetched before it runs
        self.prefetch_only = False                  # a migration's pre-copy: fetched, held, never run
        self.remote_kv = False                      # another node computes its prompt KV (Scheduler.add_remote)
        self._block_hashes: list[int] = []          # stable hashes of the full blocks of token_ids, grown lazily
        self.hash_seed = hash_seed                  # where the hash chain starts (the engine's `hash_seed`)
        self.lora: LoRARequest | None = None        # the adapter it runs under (None: the base model)
        self.finish_reason: str | None = None
        self.stop_reason: int | None = None
        # structured output (engine/structured_output.Grammar): accepts every output token; None without one
        self.grammar: Any = None
        self.error: str | None = None               # why it finished with "abort" without being aborted
        # speculative decoding: drafts for the positions after token_ids, scored by the next step (the scheduler
        # sets and clears them); what the proposer keeps about this sequence's KV (None once its blocks are freed)
        self.spec_token_ids: list[int] = []
        self.spec_acceptance = Acceptance()         # its drafts' record, what the draft policy reads
        self.proposer_state: Any = None
        self.num_step_tokens = 0                    # output tokens the last step appended (several when drafts passed)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Prompt logprobs are asked and not all computed: the prompt must be run, not read from the prefix cache."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens

    def move_to(self, status: SequenceStatus) -> None:
        """Change the status along one of the moves of `_NEXT`; any other move is a bug and raises."""
        self.status = check_move(_NEXT, self.status, status, f"request {self.request_id!r}")

    def block_hashes(self, block_size: int) -> list[int]:
        """Chained hashes (`pdcluster.control.block_hash`) of every full block of `token_ids`. Each block is
        hashed once while tokens are only appended (preemption keeps them); `drop_tokens` forgets them."""
        hashes = self._block_hashes
        for i in range(len(hashes), self.num_tokens // block_size):
            prev = hashes[-1] if hashes else self.hash_seed
            hashes.append(chain_hash(prev, self.token_ids[i * block_size:(i + 1) * block_size]))
        return hashes

    def drop_tokens(self, start: int, count: int) -> None:
        """StreamingLLM: remove `token_ids[start:start + count]` (cache positions; outputs keep every token).
        The block hashes of the shortened tokens differ: they are recomputed when next asked for."""
        del self.token_ids[start:start + count]
        self.num_evicted_tokens += count
        self._block_hashes = []

    def append_token(self, token: int, logprob=None) -> None:
        self.output_token_ids.append(token)
        self.token_ids.append(token)
        if self.grammar is not None:
            self.grammar.accept(token)
        if self.params.logprobs is not None:
            self.output_logprobs.append(logprob)
            if logprob is not None:
                self.cumulative_logprob += logprob[0]
        self._check_stop(token)

    def _check_stop(self, token: int) -> None:
        p = self.params
        n_out = len(self.output_token_ids)
        if self.grammar is not None and self.grammar.terminated:   # it accepted EOS where the grammar may end
            self.finish_reason = "stop"
            return
        if n_out >= p.min_tokens:
            if not p.ignore_eos and token in self.eos_token_ids:
                self.finish_reason = "stop"
                return
            if token in p.stop_token_ids:
                self.finish_reason, self.stop_reason = "stop", token
                return
        if n_out >= p.max_tokens or self.num_tokens >= self.max_model_len:
            self.finish_reason = "length"

    @property
    def stopped(self) -> bool:
        return self.finish_reason is not None
