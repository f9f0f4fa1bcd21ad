"""Per-step attention inputs, built once by the model runner and shared by every layer.

The step's tokens are flattened: first one token per decoding sequence, then the prefill chunks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class PrefillChunk:
    start: int                  # first row of this chunk in the flattened batch
    end: int                    # one past its last row
    num_cached: int             # tokens of this sequence already in the cache before this chunk
    block_table: torch.Tensor   # [num_blocks] long, covers num_cached + (end - start) tokens


@dataclass
class AttentionMetadata:
    slot_blocks: torch.Tensor          # [T] block id where each new token's K/V goes
    slot_offsets: torch.Tensor         # [T] offset inside that block
    num_decode_tokens: int = 0
    decode_block_tables: torch.Tensor | None = None   # [B, max_blocks] long (padded with a valid id)
    decode_bias: torch.Tensor | None = None           # [B, 1, 1, max_blocks * block_size] additive: 0 or -inf
    decode_context_lens: torch.Tensor | None = None   # [B] int32: tokens each decode row attends to (incl. its own)
    # (start row, end row, blocks) per decode group; rows sorted by context length so a group attends over
    # only `blocks` blocks instead of the batch maximum. Empty: one group of all rows over every column.
    decode_groups: list[tuple[int, int, int]] = field(default_factory=list)
    prefills: list[PrefillChunk] = field(default_factory=list)
    _window_bias: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)

    def decode_window_bias(self, window: int) -> torch.Tensor:
        """`decode_bias` also hiding the positions more than `window` tokens back (sliding-window layers);
        built once per step and window, shared by the layers."""
        if window not in self._window_bias:
            cols = torch.arange(self.decode_bias.shape[-1], device=self.decode_bias.device)
            old = cols[None, :] < (self.decode_context_lens.to(cols.device)[:, None] - window)
            self._window_bias[window] = self.decode_bias.masked_fill(old[:, None, None, :], float("-inf"))
        return self._window_bias[window]
