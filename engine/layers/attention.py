"""Self-attention layer: fused QKV projection, rotary, paged attention through the selected backend."""

from __future__ import annotations

import torch
from torch import nn

from pdcluster.engine.attention import AttentionMetadata
from pdcluster.engine.compiled import paged_attention
from pdcluster.engine.layers.layernorm import RMSNorm
from pdcluster.engine.layers.linear import MergedLinear, RowParallelLinear
from pdcluster.engine.layers.rotary import apply_rotary
from pdcluster.engine.parallel import TPGroup


class SelfAttention(nn.Module):
    """Under tensor parallelism (`tp`) a rank holds num_heads / tp query heads and num_kv_heads / tp KV heads
    (one replicated KV head when there are fewer KV heads than ranks): column-parallel QKV, row-parallel o_proj."""

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, qkv_bias: bool, backend,
                 window: int = 0, tp: TPGroup | None = None, qk_norm_eps: float | None = None) -> None:
        """`qk_norm_eps`: RMS-normalize each query and key head before the rotary (Qwen3's q_norm / k_norm)."""
        super().__init__()
        tp = tp or TPGroup()
        num_heads, num_kv_heads = num_heads // tp.size, max(1, num_kv_heads // tp.size)
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.window = window   # > 0: sliding-window attention over the last `window` positions
        self.q_size, self.kv_size = num_heads * head_dim, num_kv_heads * head_dim
        self.qkv_proj = MergedLinear(hidden_size, {"q": self.q_size, "k": self.kv_size, "v": self.kv_size},
                                     bias=qkv_bias)
        self.o_proj = RowParallelLinear(self.q_size * tp.size, hidden_size, tp)
        self.q_norm = RMSNorm(head_dim, qk_norm_eps) if qk_norm_eps is not None else None
        self.k_norm = RMSNorm(head_dim, qk_norm_eps) if qk_norm_eps is not None else None
        self.backend = backend
        # Per-layer strided views into the engine's KV pool, bound by the model runner.
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None
        self.layer_index = 0   # set by the model: this layer's place for `paged_attention`

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor,
                meta: AttentionMetadata | None) -> torch.Tensor:
        """`meta`: the attention backend's per-step metadata (`backend.prepare`), shared by the layers; None in
        the compiled body, where the opaque `paged_attention` op reads it from the step context."""
        qkv = self.qkv_proj(x)
        qk, v = qkv.split((self.q_size + self.kv_size, self.kv_size), dim=-1)
        qk = qk.view(-1, self.num_heads + self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = qk.split((self.num_heads, self.num_kv_heads), dim=1)
            qk = torch.cat((self.q_norm(q), self.k_norm(k)), dim=1)
        qk = apply_rotary(qk, *rope)  # q and k in one go
        q, k = qk.split((self.num_heads, self.num_kv_heads), dim=1)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if meta is None:
            o = paged_attention(q, k, v, self.layer_index)
        else:
            o = self.backend.forward(q, k, v, self.k_cache, self.v_cache, meta, self.window)
        return self.o_proj(o.reshape(-1, self.q_size))
