"""SwiGLU MLP with gate and up projections fused into one matmul."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.linear import Linear, MergedLinear


class GatedMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = MergedLinear(hidden_size, {"gate": intermediate_size, "up": intermediate_size})
        self.down_proj = Linear(intermediate_size, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # One matmul per half of the fused weight (contiguous row views, no copy): on CPU two GEMMs with
        # N = intermediate_size run ~10% faster than one with 2x N, and each output is then contiguous.
        w, b, n = self.gate_up_proj.weight, self.gate_up_proj.bias, self.intermediate_size
        gate = F.linear(x, w[:n], None if b is None else b[:n])
        up = F.linear(x, w[n:], None if b is None else b[n:])
        return self.down_proj(F.silu(gate, inplace=True).mul_(up))
