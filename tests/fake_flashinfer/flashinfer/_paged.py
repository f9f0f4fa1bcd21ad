"""What the wrappers and the page functions share: argument checks from the csrc TVM-FFI checks quoted in the
docs, the page-table reading, and the reference attention math (float32, as the kernels accumulate).

Source pinned: flashinfer-python v0.6.17 (`flashinfer/prefill.py`, `flashinfer/decode.py`, `flashinfer/page.py`,
`flashinfer/utils.py`, `csrc/batch_prefill.cu`, `csrc/batch_decode.cu`, `csrc/page.cu`; the API reference at
https://docs.flashinfer.ai/api/prefill.html, /api/decode.html, /api/page.html, and the page-table layout of
https://docs.flashinfer.ai/tutorials/kv_layout.html).
"""

from __future__ import annotations

import math
from itertools import pairwise

import torch

TENSOR_LAYOUTS = ("NHD", "HND")
POS_ENCODING_MODES = ("NONE", "ROPE_LLAMA", "ALIBI")


def canonicalize_torch_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """utils.canonicalize_torch_dtype: a name or a torch.dtype."""
    if isinstance(dtype, str):
        return getattr(torch, dtype)
    if isinstance(dtype, torch.dtype):
        return dtype
    raise TypeError(f"dtype must be a string or torch.dtype, got {type(dtype)}")


def check_kv_layout(kv_layout: str) -> None:
    """utils._check_kv_layout."""
    if kv_layout not in TENSOR_LAYOUTS:
        raise KeyError(f"Invalid kv_layout {kv_layout}")


def check_workspace(buf: torch.Tensor, name: str = "float_workspace_buffer") -> None:
    """Wrapper constructors: "The buffer must be 16-byte aligned" (utils._check_workspace_buffer_alignment)."""
    if not isinstance(buf, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor")
    if buf.numel() and buf.data_ptr() % 16:
        raise ValueError(f"{name} must be 16-byte aligned, got data_ptr % 16 = {buf.data_ptr() % 16}")


def check_int32(name: str, t: torch.Tensor, dims: int = 1) -> None:
    """csrc: CHECK_INPUT_TYPE(indptr / indices / last_page_len, dl_int32), CHECK_DIM(1, ...)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor")
    if t.dtype != torch.int32:
        raise ValueError(f"{name} must be int32 (CHECK_INPUT_TYPE dl_int32), got {t.dtype}")
    if t.dim() != dims:
        raise ValueError(f"{name} must be {dims}-D, got shape {tuple(t.shape)}")


def check_page_table(indptr: torch.Tensor, indices: torch.Tensor, last_page_len: torch.Tensor, page_size: int,
                     names: tuple[str, str, str]) -> list[tuple[list[int], int]]:
    """Per request: (its page ids, its kv length). Docs: indptr [batch_size + 1], indices [indptr[-1]],
    last_page_len [batch_size] with 1 <= last_page_len <= page_size (0 for a request without pages);
    kv_len = (pages - 1) * page_size + last_page_len (page.get_seq_lens)."""
    for name, t in zip(names, (indptr, indices, last_page_len), strict=True):
        check_int32(name, t)
    batch = last_page_len.shape[0]
    if indptr.shape[0] != batch + 1:
        raise ValueError(f"{names[0]} must have shape [batch_size + 1] = [{batch + 1}], got {tuple(indptr.shape)}")
    ptr, idx, last = indptr.cpu().tolist(), indices.cpu().tolist(), last_page_len.cpu().tolist()
    if ptr[0] != 0 or any(b < a for a, b in pairwise(ptr)):
        raise ValueError(f"{names[0]} must start at 0 and be non-decreasing, got {ptr}")
    if ptr[-1] > len(idx):
        raise ValueError(f"{names[1]} must have shape [{names[0]}[-1]] = [{ptr[-1]}], got {len(idx)}")
    out = []
    for b in range(batch):
        pages = idx[ptr[b]:ptr[b + 1]]
        if pages and not 1 <= last[b] <= page_size:
            raise ValueError(f"{names[2]}[{b}] = {last[b]}: must satisfy 1 <= last_page_len <= page_size ({page_size})")
        out.append((pages, (len(pages) - 1) * page_size + last[b] if pages else 0))
    return out


def unpack_paged_kv_cache(paged_kv_cache, kv_layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """utils._unpack_paged_kv_cache: a (k_cache, v_cache) tuple of 4-D tensors, or one 5-D tensor split on dim 1."""
    if isinstance(paged_kv_cache, tuple):
        k, v = paged_kv_cache
    elif isinstance(paged_kv_cache, torch.Tensor):
        if paged_kv_cache.dim() != 5 or paged_kv_cache.shape[1] != 2:
            raise ValueError(f"a single paged_kv_cache tensor must be [max_num_pages, 2, ...], got "
                             f"{tuple(paged_kv_cache.shape)}")
        k, v = paged_kv_cache.unbind(dim=1)
    else:
        raise KeyError(f"Unrecognized paged_kv_cache type {type(paged_kv_cache)}, expect a single tensor or a "
                       "tuple of tensor.")
    for name, t in (("k_cache", k), ("v_cache", v)):
        if t.dim() != 4:
            raise ValueError(f"paged {name} must be 4-D ([max_num_pages, page_size, num_kv_heads, head_dim] for "
                             f"NHD), got shape {tuple(t.shape)}")
        if t.stride(-1) != 1:
            raise ValueError(f"paged {name}: the last dim must be contiguous (CHECK_LAST_DIM_CONTIGUOUS)")
    if k.shape != v.shape or k.dtype != v.dtype:
        raise ValueError(f"k_cache {tuple(k.shape)} {k.dtype} and v_cache {tuple(v.shape)} {v.dtype} differ")
    if k.stride() != v.stride():
        raise ValueError(f"k/v strides must be identical (csrc), got {k.stride()} and {v.stride()}")
    if k.device != v.device:
        raise ValueError("k_cache and v_cache are on different devices")
    return k, v


def as_nhd(cache: torch.Tensor, kv_layout: str) -> torch.Tensor:
    """[pages, page_size, heads, dim] whatever the layout."""
    return cache if kv_layout == "NHD" else cache.transpose(1, 2)


def check_same_device(device: torch.device, **tensors: torch.Tensor) -> None:
    """csrc CHECK_DEVICE: every input on the workspace's device."""
    for name, t in tensors.items():
        if t is not None and t.device != device:
            raise ValueError(f"{name} is on {t.device}, the workspace buffer on {device} (CHECK_DEVICE)")


def attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, requests: list[tuple[list[int], int]],
           qo_indptr: list[int], causal: bool, window_left: int, sm_scale: float, out: torch.Tensor) -> torch.Tensor:
    """The wrappers' math. Request b's queries q[qo_indptr[b]:qo_indptr[b+1]] are the last qo_len positions of its
    kv_len (append attention: query i sits at kv_len - qo_len + i); key j is visible when causal allows it
    (j <= kv_len - qo_len + i) and, with window_left >= 0, when j >= kv_len - qo_len + i - window_left
    (include/flashinfer/attention/variants.cuh: `kv_idx + qo_len + window_left >= kv_len + qo_idx`). GQA: query
    head h reads KV head h // (num_qo_heads // num_kv_heads). Softmax in float32; a row that sees no key is 0."""
    hkv = k_cache.shape[2]
    g = q.shape[1] // hkv
    for b, (pages, kv_len) in enumerate(requests):
        q0, q1 = qo_indptr[b], qo_indptr[b + 1]
        qo_len = q1 - q0
        if qo_len == 0:
            continue
        if kv_len == 0:
            out[q0:q1] = 0
            continue
        idx = torch.tensor(pages, dtype=torch.long, device=k_cache.device)
        k = k_cache.index_select(0, idx).flatten(0, 1)[:kv_len].float()     # [kv_len, Hkv, D]
        v = v_cache.index_select(0, idx).flatten(0, 1)[:kv_len].float()
        k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)  # [kv_len, Hq, D]
        qs = q[q0:q1].float()
        scores = torch.einsum("qhd,khd->hqk", qs, k) * sm_scale
        q_pos = torch.arange(kv_len - qo_len, kv_len, device=q.device)[:, None]
        k_pos = torch.arange(kv_len, device=q.device)[None, :]
        visible = torch.ones(qo_len, kv_len, dtype=torch.bool, device=q.device)
        if causal:
            visible &= k_pos <= q_pos
        if window_left >= 0:
            visible &= k_pos >= q_pos - window_left
        scores = scores.masked_fill(~visible, float("-inf"))
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
        out[q0:q1] = torch.einsum("hqk,khd->qhd", probs, v).to(out.dtype)
    return out


def default_sm_scale(head_dim: int, sm_scale: float | None) -> float:
    """plan/run: sm_scale "if not provided, will be set to 1.0 / sqrt(head_dim)"."""
    return 1.0 / math.sqrt(head_dim) if sm_scale is None else sm_scale
