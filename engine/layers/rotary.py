"""Rotary position embedding (rotate-half form used by Llama/Qwen2/Mistral) with llama3, yarn and linear scaling,
computed as transformers computes them (`modeling_rope_utils`)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from pdcluster.engine.attention import native
from pdcluster.engine.device import is_npu


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    kind = scaling["rope_type"]
    factor = float(scaling["factor"])
    if kind == "linear":
        return inv_freq / factor
    if kind == "llama3":
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    if kind == "yarn":
        return _yarn_inv_freq(head_dim, theta, scaling)
    raise ValueError(f"rope_scaling type {kind!r} is not supported; supported: llama3, yarn, linear")


def rope_attention_factor(scaling: dict[str, Any] | None) -> float:
    """The factor cos and sin are multiplied by: yarn's attention temperature (1 for the other types)."""
    if scaling is None or scaling["rope_type"] != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor, mscale, mscale_all_dim = float(scaling["factor"]), scaling.get("mscale"), scaling.get("mscale_all_dim")

    def get_mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if mscale and mscale_all_dim:
        return get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
    return get_mscale(factor)


def mla_softmax_scale(qk_head_dim: int, scaling: dict[str, Any] | None) -> float:
    """DeepSeek MLA's softmax scale: qk_head_dim ** -0.5, times yarn's mscale(factor, mscale_all_dim) squared
    when the rope is scaled with `mscale_all_dim` (as transformers' `yarn_apply_mscale`): the temperature
    correction of the whole head, of which `rope_attention_factor` already put mscale / mscale_all_dim into
    the rotary part."""
    scale = qk_head_dim ** -0.5
    if scaling is None or not scaling.get("mscale_all_dim"):
        return scale
    factor, m = float(scaling["factor"]), float(scaling["mscale_all_dim"])
    mscale = 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0
    return scale * mscale * mscale


def _yarn_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any]) -> torch.Tensor:
    """YaRN (arXiv 2309.00071): interpolate the low frequencies by `factor`, keep the high ones, ramp between the
    dimensions that turn `beta_slow` and `beta_fast` times over the original context."""
    factor = float(scaling["factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return head_dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    extrapolation = 1 - ramp
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin tables indexed by absolute position; applied to flattened [T, heads, head_dim]."""

    cos: torch.Tensor   # [max_positions, head_dim] buffers (register_buffer)
    sin: torch.Tensor

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict[str, Any] | None,
                 dtype: torch.dtype) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        factor = rope_attention_factor(scaling)
        self.register_buffer("cos", (emb.cos() * factor).to(dtype), persistent=False)
        self.register_buffer("sin", (emb.sin() * factor).to(dtype), persistent=False)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) for these positions, shaped [T, 1, head_dim]; computed once per step for all layers."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def key_rerotator(pool, head_dim: int, theta: float, scaling: dict[str, Any] | None, tp_size: int = 1):
    """For StreamingLLM (engine/scheduler.py): a function (block ids, delta) that moves the keys stored in those
    blocks of `pool` (every layer) by `delta` positions. RoPE keys rotate by position, and R(p)R(d) = R(p + d),
    so a key written at cache position p becomes exactly the key of position p + delta (yarn's attention factor
    is already in the stored key and is not applied again)."""
    if pool.latent:
        raise ValueError("attention_sinks / streaming_window: not supported for MLA models (the latent cache "
                         "holds the rope part apart from the compressed KV)")
    if pool.quantized:
        raise ValueError("attention_sinks / streaming_window: not supported with kv_cache_dtype='int8' "
                         "(moving a quantized key would requantize it)")
    if tp_size != 1:
        raise ValueError("attention_sinks / streaming_window: not supported with tensor_parallel_size > 1")
    inv_freq = rope_inv_freq(head_dim, theta, scaling).to(pool.device)

    def rerotate(block_ids: list[int], delta: int) -> None:
        if not block_ids:
            return
        ids = torch.tensor(block_ids, dtype=torch.long, device=pool.device)
        keys = pool.tensor[:, 0, ids]                                   # [layers, n, block_size, heads, D]
        angle = torch.cat((inv_freq, inv_freq)) * float(delta)
        cos, sin = angle.cos(), angle.sin()
        moved = apply_rotary(keys.float(), cos, sin)
        pool.tensor[:, 0, ids] = moved.to(pool.tensor.dtype)

    return rerotate


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D] (any leading dims), cos / sin broadcastable to it; on NPU one fused `npu_rotary_mul` (its
    "half" mode is this rotate-half form) over x as [1, T, heads, D] with cos / sin [1, T, 1, D]."""
    if x.dim() == 3 and cos.dim() == 3 and is_npu(x.device):
        import torch_npu

        return torch_npu.npu_rotary_mul(x.unsqueeze(0), cos.unsqueeze(0), sin.unsqueeze(0))[0]
    if x.device.type == "cpu" and not torch.compiler.is_compiling():   # one pass (engine/layers/fused_ops.c)
        out = native.rotary(x, cos, sin)
        if out is not None:
            return out
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin
