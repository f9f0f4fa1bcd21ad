"""The MoE kernel on CPU (and the torch fallback of the device kernels): tokens grouped by expert.

The (token, slot) pairs are sorted by expert id once; each expert that received tokens then runs one gate/up GEMM
pair and one down GEMM over its contiguous slice of the gathered rows, and a single index_add sums the weighted
rows back into their tokens (in expert order per token, the order transformers' loop adds them). Experts with no
token cost nothing. Pairs routed to another rank's experts (expert parallelism) sort past the local ones and are
dropped. With oneDNN, `prepack` keeps each expert's gate+up and down matrices in its blocked layout
(engine/layers/linear.py cpu_packed), which F.linear would otherwise re-pack on every call. Gate and up stay one
GEMM (GatedMLP splits them): at the few rows an expert gets, one call over both was as fast or faster when timed.
Quantized experts come packed for the quantized kernels (engine/quant/kernels.py `PackedWeight`s) instead."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pdcluster.engine.layers.linear import cpu_packed, linear
from pdcluster.engine.layers.moe_routing import RoutingConfig, select_experts
from pdcluster.engine.quant.kernels import PackedWeight, quant_linear

# per local expert: gate and up (one matrix), down; oneDNN-packed dense ones or quantized ones
PackedExperts = list[tuple[torch.Tensor, torch.Tensor]] | list[tuple[PackedWeight, PackedWeight]]


class CpuMoEKernel:
    def select(self, router_logits: torch.Tensor, cfg: RoutingConfig,
               correction_bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        return select_experts(router_logits, cfg, correction_bias)

    def prepack(self, w13: torch.Tensor, w2: torch.Tensor) -> PackedExperts | None:
        """oneDNN-packed copies of every expert's matrices, which then serve every call in place of w13 / w2 (the
        caller may release those); None where oneDNN does not serve this dtype / device."""
        packed: list[tuple[torch.Tensor, torch.Tensor]] = []
        for e in range(w13.shape[0]):
            gate_up, down = cpu_packed(w13[e]), cpu_packed(w2[e])
            if gate_up is None or down is None:
                return None
            packed.append((gate_up, down))
        return packed

    def experts(self, hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                ids: torch.Tensor, expert_start: int, num_experts: int,
                packed: PackedExperts | None = None) -> torch.Tensor:
        """hidden [T, H]; w13 [E_local, 2 * I, H] (gate rows first); w2 [E_local, H, I]; weights / ids [T, k] of
        global experts among `num_experts`; only experts [expert_start, expert_start + E_local) contribute."""
        tokens, top_k = ids.shape
        local, n = (len(packed), 0) if packed is not None else (w13.shape[0], w13.shape[1] // 2)
        local_ids = ids.reshape(-1).long() - expert_start
        outside = (local_ids < 0) | (local_ids >= local)
        local_ids = local_ids.masked_fill(outside, local)   # another rank's experts: sorted last, then dropped
        order = torch.argsort(local_ids, stable=True)
        counts = torch.bincount(local_ids, minlength=local + 1)[:local].tolist()
        mine = sum(counts)
        order = order[:mine]
        token_of_row = order // top_k
        rows = hidden[token_of_row]
        row_weights = weights.reshape(-1)[order].unsqueeze(1)
        out_rows = torch.empty(mine, hidden.shape[1], dtype=torch.float32, device=hidden.device)
        start = 0
        for e, count in enumerate(counts):
            if count == 0:
                continue
            x = rows[start:start + count]
            if packed is not None:   # the dense weights may be released: only the packed ones are read
                gate_up_p, down_p = packed[e]
                gate_up = _matmul(x, w13, gate_up_p)
                half = gate_up.shape[1] // 2
                down = _matmul(F.silu(gate_up[:, :half]).mul_(gate_up[:, half:]), w2, down_p)
            else:
                gate, up = F.linear(x, w13[e, :n]), F.linear(x, w13[e, n:])
                down = F.linear(F.silu(gate, inplace=True).mul_(up), w2[e])
            torch.mul(down, row_weights[start:start + count], out=out_rows[start:start + count])
            start += count
        out = torch.zeros(tokens, hidden.shape[1], dtype=torch.float32, device=hidden.device)
        out.index_add_(0, token_of_row, out_rows)
        return out.to(hidden.dtype)


def _matmul(x: torch.Tensor, dense: torch.Tensor, packed: torch.Tensor | PackedWeight) -> torch.Tensor:
    return quant_linear(x, packed) if isinstance(packed, PackedWeight) else linear(x, dense, None, packed)
