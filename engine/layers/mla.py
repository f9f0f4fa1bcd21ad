"""DeepSeek's multi-head latent attention layer (MLA): the projections and RoPE; the attention over the latent
KV pool is the MLA backend's (engine/attention/mla.py).

Queries: `q_proj`, or the low-rank `q_a_proj` -> `q_a_layernorm` -> `q_b_proj` (q_lora_rank), per head
qk_nope_head_dim values without position then qk_rope_head_dim roped ones. Keys and values: `kv_a_proj_with_mqa`
gives the compressed latent (kv_lora_rank, normalized by `kv_a_layernorm`) and one roped key part shared by all
heads; `kv_b_proj` [N * (Dn + Dv), R] up-projects the latent into per-head keys and values (used by the backend
as a weight, never called on activations here).

RoPE: the checkpoints lay the rotary dims out in interleaved pairs (x0, x1), (x2, x3), ... (DeepSeek-V2 always,
V3 with `rope_interleave`). The loader permutes those weight rows once (evens first, then odds), after which the
engine's rotate-half rotary gives exactly transformers' interleaved rotation (its output is in the same
de-interleaved order); the cached k_pe is in that order.

Tensor parallelism: query heads split across ranks (q_proj / q_b_proj and kv_b_proj column-parallel by heads,
o_proj row-parallel); q_a_proj, kv_a_proj_with_mqa and the norms are replicated, and so is the latent cache.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from pdcluster.engine.config import ModelConfig
from pdcluster.engine.layers.layernorm import RMSNorm
from pdcluster.engine.layers.linear import Linear, RowParallelLinear
from pdcluster.engine.layers.rotary import apply_rotary
from pdcluster.engine.parallel import TPGroup
from pdcluster.engine.quant.scheme import QuantizedWeight

LORA_NORM_EPS = 1e-6   # q_a_layernorm / kv_a_layernorm: DeepSeek's RMSNorm default, not rms_norm_eps


def deinterleave_rows(weight: torch.Tensor, first: int, size: int, period: int) -> torch.Tensor:
    """`weight` with, in every block of `period` rows, the `size` rows from `first` reordered evens then odds:
    (x0, x1, x2, x3, ...) -> (x0, x2, ..., x1, x3, ...). Works on 1-D (a bias) and 2-D tensors."""
    blocks = weight.reshape(-1, period, *weight.shape[1:])
    rope = blocks[:, first:first + size]
    order = torch.cat((torch.arange(0, size, 2), torch.arange(1, size, 2)))
    out = blocks.clone()
    out[:, first:first + size] = rope[:, order]
    return out.reshape(weight.shape)


class MLAttention(nn.Module):
    def __init__(self, config: ModelConfig, backend, tp: TPGroup | None = None) -> None:
        super().__init__()
        mla = config.mla
        assert mla is not None, "an MLA model"
        if config.qkv_bias:
            raise ValueError(f"{config.architecture}: attention_bias is not supported")
        tp = tp or TPGroup()
        self.mla = mla
        self.num_heads = config.num_heads // tp.size
        hidden, heads = config.hidden_size, self.num_heads
        if mla.q_lora_rank:
            self.q_a_proj = Linear(hidden, mla.q_lora_rank)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, LORA_NORM_EPS)
            self.q_b_proj = Linear(mla.q_lora_rank, heads * mla.qk_head_dim)
        else:
            self.q_proj = Linear(hidden, heads * mla.qk_head_dim)
        self.kv_a_proj_with_mqa = Linear(hidden, mla.kv_lora_rank + mla.qk_rope_head_dim)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, LORA_NORM_EPS)
        self.kv_b_proj = Linear(mla.kv_lora_rank, heads * (mla.qk_nope_head_dim + mla.v_head_dim))
        self.kv_b_proj.packable = False   # the backend multiplies by per-head slices of the weight
        self.o_proj = RowParallelLinear(config.num_heads * mla.v_head_dim, hidden, tp)
        self.backend = backend
        # This layer's latent plane of the KV pool, bound by the model runner (v_cache stays None).
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None
        self.layer_index = 0

    def load_rows(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """A checkpoint tensor of this layer (`name` its leaf module) as the engine's rotary wants it: the rope
        rows of an interleaved checkpoint de-interleaved (a quantized weight's rows with their scales)."""
        mla = self.mla
        if not mla.rope_interleave:
            return tensor
        if isinstance(tensor, QuantizedWeight):
            zeros = None if tensor.zeros is None else self.load_rows(name, tensor.zeros)
            return dataclasses.replace(tensor, qweight=self.load_rows(name, tensor.qweight),
                                       scales=self.load_rows(name, tensor.scales), zeros=zeros)
        if name in ("q_proj", "q_b_proj"):
            return deinterleave_rows(tensor, mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.qk_head_dim)
        if name == "kv_a_proj_with_mqa":
            return deinterleave_rows(tensor, mla.kv_lora_rank, mla.qk_rope_head_dim, tensor.shape[0])
        return tensor

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor, meta) -> torch.Tensor:
        """x [T, hidden]; rope: (cos, sin) [T, 1, qk_rope_head_dim]; meta: the MLA backend's step metadata."""
        mla, heads = self.mla, self.num_heads
        if mla.q_lora_rank:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        else:
            q = self.q_proj(x)
        q_nope, q_pe = q.view(-1, heads, mla.qk_head_dim).split((mla.qk_nope_head_dim, mla.qk_rope_head_dim), -1)
        c_kv, k_pe = self.kv_a_proj_with_mqa(x).split((mla.kv_lora_rank, mla.qk_rope_head_dim), -1)
        c_kv = self.kv_a_layernorm(c_kv.contiguous())
        q_pe = apply_rotary(q_pe, *rope)
        k_pe = apply_rotary(k_pe[:, None], *rope)[:, 0]
        assert self.k_cache is not None and meta is not None, "an MLA layer runs eagerly over a bound latent pool"
        kv_b = self.kv_b_proj.weight.view(heads, mla.qk_nope_head_dim + mla.v_head_dim, mla.kv_lora_rank)
        o = self.backend.forward(q_nope, q_pe, c_kv, k_pe, self.k_cache, kv_b, meta)
        return self.o_proj(o.reshape(-1, heads * mla.v_head_dim))
