"""Token embedding and the LM head (which may share the embedding weight)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdcluster.engine.layers.linear import Linear, linear


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class LMHead(Linear):
    """Set `packable = False` when it shares the embedding's weight: no packed copy of a vocab-sized matrix."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__(hidden_size, vocab_size)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return linear(hidden, self.weight, None, self.packed)
        if self.weight.dtype != torch.float32 or self.weight.device.type != "cpu" or hidden.shape[0] == 1:
            return F.linear(hidden, self.weight)
        # (without a packed weight) fp32 CPU GEMM with a vocab-wide N is slower than over row slices of 2k
        # (measured in docs/benchmarks.md);
        # the slices are contiguous views and the concat is small next to the GEMM.
        return torch.cat([F.linear(hidden, w) for w in self.weight.split(2048)], dim=-1)
