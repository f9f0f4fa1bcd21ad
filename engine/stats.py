"""A snapshot of the engine's counters (`LLMEngine.get_stats()`); torch-free."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineStats:
    num_total_blocks: int = 0
    num_free_blocks: int = 0             # prefix-cached unreferenced blocks count as free
    num_reserved_blocks: int = 0         # held by requests waiting for remote KV
    num_running: int = 0
    num_waiting: int = 0
    num_waiting_for_kv: int = 0
    num_preemptions: int = 0
    prefix_cache_hit_tokens: int = 0
    prefix_cache_query_tokens: int = 0
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    num_steps: int = 0
