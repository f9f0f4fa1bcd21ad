"""Prompt lookup (n-gram) proposer: the tokens that followed an earlier occurrence of the sequence's last n
tokens (n from prompt_lookup_max down to prompt_lookup_min; the latest occurrence with k tokens after it). No
model, no state."""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from pdcluster.engine.sequence import Sequence


class NgramProposer:
    writes_kv = False
    follows_target = False
    drafts_cheaply = True

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n = min_n
        self.max_n = max_n

    def kv_bytes_per_block(self, block_size: int) -> int:
        return 0

    def bind(self, num_blocks: int, block_size: int) -> None:
        pass

    def propose(self, seqs: list[Sequence], limits: list[int]) -> list[list[int]]:
        return [self.lookup(seq.token_ids, k) if k > 0 else [] for seq, k in zip(seqs, limits, strict=True)]

    def lookup(self, token_ids: list[int], k: int) -> list[int]:
        """Up to `k` tokens after an earlier match of the longest suffix that has one."""
        tokens = np.asarray(token_ids, dtype=np.int64)
        total = len(tokens)
        for n in range(min(self.max_n, total - 1), self.min_n - 1, -1):
            # windows start at 0 .. total - n - 1: every n-gram that ends before the suffix itself
            windows = sliding_window_view(tokens[:total - 1], n)
            hits = np.flatnonzero((windows == tokens[total - n:]).all(axis=1))
            if hits.size:   # the latest match followed by k tokens, else the earliest (the longest continuation)
                whole = hits[hits + n + k <= total]
                start = int(whole[-1] if whole.size else hits[0]) + n
                return tokens[start:start + k].tolist()
        return []
