"""vLLM-Ascend's LoRA custom ops, emulated: importing this module registers `torch.ops._C_ascend.bgmv_shrink`,
`bgmv_expand`, `sgmv_shrink` and `sgmv_expand` with their schemas (the real op library registers them the same way
on import); `unregister()` removes them again (tests/npu_emulator.py calls it when the emulator leaves).

Written from vllm-project/vllm-ascend (main of 2026-08-22): the schemas and TORCH_CHECKs of csrc/torch_binding.cpp
(`ops.def("bgmv_shrink(Tensor! x, Tensor! weight, Tensor! indices, Tensor! y, float scale) -> ()")`, ...), the
kernels csrc/kernels/bgmv_shrink.cpp, bgmv_expand.cpp, sgmv_shrink.cpp, sgmv_expand.cpp, and their callers
vllm_ascend/lora/lora_ops.py and punica_npu.py. What the kernels do, which the emulation follows:

- shrink: X_T = W_T = half / bfloat16, Y_T = float. For each token t with slot i = indices[t] >= 0:
  y[t, :] = scale * sum_k float(x[t, k]) * float(W[i, :, k]) (float32 accumulation), written over y's row;
  tokens with i < 0 are skipped (their rows keep what y held). W's slot i starts at i * R * in: W is
  [slots, R, in] (or [slots, 1, R, in]) and R = y.size(1).
- expand: X_T = float, W_T = Y_T = half / bfloat16. For each token with i >= 0:
  y[t, off:off + size] = round(float(y[t, off:off + size]) + x[t] @ float(W[i])^T) (CAST_RINT to y's dtype);
  W's slot i starts at i * R * size: W is [slots, size, R]; R = x.size(1) must be 8, 16, 32 or 64 (the kernel's
  SUPPORTED_RANKS; it computes no other). Returns y (`y_out = y`).
- sgmv: the token -> slot map is segments: token t belongs to the first segment j with t < seq_len[0] + ... +
  seq_len[j], its slot lora_indices[j]; tokens past the last segment count as -1.
- indices, lora_indices and seq_len are read as int64 (`__gm__ int64_t *`), every tensor as dense row-major
  memory (pointer offsets), so the emulator refuses other dtypes and non-contiguous tensors, and slots outside
  the weight's first dimension, which the kernel would read out of bounds.

The real ops are registered for the NPU (PrivateUse1) dispatch key; here for CPU, the emulator's NPU tensors
(tests/fake_torch_npu/torch_npu/__init__.py "Devices"). Each call is counted in `torch_npu._emulator.calls`.
"""

from __future__ import annotations

import torch
from torch_npu import _state

SCHEMAS = {
    "bgmv_shrink": "bgmv_shrink(Tensor! x, Tensor! weight, Tensor! indices, Tensor! y, float scale) -> ()",
    "bgmv_expand": "bgmv_expand(Tensor! x, Tensor! weight, Tensor! indices, Tensor! y,"
                   "            int slice_offset, int slice_size) -> Tensor",
    "sgmv_shrink": "sgmv_shrink(Tensor! x, Tensor! weight, Tensor! lora_indices, Tensor! seq_len, Tensor! y,"
                   " float scale) -> ()",
    "sgmv_expand": "sgmv_expand(Tensor! x, Tensor! weight, Tensor! lora_indices, Tensor! seq_len, Tensor! y,"
                   "            int slice_offset, int slice_size) -> Tensor",
}
HALF = (torch.float16, torch.bfloat16)
EXPAND_RANKS = (8, 16, 32, 64)


def _check(op: str, ok: bool, msg: str) -> None:
    if not ok:
        raise RuntimeError(f"{op}: {msg}")


def _check_common(op: str, x: torch.Tensor, weight: torch.Tensor, y: torch.Tensor, dtype: torch.dtype) -> None:
    """The TORCH_CHECKs every op shares (torch_binding.cpp), then what the kernel's raw reads need."""
    _check(op, dtype in HALF, "only support half and bf16")
    _check(op, x.dim() == 2, "x should be [batch_size, hidden_in]")
    _check(op, weight.dim() in (3, 4), "weight should be [num_loras, hidden_out, hidden_in] or "
                                       "[num_loras, 1, hidden_out, hidden_in]")
    _check(op, y.dim() == 2, "y should be [batch_size, hidden_out]")
    _check(op, weight.dim() == 3 or weight.shape[1] == 1, "weight should be [num_loras, 1, hidden_out, hidden_in]")
    for name, t in (("x", x), ("weight", weight), ("y", y)):
        _check(op, t.is_contiguous(), f"{name} must be contiguous (the kernel reads it by offsets)")


def _slots(op: str, indices: torch.Tensor, weight: torch.Tensor, tokens: int) -> list[int]:
    _check(op, indices.dtype == torch.int64, f"indices must be int64 (read as int64_t), got {indices.dtype}")
    slots = indices.tolist()
    bad = [i for i in slots[:tokens] if i >= weight.shape[0]]
    _check(op, not bad, f"LoRA index {bad[:1]} out of range for weight with {weight.shape[0]} LoRAs")
    return slots


def _segment_slots(op: str, lora_indices: torch.Tensor, seq_len: torch.Tensor, weight: torch.Tensor,
                   tokens: int) -> list[int]:
    """sgmv's CopyInIndex: each token's slot from the segments, -1 past them."""
    _check(op, seq_len.dtype == torch.int64, f"seq_len must be int64 (read as int64_t), got {seq_len.dtype}")
    _check(op, lora_indices.dim() == 1 and seq_len.dim() == 1 and lora_indices.shape[0] >= seq_len.shape[0],
           "lora_indices and seq_len should be 1-D, a LoRA index per segment")
    slots = _slots(op, lora_indices, weight, len(lora_indices))
    out: list[int] = []
    for slot, n in zip(slots, seq_len.tolist(), strict=False):
        out += [slot] * max(n, 0)
    return (out + [-1] * tokens)[:tokens]


def _shrink(op: str, x: torch.Tensor, weight: torch.Tensor, slots: list[int], y: torch.Tensor,
            scale: float) -> None:
    _check(op, x.size(1) > y.size(1), "hidden in should be greater than hidden out")
    _check(op, y.dtype == torch.float32, f"y must be float32 (the kernel's Y_T), got {y.dtype}")
    _check(op, weight.dtype == x.dtype, f"weight must have x's dtype {x.dtype}, got {weight.dtype}")
    w = weight.reshape(weight.shape[0], -1, weight.shape[-1])
    _check(op, tuple(w.shape[1:]) == (y.size(1), x.size(1)),
           f"weight {tuple(weight.shape)} should be [num_loras, {y.size(1)}, {x.size(1)}] (rank = y.size(1))")
    for t, i in enumerate(slots):
        if i >= 0:
            y[t] = scale * (w[i].float() @ x[t].float())


def _expand(op: str, x: torch.Tensor, weight: torch.Tensor, slots: list[int], y: torch.Tensor, slice_offset: int,
            slice_size: int) -> torch.Tensor:
    _check(op, x.size(1) <= slice_size, "hidden in should be smaller than hidden out")
    _check(op, slice_offset >= 0, "slice offset should be no smaller than 0")
    _check(op, slice_size + slice_offset <= y.size(1),
           "slice_size + slice_offset should be smaller than the second dimension of y")
    _check(op, x.dtype == torch.float32, f"x must be float32 (the kernel's X_T), got {x.dtype}")
    _check(op, weight.dtype == y.dtype, f"weight must have y's dtype {y.dtype}, got {weight.dtype}")
    _check(op, x.size(1) in EXPAND_RANKS, f"LoRA rank {x.size(1)} is not one the kernel computes {EXPAND_RANKS}")
    w = weight.reshape(weight.shape[0], -1, weight.shape[-1])
    _check(op, tuple(w.shape[1:]) == (slice_size, x.size(1)),
           f"weight {tuple(weight.shape)} should be [num_loras, {slice_size}, {x.size(1)}]")
    cols = slice(slice_offset, slice_offset + slice_size)
    for t, i in enumerate(slots):
        if i >= 0:
            y[t, cols] = (y[t, cols].float() + w[i].float() @ x[t]).to(y.dtype)
    return y


def bgmv_shrink(x: torch.Tensor, weight: torch.Tensor, indices: torch.Tensor, y: torch.Tensor,
                scale: float) -> None:
    op = "bgmv_shrink"
    _state.record(op)
    _check_common(op, x, weight, y, x.dtype)
    _check(op, indices.dim() == 1, "indices should be [batch_size]")
    _check(op, x.size(0) == y.size(0) and x.size(0) == indices.size(0),
           "the first dimension of x, y, indices should be same")
    _shrink(op, x, weight, _slots(op, indices, weight, x.size(0)), y, scale)


def bgmv_expand(x: torch.Tensor, weight: torch.Tensor, indices: torch.Tensor, y: torch.Tensor, slice_offset: int,
                slice_size: int) -> torch.Tensor:
    op = "bgmv_expand"
    _state.record(op)
    _check_common(op, x, weight, y, y.dtype)
    _check(op, indices.dim() == 1, "indices should be [batch_size]")
    _check(op, x.size(0) == y.size(0) and x.size(0) == indices.size(0),
           "the first dimension of x, y, indices should be same")
    return _expand(op, x, weight, _slots(op, indices, weight, x.size(0)), y, slice_offset, slice_size)


def sgmv_shrink(x: torch.Tensor, weight: torch.Tensor, lora_indices: torch.Tensor, seq_len: torch.Tensor,
                y: torch.Tensor, scale: float) -> None:
    op = "sgmv_shrink"
    _state.record(op)
    _check_common(op, x, weight, y, x.dtype)
    _check(op, x.size(0) == y.size(0), "the first dimension of x and y should be same (the kernel writes a row of y "
                                       "per row of x)")
    _shrink(op, x, weight, _segment_slots(op, lora_indices, seq_len, weight, x.size(0)), y, scale)


def sgmv_expand(x: torch.Tensor, weight: torch.Tensor, lora_indices: torch.Tensor, seq_len: torch.Tensor,
                y: torch.Tensor, slice_offset: int, slice_size: int) -> torch.Tensor:
    op = "sgmv_expand"
    _state.record(op)
    _check_common(op, x, weight, y, y.dtype)
    _check(op, x.size(0) == y.size(0), "the first dimension of x and y should be same (the kernel reads a row of x "
                                       "per row of y)")
    return _expand(op, x, weight, _segment_slots(op, lora_indices, seq_len, weight, x.size(0)), y, slice_offset,
                   slice_size)


def _register() -> torch.library.Library:
    try:
        torch.ops._C_ascend.bgmv_shrink   # noqa: B018  (raises when nothing registered it)
    except (AttributeError, RuntimeError):
        pass
    else:
        raise RuntimeError("torch.ops._C_ascend already has the LoRA ops (a real vLLM-Ascend, or an emulator that "
                           "was not unregistered)")
    lib = torch.library.Library("_C_ascend", "FRAGMENT")
    for name, schema in SCHEMAS.items():
        lib.define(schema)
        lib.impl(name, globals()[name], "CPU")
    return lib


_lib: torch.library.Library | None = _register()


def unregister() -> None:
    global _lib
    if _lib is not None:
        _lib._destroy()
        _lib = None
