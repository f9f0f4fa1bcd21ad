"""A request's state inside the engine, and the stop rules (vLLM semantics)."""

from __future__ import annotations

import enum

from pdcluster.control.sampling_params import SamplingParams
from pdcluster.engine.block_manager import chain_hash


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 eos_token_ids: list[int], max_model_len: int, arrival: int, hold_blocks: bool = False) -> None:
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
        self.status = SequenceStatus.WAITING
        self.block_table: list[int] = []
        self.num_computed_tokens = 0                # tokens whose KV is in the cache
        self.num_cached_tokens = 0                  # prompt tokens served by the prefix cache
        self.block_hashes: list[int] = []           # hashes of the leading full, computed blocks
        self.finish_reason: str | None = None
        self.stop_reason: int | None = None
        self.num_emitted = 0                        # output tokens already reported by step()

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token: int, logprob=None) -> None:
        self.output_token_ids.append(token)
        self.token_ids.append(token)
        if self.params.logprobs is not None:
            self.output_logprobs.append(logprob)
        self._check_stop(token)

    def _check_stop(self, token: int) -> None:
        p = self.params
        n_out = len(self.output_token_ids)
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

    def reset_for_recompute(self) -> None:
        """After preemption: the blocks are gone, everything (prompt + outputs so far) is recomputed."""
        self.block_table = []
        self.num_computed_tokens = 0
        self.block_hashes = []
        self.status = SequenceStatus.WAITING

    def new_full_block_hashes(self, block_size: int) -> list[tuple[int, int, list[int]]]:
        """(block id, hash, tokens) for blocks that became full and computed since the last call."""
        out = []
        full = self.num_computed_tokens // block_size
        prev = self.block_hashes[-1] if self.block_hashes else None
        for i in range(len(self.block_hashes), full):
            tokens = self.token_ids[i * block_size:(i + 1) * block_size]
            prev = chain_hash(prev, tokens)
            self.block_hashes.append(prev)
            out.append((self.block_table[i], prev, tokens))
        return out
