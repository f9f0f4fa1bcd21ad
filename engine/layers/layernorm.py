"""RMSNorm, computed in float32 like the HF reference, with an optional fused residual add; on NPU torch_npu's
fused `npu_rms_norm` / `npu_add_rms_norm`. A checkpoint may give a norm a bias (msModelSlim's anti-outlier
quantization writes `input_layernorm.bias` / `post_attention_layernorm.bias`): y = weight * norm(x) + bias, added
after the norm as vLLM-Ascend's AscendRMSNorm does."""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from pdcluster.engine.attention import native
from pdcluster.engine.device import is_npu


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden_size))
        self.bias: nn.Parameter | None = None

    def load_bias(self, name: str, bias: torch.Tensor) -> None:
        if tuple(bias.shape) != tuple(self.weight.shape):
            raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(bias.shape)}, expected "
                             f"{tuple(self.weight.shape)}")
        self.bias = nn.Parameter(bias.to(self.weight.dtype).to(self.weight.device), requires_grad=False)

    def _biased(self, y: torch.Tensor) -> torch.Tensor:
        return y if self.bias is None else y + self.bias

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # torch's fused kernel over the fp32 values: the same result as HF's pow / mean / rsqrt / mul chain
        # (bitwise, in the tests' parity checks), one pass instead of five.
        return self.weight * F.rms_norm(x.float(), self.weight.shape, eps=self.eps).to(x.dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Without `residual`: norm(x). With it: (norm(x + residual), x + residual)."""
        if is_npu(x.device):
            import torch_npu

            if residual is None:
                return self._biased(torch_npu.npu_rms_norm(x, self.weight, self.eps)[0])
            y, _, x = torch_npu.npu_add_rms_norm(x, residual, self.weight, self.eps)
            return self._biased(y), x
        if x.device.type == "cpu" and not torch.compiler.is_compiling():   # (compiled: inductor fuses the chain)
            fused = native.rms_norm(x, self.weight, self.eps, residual)
            if fused is not None:
                y, s = fused
                return self._biased(y) if s is None else (self._biased(y), s)
        if residual is None:
            return self._biased(self._norm(x))
        x = x + residual
        return self._biased(self._norm(x)), x


def norm_tensor_name(name: str) -> str:
    """msModelSlim's anti-outlier names a norm's tensors `<norm>.module.weight` / `.module.bias`: the plain name."""
    return re.sub(r"norm\.module\.(weight|bias)$", r"norm.\1", name)


def load_norm_bias(model: nn.Module, name: str, tensor: torch.Tensor) -> bool:
    """Checkpoint tensor `name` (a plain name: norm_tensor_name) as the bias of an RMSNorm of `model`; False when
    `name` is no such tensor."""
    path, _, leaf = name.rpartition(".")
    if leaf != "bias" or not path:
        return False
    try:
        norm = model.get_submodule(path)
    except AttributeError:
        return False
    if not isinstance(norm, RMSNorm):
        return False
    norm.load_bias(name, tensor)
    return True
