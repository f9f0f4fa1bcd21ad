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
        gate_up = self.gate_up_proj(x)
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)
