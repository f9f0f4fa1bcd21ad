"""flashinfer.mla.BatchMLAPagedAttentionWrapper, as in flashinfer-python v0.6.17 (`flashinfer/mla/_core.py`;
https://docs.flashinfer.ai/api/mla.html; the MLA page layout of https://docs.flashinfer.ai/tutorials/kv_layout.html;
csrc/batch_mla_plan.cu and batch_mla_run.cu for the input checks; include/flashinfer/attention/mla.cuh).

MLA attention with the weights absorbed: per request b, its query rows qo_indptr[b]..qo_indptr[b + 1] ([.., num_heads,
head_dim_ckv] without RoPE and [.., num_heads, head_dim_kpe] with it) attend to its kv_len_arr[b] tokens, stored in
the pages kv_indices[kv_indptr[b]:kv_indptr[b + 1]] of two caches, ckv_cache [num_pages, page_size, head_dim_ckv]
and kpe_cache [num_pages, page_size, head_dim_kpe]:
    score = (q_nope . ckv + q_pe . kpe) * sm_scale,  out = softmax(score) @ ckv   ([.., num_heads, head_dim_ckv])
causal=True aligns a request's queries with its last keys. The caches may be strided views (the kernel reads
stride(0) and stride(1) of each; batch_mla_run.cu) whose last dim is contiguous, e.g. two slices of one latent row.

Emulated: backends "auto" (fa2 here) / "fa2" / "fa3", float16 / bfloat16 (float32 with
`flashinfer._emulator.allow_float32`), causal or not, out=. Raised as the library does: run before plan, kv dtype
outside float16/bfloat16/fp8_e4m3fn (ValueError), q/kv tensors whose dtype differs from the plan's, index arrays not
int32 (CHECK_INPUT_TYPE), shapes that disagree with the plan, page indices outside the caches, a non-contiguous last
dim. Head dims must be multiples of 64: the kernel tiles them by 16 (NUM_MMA_D_CKV = HEAD_DIM_CKV / 16, likewise
KPE) in 128-byte swizzled shared-memory rows (SwizzleMode::k128B: 64 16-bit values a row); the library itself ships
and tests 512 / 64. Not emulated (NotImplementedError): the cutlass backend (its other input layout), fp8 KV,
return_lse, the profiler, CUDA graphs.
"""

from __future__ import annotations

from itertools import pairwise

import torch

from flashinfer import _emulator
from flashinfer._paged import canonicalize_torch_dtype, check_int32, check_same_device, check_workspace

_KV_DTYPES = (torch.float16, torch.bfloat16, torch.float8_e4m3fn)
HEAD_DIM_ALIGN = 64


class BatchMLAPagedAttentionWrapper:
    def __init__(self, float_workspace_buffer: torch.Tensor, use_cuda_graph: bool = False,
                 qo_indptr: torch.Tensor | None = None, kv_indptr: torch.Tensor | None = None,
                 kv_indices: torch.Tensor | None = None, kv_len_arr: torch.Tensor | None = None,
                 backend: str = "auto") -> None:
        check_workspace(float_workspace_buffer)
        if use_cuda_graph:
            raise NotImplementedError("flashinfer emulator: use_cuda_graph=True (fixed buffers) is not emulated")
        if backend == "cutlass":
            raise NotImplementedError("flashinfer emulator: the cutlass MLA backend (q_nope_pe / ckv_kpe_cache "
                                      "inputs) is not emulated")
        if backend not in ("auto", "fa2", "fa3"):
            raise ValueError(f"Unsupported backend: {backend}")
        self._float_workspace_buffer = float_workspace_buffer
        self.device = float_workspace_buffer.device
        self._backend = "fa2" if backend == "auto" else backend   # determine_mla_backend: fa3 only on SM90a
        self._plan: dict | None = None

    def plan(self, qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
             kv_len_arr: torch.Tensor, num_heads: int, head_dim_ckv: int, head_dim_kpe: int, page_size: int,
             causal: bool, sm_scale: float, q_data_type: torch.dtype, kv_data_type: torch.dtype,
             use_profiler: bool = False) -> None:
        """Plan for a batch: qo_indptr / kv_indptr [batch_size + 1], kv_indices [kv_indptr[-1]], kv_len_arr
        [batch_size] (all int32)."""
        kv_dtype = canonicalize_torch_dtype(kv_data_type)
        q_dtype = canonicalize_torch_dtype(q_data_type)
        if kv_dtype not in _KV_DTYPES + ((torch.float32,) if _emulator.allow_float32 else ()):
            raise ValueError(f"MLA kv_data_type {kv_dtype} is not supported. Supported dtypes: "
                             f"{list(_KV_DTYPES)}.")
        if kv_dtype == torch.float8_e4m3fn:
            raise NotImplementedError("flashinfer emulator: FP8 MLA KV (fa3, SM90) is not emulated")
        if q_dtype not in _emulator.q_dtypes():
            raise ValueError(f"q_data_type {q_dtype}: the MLA kernels take float16 or bfloat16 queries")
        if use_profiler:
            raise NotImplementedError("flashinfer emulator: the intra-kernel profiler is not emulated")
        for name, t in (("qo_indptr", qo_indptr), ("kv_indptr", kv_indptr), ("kv_len_arr", kv_len_arr),
                        ("kv_indices", kv_indices)):
            check_int32(name, t)
        if num_heads < 1 or page_size < 1:
            raise ValueError(f"num_heads and page_size must be positive, got {num_heads}, {page_size}")
        for name, d in (("head_dim_ckv", head_dim_ckv), ("head_dim_kpe", head_dim_kpe)):
            if d < HEAD_DIM_ALIGN or d % HEAD_DIM_ALIGN:
                raise ValueError(f"{name} = {d}: the MLA kernel tiles head dims in 128-byte swizzled rows "
                                 f"(a multiple of {HEAD_DIM_ALIGN})")
        batch = kv_len_arr.shape[0]
        qo, kv_ptr = qo_indptr.cpu().tolist(), kv_indptr.cpu().tolist()
        lens, pages = kv_len_arr.cpu().tolist(), kv_indices.cpu().tolist()
        if len(qo) != batch + 1 or len(kv_ptr) != batch + 1:
            raise ValueError(f"qo_indptr and kv_indptr must have shape [batch_size + 1] = [{batch + 1}], got "
                             f"[{len(qo)}] and [{len(kv_ptr)}]")
        for name, ptr in (("qo_indptr", qo), ("kv_indptr", kv_ptr)):
            if ptr[0] != 0 or any(b < a for a, b in pairwise(ptr)):
                raise ValueError(f"{name} must start at 0 and be non-decreasing, got {ptr}")
        if kv_ptr[-1] > len(pages):
            raise ValueError(f"kv_indices must have shape [kv_indptr[-1]] = [{kv_ptr[-1]}] or larger, got "
                             f"{len(pages)}")
        requests = []
        for b in range(batch):
            own = pages[kv_ptr[b]:kv_ptr[b + 1]]
            if not 0 <= lens[b] <= len(own) * page_size:
                raise ValueError(f"kv_len_arr[{b}] = {lens[b]} does not fit its {len(own)} pages of {page_size}")
            if causal and lens[b] < qo[b + 1] - qo[b]:
                raise ValueError(f"causal: request {b} has more queries ({qo[b + 1] - qo[b]}) than keys ({lens[b]})")
            requests.append((own, lens[b]))
        self._plan = dict(qo=qo, requests=requests, num_heads=num_heads, ckv=head_dim_ckv, kpe=head_dim_kpe,
                          page_size=page_size, causal=causal, sm_scale=sm_scale, q_dtype=q_dtype, kv_dtype=kv_dtype)
        _emulator.calls["BatchMLAPagedAttentionWrapper.plan"] += 1

    def run(self, q_nope: torch.Tensor, q_pe: torch.Tensor, ckv_cache: torch.Tensor, kpe_cache: torch.Tensor,
            out: torch.Tensor | None = None, lse: torch.Tensor | None = None, return_lse: bool = False,
            profiler_buffer=None, kv_len=None, page_table=None, return_lse_base_on_e: bool = False,
            o_scale: float | None = None, *, ckv_scale: float | None = None,
            kpe_scale: float | None = None) -> torch.Tensor:
        """out [n, num_heads, head_dim_ckv] of q_nope [n, num_heads, head_dim_ckv] and q_pe [n, num_heads,
        head_dim_kpe] against the planned pages of ckv_cache / kpe_cache."""
        if self._plan is None:
            raise RuntimeError("BatchMLAPagedAttentionWrapper.run: plan() must be called before run()")
        p = self._plan
        if return_lse or lse is not None or profiler_buffer is not None:
            raise NotImplementedError("flashinfer emulator: return_lse / profiler_buffer are not emulated")
        if o_scale is not None:
            raise ValueError("o_scale is only supported with the cutlass backend for now.")
        if ckv_scale is not None or kpe_scale is not None:
            raise ValueError("ckv_scale / kpe_scale are only valid when kv_data_type is FP8.")
        for name, t, want in (("q_nope", q_nope, p["q_dtype"]), ("q_pe", q_pe, p["q_dtype"]),
                              ("ckv_cache", ckv_cache, p["kv_dtype"]), ("kpe_cache", kpe_cache, p["kv_dtype"])):
            if t.dtype != want:
                kind = "q_data_type" if name.startswith("q") else "kv_data_type"
                raise ValueError(f"{name}.dtype={t.dtype} does not match the planned {kind}={want}.")
        n, heads = p["qo"][-1], p["num_heads"]
        for name, t, shape in (("q_nope", q_nope, (n, heads, p["ckv"])), ("q_pe", q_pe, (n, heads, p["kpe"]))):
            if tuple(t.shape) != shape:
                raise ValueError(f"{name} must be {list(shape)} (qo_indptr[-1], num_heads, head_dim), got "
                                 f"{tuple(t.shape)}")
        for name, t, d in (("ckv_cache", ckv_cache, p["ckv"]), ("kpe_cache", kpe_cache, p["kpe"])):
            if t.dim() != 3 or t.shape[1] != p["page_size"] or t.shape[2] != d:
                raise ValueError(f"{name} must be [num_pages, page_size = {p['page_size']}, {d}], got "
                                 f"{tuple(t.shape)}")
        for name, t in (("q_nope", q_nope), ("q_pe", q_pe), ("ckv_cache", ckv_cache), ("kpe_cache", kpe_cache)):
            if t.stride(-1) != 1:
                raise ValueError(f"{name}: the last dim must be contiguous")
        if ckv_cache.shape[0] != kpe_cache.shape[0]:
            raise ValueError(f"ckv_cache and kpe_cache must hold the same pages, got {ckv_cache.shape[0]} and "
                             f"{kpe_cache.shape[0]}")
        used = [i for pages, _ in p["requests"] for i in pages]
        if used and not 0 <= min(used) <= max(used) < ckv_cache.shape[0]:
            raise ValueError(f"page index {max(used)} outside the caches' {ckv_cache.shape[0]} pages")
        check_same_device(self.device, q_nope=q_nope, q_pe=q_pe, ckv_cache=ckv_cache, kpe_cache=kpe_cache, out=out)
        if out is None:
            out = torch.empty_like(q_nope)
        elif tuple(out.shape) != tuple(q_nope.shape) or out.dtype != q_nope.dtype:
            raise ValueError(f"Invalid out: expected {tuple(q_nope.shape)} {q_nope.dtype}, got {tuple(out.shape)} "
                             f"{out.dtype}")
        _emulator.calls["BatchMLAPagedAttentionWrapper.run"] += 1

        for b, (pages, kv_len) in enumerate(p["requests"]):
            rows = slice(p["qo"][b], p["qo"][b + 1])
            q_len = rows.stop - rows.start
            if q_len == 0:
                continue
            if kv_len == 0:
                out[rows] = 0
                continue
            page_ids = torch.tensor(pages, dtype=torch.long, device=ckv_cache.device)
            ckv = ckv_cache[page_ids].reshape(-1, p["ckv"])[:kv_len].float()
            kpe = kpe_cache[page_ids].reshape(-1, p["kpe"])[:kv_len].float()
            scores = (torch.einsum("qhd,kd->hqk", q_nope[rows].float(), ckv)
                      + torch.einsum("qhd,kd->hqk", q_pe[rows].float(), kpe)) * p["sm_scale"]
            if p["causal"]:
                i = torch.arange(q_len, device=scores.device).unsqueeze(1)
                j = torch.arange(kv_len, device=scores.device).unsqueeze(0)
                scores = scores.masked_fill(j > i + kv_len - q_len, float("-inf"))
            out[rows] = torch.einsum("hqk,kd->qhd", torch.softmax(scores, dim=-1), ckv).to(out.dtype)
        return out


__all__ = ["BatchMLAPagedAttentionWrapper"]
