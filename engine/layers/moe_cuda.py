"""The MoE kernel on CUDA: FlashInfer's CUTLASS fused MoE (`flashinfer.fused_moe.cutlass_fused_moe`, flashinfer-python
v0.6.17; https://docs.flashinfer.ai/api/fused_moe.html), one call that groups the tokens by expert, runs both grouped
GEMMs with the SwiGLU between them and sums each token's weighted expert rows.

Its first weight is w31: the linear (up) half first, the gate half second (the library's test splits it as
`w3, w1 = chunk(w31, 2)`), where our w13 has the gate first; `prepack` makes the swapped copy once at load and
FusedMoE keeps only it (and w2) from then on, handing them back to every call. Expert
parallelism is the kernel's own: ep_size ranks of E_local experts each, this one ep_rank = expert_start / E_local;
tokens routed elsewhere add nothing. Tensor-parallel expert slices are already in the weights (tp_size 1 for the
kernel; FusedMoE all-reduces).

Routing (`select`) stays the torch top-k of moe_routing.py: the routing kernels FlashInfer has fused into its
TensorRT-LLM-gen MoE variants (trtllm_*_moe) take their own weight layouts and need SM100 (Blackwell). The kernel
runs float16 / bfloat16 only (flashinfer_backend.KERNEL_DTYPES, the emulator's float32 switch included) and needs
hidden and intermediate sizes divisible by 8; other cases (a float32 model, odd sizes, flashinfer missing) run the
CPU kernel's torch grouped path.

Not run on a GPU here: tested on CPU tensors under the emulator in tests/fake_flashinfer (tests/test_moe_devices.py).
"""

from __future__ import annotations

import torch

from pdcluster.engine.attention import flashinfer_backend
from pdcluster.engine.layers.moe_routing import RoutingConfig, select_experts

TMA_ALIGNMENT = 8   # 128-bit TMA alignment in 16-bit elements


def w31(w13: torch.Tensor) -> torch.Tensor:
    """w13 [E, 2I, H] (gate, up) as the kernel's fc1 [E, 2I, H] (up, gate); also the way back (a swap of halves)."""
    first, second = w13.detach().chunk(2, dim=1)
    return torch.cat((second, first), dim=1).contiguous()


Packed = tuple[torch.Tensor, torch.Tensor]   # the kernel's fc1 (w31) and fc2 (w2)


class CudaMoEKernel:
    def __init__(self) -> None:
        self._fallback = None
        try:
            from flashinfer.fused_moe import cutlass_fused_moe
        except Exception:   # missing, or built for another torch / CUDA
            cutlass_fused_moe = None
        self._fused = cutlass_fused_moe

    def select(self, router_logits: torch.Tensor, cfg: RoutingConfig,
               correction_bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        return select_experts(router_logits, cfg, correction_bias)

    def fused_supported(self, dtype: torch.dtype, w2: torch.Tensor) -> bool:
        """Whether cutlass_fused_moe runs activations of `dtype` with these experts (w2 [E, H, I] of that dtype)."""
        return (self._fused is not None and dtype in flashinfer_backend.KERNEL_DTYPES and w2.dtype == dtype
                and w2.shape[1] % TMA_ALIGNMENT == 0 and w2.shape[2] % TMA_ALIGNMENT == 0)

    def prepack(self, w13: torch.Tensor, w2: torch.Tensor) -> Packed | None:
        """The kernel's weights, made once at load (FusedMoE then drops its own: these are the only copies kept);
        None where the kernel does not run these weights."""
        if not self.fused_supported(w13.dtype, w2):
            return None
        return w31(w13), w2.detach().contiguous()

    def experts(self, hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                ids: torch.Tensor, expert_start: int, num_experts: int, packed: Packed | None = None) -> torch.Tensor:
        """hidden [T, H]; w13 [E_local, 2 * I, H] (gate rows first); w2 [E_local, H, I]; weights / ids [T, k] of
        global experts among `num_experts`; only experts [expert_start, expert_start + E_local) contribute.
        `packed`: prepack's weights, which replace w13 and w2 (released by then)."""
        fc1, fc2 = packed if packed is not None else (None, w2)
        if hidden.shape[0] == 0 or not self.fused_supported(hidden.dtype, fc2):
            if packed is not None:
                w13, w2 = w31(packed[0]), packed[1]
            return self._torch_kernel().experts(hidden, w13, w2, weights, ids, expert_start, num_experts)
        local = fc2.shape[0]
        out = torch.empty_like(hidden)
        self._fused(hidden.contiguous(), ids.to(torch.int32).contiguous(), weights.float().contiguous(),
                    w31(w13) if fc1 is None else fc1, fc2.contiguous(), hidden.dtype, quant_scales=None,
                    ep_size=num_experts // local, ep_rank=expert_start // local, output=out)
        return out

    def _torch_kernel(self):
        if self._fallback is None:
            from pdcluster.engine.layers.moe_cpu import CpuMoEKernel

            self._fallback = CpuMoEKernel()
        return self._fallback
