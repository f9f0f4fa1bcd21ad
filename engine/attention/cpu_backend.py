"""CPU attention: decode and prefill through the native paged kernels (paged_decode.c, paged_prefill.c), the
rest as the torch path (whose per-step metadata it reuses for those fallbacks).

The decode kernel reads each sequence's K/V straight from the pool blocks, once; the torch path gathers them
into a buffer and reads them again in SDPA (slower: measured in docs/benchmarks.md). The prefill kernel packs a
chunk's keys once per KV head and runs a register-tiled flash loop (AVX-512 or AVX2), 1.2-2.2x torch's CPU flash
SDPA (docs/benchmarks.md "Prefill attention") on CPUs without AMX. With AMX-BF16 (Sapphire Rapids and later) the
kernel's bf16 path runs its two products on the tiles (`native.prefill_amx`), 1.2-1.7x torch's flash SDPA, which
also runs on the tiles and is 3-4x the kernel's AVX512-BF16 path; where the library has no AMX path but the CPU has
AMX for the query dtype (fp16 with AMX-FP16, or a build without it) prefill takes the torch path (int8 pools keep the
kernel, which reads them without a dequantized copy). Without a C compiler (or, for prefill, without AVX-512 or AVX2,
or with a head size other than 64/128/256) this backend behaves exactly as the torch one.
"""

from __future__ import annotations

import torch

from pdcluster.engine.attention import native
from pdcluster.engine.attention.metadata import PrefillChunk
from pdcluster.engine.attention.torch_backend import TorchAttentionBackend, TorchAttentionMetadata
from pdcluster.engine.config import cpu_has_amx


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

    def _prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, chunk: PrefillChunk, window: int) -> torch.Tensor:
        kernel = native.prefill_kernel(q.dtype, k_cache.dtype) if self._native_prefill(q, k_cache) else None
        out = None if kernel is None else native.paged_prefill(kernel, q, k_cache, v_cache, chunk.block_table,
                                                               chunk.num_cached, self.scale, window)
        return super()._prefill(q, k, v, k_cache, v_cache, chunk, window) if out is None else out

    @staticmethod
    def _native_prefill(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
        if q.device.type != "cpu" or not native.NATIVE_PREFILL:
            return False
        return k_cache.dtype == torch.int8 or not cpu_has_amx(q.dtype) or (
            q.dtype == torch.bfloat16 and k_cache.dtype == torch.bfloat16 and native.prefill_amx())
