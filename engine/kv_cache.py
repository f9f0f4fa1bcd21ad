"""The KV cache pool: one preallocated tensor per engine, block-major.

Shape `[num_blocks, num_layers, 2 (k, v), block_size, num_kv_heads, head_dim]`: one block of one
request is a single contiguous byte range across all layers, so moving it to another process is one
copy. Attention sees strided per-layer views `[num_blocks, block_size, num_kv_heads, head_dim]`.
"""

from __future__ import annotations

import torch

from pdcluster.engine.config import ModelConfig


class KVCachePool:
    def __init__(self, num_blocks: int, num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu", tensor: torch.Tensor | None = None) -> None:
        shape = (num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim)
        if tensor is None:
            tensor = torch.zeros(shape, dtype=dtype, device=device)
        else:
            if tuple(tensor.shape) != shape:
                raise ValueError(f"kv_pool_tensor: shape {tuple(tensor.shape)} does not match expected {shape}")
            if tensor.dtype != dtype:
                raise ValueError(f"kv_pool_tensor: dtype {tensor.dtype} does not match model dtype {dtype}")
            if not tensor.is_contiguous():
                raise ValueError("kv_pool_tensor: must be contiguous")
        self.tensor = tensor
        self.num_blocks, self.num_layers, _, self.block_size, self.num_kv_heads, self.head_dim = shape
        self.dtype = dtype
        self.device = tensor.device

    @staticmethod
    def shape_for(config: ModelConfig, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return (num_blocks, config.num_layers, 2, block_size, config.num_kv_heads, config.head_dim)

    @staticmethod
    def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return config.num_layers * 2 * block_size * config.num_kv_heads * config.head_dim * elem

    @property
    def block_bytes(self) -> int:
        return self.tensor[0].numel() * self.tensor.element_size()

    def layer_views(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(k, v) views of one layer, each `[num_blocks, block_size, num_kv_heads, head_dim]`, no copy."""
        return self.tensor[:, layer, 0], self.tensor[:, layer, 1]

    def block(self, block_id: int) -> torch.Tensor:
        """One block across all layers: a contiguous `[num_layers, 2, block_size, H, D]` view."""
        return self.tensor[block_id]
