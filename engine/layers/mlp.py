"""SwiGLU MLP with gate and up projections fused into one matmul."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdcluster.engine.layers.linear import Linear, MergedLinear, linear, onednn_packed, release


class GatedMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = MergedLinear(hidden_size, {"gate": intermediate_size, "up": intermediate_size})
        self.down_proj = Linear(intermediate_size, hidden_size)
        self.gate_up_proj.packable = False   # forward uses its halves, packed separately below
        self.packed_halves: tuple[torch.Tensor, torch.Tensor] | None = None

    def prepack(self) -> None:
        n = self.intermediate_size
        w = self.gate_up_proj.weight
        halves = (onednn_packed(w[:n]), onednn_packed(w[n:]))
        self.packed_halves = None if halves[0] is None else halves
        if self.packed_halves is not None:
            release(w)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # One matmul per half of the fused weight (contiguous row views, no copy): on CPU two GEMMs with
        # N = intermediate_size beat one with 2x N (measured in docs/benchmarks.md), and each output is then
        # contiguous.
        w, b, n = self.gate_up_proj.weight, self.gate_up_proj.bias, self.intermediate_size
        packed = self.packed_halves or (None, None)
        gate = linear(x, w[:n], None if b is None else b[:n], packed[0])
        up = linear(x, w[n:], None if b is None else b[n:], packed[1])
        return self.down_proj(F.silu(gate, inplace=True).mul_(up))
