"""Expert load: tokens routed to each expert of each MoE layer, summed over the engine's steps, so an operator
sees imbalance (`EngineStats.expert_tokens`, the node's Prometheus metrics, `NPUMonitor`).

Each FusedMoE leaves its step's counts on the device (`expert_counts`); `accumulate` adds them into one device
tensor [MoE layers, E] after the forward (device ops only, queued behind the step), and `read` copies it to the
host once, when stats are taken after a step: no sync per layer, at most one per step.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from pdcluster.engine.layers.moe import FusedMoE

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


class ExpertLoadCounter:
    def __init__(self, model: nn.Module, enabled: bool = True) -> None:
        """`enabled` False (a tensor-parallel worker rank: rank 0's routing is the same): counts nothing."""
        found = [(name, m) for name, m in model.named_modules() if isinstance(m, FusedMoE)] if enabled else []
        self.moes = [m for _, m in found]
        self.layers = tuple(_layer_index(name, i) for i, (name, _) in enumerate(found))   # decoder layer indices
        self.totals: torch.Tensor | None = None   # [len(moes), E] int64 on the model's device
        self._host: tuple[tuple[int, ...], ...] = tuple((0,) * m.num_experts for m in self.moes)
        self._fresh = True   # _host matches totals

    def accumulate(self) -> None:
        """Add the last forward's per-layer counts (call once after each forward)."""
        if not self.moes:
            return
        step = torch.stack([m.expert_counts for m in self.moes])
        self.totals = step if self.totals is None else self.totals.add_(step)
        self._fresh = False

    def read(self) -> tuple[tuple[int, ...], ...]:
        """Tokens per (MoE layer, expert) since the engine started; () without MoE layers."""
        if not self._fresh and self.totals is not None:
            self._host = tuple(tuple(row) for row in self.totals.tolist())
            self._fresh = True
        return self._host


def _layer_index(name: str, position: int) -> int:
    match = _LAYER.search(name + ".")
    return int(match.group(1)) if match else position
