"""What the paged prefill and decode wrappers share: construction, the plan's checks and cached state, and
run's checks. Follows flashinfer-python v0.6.17 (`flashinfer/prefill.py` BatchPrefillWithPagedKVCacheWrapper,
`flashinfer/decode.py` BatchDecodeWithPagedKVCacheWrapper; docs.flashinfer.ai /api/prefill.html and
/api/decode.html): the Notes there say `plan` must be called before any `run`, and that num_qo_heads must be a
multiple of num_kv_heads.
"""

from __future__ import annotations

import torch

from flashinfer import _emulator
from flashinfer._paged import (
    POS_ENCODING_MODES,
    attend,
    canonicalize_torch_dtype,
    check_kv_layout,
    check_page_table,
    check_same_device,
    check_workspace,
    default_sm_scale,
    unpack_paged_kv_cache,
)


class PagedWrapper:
    api = "wrapper"

    def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD", use_cuda_graph: bool = False,
                 backend: str = "auto") -> None:
        check_workspace(float_workspace_buffer)
        check_kv_layout(kv_layout)
        if use_cuda_graph:
            raise NotImplementedError("flashinfer emulator: use_cuda_graph=True (fixed buffers) is not emulated")
        self._float_workspace_buffer = float_workspace_buffer
        self.device = float_workspace_buffer.device
        self._kv_layout = kv_layout
        self._backend = backend
        self._plan: dict | None = None

    # ---- plan ---------------------------------------------------------------------------------------

    def _plan_common(self, qo_indptr: list[int], indptr: torch.Tensor, indices: torch.Tensor,
                     last_page_len: torch.Tensor, num_qo_heads: int, num_kv_heads: int, head_dim: int,
                     page_size: int, names: tuple[str, str, str], *, causal: bool, pos_encoding_mode: str,
                     window_left: int, logits_soft_cap: float | None, sm_scale: float | None,
                     q_data_type, kv_data_type, o_data_type) -> None:
        if num_qo_heads % num_kv_heads:
            raise ValueError(f"num_qo_heads ({num_qo_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        if page_size < 1 or head_dim < 1:
            raise ValueError(f"page_size and head_dim must be positive, got {page_size}, {head_dim}")
        if pos_encoding_mode not in POS_ENCODING_MODES:
            raise KeyError(f"Invalid pos_encoding_mode {pos_encoding_mode}")
        if pos_encoding_mode != "NONE":
            raise NotImplementedError(f"flashinfer emulator: pos_encoding_mode={pos_encoding_mode!r} (rotary or "
                                      "ALIBI inside the kernel) is not emulated; apply RoPE before attention")
        if logits_soft_cap:
            raise NotImplementedError("flashinfer emulator: logits_soft_cap is not emulated")
        if not isinstance(window_left, int) or window_left < -1:
            raise ValueError(f"window_left must be -1 (no window) or >= 0, got {window_left!r}")
        q_dtype = canonicalize_torch_dtype(q_data_type)
        kv_dtype = q_dtype if kv_data_type is None else canonicalize_torch_dtype(kv_data_type)
        o_dtype = q_dtype if o_data_type is None else canonicalize_torch_dtype(o_data_type)
        if q_dtype not in _emulator.q_dtypes():
            raise ValueError(f"q_data_type {q_dtype}: the kernels take float16 or bfloat16 queries "
                             "(no float32 kernels: failed to dispatch)")
        if kv_dtype not in _emulator.kv_dtypes():
            raise ValueError(f"kv_data_type {kv_dtype}: the kernels take float16, bfloat16 or fp8 KV")
        if kv_dtype in _emulator.FP8_DTYPES:
            raise NotImplementedError("flashinfer emulator: fp8 KV (k_scale / v_scale) is not emulated")
        requests = check_page_table(indptr, indices, last_page_len, page_size, names)
        if len(qo_indptr) != len(requests) + 1:
            raise ValueError(f"qo_indptr must have shape [batch_size + 1] = [{len(requests) + 1}], "
                             f"got [{len(qo_indptr)}]")
        self._plan = dict(requests=requests, qo_indptr=qo_indptr, num_qo_heads=num_qo_heads,
                          num_kv_heads=num_kv_heads, head_dim=head_dim, page_size=page_size, causal=causal,
                          window_left=window_left, sm_scale=sm_scale, q_dtype=q_dtype, kv_dtype=kv_dtype,
                          o_dtype=o_dtype)

    # ---- run ----------------------------------------------------------------------------------------

    def _run(self, q: torch.Tensor, paged_kv_cache, *, q_scale, k_scale, v_scale, out, lse, return_lse,
             window_left, sinks, kv_cache_sf) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if self._plan is None:
            raise RuntimeError(f"{type(self).__name__}.run: plan() must be called before run() (the docs' Note: "
                               "\"The plan method should be called before any run\"); plan info is not initialized")
        p = self._plan
        if any(x is not None for x in (q_scale, k_scale, v_scale, sinks, kv_cache_sf)):
            raise NotImplementedError("flashinfer emulator: q/k/v scales, sinks and kv_cache_sf are not emulated")
        if return_lse or lse is not None:
            raise NotImplementedError("flashinfer emulator: return_lse is not emulated")
        if window_left is not None and window_left != p["window_left"]:
            # run() asserts `window_left == self._window_left` for every backend but trtllm-gen
            raise AssertionError(f"run(window_left={window_left}) differs from plan(window_left={p['window_left']})")
        k_cache, v_cache = unpack_paged_kv_cache(paged_kv_cache, self._kv_layout)
        if q.dtype != p["q_dtype"]:
            raise ValueError(f"The dtype of q {q.dtype} does not match the q_data_type {p['q_dtype']} specified in "
                             "plan function.")
        if k_cache.dtype != p["kv_dtype"]:
            raise ValueError(f"The dtype of k {k_cache.dtype} does not match the kv_data_type {p['kv_dtype']} "
                             "specified in plan function.")
        if q.dim() != 3 or q.shape[1] != p["num_qo_heads"] or q.shape[2] != p["head_dim"]:
            raise ValueError(f"q must be [{self._rows_name}, num_qo_heads={p['num_qo_heads']}, "
                             f"head_dim={p['head_dim']}], got {tuple(q.shape)}")
        if q.shape[0] != p["qo_indptr"][-1]:
            raise ValueError(f"q.shape[0] ({q.shape[0]}) does not match {self._rows_name} ({p['qo_indptr'][-1]})")
        if q.stride(-1) != 1:
            raise ValueError("q: the last dim must be contiguous (CHECK_LAST_DIM_CONTIGUOUS)")
        nhd = k_cache if self._kv_layout == "NHD" else k_cache.transpose(1, 2)
        want = (p["page_size"], p["num_kv_heads"], p["head_dim"])
        if tuple(nhd.shape[1:]) != want:
            layout = "[max_num_pages, page_size, num_kv_heads, head_dim]" if self._kv_layout == "NHD" else \
                "[max_num_pages, num_kv_heads, page_size, head_dim]"
            raise ValueError(f"paged kv cache ({self._kv_layout}: {layout}) has shape {tuple(k_cache.shape)}; the "
                             f"plan's page_size, num_kv_heads, head_dim are {want}")
        used = [i for pages, _ in p["requests"] for i in pages]
        if used and not 0 <= min(used) <= max(used) < nhd.shape[0]:
            raise ValueError(f"page index {max(used)} outside the cache's {nhd.shape[0]} pages")
        check_same_device(self.device, q=q, k_cache=k_cache, v_cache=v_cache, out=out)
        shape = (q.shape[0], q.shape[1], p["head_dim"])
        if out is None:
            out = torch.zeros(shape, dtype=p["o_dtype"], device=q.device)
        elif tuple(out.shape) != shape or out.dtype != p["o_dtype"]:
            raise ValueError(f"Invalid out: expected {shape} {p['o_dtype']}, got {tuple(out.shape)} {out.dtype}")
        _emulator.calls[f"{type(self).__name__}.run"] += 1
        v_nhd = v_cache if self._kv_layout == "NHD" else v_cache.transpose(1, 2)
        return attend(q, nhd, v_nhd, p["requests"], p["qo_indptr"], p["causal"], p["window_left"],
                      default_sm_scale(p["head_dim"], p["sm_scale"]), out)
