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
delta joins the base output before its all-reduce (`Linear.forward` runs before `RowParallelLinear`'s reduce)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


class LoRAStep:
    """The current step's choice of slot per token, shared by every LoRA layer of a model."""

    def __init__(self) -> None:
        # [T, (hi - lo) * R]: 1 on the R columns of each token's slot; None: no token of the step uses an adapter
        self.mask: torch.Tensor | None = None
        self.lo = self.hi = 0   # the step's tokens use slots [lo, hi): only those are multiplied


class LoRALayer:
    def __init__(self, step: LoRAStep, in_features: int, shard_sizes: list[int], slots: int, rank: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.step, self.slots, self.rank = step, slots, rank
        self.shard_sizes = shard_sizes
        # slot-major, so the rows of a range of slots are one contiguous view: row (slot * shards + shard) * R + j
        self.a = torch.zeros(slots * len(shard_sizes) * rank, in_features, dtype=dtype, device=device)
        self.b = [torch.zeros(slots * rank, size, dtype=dtype, device=device) for size in shard_sizes]
        self.filled: set[int] = set()   # slots holding a nonzero delta here

    def set_slot(self, slot: int, shard: int, a: torch.Tensor | None, b: torch.Tensor | None) -> None:
        """Slot `slot`'s A [r, in] and B [out_s, r] of one shard (None: the adapter does not target it), padded
        to the table's rank with zeros."""
        first = (slot * len(self.shard_sizes) + shard) * self.rank
        rows = slice(first, first + self.rank)
        self.a[rows].zero_()
        self.b[shard][slot * self.rank:(slot + 1) * self.rank].zero_()
        if a is None or b is None:
            return
        r = a.shape[0]
        self.a[rows][:r].copy_(a)
        self.b[shard][slot * self.rank:slot * self.rank + r].copy_(b.t())
        self.filled.add(slot)

    def clear_slot(self, slot: int) -> None:
        for shard in range(len(self.shard_sizes)):
            self.set_slot(slot, shard, None, None)
        self.filled.discard(slot)

    def add_(self, x: torch.Tensor, out: torch.Tensor | list[torch.Tensor]) -> None:
        """Add the step's delta to the layer output `out` [T, sum(shards)] in place (or to its shards' outputs,
        given as a list: GatedMLP computes gate and up apart)."""
        step = self.step
        if step.mask is None or not self.filled:
            return
        t, k, n, r = x.shape[0], step.hi - step.lo, len(self.shard_sizes), self.rank
        parts = out if isinstance(out, list) else list(out.split(self.shard_sizes, dim=-1))
        a = self.a[step.lo * n * r:step.hi * n * r]
        shrink = F.linear(x, a).view(t, k, n, r).mul_(step.mask.view(t, k, 1, r))
        for s, part in enumerate(parts):
            part.addmm_(shrink[:, :, s].reshape(t, k * r), self.b[s][step.lo * r:step.hi * r])
