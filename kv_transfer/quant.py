"""Optional INT8 wire compression of KV: symmetric, one fp32 scale per (plane, block, head); a plane is one layer's
K or V of one rank, or a latent pool's one plane per layer (one scale per layer and block).

Halves the bytes of 16-bit KV (quarters fp32). Lossy: see docs/kv_transfer.md for its measured effect.
The payload is the int8 values followed by the fp32 scales.
"""

from __future__ import annotations

import torch


def wire_bytes(num_blocks: int, num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
               kv_planes: int = 2) -> int:
    """Payload bytes of `num_blocks` blocks, `num_layers` layers of `kv_planes` planes each (layout.KVLayout's:
    2 * tp per-head planes, or 1 latent plane), `num_kv_heads` heads per plane."""
    planes = num_blocks * num_layers * kv_planes
    return planes * block_size * num_kv_heads * head_dim + planes * num_kv_heads * 4


def quantize(kv: torch.Tensor) -> torch.Tensor:
    """kv [..., block_size, heads, head_dim] (e.g. [planes, n, block_size, heads, head_dim]) → flat uint8
    payload: the int8 values, then one fp32 scale per (leading index, head)."""
    x = kv.float()
    amax = x.abs().amax(dim=(-3, -1))  # [..., heads]
    scale = (amax / 127.0).clamp_min(1e-12)
    q = torch.round(x / scale[..., None, :, None]).clamp_(-127, 127).to(torch.int8)
    return torch.cat([q.reshape(-1).view(torch.uint8), scale.reshape(-1).view(torch.uint8)])


def dequantize(payload: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Inverse of quantize: flat uint8 payload → tensor of `shape` [..., block_size, heads, head_dim]."""
    *lead, bs, nh, hd = shape
    nvalues = torch.Size(shape).numel()
    nscales = torch.Size(lead).numel() * nh
    if payload.numel() != nvalues + nscales * 4:
        raise ValueError(f"int8 payload: {payload.numel()} bytes does not match shape {list(shape)}")
    q = payload[:nvalues].view(torch.int8).view(shape)
    scale = payload[nvalues:].view(torch.float32).view(*lead, nh)
    return (q.float() * scale[..., None, :, None]).to(dtype)
