"""MLA decode on Ascend NPUs: `torch_npu._npu_paged_attention_mla`, ATB's paged attention with `mlaVHeadSize`, on
the latent pool as it is.

vLLM-Ascend's eager MLA decode called exactly this (vllm_ascend/attention/mla_v1.py up to v0.9.x:
`_npu_paged_attention_mla(query=q, key_cache=kv_c_and_k_pe_cache, num_kv_heads, num_heads, scale_value,
block_table, context_lens, mla_vheadsize=kv_lora_rank, out=...)`) on a cache shaped like ours, [num_blocks,
block_size, 1, kv_lora_rank + qk_rope_head_dim]: every row is a key, its first kv_lora_rank values the value, the
query the absorbed q_nope · W_UK followed by q_pe. Its later decode path, `npu_fused_infer_attention_score(_v2)`
with `query_rope` / `key_rope`, takes the rope part as a separate contiguous cache and a 512 + 64 split only, which
this one-row pool is not. The operator's rules (ATB PagedAttentionOperation, "MLA合并输入kvcache"): float16 /
bfloat16, row <= 576, one KV head, block_size a multiple of 16 and at most 128 for rows over 256 (the NPU default
block is 128). Anything else (an int8 pool, a float32 model, other blocks) runs the torch absorbed decode of
mla.py; the latent write and the expanded prefill are mla.py's torch ops on NPU tensors.

Runs only under the CPU emulator of torch_npu here (tests/fake_torch_npu/torch_npu/mla.py, tests/test_mla_devices.py).
"""

from __future__ import annotations

import torch

from pdcluster.engine.attention.mla import MLAAttentionBackend
from pdcluster.engine.attention.torch_backend import TorchAttentionMetadata

OP_DTYPES = (torch.float16, torch.bfloat16)
MAX_ROW = 576


def op_takes(q: torch.Tensor, latent_cache: torch.Tensor) -> bool:
    """Whether `_npu_paged_attention_mla` accepts this query and latent cache (ATB's documented limits)."""
    block_size, row = latent_cache.shape[1], latent_cache.shape[-1]
    return (q.dtype in OP_DTYPES and latent_cache.dtype == q.dtype and row <= MAX_ROW and block_size % 16 == 0
            and (row <= 256 or block_size <= 128))


class NpuMLABackend(MLAAttentionBackend):
    name = "npu"

    def __init__(self, num_heads: int, kv_lora_rank: int, qk_rope_head_dim: int, qk_nope_head_dim: int,
                 v_head_dim: int, scale: float) -> None:
        super().__init__(num_heads, kv_lora_rank, qk_rope_head_dim, qk_nope_head_dim, v_head_dim, scale)
        import torch_npu  # imported only when this backend is selected

        self.ops = torch_npu
        self._step: tuple[TorchAttentionMetadata, torch.Tensor, torch.Tensor] | None = None

    def decode(self, q: torch.Tensor, latent_cache: torch.Tensor, meta: TorchAttentionMetadata) -> torch.Tensor:
        """q [B, N, R + P] (absorbed, then q_pe) -> [B, N, R]."""
        if not op_takes(q, latent_cache):
            return super().decode(q, latent_cache, meta)
        tables, lens = self._tables(meta)
        out = torch.empty(q.shape[0], q.shape[1], self.kv_lora_rank, dtype=q.dtype, device=q.device)
        self.ops._npu_paged_attention_mla(q.contiguous(), latent_cache, 1, self.num_heads, self.scale, tables, lens,
                                          self.kv_lora_rank, out)
        return out

    def _tables(self, meta: TorchAttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's int32 block tables and its context lengths on the host (ATB reads contextLens there), made
        once per step."""
        if self._step is None or self._step[0] is not meta:
            tables, lens = meta.decode_block_tables, meta.decode_context_lens
            assert tables is not None and lens is not None, "a step with decode rows"
            self._step = (meta, tables.to(torch.int32).contiguous(), lens.to("cpu", torch.int32).contiguous())
        return self._step[1], self._step[2]
