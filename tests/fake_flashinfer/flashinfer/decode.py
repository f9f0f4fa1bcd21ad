"""flashinfer.decode.BatchDecodeWithPagedKVCacheWrapper, as in flashinfer-python v0.6.17 (`flashinfer/decode.py`;
https://docs.flashinfer.ai/api/decode.html): one query row per request against its paged KV. Options after
page_size are keyword-only (positional use is deprecated in v0.6.17). Emulated: NHD / HND caches, GQA (with or
without use_tensor_cores: the same math), window_left, sm_scale, out=. Not emulated (NotImplementedError):
pos_encoding_mode other than NONE, logits_soft_cap, fp8 scales, return_lse, q_len_per_req > 1, window_right,
CUDA graphs.
"""

from __future__ import annotations

import torch

from flashinfer import _emulator
from flashinfer._wrapper import PagedWrapper


class BatchDecodeWithPagedKVCacheWrapper(PagedWrapper):
    _rows_name = "batch_size"

    def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD", use_cuda_graph: bool = False,
                 use_tensor_cores: bool = False, paged_kv_indptr_buffer=None, paged_kv_indices_buffer=None,
                 paged_kv_last_page_len_buffer=None, backend: str = "auto", jit_args=None) -> None:
        if jit_args is not None:
            raise NotImplementedError("flashinfer emulator: JIT variants are not emulated")
        super().__init__(float_workspace_buffer, kv_layout, use_cuda_graph, backend)
        self._use_tensor_cores = use_tensor_cores

    @property
    def use_tensor_cores(self) -> bool:
        return self._use_tensor_cores

    def plan(self, indptr: torch.Tensor, indices: torch.Tensor, last_page_len: torch.Tensor, num_qo_heads: int,
             num_kv_heads: int, head_dim: int, page_size: int, *, pos_encoding_mode: str = "NONE",
             window_left: int = -1, window_right: int = 0, logits_soft_cap: float | None = None,
             q_data_type="float16", kv_data_type=None, o_data_type=None, data_type=None,
             sm_scale: float | None = None, rope_scale: float | None = None, rope_theta: float | None = None,
             non_blocking: bool = True, block_tables=None, seq_lens=None, fixed_split_size=None,
             disable_split_kv: bool = False, q_len_per_req: int = 1) -> None:
        """Plan batch decode: indptr [batch_size + 1], indices [indptr[-1]], last_page_len [batch_size] (all
        int32), heads, head_dim, page_size."""
        if q_len_per_req != 1 or window_right != 0:
            raise NotImplementedError("flashinfer emulator: q_len_per_req > 1 / window_right are not emulated")
        if data_type is not None:   # deprecated: both q and kv
            q_data_type = kv_data_type = data_type
        batch = last_page_len.shape[0] if isinstance(last_page_len, torch.Tensor) else 0
        self._plan_common(list(range(batch + 1)), indptr, indices, last_page_len, num_qo_heads, num_kv_heads,
                          head_dim, page_size, ("indptr", "indices", "last_page_len"), causal=False,
                          pos_encoding_mode=pos_encoding_mode, window_left=window_left,
                          logits_soft_cap=logits_soft_cap, sm_scale=sm_scale, q_data_type=q_data_type,
                          kv_data_type=kv_data_type, o_data_type=o_data_type)
        _emulator.calls["BatchDecodeWithPagedKVCacheWrapper.plan"] += 1

    def run(self, q: torch.Tensor, paged_kv_cache, *args, q_scale=None, k_scale=None, v_scale=None, out=None,
            lse=None, return_lse: bool = False, enable_pdl=None, window_left: int | None = None, sinks=None,
            q_len_per_req: int | None = None, skip_softmax_threshold_scale_factor=None, kv_cache_sf=None):
        """Decode attention of q [batch_size, num_qo_heads, head_dim] (one row per request); returns the same shape."""
        if args or skip_softmax_threshold_scale_factor is not None or q_len_per_req not in (None, 1):
            raise NotImplementedError("flashinfer emulator: extra kernel arguments are not emulated")
        return self._run(q, paged_kv_cache, q_scale=q_scale, k_scale=k_scale, v_scale=v_scale, out=out, lse=lse,
                         return_lse=return_lse, window_left=window_left, sinks=sinks, kv_cache_sf=kv_cache_sf)
