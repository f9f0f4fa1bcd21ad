"""The LoRA delta on CUDA through FlashInfer's segment GEMM, `flashinfer.SegmentGEMMWrapper` (flashinfer-python
v0.6.17, flashinfer/gemm/gemm_base.py; https://docs.flashinfer.ai/api/gemm.html), the kernel SGLang's FlashInfer
LoRA backend runs (python/sglang/srt/lora/backend/flashinfer_backend.py):

    run(x, weights, batch_size, weight_column_major, out=None, seg_lens=None, seg_indptr=None, weight_indices=None)

y[seg_indptr[i]:seg_indptr[i + 1]] = x[same rows] @ W[weight_indices[i]] for each of the `batch_size` segments, W
of `weights` [num_weights, d_out, d_in] when column-major, else [num_weights, d_in, d_out]; x [rows, d_in] and
the returned y [rows, d_out] in x's dtype (float16 / bfloat16); seg_indptr and weight_indices int64; contiguous
tensors (the kernel's arguments are pointer offsets).

The scheduler's rows may interleave adapters, and segments must be consecutive rows, so the adapter tokens are
gathered in slot order (base-model tokens left out), multiplied segment by segment (one shrink for all output
shards: the layer's `a` [slots * shards * R, in] is [slots, shards * R, in] column-major; one expand per shard:
b[s] [slots * R, out_s] is [slots, R, out_s] row-major; the masked path's tables, unchanged) and scattered back
into the output. Without flashinfer (or for a dtype it has no kernel for) a layer computes the masked delta."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from pdcluster.engine.attention import flashinfer_backend

_wrappers: dict[torch.device, Any] = {}


def segment_gemm(device: torch.device) -> Any | None:
    """The device's SegmentGEMMWrapper (one for every layer: their runs never overlap), made on first use; None
    without flashinfer (missing, or built for another torch / CUDA)."""
    try:
        from flashinfer import SegmentGEMMWrapper
    except Exception:
        return None
    wrapper = _wrappers.get(device)
    if wrapper is None or not isinstance(wrapper, SegmentGEMMWrapper):   # (a test's emulator came and went)
        size = flashinfer_backend.CUDA_WORKSPACE_BYTES if device.type == "cuda" \
            else flashinfer_backend.HOST_WORKSPACE_BYTES
        wrapper = _wrappers[device] = SegmentGEMMWrapper(torch.empty(size, dtype=torch.int8, device=device))
    return wrapper


def supported(dtype: torch.dtype) -> bool:
    return dtype in flashinfer_backend.KERNEL_DTYPES


@dataclass
class Segments:
    """One step's adapter tokens in slot order, as the segment GEMM reads them (int64 on the device)."""
    order: torch.Tensor           # [n]: the rows of the adapter tokens, grouped by slot
    seg_indptr: torch.Tensor      # [S + 1]: the segments' bounds in that order
    weight_indices: torch.Tensor  # [S]: each segment's slot
    batch_size: int               # S

    @staticmethod
    def build(slots: torch.Tensor, device: torch.device) -> Segments:
        rows = (slots >= 0).nonzero().squeeze(1)
        order = rows[torch.argsort(slots[rows], stable=True)]
        weight_indices, lens = torch.unique_consecutive(slots[order].to(torch.int64), return_counts=True)
        seg_indptr = torch.zeros(len(lens) + 1, dtype=torch.int64)
        torch.cumsum(lens, 0, out=seg_indptr[1:])
        return Segments(order.to(device), seg_indptr.to(device), weight_indices.to(device), len(lens))


def add_lora(wrapper: Any, x: torch.Tensor, parts: list[torch.Tensor], a: torch.Tensor, b: list[torch.Tensor],
             rank: int, seg: Segments) -> None:
    """Add the delta to each shard's output in `parts` (views of the layer output, or its own tensors)."""
    slots = b[0].shape[0] // rank
    xs = x.index_select(0, seg.order)
    shrink = wrapper.run(xs, a.view(slots, -1, a.shape[1]), seg.batch_size, True, seg_indptr=seg.seg_indptr,
                         weight_indices=seg.weight_indices)
    for s, part in enumerate(parts):
        delta = wrapper.run(shrink[:, s * rank:(s + 1) * rank].contiguous(), b[s].view(slots, rank, -1),
                            seg.batch_size, False, seg_indptr=seg.seg_indptr, weight_indices=seg.weight_indices)
        part.index_add_(0, seg.order, delta)
