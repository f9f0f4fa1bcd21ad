"""The current step's choice of slot per token, shared by every LoRA layer of a model, in the form each compute
path reads: the masked path's 0/1 mask (engine/lora/layers.py), the Ascend bgmv/sgmv ops' per-token indices and
segments (engine/lora/npu_ops.py), FlashInfer's segment GEMM's gather order and segments (engine/lora/cuda_ops.py).
Built once per step from the host-side slots (-1: a base-model token), only for the paths the model's layers use."""

from __future__ import annotations

import torch

from pdcluster.engine.lora.cuda_ops import Segments
from pdcluster.engine.lora.npu_ops import NpuIndices


class LoRAStep:
    def __init__(self) -> None:
        # [T, (hi - lo) * R]: 1 on the R columns of each token's slot; None: no token of the step uses an adapter
        self.mask: torch.Tensor | None = None
        self.lo = self.hi = 0   # the step's tokens use slots [lo, hi): only those are multiplied
        self.npu: NpuIndices | None = None
        self.segments: Segments | None = None

    def begin(self, slots: torch.Tensor | None, kinds: set[str], rank: int, dtype: torch.dtype,
              device: torch.device) -> None:
        """`slots` [T] on the host (None: no token uses an adapter); `kinds`: the compute paths of the layers."""
        self.mask, self.npu, self.segments = None, None, None
        if slots is None:
            return
        used = slots[slots >= 0]
        self.lo, self.hi = int(used.min()), int(used.max()) + 1
        if "masked" in kinds:
            onehot = slots.to(torch.long).unsqueeze(1) == torch.arange(self.lo, self.hi)
            self.mask = onehot.to(dtype).repeat_interleave(rank, dim=1).to(device)
        if "npu" in kinds:
            self.npu = NpuIndices.build(slots, device)
        if "segment" in kinds:
            self.segments = Segments.build(slots, device)
