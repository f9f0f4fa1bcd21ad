"""Token embedding and the LM head (which may share the embedding weight), both split over the vocabulary
across tensor-parallel ranks (rank r holds rows `split_range(vocab, r, tp)`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdcluster.engine.layers.linear import Linear, cpu_packed, linear
from pdcluster.engine.parallel import TPGroup
from pdcluster.engine.tp_shards import split_range


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.tp = tp or TPGroup()
        self.start, size = split_range(vocab_size, self.tp.rank, self.tp.size)
        self.weight = nn.Parameter(torch.empty(size, hidden_size))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        # Each rank looks up the ids in its rows (zeros for the others); the all-reduce assembles them.
        local = ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(out.masked_fill_(outside[:, None], 0.0))


class LMHead(Linear):
    """Set `tied = True` when it shares the embedding's weight: the packed copy (CPU) then comes in addition to
    the dense weight the embedding looks rows up in (vocab x hidden more bytes, for a bf16 LM head GEMM ~1.6x
    faster than over the dense weight; docs/benchmarks.md).
    Under tensor parallelism each rank computes the logits of its vocab rows; rank 0, which samples, gathers
    them (the other ranks get None)."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TPGroup | None = None) -> None:
        self.tp = tp or TPGroup()
        self.sizes = [split_range(vocab_size, r, self.tp.size)[1] for r in range(self.tp.size)]
        super().__init__(hidden_size, self.sizes[self.tp.rank])
        self.tied = False

    def prepack(self) -> None:
        if not self.tied:
            return super().prepack()
        self.packed = cpu_packed(self.weight)   # the dense weight stays: the embedding reads it

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:  # type: ignore[override]  # None: TP rank > 0
        return self.tp.gather_last_dim(self._local_logits(hidden), self.sizes)

    def _local_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.quant is not None:   # a checkpoint with a quantized LM head
            return super().forward(hidden)
        if self.packed is not None:
            return linear(hidden, self.weight, None, self.packed)
        if self.weight.dtype != torch.float32 or self.weight.device.type != "cpu" or hidden.shape[0] == 1:
            return F.linear(hidden, self.weight)
        # (without a packed weight) fp32 CPU GEMM with a vocab-wide N is slower than over row slices of 2k
        # (measured in docs/benchmarks.md);
        # the slices are contiguous views and the concat is small next to the GEMM.
        return torch.cat([F.linear(hidden, w) for w in self.weight.split(2048)], dim=-1)
