"""The KV cache pool: one preallocated tensor per engine, block-major.

Shape `[num_blocks, num_layers, 2 (k, v), block_size, num_kv_heads, row]`: one block of one request is a
single contiguous byte range across all layers, so moving it to another process is one copy. Attention
sees strided per-layer views `[num_blocks, block_size, num_kv_heads, row]`.

`row` is `head_dim` for a float pool. An int8 pool (`kv_cache_dtype="int8"`) stores each (token, KV head)
row as `head_dim` int8 values followed by its fp16 scale (2 bytes, symmetric: scale = absmax / 127), so
`row = head_dim + 2` and a block carries its own scales: it is self-contained for KV transfer and the
prefix cache. An fp16 scale (not fp32) keeps a head_dim 64 row at 66 bytes, 1.94x fewer than bf16.

Under tensor parallelism on CPU the pool holds every rank's heads, shared by the rank processes:
`[num_blocks, num_layers, 2 * tp, block_size, kv_heads_per_rank, row]` (k and v of rank 0, of rank 1, ...).
Rank r reads and writes `[:, layer, 2r]` and `[:, layer, 2r + 1]` (contiguous per block, as the kernels
want), and a block restricted to a range of layers is
still one contiguous byte range holding all ranks' heads: KV transfer moves it unchanged between engines of
the same tensor_parallel_size (rank i's heads land in rank i's slice). A device rank's pool is its own slice
(tp = 1 here).
"""

from __future__ import annotations

import torch

from pdcluster.engine.config import ModelConfig
from pdcluster.engine.tp_shards import local_kv_heads

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
                 dtype: torch.dtype, device: torch.device | str = "cpu", tensor: torch.Tensor | None = None,
                 tp: int = 1) -> None:
        """`dtype`: the pool's (torch.int8 for an int8 KV cache with its scales inside each row);
        `num_kv_heads`: per rank; `tp`: how many ranks' slices the tensor holds."""
        shape = _shape(num_blocks, num_layers, block_size, num_kv_heads, row_size(head_dim, dtype), tp)
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
        self.num_blocks, self.num_layers, self.block_size, self.num_kv_heads = num_blocks, num_layers, block_size, \
            num_kv_heads
        self.tp = tp
        self.head_dim = head_dim
        self.dtype = dtype
        self.quantized = dtype == torch.int8
        self.device = tensor.device

    @staticmethod
    def shape_for(config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype | None = None,
                  tp: int = 1) -> tuple[int, ...]:
        return _shape(num_blocks, config.num_layers, block_size, local_kv_heads(config, tp),
                      row_size(config.head_dim, dtype), tp)

    @staticmethod
    def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype, tp: int = 1) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return torch.Size(KVCachePool.shape_for(config, 1, block_size, dtype, tp)).numel() * elem

    @property
    def block_bytes(self) -> int:
        return self.tensor[0].numel() * self.tensor.element_size()

    def layer_views(self, layer: int, rank: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """(k, v) views of one layer (of one rank's heads), each `[num_blocks, block_size, num_kv_heads, row]`,
        contiguous per block, no copy."""
        return self.tensor[:, layer, 2 * rank], self.tensor[:, layer, 2 * rank + 1]

    def block(self, block_id: int) -> torch.Tensor:
        """One block across all layers (and ranks): a contiguous view."""
        return self.tensor[block_id]


def _shape(num_blocks: int, num_layers: int, block_size: int, kv_heads: int, row: int, tp: int) -> tuple[int, ...]:
    return (num_blocks, num_layers, 2 * tp, block_size, kv_heads, row)
