"""Linear layers whose parameters are left uninitialized: every value comes from the checkpoint.

`MergedLinear` stores several projections (q/k/v or gate/up) as one matrix so one matmul serves them;
`load_shard` copies one checkpoint tensor into its rows."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class MergedLinear(Linear):
    def __init__(self, in_features: int, shard_sizes: dict[str, int], bias: bool = False) -> None:
        super().__init__(in_features, sum(shard_sizes.values()), bias)
        self.shard_offsets: dict[str, tuple[int, int]] = {}
        start = 0
        for name, size in shard_sizes.items():
            self.shard_offsets[name] = (start, size)
            start += size

    def load_shard(self, param: nn.Parameter, shard: str, loaded: torch.Tensor) -> None:
        start, size = self.shard_offsets[shard]
        if loaded.shape[0] != size:
            raise ValueError(f"shard {shard}: checkpoint has {loaded.shape[0]} rows, model expects {size}")
        param.data[start:start + size].copy_(loaded)
