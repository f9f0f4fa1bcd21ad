"""flashinfer.prefill.BatchPrefillWithPagedKVCacheWrapper, as in flashinfer-python v0.6.17
(`flashinfer/prefill.py`; https://docs.flashinfer.ai/api/prefill.html). Emulated: NHD / HND paged caches given
as a (k_cache, v_cache) tuple or one 5-D tensor, GQA, causal (bottom-right aligned for append), window_left,
sm_scale, out=. Not emulated (NotImplementedError): custom / packed masks, pos_encoding_mode other than NONE,
logits_soft_cap, fp8 scales, return_lse, CUDA graphs, multi-item scoring, the cudnn / trtllm-gen backends.
"""

from __future__ import annotations

from itertools import pairwise

import torch

from flashinfer import _emulator
from flashinfer._paged import check_int32
from flashinfer._wrapper import PagedWrapper


class BatchPrefillWithPagedKVCacheWrapper(PagedWrapper):
    _rows_name = "qo_indptr[-1]"

    def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD", use_cuda_graph: bool = False,
                 qo_indptr_buf=None, paged_kv_indptr_buf=None, paged_kv_indices_buf=None,
                 paged_kv_last_page_len_buf=None, custom_mask_buf=None, mask_indptr_buf=None, backend: str = "auto",
                 jit_args=None, jit_kwargs=None) -> None:
        if jit_args is not None or jit_kwargs is not None:
            raise NotImplementedError("flashinfer emulator: JIT variants are not emulated")
        super().__init__(float_workspace_buffer, kv_layout, use_cuda_graph, backend)

    def plan(self, qo_indptr: torch.Tensor, paged_kv_indptr: torch.Tensor, paged_kv_indices: torch.Tensor,
             paged_kv_last_page_len: torch.Tensor, num_qo_heads: int, num_kv_heads: int, head_dim_qk: int,
             page_size: int, head_dim_vo: int | None = None, custom_mask=None, packed_custom_mask=None,
             causal: bool = False, pos_encoding_mode: str = "NONE", use_fp16_qk_reduction: bool = False,
             sm_scale: float | None = None, window_left: int = -1, logits_soft_cap: float | None = None,
             rope_scale: float | None = None, rope_theta: float | None = None, q_data_type="float16",
             kv_data_type=None, o_data_type=None, non_blocking: bool = True, prefix_len_ptr=None,
             token_pos_in_items_ptr=None, token_pos_in_items_len: int = 0, max_item_len_ptr=None, seq_lens=None,
             seq_lens_q=None, block_tables=None, max_token_per_sequence=None, max_sequence_kv=None,
             fixed_split_size=None, disable_split_kv: bool = False) -> None:
        """Plan batch prefill/append attention: qo_indptr [batch_size + 1] (int32, as the kernel's
        CHECK_INPUT_TYPE requires), the paged-KV CSR arrays, heads, head_dim_qk, page_size; then `run` any
        number of times (e.g. once per layer) with the same plan."""
        if custom_mask is not None or packed_custom_mask is not None:
            raise NotImplementedError("flashinfer emulator: custom masks are not emulated")
        if prefix_len_ptr is not None or token_pos_in_items_ptr is not None or max_item_len_ptr is not None:
            raise NotImplementedError("flashinfer emulator: multi-item scoring is not emulated")
        if head_dim_vo is not None and head_dim_vo != head_dim_qk:
            raise NotImplementedError("flashinfer emulator: head_dim_vo != head_dim_qk is not emulated")
        if self._backend in ("cudnn", "trtllm-gen"):
            raise NotImplementedError(f"flashinfer emulator: backend={self._backend!r} is not emulated")
        check_int32("qo_indptr", qo_indptr)
        qo = qo_indptr.cpu().tolist()
        if qo and (qo[0] != 0 or any(b < a for a, b in pairwise(qo))):
            raise ValueError(f"qo_indptr must start at 0 and be non-decreasing, got {qo}")
        self._plan_common(qo, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads,
                          num_kv_heads, head_dim_qk, page_size,
                          ("paged_kv_indptr", "paged_kv_indices", "paged_kv_last_page_len"), causal=causal,
                          pos_encoding_mode=pos_encoding_mode, window_left=window_left,
                          logits_soft_cap=logits_soft_cap, sm_scale=sm_scale, q_data_type=q_data_type,
                          kv_data_type=kv_data_type, o_data_type=o_data_type)
        q_lens = [y - x for x, y in pairwise(qo)]
        for b, (q_len, (_, kv_len)) in enumerate(zip(q_lens, self._plan["requests"], strict=True)):
            if causal and q_len > kv_len:
                raise ValueError(f"request {b}: qo_len {q_len} > kv_len {kv_len} (append attention: the queries are "
                                 "the last qo_len of the kv_len positions)")
        _emulator.calls["BatchPrefillWithPagedKVCacheWrapper.plan"] += 1

    def run(self, q: torch.Tensor, paged_kv_cache, *args, q_scale=None, k_scale=None, v_scale=None, out=None,
            lse=None, return_lse: bool = False, enable_pdl=None, window_left: int | None = None, sinks=None,
            kv_cache_sf=None, skip_softmax_threshold_scale_factor=None):
        """Batch prefill/append attention of q [qo_indptr[-1], num_qo_heads, head_dim] against the paged cache;
        returns [qo_indptr[-1], num_qo_heads, head_dim] (into `out` when given)."""
        if args or skip_softmax_threshold_scale_factor is not None:
            raise NotImplementedError("flashinfer emulator: extra kernel arguments are not emulated")
        return self._run(q, paged_kv_cache, q_scale=q_scale, k_scale=k_scale, v_scale=v_scale, out=out, lse=lse,
                         return_lse=return_lse, window_left=window_left, sinks=sinks, kv_cache_sf=kv_cache_sf)
