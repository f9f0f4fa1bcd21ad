"""The LoRA delta on Ascend NPUs through vLLM-Ascend's AscendC custom ops, `torch.ops._C_ascend.*`, registered
by its op library (`import vllm_ascend.vllm_ascend_C`); called as vLLM-Ascend's punica wrapper calls them
(vllm_ascend/lora/punica_npu.py, lora_ops.py), with the contracts of csrc/torch_binding.cpp and
csrc/kernels/{bgmv,sgmv}_{shrink,expand}.cpp (vllm-project/vllm-ascend, main of 2026-08-22):

    bgmv_shrink(x, weight, indices, y, scale)                                    -> ()
    bgmv_expand(x, weight, indices, y, slice_offset, slice_size)                 -> y
    sgmv_shrink(x, weight, lora_indices, seq_len, y, scale)                      -> ()
    sgmv_expand(x, weight, lora_indices, seq_len, y, slice_offset, slice_size)   -> y

shrink: x [T, in] fp16/bf16, weight [slots, R, in] of x's dtype, y [T, R] float32; y[t] = scale * x[t] @ W[i]^T
written (not added) for each token t whose slot i >= 0, other rows untouched. expand: x [T, R] float32 (the
shrink's output), weight [slots, out, R], y [T, full] fp16/bf16; y[t, off:off + out] += x[t] @ W[i]^T for i >= 0.
bgmv takes a slot per token (`indices` int64 [T], -1: base model); sgmv takes segments of consecutive tokens
(`lora_indices` and `seq_len`, int64 [S]; tokens past sum(seq_len) count as -1). The kernels index raw
memory, so every tensor is contiguous; the expand kernel computes ranks 8, 16, 32 and 64 only.

As vLLM-Ascend: sgmv when some segment holds more than one token (its prefill metadata), bgmv otherwise (decode);
one shrink and one expand per output shard into a zeroed float32 buffer; scale 1 (the adapter's scaling is folded
into B, engine/lora/adapter.py). A layer takes this path only when the ops are registered and it meets their
contract (`supported`); otherwise it computes the masked delta."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

OPS = ("bgmv_shrink", "bgmv_expand", "sgmv_shrink", "sgmv_expand")
RANKS = (8, 16, 32, 64)   # bgmv_expand.cpp / sgmv_expand.cpp SUPPORTED_RANKS
DTYPES = (torch.float16, torch.bfloat16)   # "only support half and bf16"


def ascend_ops() -> Any | None:
    """`torch.ops._C_ascend` with the four LoRA ops, loading vLLM-Ascend's op library if needed; None when it is
    missing (any failure to load counts, as for torch_npu in engine/device.py)."""
    try:
        import vllm_ascend.vllm_ascend_C  # type: ignore[import-not-found]  # noqa: F401  (registers the ops)
    except Exception:
        return None
    ns = torch.ops._C_ascend
    return ns if all(hasattr(ns, op) for op in OPS) else None


def supported(dtype: torch.dtype, rank: int, in_features: int, shard_sizes: list[int]) -> bool:
    """Whether a layer meets the ops' contract: the TORCH_CHECKs "hidden in should be greater than hidden out"
    (shrink) and "hidden in should be smaller than hidden out" (expand: R <= each shard), the dtypes, the ranks;
    not on Atlas 300I / 310P, where vLLM-Ascend's punica wrapper does not call them (it uses torch ops there)."""
    if not (dtype in DTYPES and rank in RANKS and in_features > rank and min(shard_sizes) >= rank):
        return False
    npu: Any = getattr(torch, "npu", None)   # set by torch_npu
    if npu is None or "310P" in npu.get_device_name():
        return False
    return ascend_ops() is not None


@dataclass
class NpuIndices:
    """One step's token -> slot map in the ops' two forms, int64 on the device."""
    indices: torch.Tensor       # [T]: each token's slot, -1 for the base model (bgmv)
    lora_indices: torch.Tensor  # [S]: the slot of each run of consecutive tokens with the same slot (sgmv)
    seq_len: torch.Tensor       # [S]: the run's length
    prefill: bool               # some run is longer than one token: sgmv

    @staticmethod
    def build(slots: torch.Tensor, device: torch.device) -> NpuIndices:
        slots = slots.to(torch.int64)
        runs, lens = torch.unique_consecutive(slots, return_counts=True)
        return NpuIndices(slots.to(device), runs.to(device), lens.to(device), len(runs) < len(slots))


def add_lora(ops: Any, x: torch.Tensor, parts: list[torch.Tensor], out: torch.Tensor | None, a: torch.Tensor,
             b: list[torch.Tensor], step: NpuIndices) -> None:
    """Add the delta to the layer output: `out` [T, sum(shards)] when it is one tensor (then `parts` are its
    column slices), else each shard's own output in `parts`. `a` [shards, slots, R, in] (a[s] is one shard's
    stacked A, vLLM's lora_a_stacked layout), b[s] [slots, out_s, R]; `ops`: `ascend_ops()`."""
    x = x.contiguous()
    buf = torch.zeros(x.shape[0], a.shape[2], dtype=torch.float32, device=x.device)
    offset = 0
    for s, part in enumerate(parts):
        size = part.shape[1]
        if out is not None and out.is_contiguous():
            y, y_offset = out, offset
        else:
            y, y_offset = part if part.is_contiguous() else torch.zeros_like(part), 0
        if step.prefill:
            ops.sgmv_shrink(x, a[s], step.lora_indices, step.seq_len, buf, 1.0)
            ops.sgmv_expand(buf, b[s], step.lora_indices, step.seq_len, y, y_offset, size)
        else:
            ops.bgmv_shrink(x, a[s], step.indices, buf, 1.0)
            ops.bgmv_expand(buf, b[s], step.indices, y, y_offset, size)
        if y is not out and y is not part:
            part.add_(y)
        offset += size
