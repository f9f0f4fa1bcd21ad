"""flashinfer.gemm.SegmentGEMMWrapper (also `flashinfer.SegmentGEMMWrapper`), emulated.

Follows flashinfer-python v0.6.17: flashinfer/gemm/gemm_base.py (SegmentGEMMWrapper.__init__ / run, `forward = run`,
launch_compute_sm80_group_gemm_args), flashinfer/triton/gemm.py (compute_sm80_group_gemm_args: the per-segment
pointers), csrc/group_gemm.cu (DISPATCH_DLPACK_DTYPE_TO_CTYPE_FP16) and the API reference
https://docs.flashinfer.ai/api/gemm.html ("Grouped GEMM (Ampere/Hopper)"):

- run(x, weights, batch_size, weight_column_major, out=None, seg_lens=None, seg_indptr=None, weight_indices=None):
  for segment i < batch_size, out[seg_indptr[i]:seg_indptr[i + 1]] = x[same rows] @ W, W = weights[weight_indices[i]]
  (weights[i] without weight_indices) as [d_in, d_out]: weights is [num_weights, d_out, d_in] when
  weight_column_major, else [num_weights, d_in, d_out]. Rows outside the segments are not written (a new `out` is
  zeros). Returns out, [x.size(0), d_out] in x's dtype.
- ValueError "Either seg_lens or seg_indptr should be provided."; seg_indptr wins over seg_lens; seg_lens is turned
  into seg_indptr as the library does (`get_indptr(seg_lens.to(x))`); `out` of another shape raises
  "Output tensor shape mismatch".
- What the kernel's pointer arithmetic assumes, refused here rather than read out of bounds: x, weights and out
  contiguous; x.size(1) == d_in; seg_indptr non-decreasing within x's rows; weight indices within num_weights; all
  tensors on the workspace's device (CHECK_DEVICE).
- dtypes: the segment GEMM dispatches float16 / bfloat16 (x, weights and out alike); float32 only with the
  emulator's switch (`_emulator.allow_float32`). fp8 inputs (bf16 output, sm90) are not emulated.
Math in float32, rounded once to out's dtype.
"""

from __future__ import annotations

import torch

from flashinfer import _emulator
from flashinfer._paged import check_same_device, check_workspace

BACKENDS = ("auto", "sm80", "sm90")


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


class SegmentGEMMWrapper:
    def __init__(self, float_workspace_buffer: torch.Tensor, backend: str = "auto") -> None:
        check_workspace(float_workspace_buffer)
        self._int_workspace_buffer = torch.empty((1024 * 1024,), dtype=torch.int8,
                                                 device=float_workspace_buffer.device)
        self._float_workspace_buffer = float_workspace_buffer
        self.backend = backend

    def reset_workspace_buffer(self, float_workspace_buffer: torch.Tensor, int_workspace_buffer: torch.Tensor) -> None:
        self._float_workspace_buffer = float_workspace_buffer
        self._int_workspace_buffer = int_workspace_buffer

    def run(self, x: torch.Tensor, weights: torch.Tensor, batch_size: int, weight_column_major: bool,
            out: torch.Tensor | None = None, seg_lens: torch.Tensor | None = None,
            seg_indptr: torch.Tensor | None = None, weight_indices: torch.Tensor | None = None) -> torch.Tensor:
        _emulator.calls["SegmentGEMMWrapper.run"] += 1
        if seg_lens is None and seg_indptr is None:
            raise ValueError("Either seg_lens or seg_indptr should be provided.")
        if seg_indptr is None:
            assert seg_lens is not None
            lens = seg_lens.to(x).to(torch.int64)   # utils.get_indptr(seg_lens.to(x))
            seg_indptr = torch.zeros(lens.shape[0] + 1, dtype=torch.int64, device=lens.device)
            seg_indptr[1:] = lens.cumsum(0)
        d_out = weights.size(1) if weight_column_major else weights.size(2)
        d_in = weights.size(2) if weight_column_major else weights.size(1)
        if out is None:
            _check(x.dtype not in _emulator.FP8_DTYPES, "flashinfer emulator: fp8 segment GEMM is not emulated")
            out = torch.zeros((x.size(0), d_out), dtype=x.dtype, device=x.device)
        elif out.shape != (x.size(0), d_out):
            raise ValueError(f"Output tensor shape mismatch, expected {x.size(0), d_out}, got {out.shape}")
        if self.backend not in BACKENDS:
            raise ValueError(f"Unsupported gemm backend: {self.backend}")
        check_same_device(self._float_workspace_buffer.device, x=x, weights=weights, out=out, seg_indptr=seg_indptr,
                          weight_indices=weight_indices)
        _check(x.dtype in _emulator.q_dtypes(), f"segment GEMM: unsupported dtype {x.dtype} (float16 / bfloat16)")
        _check(weights.dtype == x.dtype and out.dtype == x.dtype,
               f"segment GEMM: x, weights and out must share one dtype, got {x.dtype}, {weights.dtype}, {out.dtype}")
        _check(x.dim() == 2 and weights.dim() == 3, "x must be 2-D and weights 3-D")
        _check(x.size(1) == d_in, f"x has {x.size(1)} columns, the weights' d_in is {d_in}")
        for name, t in (("x", x), ("weights", weights), ("out", out)):
            _check(t.is_contiguous(), f"{name} must be contiguous (the kernel's arguments are pointer offsets)")
        _check(seg_indptr.dim() == 1 and seg_indptr.shape[0] >= batch_size + 1,
               f"seg_indptr must be 1-D with batch_size + 1 = {batch_size + 1} entries")
        ptr = seg_indptr.to(torch.int64).tolist()
        ordered = all(a <= b for a, b in zip(ptr[:batch_size], ptr[1:batch_size + 1], strict=True))
        _check(ptr[0] >= 0 and ordered and ptr[batch_size] <= x.size(0),
               f"seg_indptr {ptr[:batch_size + 1]} is not within x's {x.size(0)} rows")
        if weight_indices is None:
            idx = list(range(batch_size))
        else:
            _check(weight_indices.dim() == 1 and weight_indices.shape[0] >= batch_size,
                   f"weight_indices must be 1-D with batch_size = {batch_size} entries")
            idx = weight_indices.to(torch.int64).tolist()
        _check(all(0 <= w < weights.size(0) for w in idx[:batch_size]),
               f"weight indices {idx[:batch_size]} out of range for {weights.size(0)} weights")
        for i in range(batch_size):
            w = weights[idx[i]].float()
            rows = slice(ptr[i], ptr[i + 1])
            out[rows] = (x[rows].float() @ (w.t() if weight_column_major else w)).to(out.dtype)
        return out

    forward = run
