"""CPU attention: decode through the native paged kernel (paged_decode.c), the rest as the torch path
(whose per-step metadata it reuses for those fallbacks).

The kernel reads each sequence's K/V straight from the pool blocks, once; the torch path gathers them
into a buffer and reads them again in SDPA (slower: measured in docs/benchmarks.md).
Without a C compiler the kernel is missing and this backend behaves exactly as the torch one.
"""

from __future__ import annotations

import torch

from pdcluster.engine.attention import native
from pdcluster.engine.attention.torch_backend import TorchAttentionBackend, TorchAttentionMetadata


class CpuAttentionBackend(TorchAttentionBackend):
    name = "cpu"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim)
        self.scale = head_dim ** -0.5
        native.load()   # build now (once per machine), not in the first decode step

    def _decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: TorchAttentionMetadata, window: int = 0) -> torch.Tensor:
        kernel = native.decode_kernel(q.dtype, k_cache.dtype) if q.device.type == "cpu" else None
        tables, lens = meta.decode_block_tables, meta.decode_context_lens
        if kernel is None or tables is None or lens is None:
            return super()._decode(q, k_cache, v_cache, meta, window)
        return native.paged_decode(kernel, q, k_cache, v_cache, tables, lens, self.scale, window)
