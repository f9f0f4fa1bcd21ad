"""The KV cache pool: one preallocated tensor per engine, layer-major, one contiguous K and V cache per layer.

Shape `[num_layers, 2 * tp, num_blocks, block_size, num_kv_heads, row]`: plane `2r` is rank r's K cache of a
layer and plane `2r + 1` its V cache, each one contiguous `[num_blocks, block_size, num_kv_heads, row]` tensor
(`layer_views`), the layout the device kernels take (torch_npu `_npu_reshape_and_cache` /
`npu_fused_infer_attention_score` with a block table, FlashInfer's paged KV, the CPU decode kernel): new K/V
land through one flat int32 slot index (`block * block_size + offset`), and a block table indexes the first
dim. Why layer-major (and rank inside the layer) rather than rank-major: a layer's planes of every rank are
neighbours, so the layer-wise KV push addresses "layers [l0, l1)" as one range of planes
`[2tp·l0, 2tp·l1)`, and a run of consecutive blocks is one contiguous byte range per plane (KV transfer moves
per-plane runs, no staging). The price: one block across all layers is `2tp · num_layers` ranges
(`block(i)` is a strided view) instead of one.

`row` is `head_dim` for a float pool. An int8 pool (`kv_cache_dtype="int8"`) stores each (token, KV head)
row as `head_dim` int8 values followed by its fp16 scale (2 bytes, symmetric: scale = absmax / 127), so
`row = head_dim + 2` and a block carries its own scales: it is self-contained for KV transfer and the
prefix cache. An fp16 scale (not fp32) keeps a head_dim 64 row at 66 bytes, 1.94x fewer than bf16.

Under tensor parallelism on CPU the pool holds every rank's heads, shared by the rank processes (2 * tp
planes per layer, rank r's K and V at 2r and 2r + 1; rank r holds the model's KV heads
`device.rank_kv_heads(num_kv_heads, r, tp)`: an equal share, or a copy of one head when the model has fewer KV
heads than ranks). KV transfer moves a block's planes unchanged between engines of the same tensor_parallel_size
(rank i's heads land in rank i's planes) and regroups the heads between engines of different sizes
(kv_transfer/regroup.py). A device rank's pool is its own slice (tp = 1 here), and so is a CPU rank's with
`kv_pool_per_rank`: each rank allocates its slice in its own process, and KV moves rank to rank over each rank's
own channel (kv_transfer/per_rank/).

A latent pool (an MLA model, `ModelConfig.kv_latent_dim` > 0: DeepSeek-V2/V3) has ONE plane per layer whatever
the tensor-parallel size, `[num_layers, 1, num_blocks, block_size, 1, row]`: each (token, layer) row is the
normalized compressed KV (kv_lora_rank values) then the roped shared key (qk_rope_head_dim values), row =
kv_latent_dim (+ 2 scale bytes in an int8 pool, quantized as one row). Every rank's heads are up-projected from
the same latent, so it is replicated, never split by heads: the ranks of a CPU engine share the one plane, and
a prefill node ships one copy. `layer_views` returns (latent cache, None).

Construction: `make_pool` builds an engine's pool (an external tensor, a `kv_pool_factory` tensor, or its own)
and, under tensor parallelism, the `RankPools` the other ranks bind theirs from.

Allocation: the pool this module allocates starts at a `POOL_ALIGNMENT` boundary (2 MiB on a device, the
huge-page size memory registration for RDMA / HCCL / CUDA IPC works in; a page on CPU, which shared-memory
pools get from mmap anyway), and every plane starts at a multiple of one block's plane bytes after it.
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass
from typing import Callable

import torch

from pdcluster.device import SCALE_BYTES, SCALE_DTYPE, kv_planes, pool_shape, row_size
from pdcluster.engine.config import ModelConfig
from pdcluster.engine.tp_shards import local_kv_heads


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


POOL_ALIGNMENT = {"cpu": 4096}   # bytes; any other device: DEVICE_ALIGNMENT
DEVICE_ALIGNMENT = 2 << 20


def aligned_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """A zeroed contiguous tensor whose storage starts at the device's POOL_ALIGNMENT (over-allocates by at
    most one alignment and slices)."""
    device = torch.device(device)
    align = POOL_ALIGNMENT.get(device.type, DEVICE_ALIGNMENT)
    elem = torch.empty((), dtype=dtype).element_size()
    nbytes = torch.Size(shape).numel() * elem
    raw = torch.zeros(nbytes + align, dtype=torch.uint8, device=device)
    skip = -raw.data_ptr() % align
    return raw[skip:skip + nbytes].view(dtype).view(shape)


def pool_geometry(config: ModelConfig, tp: int = 1) -> tuple[int, int, bool]:
    """(KV heads per rank, values per row before any scale, latent) of `config`'s pool: an MLA model caches one
    latent row (kv_latent_dim values) per token, as one 'head' every rank shares."""
    if config.kv_latent_dim:
        return 1, config.kv_latent_dim, True
    return local_kv_heads(config, tp), config.head_dim, False


class KVCachePool:
    def __init__(self, num_blocks: int, num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu", tensor: torch.Tensor | None = None,
                 tp: int = 1, latent: bool = False) -> None:
        """`dtype`: the pool's (torch.int8 for an int8 KV cache with its scales inside each row);
        `num_kv_heads`: per rank; `tp`: how many ranks' slices the tensor holds (ranks sharing it, for a latent
        pool); `latent`: an MLA pool, one plane per layer of rows of `head_dim` (= kv_latent_dim) values, 1 head."""
        self.kv_planes = kv_planes(tp, latent)
        self.latent = latent
        shape = pool_shape(num_blocks, num_layers, block_size, num_kv_heads, row_size(head_dim, dtype),
                           planes=self.kv_planes)
        if tensor is None:
            tensor = aligned_zeros(shape, dtype, device)
        else:
            if tuple(tensor.shape) != shape:
                planes = "1 (latent)" if latent else "2 * tp"
                raise ValueError(f"kv_pool_tensor: shape {tuple(tensor.shape)} does not match expected {shape} "
                                 f"[num_layers, {planes}, num_blocks, block_size, kv_heads, row]")
            if tensor.dtype != dtype:
                raise ValueError(f"kv_pool_tensor: dtype {tensor.dtype} does not match the KV cache dtype {dtype}")
            if not tensor.is_contiguous():
                raise ValueError("kv_pool_tensor: must be contiguous")
        self.tensor = tensor
        self.num_blocks, self.num_layers, self.block_size, self.num_kv_heads = num_blocks, num_layers, block_size, \
            num_kv_heads
        self.tp = tp
        # The model's KV heads when the tensor holds every rank's (KV transfer's total_kv_heads, make_pool sets
        # it); None for one device rank's own slice under tensor parallelism.
        self.model_kv_heads: int | None = None
        self.head_dim = head_dim
        self.dtype = dtype
        self.quantized = dtype == torch.int8
        self.device = tensor.device

    @staticmethod
    def shape_for(config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype = torch.float32,
                  tp: int = 1) -> tuple[int, ...]:
        heads, dim, latent = pool_geometry(config, tp)
        return pool_shape(num_blocks, config.num_layers, block_size, heads, row_size(dim, dtype),
                          planes=kv_planes(tp, latent))

    @staticmethod
    def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype, tp: int = 1) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return torch.Size(KVCachePool.shape_for(config, 1, block_size, dtype, tp)).numel() * elem

    @property
    def block_bytes(self) -> int:
        """Bytes of one block across all layers and planes."""
        return self.tensor[:, :, 0].numel() * self.tensor.element_size()

    def layer_views(self, layer: int, rank: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(k, v) caches of one layer (of one rank's heads), each a contiguous
        `[num_blocks, block_size, num_kv_heads, row]` tensor, no copy. A latent pool: (the layer's latent
        cache `[num_blocks, block_size, 1, row]`, None), the same for every rank."""
        if self.latent:
            return self.tensor[layer, 0], None
        return self.tensor[layer, 2 * rank], self.tensor[layer, 2 * rank + 1]

    def block(self, block_id: int) -> torch.Tensor:
        """One block across all layers (and ranks): a strided `[num_layers, kv_planes, block_size, heads, row]`
        view."""
        return self.tensor[:, :, block_id]


@dataclass(frozen=True)
class MappedFile:
    """Where a CPU pool tensor lives when it is a shared mapping of a file (e.g. kv_transfer's /dev/shm pools):
    another process maps the same bytes by path."""
    path: str
    offset: int

    def map(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        with open(self.path, "r+b") as f:
            mm = mmap.mmap(f.fileno(), self.offset + nbytes, flags=mmap.MAP_SHARED)
        return torch.frombuffer(mm, dtype=torch.uint8)[self.offset:self.offset + nbytes].view(dtype).view(shape)


def mapped_file(tensor: torch.Tensor) -> MappedFile | None:
    """The file a contiguous CPU tensor is a shared mapping of (read from /proc/self/maps), or None."""
    start, end = tensor.data_ptr(), tensor.data_ptr() + tensor.numel() * tensor.element_size()
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split(maxsplit=5)
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                if lo <= start < hi:
                    path = parts[5].strip() if len(parts) == 6 else ""
                    if end > hi or "s" not in parts[1] or not path.startswith("/") or path.endswith("(deleted)"):
                        return None
                    return MappedFile(path, int(parts[2], 16) + start - lo)
    except OSError:
        return None
    return None


@dataclass(frozen=True)
class RankPools:
    """What tensor-parallel ranks 1..N-1 need to bind their KV pool (handed to them pickled)."""
    num_blocks: int
    block_size: int
    kv_heads: int                                   # per rank
    dtype: torch.dtype
    shared: torch.Tensor | MappedFile | None = None  # CPU: rank 0's pool of every rank's heads; None: own slices

    def pool(self, config: ModelConfig, device: torch.device, tp: int, tensor: torch.Tensor | None = None
             ) -> KVCachePool:
        """This rank's view: the shared pool (every rank's planes) or its own slice on `device` (in `tensor` when
        given: e.g. shared memory its rank agent made, engine/rank_agent.py)."""
        _, dim, latent = pool_geometry(config, tp)
        if self.shared is None:
            return KVCachePool(self.num_blocks, config.num_layers, self.block_size, self.kv_heads, dim,
                               self.dtype, device, tensor=tensor, latent=latent)
        shape = pool_shape(self.num_blocks, config.num_layers, self.block_size, self.kv_heads,
                           row_size(dim, self.dtype), planes=kv_planes(tp, latent))
        t = self.shared if isinstance(self.shared, torch.Tensor) else self.shared.map(shape, self.dtype)
        return KVCachePool(self.num_blocks, config.num_layers, self.block_size, self.kv_heads, dim,
                           self.dtype, device, tensor=t, tp=tp, latent=latent)


PoolFactory = Callable[[tuple[int, ...], torch.dtype], "torch.Tensor | None"]


def make_pool(config: ModelConfig, block_size: int, dtype: torch.dtype, device: torch.device, tp: int,
              num_blocks_for: Callable[[int], int], tensor: torch.Tensor | None = None,
              factory: PoolFactory | None = None, per_rank: bool = False) -> tuple[KVCachePool, RankPools | None]:
    """An engine's KV pool of `dtype`: `tensor` when given (its block count is its own), else one of
    `num_blocks_for(bytes per block)` blocks from `factory(shape, dtype)` (None: allocated here). With `tp` > 1
    also the `RankPools` of the other ranks: on CPU the pool holds every rank's heads (a latent pool: the one
    plane they share) in memory they map (a torch shared-memory tensor, or a shared mapping of a file); on a
    device, or with `per_rank`, each rank allocates its own slice (its own latent copy) of the same number of
    blocks, and this pool is rank 0's. A block's bytes, which the budget is divided by, are one rank's on a device
    (each rank's budget is its own device's memory) and every rank's on CPU (the ranks share the host's)."""
    shared = tp > 1 and device.type == "cpu" and not per_rank
    pool_tp = tp if shared else 1
    kv_heads, dim, latent = pool_geometry(config, tp)

    def shape_of(blocks: int) -> tuple[int, ...]:   # this pool's: every rank's planes, or one rank's slice
        return pool_shape(blocks, config.num_layers, block_size, kv_heads, row_size(dim, dtype),
                          planes=kv_planes(pool_tp, latent))

    if tensor is not None:
        num_blocks = tensor.shape[2]
    else:
        if device.type == "cpu":   # the ranks share the host's memory: a block costs every rank's slice of it
            per_block = torch.Size(shape_of(1)).numel() * torch.empty((), dtype=dtype).element_size()
            per_block *= 1 if shared else tp
        else:   # each rank its own device's (counted over the model's heads)
            per_block = KVCachePool.bytes_per_block(config, block_size, dtype)
        num_blocks = num_blocks_for(per_block)
        shape = shape_of(num_blocks)
        if factory is not None:
            tensor = factory(shape, dtype)
            if tensor is not None and not isinstance(tensor, torch.Tensor):
                raise TypeError(f"kv_pool_factory: must return a torch.Tensor or None, got {type(tensor).__name__}")
        if tensor is None and shared:
            tensor = torch.zeros(shape, dtype=dtype).share_memory_()
    pool = KVCachePool(num_blocks, config.num_layers, block_size, kv_heads, dim, dtype, device,
                       tensor=tensor, tp=pool_tp, latent=latent)
    pool.model_kv_heads = config.num_kv_heads if pool_tp == tp else None
    if tp == 1:
        return pool, None
    ranks = RankPools(num_blocks, block_size, kv_heads, dtype)
    if not shared:
        return pool, ranks
    where = pool.tensor if pool.tensor.is_shared() else mapped_file(pool.tensor)
    if where is None:
        raise ValueError("kv_pool_tensor / kv_pool_factory: with tensor_parallel_size > 1 on CPU the pool must be "
                         "memory the worker ranks can map (tensor.share_memory_() or a shared mapping of a file, "
                         "as kv_transfer's SharedKVPool)")
    return pool, RankPools(num_blocks, block_size, kv_heads, dtype, shared=where)
