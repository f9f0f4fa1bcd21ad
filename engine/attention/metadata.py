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
    # [B] int32: tokens each decode row attends to (incl. its own); the runner sorts rows by it (ascending).
    decode_context_lens: torch.Tensor | None = None
    prefills: list[PrefillChunk] = field(default_factory=list)
    _derived: dict = field(default_factory=dict, repr=False)   # per-step caches of the methods below

    def decode_bias(self, block_size: int, dtype: torch.dtype, window: int = 0) -> torch.Tensor:
        """[B, 1, 1, max_blocks * block_size] additive mask, 0 or -inf: hides each row's padding and, with
        window > 0, the positions more than `window` back. Built on first use (only backends that attend over
        padded gathers need it), once per step, dtype and window, and shared by the layers."""
        key = ("bias", dtype, window)
        if key not in self._derived:
            device = self.decode_block_tables.device
            lens = self.decode_context_lens.to(device, torch.long)[:, None]
            cols = torch.arange(self.decode_block_tables.shape[1] * block_size, device=device)[None, :]
            hidden = cols >= lens
            if window:
                hidden |= cols < lens - window
            bias = torch.zeros(hidden.shape, dtype=dtype, device=device).masked_fill_(hidden, float("-inf"))
            self._derived[key] = bias[:, None, None, :]
        return self._derived[key]

    def decode_groups(self, block_size: int) -> list[tuple[int, int, int]]:
        """(start row, end row, blocks) groups of decode rows, so a group attends over only `blocks` blocks
        instead of the batch maximum (`decode_groups` below); one group over every column if the rows are
        not sorted by context length."""
        if "groups" not in self._derived:
            blocks = ((self.decode_context_lens.long() + block_size - 1) // block_size).tolist()
            ordered = all(a <= b for a, b in zip(blocks, blocks[1:]))
            whole = [(0, len(blocks), self.decode_block_tables.shape[1])]
            self._derived["groups"] = decode_groups(blocks) if ordered else whole
        return self._derived["groups"]


def decode_groups(blocks: list[int], overhead: int = 8) -> list[tuple[int, int, int]]:
    """Split decode rows (sorted by ascending block count) into (start, end, blocks) groups minimising the
    padded attention work: a group costs rows * its largest block count, plus `overhead` (in row-blocks)
    for its extra gather and attention calls. Exact O(n^2) dynamic program; n is at most max_num_seqs."""
    n = len(blocks)
    best = [0] + [0] * n
    cut = [0] * (n + 1)
    for i in range(1, n + 1):
        widest = blocks[i - 1]
        best[i], cut[i] = min((best[j] + (i - j) * widest + overhead, j) for j in range(i))
    groups = []
    i = n
    while i > 0:
        groups.append((cut[i], i, blocks[i - 1]))
        i = cut[i]
    return groups[::-1]
