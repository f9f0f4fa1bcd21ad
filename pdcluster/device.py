"""What the engine and KV transfer must agree on about a device and a KV pool, in one place below both.

- `bind_thread(device)`: the calling thread's device context (Ascend and CUDA).
- The KV pool layout (engine/kv_cache.py describes it): `pool_shape`
  `[num_layers, kv_planes, num_blocks, block_size, num_kv_heads, row]` (`kv_planes`: 2 * tp K/V planes, or one
  plane of latent rows for an MLA model, whatever tp), and the row of an int8 pool, `head_dim` int8 values
  followed by one fp16 scale (`SCALE_BYTES`, `SCALE_DTYPE`): `row_size`, `row_scale_bytes`; which of the model's
  KV heads each tensor-parallel rank's planes hold (`rank_kv_heads`).
"""

from __future__ import annotations

import sys

import torch

SCALE_BYTES = 2   # one fp16 scale per (token, KV head) row of an int8 pool, after its head_dim values
SCALE_DTYPE = torch.float16


def row_scale_bytes(dtype: torch.dtype) -> int:
    """Bytes of scale at the end of each row of a pool of `dtype`: SCALE_BYTES for int8, else none."""
    return SCALE_BYTES if dtype == torch.int8 else 0


def row_size(head_dim: int, dtype: torch.dtype) -> int:
    """Elements of one (token, KV head) row in a pool of `dtype` (an int8 element is one byte)."""
    return head_dim + row_scale_bytes(dtype)


def kv_planes(tp: int = 1, latent: bool = False) -> int:
    """Planes per layer of a KV pool: K and V of each of `tp` ranks, or one for a latent (MLA) pool, whose
    latent rows every rank shares (they are not split by heads)."""
    return 1 if latent else 2 * tp


def rank_kv_heads(num_kv_heads: int, rank: int, tp: int) -> range:
    """The model's KV heads rank `rank` of `tp` holds (engine/tp_shards.py splits k/v_proj so): an equal share while
    there are at least as many heads as ranks, else one copy of head rank * num_kv_heads // tp."""
    if num_kv_heads >= tp:
        per = num_kv_heads // tp
        return range(rank * per, (rank + 1) * per)
    head = rank * num_kv_heads // tp
    return range(head, head + 1)


def pool_shape(num_blocks: int, num_layers: int, block_size: int, num_kv_heads: int, row: int,
               tp: int = 1, planes: int | None = None) -> tuple[int, ...]:
    """The KV pool's shape: layer-major, then the layer's `planes` (default K and V of each of `tp` ranks:
    `kv_planes`), then blocks."""
    return (num_layers, kv_planes(tp) if planes is None else planes, num_blocks, block_size, num_kv_heads, row)


def is_npu(device: torch.device) -> bool:
    """Whether tensors on `device` run torch_npu's kernels: NPU tensors; and, under the CPU emulator of torch_npu
    (tests/fake_torch_npu) set to `npu_on_cpu`, CPU tensors, which stand in for NPU ones there (a CPU process
    cannot hold tensors on a device named "npu": docs/engine.md "NPU emulator")."""
    if device.type == "npu":
        return True
    emulator = getattr(sys.modules.get("torch_npu"), "_emulator", None)
    return device.type == "cpu" and bool(getattr(emulator, "npu_on_cpu", False))


def bind_thread(device: torch.device) -> None:
    """Bind the calling thread to `device`. On Ascend the device context is per thread: a thread that never called
    `torch.npu.set_device` (an engine thread, a KV channel's connect, write or receive thread) fails its first
    device op with "the context is empty". On CUDA, ops without an explicit device go to the current one.
    Cheap to repeat; nothing on CPU."""
    if is_npu(device):
        torch.npu.set_device(device.index or 0)  # type: ignore[attr-defined]  # set by torch_npu
    elif device.type == "cuda":
        torch.cuda.set_device(device)
