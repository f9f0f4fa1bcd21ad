"""flashinfer.page as in flashinfer-python v0.6.17 (`flashinfer/page.py`, `csrc/page.cu`;
https://docs.flashinfer.ai/api/page.html): append_paged_kv_cache, get_batch_indices_positions, get_seq_lens."""

from __future__ import annotations

import torch

from flashinfer import _emulator
from flashinfer._paged import as_nhd, check_kv_layout, check_page_table, unpack_paged_kv_cache


def get_seq_lens(kv_indptr: torch.Tensor, kv_last_page_len: torch.Tensor, page_size: int) -> torch.Tensor:
    """Sequence lengths: clamp(pages - 1, min=0) * page_size + last_page_len."""
    return torch.clamp(kv_indptr[1:] - kv_indptr[:-1] - 1, min=0) * page_size + kv_last_page_len


def get_batch_indices_positions(append_indptr: torch.Tensor, seq_lens: torch.Tensor, nnz: int,
                                batch_indices: torch.Tensor | None = None,
                                positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Ragged append rows → (batch index, position in the KV) per row, both int32 [nnz]: request b's rows
    append_indptr[b]..append_indptr[b+1] are its last rows, positions seq_lens[b] - append_len + j (the doc's
    example: indptr [0, 1, 3, 6, 10], seq_lens [5, 5, 5, 5] → positions [4, 3, 4, 2, 3, 4, 1, 2, 3, 4]).
    Preallocated outputs must be int32 [nnz] on append_indptr's device (check_shape_dtype_device)."""
    device = append_indptr.device
    for name, t in (("batch_indices", batch_indices), ("positions", positions)):
        if t is not None and (tuple(t.shape) != (nnz,) or t.dtype != torch.int32 or t.device != device):
            raise ValueError(f"Invalid {name}: expected ({nnz},) torch.int32 on {device}, got {tuple(t.shape)} "
                             f"{t.dtype} on {t.device}")
    ptr, lens = append_indptr.cpu().tolist(), seq_lens.cpu().tolist()
    if len(lens) != len(ptr) - 1:
        raise ValueError(f"seq_lens must have shape [batch_size] = [{len(ptr) - 1}], got [{len(lens)}]")
    b_out = torch.full((nnz,), -1, dtype=torch.int32)
    p_out = torch.zeros((nnz,), dtype=torch.int32)
    for b in range(len(lens)):
        n = ptr[b + 1] - ptr[b]
        b_out[ptr[b]:ptr[b + 1]] = b
        p_out[ptr[b]:ptr[b + 1]] = torch.arange(lens[b] - n, lens[b], dtype=torch.int32)
    _emulator.calls["get_batch_indices_positions"] += 1
    if batch_indices is None:
        batch_indices = torch.empty((nnz,), dtype=torch.int32, device=device)
    if positions is None:
        positions = torch.empty((nnz,), dtype=torch.int32, device=device)
    batch_indices.copy_(b_out)
    positions.copy_(p_out)
    return batch_indices, positions


def append_paged_kv_cache(append_key: torch.Tensor, append_value: torch.Tensor, batch_indices: torch.Tensor,
                          positions: torch.Tensor, paged_kv_cache, kv_indices: torch.Tensor, kv_indptr: torch.Tensor,
                          kv_last_page_len: torch.Tensor, kv_layout: str = "NHD") -> None:
    """Writes row i of append_key / append_value [nnz, num_kv_heads, head_dim] at position positions[i] of request
    batch_indices[i]: page kv_indices[kv_indptr[b] + pos // page_size], slot pos % page_size. "The function
    assumes that the space for appended k/v has already been allocated" (the page table covers the new rows).
    csrc/page.cu: append k/v 3-D with the last dim contiguous; batch_indices, positions and the page-table arrays
    contiguous 1-D on the same device (the Python wrapper casts them to int32); caches 4-D, last dim contiguous,
    identical k/v strides; kv_indptr.size(0) == batch_size + 1; batch_indices.size(0) == positions.size(0) ==
    nnz; the caches' dtype is the append dtype (dispatched on it)."""
    check_kv_layout(kv_layout)
    k_cache, v_cache = unpack_paged_kv_cache(paged_kv_cache, kv_layout)
    k_nhd, v_nhd = as_nhd(k_cache, kv_layout), as_nhd(v_cache, kv_layout)
    for name, t in (("append_key", append_key), ("append_value", append_value)):
        if t.dim() != 3:
            raise ValueError(f"{name} must be 3-D [nnz, num_kv_heads, head_dim], got {tuple(t.shape)}")
        if t.stride(-1) != 1:
            raise ValueError(f"{name}: the last dim must be contiguous (CHECK_LAST_DIM_CONTIGUOUS)")
        if tuple(t.shape[1:]) != tuple(k_nhd.shape[2:]):
            raise ValueError(f"{name} heads/head_dim {tuple(t.shape[1:])} differ from the cache's "
                             f"{tuple(k_nhd.shape[2:])}")
        if t.dtype != k_cache.dtype:
            raise ValueError(f"{name} dtype {t.dtype} differs from the paged cache's {k_cache.dtype}")
    ints = {"batch_indices": batch_indices, "positions": positions, "kv_indices": kv_indices,
            "kv_indptr": kv_indptr, "kv_last_page_len": kv_last_page_len}
    for name, t in ints.items():
        if t.dim() != 1 or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous 1-D tensor (CHECK_INPUT / CHECK_DIM(1))")
        if t.is_floating_point():
            raise ValueError(f"{name} must be an integer tensor")
    device = append_key.device
    for name, t in (("append_value", append_value), ("k_cache", k_cache), *ints.items()):
        if t.device != device:
            raise ValueError(f"{name} is on {t.device}, append_key on {device} (CHECK_DEVICE)")
    nnz = append_key.shape[0]
    if append_value.shape[0] != nnz or batch_indices.shape[0] != nnz or positions.shape[0] != nnz:
        raise ValueError(f"append_value, batch_indices and positions must have nnz = {nnz} rows")
    page_size = k_nhd.shape[1]
    requests = check_page_table(kv_indptr.int(), kv_indices.int(), kv_last_page_len.int(), page_size,
                                ("kv_indptr", "kv_indices", "kv_last_page_len"))
    rows, slots = [], []
    for i, (b, pos) in enumerate(zip(batch_indices.cpu().tolist(), positions.cpu().tolist(), strict=True)):
        if not 0 <= b < len(requests):
            raise ValueError(f"batch_indices[{i}] = {b} outside the batch of {len(requests)}")
        pages, kv_len = requests[b]
        if not 0 <= pos < kv_len:
            raise ValueError(f"positions[{i}] = {pos} outside request {b}'s {kv_len} allocated entries")
        page = pages[pos // page_size]
        if not 0 <= page < k_nhd.shape[0]:
            raise ValueError(f"kv_indices: page {page} outside the cache's {k_nhd.shape[0]} pages")
        rows.append(i)
        slots.append((page, pos % page_size))
    if slots:
        pages_t = torch.tensor([p for p, _ in slots], device=device)
        offs_t = torch.tensor([o for _, o in slots], device=device)
        k_nhd[pages_t, offs_t] = append_key
        v_nhd[pages_t, offs_t] = append_value
    _emulator.calls["append_paged_kv_cache"] += 1
