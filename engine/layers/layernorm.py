"""RMSNorm, computed in float32 like the HF reference, with an optional fused residual add; on NPU torch_npu's
fused `npu_rms_norm` / `npu_add_rms_norm`."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdcluster.engine.device import is_npu


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden_size))

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # torch's fused kernel over the fp32 values: the same result as HF's pow / mean / rsqrt / mul chain
        # (bitwise, in the tests' parity checks), one pass instead of five.
        return self.weight * F.rms_norm(x.float(), self.weight.shape, eps=self.eps).to(x.dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Without `residual`: norm(x). With it: (norm(x + residual), x + residual)."""
        if is_npu(x.device):
            import torch_npu

            if residual is None:
                return torch_npu.npu_rms_norm(x, self.weight, self.eps)[0]
            y, _, x = torch_npu.npu_add_rms_norm(x, residual, self.weight, self.eps)
            return y, x
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x
