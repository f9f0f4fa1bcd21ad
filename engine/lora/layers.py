"""The batched LoRA delta of one linear layer, for every token of a step at once.

Each layer keeps the A and B of every device slot stacked and zero-padded to max_lora_rank R:
`a` [slots * shards * R, in] (F.linear's layout) and per output shard `b[s]` [slots * R, out_s] (scaling folded
in). A step multiplies x by the rows of `a` of the slots its tokens use (shrink, [T, slots * shards * R]; the
range [lo, hi) of them, a view), keeps for each token only the R columns of its own slot (`LoRAStep.mask`: 1
there, 0 elsewhere and everywhere for a base-model token), and multiplies by `b[s]` (expand) into each output
slice. One shrink GEMM, one multiply and one expand GEMM per shard, whatever the mix of adapters: no Python loop
over adapters and no copy of A/B per token. Measured on CPU (docs/engine.md "Multi-LoRA"): a gathered BGMV (A and
B copied per token, batched matmuls) is 3-20x slower; a Python loop over adapter segments does the least arithmetic
and is up to ~1.4x cheaper with 8 adapters in a step, but slower with few. The shrink and expand do (hi - lo) x the
work a token needs, small next to the base GEMM while (hi - lo) * R stays well under the layer's width. A step
without adapter tokens skips it all (`mask` None).

Merged layers (q/k/v, gate/up) have one shard per projection: one shrink for all of them, one expand into each
output slice. Under tensor parallelism the tensors are this rank's part (engine/lora/adapter.py): a
column-parallel layer's B holds its output rows, a row-parallel layer's A its input columns, and the partial
delta joins the base output before its all-reduce (`Linear.forward` runs before `RowParallelLinear`'s reduce).

Device paths (`kind`, chosen per layer when it is made): "npu" runs vLLM-Ascend's bgmv/sgmv ops
(engine/lora/npu_ops.py; its own table layout, vLLM's: a [shards, slots, R, in], b[s] [slots, out_s, R]),
"segment" FlashInfer's segment GEMM on CUDA (engine/lora/cuda_ops.py; the tables above), "masked" the above on
any device, and wherever a device path's library is missing or its contract does not fit the layer. One table per
layer whatever the path: `set_slot` writes it in the path's layout."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from pdcluster.device import is_npu
from pdcluster.engine.lora import cuda_ops, npu_ops
from pdcluster.engine.lora.step import LoRAStep

KINDS = ("masked", "npu", "segment")


def choose_kind(device: torch.device, dtype: torch.dtype, rank: int, in_features: int,
                shard_sizes: list[int]) -> str:
    if is_npu(device) and npu_ops.supported(dtype, rank, in_features, shard_sizes):
        return "npu"
    if device.type == "cuda" and cuda_ops.supported(dtype) and cuda_ops.segment_gemm(device) is not None:
        return "segment"
    return "masked"


class LoRALayer:
    def __init__(self, step: LoRAStep, in_features: int, shard_sizes: list[int], slots: int, rank: int,
                 dtype: torch.dtype, device: torch.device, kind: str | None = None) -> None:
        self.step, self.slots, self.rank = step, slots, rank
        self.shard_sizes = shard_sizes
        self.kind = kind or choose_kind(device, dtype, rank, in_features, shard_sizes)
        if self.kind not in KINDS:
            raise ValueError(f"LoRA compute path {self.kind!r}: expected one of {', '.join(KINDS)}")
        n = len(shard_sizes)
        self.ops: Any = None   # the path's kernels: torch.ops._C_ascend, or the SegmentGEMMWrapper
        if self.kind == "npu":
            self.ops = npu_ops.ascend_ops()
            self.a = torch.zeros(n, slots, rank, in_features, dtype=dtype, device=device)
            self.b = [torch.zeros(slots, size, rank, dtype=dtype, device=device) for size in shard_sizes]
        else:
            if self.kind == "segment":
                self.ops = cuda_ops.segment_gemm(device)
            # slot-major, so the rows of a range of slots are one contiguous view: row (slot * shards + shard) * R + j
            self.a = torch.zeros(slots * n * rank, in_features, dtype=dtype, device=device)
            self.b = [torch.zeros(slots * rank, size, dtype=dtype, device=device) for size in shard_sizes]
        self.filled: set[int] = set()   # slots holding a nonzero delta here

    def _slot_tables(self, slot: int, shard: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of slot `slot`'s A [R, in] and B [out_s, R] of one shard in this layer's tables."""
        if self.kind == "npu":
            return self.a[shard, slot], self.b[shard][slot]
        first = (slot * len(self.shard_sizes) + shard) * self.rank
        return self.a[first:first + self.rank], self.b[shard][slot * self.rank:(slot + 1) * self.rank].t()

    def set_slot(self, slot: int, shard: int, a: torch.Tensor | None, b: torch.Tensor | None) -> None:
        """Slot `slot`'s A [r, in] and B [out_s, r] of one shard (None: the adapter does not target it), padded
        to the table's rank with zeros."""
        a_rows, b_cols = self._slot_tables(slot, shard)
        a_rows.zero_()
        b_cols.zero_()
        if a is None or b is None:
            return
        r = a.shape[0]
        a_rows[:r].copy_(a)
        b_cols[:, :r].copy_(b)
        self.filled.add(slot)

    def clear_slot(self, slot: int) -> None:
        for shard in range(len(self.shard_sizes)):
            self.set_slot(slot, shard, None, None)
        self.filled.discard(slot)

    def add_(self, x: torch.Tensor, out: torch.Tensor | list[torch.Tensor]) -> None:
        """Add the step's delta to the layer output `out` [T, sum(shards)] in place (or to its shards' outputs,
        given as a list: GatedMLP computes gate and up apart)."""
        if not self.filled:
            return
        step = self.step
        parts = out if isinstance(out, list) else list(out.split(self.shard_sizes, dim=-1))
        if self.kind == "npu":
            if step.npu is not None:
                npu_ops.add_lora(self.ops, x, parts, None if isinstance(out, list) else out, self.a, self.b,
                                 step.npu)
        elif self.kind == "segment":
            if step.segments is not None:
                cuda_ops.add_lora(self.ops, x, parts, self.a, self.b, self.rank, step.segments)
        elif step.mask is not None:
            self._masked_add_(x, parts)

    def _masked_add_(self, x: torch.Tensor, parts: list[torch.Tensor]) -> None:
        step = self.step
        assert step.mask is not None
        t, k, n, r = x.shape[0], step.hi - step.lo, len(self.shard_sizes), self.rank
        a = self.a[step.lo * n * r:step.hi * n * r]
        shrink = F.linear(x, a).view(t, k, n, r).mul_(step.mask.view(t, k, 1, r))
        for s, part in enumerate(parts):
            part.addmm_(shrink[:, :, s].reshape(t, k * r), self.b[s][step.lo * r:step.hi * r])
