"""Per-step attention inputs, built once by the model runner and shared by every layer.

The step's tokens are flattened: first one token per decoding sequence, then the prefill chunks.
A backend derives its own per-step metadata from these (`prepare`), once per step.
Indices are int32, as the device kernels take them (torch_npu `_npu_reshape_and_cache` slot mapping and
`npu_fused_infer_attention_score` block tables, FlashInfer's paged KV indices, the CPU decode kernel):
slots are flat, `block * block_size + offset`, into a layer's `[num_blocks, block_size, ...]` cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class PrefillChunk:
    start: int                  # first row of this chunk in the flattened batch
    end: int                    # one past its last row
    num_cached: int             # tokens of this sequence already in the cache before this chunk
    block_table: torch.Tensor   # [num_blocks] int32, covers num_cached + (end - start) tokens


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor         # [T] int32: flat slot (block * block_size + offset) of each new token's K/V
    num_decode_tokens: int = 0
    decode_block_tables: torch.Tensor | None = None   # [B, max_blocks] int32 (padded with a valid id)
    # [B] int32: tokens each decode row attends to (incl. its own); the runner sorts rows by it (ascending).
    decode_context_lens: torch.Tensor | None = None
    prefills: list[PrefillChunk] = field(default_factory=list)
