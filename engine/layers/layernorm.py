"""RMSNorm, computed in float32 like the HF reference, with an optional fused residual add."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden_size))

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Without `residual`: norm(x). With it: (norm(x + residual), x + residual)."""
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x
