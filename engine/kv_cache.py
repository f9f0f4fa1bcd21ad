"""The KV cache pool: one preallocated tensor per engine, block-major.

Shape `[num_blocks, num_layers, 2 (k, v), block_size, num_kv_heads, row]`: one block of one request is a
single contiguous byte range across all layers, so moving it to another process is one copy. Attention
sees strided per-layer views `[num_blocks, block_size, num_kv_heads, row]`.

`row` is `head_dim` for a float pool. An int8 pool (`kv_cache_dtype="int8"`) stores each (token, KV head)
row as `head_dim` int8 values followed by its fp16 scale (2 bytes, symmetric: scale = absmax / 127), so
`row = head_dim + 2` and a block carries its own scales: it is self-contained for KV transfer and the
prefix cache. An fp16 scale (not fp32) keeps a head_dim 64 row at 66 bytes, 1.94x fewer than bf16.
"""

from __future__ import annotations

import torch

from pdcluster.engine.config import ModelConfig

SCALE_BYTES = 2        # one fp16 scale per (token, KV head) row of an int8 pool
SCALE_DTYPE = torch.float16


def row_size(head_dim: int, dtype: torch.dtype) -> int:
    """Elements of one (token, KV head) row in a pool of `dtype`."""
    return head_dim + SCALE_BYTES if dtype == torch.int8 else head_dim


def resolve_kv_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """`EngineArgs.kv_cache_dtype` as the pool's torch dtype: "auto" is the model dtype."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype == "int8":
        return torch.int8
    raise ValueError(f"kv_cache_dtype: expected auto or int8, got {kv_cache_dtype!r}")


def quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """[..., D] float → [..., D + 2] int8 rows: the values, then the row's fp16 scale (absmax / 127)."""
    scale = (x.abs().amax(-1, keepdim=True).float() / 127.0).clamp_min(2.0 ** -24).to(SCALE_DTYPE)
    q = torch.round(x.float() / scale.float()).clamp_(-127, 127).to(torch.int8)
    return torch.cat([q, scale.view(torch.int8)], dim=-1)


def dequantize_rows(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[..., D + 2] int8 rows (any strides with a contiguous last dim) → [..., D] of `dtype`."""
    d = rows.shape[-1] - SCALE_BYTES
    scale = rows[..., d:].contiguous().view(SCALE_DTYPE)
    return (rows[..., :d].float() * scale.float()).to(dtype)


class KVCachePool:
    def __init__(self, num_blocks: int, num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu", tensor: torch.Tensor | None = None) -> None:
        """`dtype`: the pool's (torch.int8 for an int8 KV cache with its scales inside each row)."""
        shape = (num_blocks, num_layers, 2, block_size, num_kv_heads, row_size(head_dim, dtype))
        if tensor is None:
            tensor = torch.zeros(shape, dtype=dtype, device=device)
        else:
            if tuple(tensor.shape) != shape:
                raise ValueError(f"kv_pool_tensor: shape {tuple(tensor.shape)} does not match expected {shape}")
            if tensor.dtype != dtype:
                raise ValueError(f"kv_pool_tensor: dtype {tensor.dtype} does not match the KV cache dtype {dtype}")
            if not tensor.is_contiguous():
                raise ValueError("kv_pool_tensor: must be contiguous")
        self.tensor = tensor
        self.num_blocks, self.num_layers, _, self.block_size, self.num_kv_heads, _ = shape
        self.head_dim = head_dim
        self.dtype = dtype
        self.quantized = dtype == torch.int8
        self.device = tensor.device

    @staticmethod
    def shape_for(config: ModelConfig, num_blocks: int, block_size: int,
                  dtype: torch.dtype | None = None) -> tuple[int, ...]:
        return (num_blocks, config.num_layers, 2, block_size, config.num_kv_heads, row_size(config.head_dim, dtype))

    @staticmethod
    def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return config.num_layers * 2 * block_size * config.num_kv_heads * row_size(config.head_dim, dtype) * elem

    @property
    def block_bytes(self) -> int:
        return self.tensor[0].numel() * self.tensor.element_size()

    def layer_views(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(k, v) views of one layer, each `[num_blocks, block_size, num_kv_heads, row]`, no copy."""
        return self.tensor[:, layer, 0], self.tensor[:, layer, 1]

    def block(self, block_id: int) -> torch.Tensor:
        """One block across all layers: a contiguous `[num_layers, 2, block_size, H, row]` view."""
        return self.tensor[block_id]
