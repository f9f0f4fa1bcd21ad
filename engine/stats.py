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
    num_waiting_for_grammar: int = 0     # structured-output requests whose grammar still compiles
    num_preemptions: int = 0
    prefix_cache_hit_tokens: int = 0
    prefix_cache_query_tokens: int = 0
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    num_generated_tokens: int = 0        # tokens sampled (the first token of each prompt included)
    num_steps: int = 0
    max_num_seqs: int = 0
    tokens_per_s: float = 0.0            # generated tokens per second over the last RATE_INTERVAL_S (llm_engine)
    # MoE models (engine/expert_load.py): tokens routed to each expert, one row per MoE layer, since the start
    expert_layers: tuple[int, ...] = ()  # the decoder layer index of each row
    expert_tokens: tuple[tuple[int, ...], ...] = ()
    # speculative decoding (engine/scheduler.SpecDecodeCounts): the method ("": off), steps that scored drafts,
    # drafts, accepted ones
    spec_method: str = ""
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_position: tuple[int, ...] = ()
    # KV tiers (engine/kv_tiers.py; all 0 without them): requests whose prefix is being loaded back, blocks each
    # tier holds, copies since the start
    num_loading_kv: int = 0
    kv_tier_host_blocks: int = 0
    kv_tier_disk_blocks: int = 0
    kv_tier_stored_blocks: int = 0          # pool -> host
    kv_tier_disk_writes: int = 0            # host -> disk
    kv_tier_loaded_host_blocks: int = 0     # prefix blocks served by the host tier instead of recomputed
    kv_tier_loaded_disk_blocks: int = 0     # ... by the disk tier
    kv_tier_failed_loads: int = 0           # blocks that could not be read back (missing, corrupt): recomputed
    # prefix blocks copied between nodes (KVConnector.on_fetch): fetched intact, asked for but not arrived (the
    # holder lacked them, failed, died: recomputed), and this node's blocks lent to another node
    kv_fetched_blocks: int = 0
    kv_fetch_missed_blocks: int = 0
    kv_lent_blocks: int = 0
    kv_tier_dropped_stores: int = 0         # blocks not offloaded (too many copies pending)
    kv_tier_disk_disabled: bool = False     # a disk write failed (full, I/O error): the disk tier is off

    @property
    def spec_acceptance_rate(self) -> float:
        """Accepted drafts / drafts (0 before any)."""
        return self.spec_num_accepted_tokens / self.spec_num_draft_tokens if self.spec_num_draft_tokens else 0.0

    @property
    def spec_mean_accepted_length(self) -> float:
        """Tokens a sequence step that scored drafts produced, on average: 1 + accepted drafts per such step
        (vLLM's mean acceptance length; 0 before any)."""
        return 1.0 + self.spec_num_accepted_tokens / self.spec_num_drafts if self.spec_num_drafts else 0.0

    @property
    def num_used_blocks(self) -> int:
        return self.num_total_blocks - self.num_free_blocks

    @property
    def batch_occupancy(self) -> float:
        """Running sequences / max_num_seqs: how full the batch is (0 when unknown)."""
        return self.num_running / self.max_num_seqs if self.max_num_seqs else 0.0

    @property
    def expert_totals(self) -> tuple[int, ...]:
        """Tokens routed to each expert, summed over the MoE layers."""
        return tuple(sum(column) for column in zip(*self.expert_tokens, strict=True))

    @property
    def expert_imbalance(self) -> tuple[float, int] | None:
        """(max / mean tokens per expert, layer index) of the most imbalanced MoE layer (1.0: perfectly even);
        None before any token was routed."""
        worst: tuple[float, int] | None = None
        for layer, row in zip(self.expert_layers, self.expert_tokens, strict=True):
            if sum(row):
                ratio = max(row) * len(row) / sum(row)
                if worst is None or ratio > worst[0]:
                    worst = (ratio, layer)
        return worst
