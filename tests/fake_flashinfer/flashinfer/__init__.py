"""A CPU emulator of the FlashInfer APIs pdcluster calls, importable as `flashinfer` in tests.

Pinned to flashinfer-python v0.6.17 (PyPI `flashinfer-python`; sources flashinfer/prefill.py, decode.py, page.py,
utils.py and csrc/batch_prefill.cu, batch_decode.cu, page.cu at tag v0.6.17; API reference
https://docs.flashinfer.ai/api/prefill.html, /api/decode.html, /api/page.html; page-table layout
https://docs.flashinfer.ai/tutorials/kv_layout.html). Argument names and defaults follow those signatures; the
documented restrictions and the kernels' input checks raise (ValueError / KeyError / TypeError, as the library
does); documented features nobody here calls raise NotImplementedError, so a caller never gets a silently wrong
emulation. Math in float32, outputs in the planned output dtype.

Devices: FlashInfer needs CUDA tensors; the emulator takes tensors on any device as long as every input is on
the workspace buffer's device (its CHECK_DEVICE), so the engine's FlashInfer backend runs on CPU tensors here.
float32 queries fail to dispatch on hardware and here, unless a test sets `flashinfer._emulator.allow_float32`.

Emulated:
- BatchPrefillWithPagedKVCacheWrapper (prefill.py): __init__, plan, run
- BatchDecodeWithPagedKVCacheWrapper (decode.py): __init__, plan, run
- append_paged_kv_cache, get_batch_indices_positions, get_seq_lens (page.py)
- fused_moe.cutlass_fused_moe (fused_moe.py)
- mla.BatchMLAPagedAttentionWrapper (mla.py)
- gemm.SegmentGEMMWrapper (gemm.py; flashinfer/gemm/gemm_base.py, https://docs.flashinfer.ai/api/gemm.html)

Install it with tests/flashinfer_emulator.py (the `flashinfer_emulator` fixture, or `emulated_flashinfer()`).
"""

from __future__ import annotations

from flashinfer import _emulator
from flashinfer.decode import BatchDecodeWithPagedKVCacheWrapper
from flashinfer.fused_moe import ActivationType, cutlass_fused_moe
from flashinfer.gemm import SegmentGEMMWrapper
from flashinfer.mla import BatchMLAPagedAttentionWrapper
from flashinfer.page import append_paged_kv_cache, get_batch_indices_positions, get_seq_lens
from flashinfer.prefill import BatchPrefillWithPagedKVCacheWrapper

__version__ = "0.6.17+emulated"
EMULATED = True

__all__ = [
    "EMULATED", "ActivationType", "BatchDecodeWithPagedKVCacheWrapper", "BatchMLAPagedAttentionWrapper",
    "BatchPrefillWithPagedKVCacheWrapper", "SegmentGEMMWrapper", "_emulator", "append_paged_kv_cache",
    "cutlass_fused_moe", "get_batch_indices_positions", "get_seq_lens",
]
