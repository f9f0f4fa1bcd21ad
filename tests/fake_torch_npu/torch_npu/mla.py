"""`torch_npu._npu_paged_attention_mla`: MLA decode attention over the combined latent cache (ATB).

The op is ATB's PagedAttentionOperation with `mlaVHeadSize` set, exposed by op-plugin (op_plugin/ops/atb/
PagedAttentionMlaAtb.cpp: schema `_npu_paged_attention_mla(Tensor query, Tensor key_cache, int num_kv_heads, int
num_heads, float scale_value, Tensor block_table, Tensor context_lens, int mla_vheadsize, Tensor(a!) out) -> ()`,
BSND layout, no mask; its test test/test_custom_ops/test_atb_paged_attention_mla.py is the reference computation).
Rules from the ATB documentation of PagedAttentionOperation (hiascend ascendtbapi, "PagedAttentionOperation" and its
"MLA合并输入kvcache功能" section, e.g. canncommercial/81RC1 ascendtb_01_0200): each decode token's query [num_heads,
head_size] attends to the first context_lens[b] rows of its blocks; a key row is the whole cache row (head_size,
e.g. kv_lora_rank + rope = 576) and its value is the row's first mla_vheadsize values. vLLM-Ascend called it so for
eager MLA decode (vllm_ascend/attention/mla_v1.py up to v0.9.x, `kv_c_and_k_pe_cache` [num_blocks, block_size,
num_kv_heads, kv_lora_rank + qk_rope_head_dim], `mla_vheadsize=self.kv_lora_rank`).
"""

from __future__ import annotations

import torch

from torch_npu import _state

OP = "_npu_paged_attention_mla"
_DTYPES = (torch.float16, torch.bfloat16)
MAX_HEAD_SIZE = 576
MAX_BATCH = 8192


def _fail(msg: str) -> None:
    raise RuntimeError(f"{OP}: {msg}")


def _npu_paged_attention_mla(query: torch.Tensor, key_cache: torch.Tensor, num_kv_heads: int, num_heads: int,
                             scale_value: float, block_table: torch.Tensor, context_lens: torch.Tensor,
                             mla_vheadsize: int, out: torch.Tensor) -> None:
    """Writes out[b] = softmax(scale * q[b] @ K_b^T) @ K_b[:, :mla_vheadsize] (float32 math, out's dtype), K_b the
    context_lens[b] cache rows block_table[b] names; a zero-length context leaves zeros.

    Raised, as the ATB document states them: query not [num_tokens, num_heads, head_size] or key_cache not
    [num_blocks, block_size, num_kv_heads, head_size]; dtypes other than float16/bfloat16 or differing; head_size
    outside (0, 576]; mla_vheadsize outside (0, head_size]; num_kv_heads != 1 ("MLA合并输入只支持MQA场景");
    num_heads < 1; block_size not a multiple of 16, or above 128 when head_size > 256; batch outside (0, 8192];
    block_table not int32 [num_tokens, *] or naming blocks outside [0, num_blocks); context_lens not int32
    [num_tokens]; out not [num_tokens, num_heads, mla_vheadsize] of query's dtype; non-contiguous tensors.
    """
    _state.record(OP)
    if query.dim() != 3 or query.shape[1] != num_heads:
        _fail(f"query must be [num_tokens, num_heads = {num_heads}, head_size]; got {tuple(query.shape)}")
    if key_cache.dim() != 4:
        _fail(f"key_cache must be [num_blocks, block_size, num_kv_heads, head_size] (ND); got {tuple(key_cache.shape)}")
    if query.dtype not in _DTYPES or key_cache.dtype != query.dtype:
        _fail(f"query and key_cache must share float16 or bfloat16; got {query.dtype} and {key_cache.dtype}")
    for name, t in (("query", query), ("key_cache", key_cache), ("out", out)):
        if not t.is_contiguous():
            _fail(f"{name}: non-contiguous tensors are not supported")
    num_blocks, block_size, kv_heads, head_size = key_cache.shape
    if query.shape[2] != head_size:
        _fail(f"query head_size {query.shape[2]} must equal key_cache's {head_size}")
    if not 0 < head_size <= MAX_HEAD_SIZE:
        _fail(f"with mlaVHeadSize > 0 the head_size must lie in (0, {MAX_HEAD_SIZE}]; got {head_size}")
    if not 0 < mla_vheadsize <= head_size:
        _fail(f"mla_vheadsize must lie in (0, head_size = {head_size}]; got {mla_vheadsize}")
    if num_kv_heads != 1 or kv_heads != 1:
        _fail(f"the combined MLA cache supports MQA only (num_kv_heads = 1); got num_kv_heads = {num_kv_heads}, "
              f"key_cache heads = {kv_heads}")
    if num_heads < 1:
        _fail(f"num_heads (headNum) must be > 0; got {num_heads}")
    if block_size % 16:
        _fail(f"block_size must be a multiple of 16; got {block_size}")
    if head_size > 256 and block_size > 128:
        _fail(f"with head_size > 256 the block_size must be <= 128; got {block_size}")
    batch = query.shape[0]
    if not 0 < batch <= MAX_BATCH:
        _fail(f"batch must lie in (0, {MAX_BATCH}]; got {batch}")
    if block_table.dtype != torch.int32 or block_table.dim() != 2 or block_table.shape[0] != batch:
        _fail(f"block_table must be int32 [num_tokens = {batch}, max_num_blocks]; got {block_table.dtype} "
              f"{tuple(block_table.shape)}")
    if context_lens.dtype != torch.int32 or context_lens.dim() != 1 or context_lens.shape[0] != batch:
        _fail(f"context_lens must be int32 [num_tokens = {batch}]; got {context_lens.dtype} "
              f"{tuple(context_lens.shape)}")
    if tuple(out.shape) != (batch, num_heads, mla_vheadsize) or out.dtype != query.dtype:
        _fail(f"out must be [{batch}, {num_heads}, {mla_vheadsize}] {query.dtype}; got {tuple(out.shape)} {out.dtype}")

    rows = key_cache.view(num_blocks * block_size, head_size)
    for b, n in enumerate(int(v) for v in context_lens.tolist()):
        if n <= 0:
            out[b].zero_()
            continue
        blocks = block_table[b, :(n + block_size - 1) // block_size].long()
        if blocks.shape[0] * block_size < n:
            _fail(f"block_table row {b} holds {blocks.shape[0]} blocks, fewer than context_lens {n} needs")
        if int(blocks.min()) < 0 or int(blocks.max()) >= num_blocks:
            _fail(f"blockTables values must lie in [0, num_blocks = {num_blocks}); row {b} has "
                  f"{blocks.tolist()}")
        slots = (blocks.unsqueeze(1) * block_size + torch.arange(block_size, device=blocks.device)).flatten()[:n]
        k = rows[slots].float()                                                # [n, head_size]
        scores = query[b].float() @ k.t() * scale_value                        # [num_heads, n]
        out[b] = (torch.softmax(scores, dim=-1) @ k[:, :mla_vheadsize]).to(out.dtype)
