"""SwiGLU MLP with gate and up projections fused into one weight; on NPU one GEMM over it and torch_npu's
`npu_swiglu` (the first half of its input is the gate)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdcluster.engine.attention import native
from pdcluster.engine.device import is_npu
from pdcluster.engine.layers.linear import MergedLinear, RowParallelLinear, cpu_packed, linear, release
from pdcluster.engine.parallel import TPGroup


class GatedMLP(nn.Module):
    """Under tensor parallelism a rank holds intermediate_size / tp rows of gate and up (column-parallel) and the
    matching columns of down_proj (row-parallel, one all-reduce)."""

    def __init__(self, hidden_size: int, intermediate_size: int, tp: TPGroup | None = None) -> None:
        super().__init__()
        tp = tp or TPGroup()
        self.intermediate_size = intermediate_size // tp.size
        self.gate_up_proj = MergedLinear(hidden_size, {"gate": self.intermediate_size, "up": self.intermediate_size})
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, tp)
        self.gate_up_proj.packable = False   # forward uses its halves, packed separately below
        self.packed_halves: tuple[torch.Tensor, torch.Tensor] | None = None

    def prepack(self) -> None:
        n = self.intermediate_size
        w = self.gate_up_proj.weight
        if is_npu(w.device) or self.gate_up_proj.quantized:   # the whole merged weight (quantized: its own prepack)
            return
        gate, up = cpu_packed(w[:n]), cpu_packed(w[n:])
        self.packed_halves = None if gate is None or up is None else (gate, up)
        if self.packed_halves is not None:
            release(w)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # One matmul per half of the fused weight (contiguous row views, no copy): on CPU two GEMMs with
        # N = intermediate_size beat one with 2x N (measured in docs/benchmarks.md), and each output is then
        # contiguous.
        w, b, n = self.gate_up_proj.weight, self.gate_up_proj.bias, self.intermediate_size
        if self.gate_up_proj.quant is not None:
            gate, up = self.gate_up_proj(x).split(n, dim=-1)
            return self.down_proj(silu_and_mul(gate, up))
        if is_npu(x.device):
            import torch_npu

            gate_up = F.linear(x, w, b)
            if self.gate_up_proj.lora is not None:
                self.gate_up_proj.lora.add_(x, gate_up)
            return self.down_proj(torch_npu.npu_swiglu(gate_up, dim=-1))
        packed = self.packed_halves or (None, None)
        gate = linear(x, w[:n], None if b is None else b[:n], packed[0])
        up = linear(x, w[n:], None if b is None else b[n:], packed[1])
        if self.gate_up_proj.lora is not None:
            self.gate_up_proj.lora.add_(x, [gate, up])
        return self.down_proj(silu_and_mul(gate, up))


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up: on CPU in one pass (engine/layers/fused_ops.c), else torch's ops (gate overwritten)."""
    if gate.device.type == "cpu" and not torch.compiler.is_compiling():
        out = native.silu_and_mul(gate, up)
        if out is not None:
            return out
    return F.silu(gate, inplace=True).mul_(up)
