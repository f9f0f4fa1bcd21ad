"""Multi-head latent attention (DeepSeek-V2/V3 MLA) over the latent KV pool, in torch ops; runs on any device.

The pool (engine/kv_cache.py) holds per layer one plane `[num_blocks, block_size, 1, row]`: for each token the
normalized compressed KV `c_kv` (kv_lora_rank = R values) then the roped shared key `k_pe` (qk_rope_head_dim = P
values), row = R + P (an int8 pool: the row quantized as one, then its fp16 scale). Heads are never stored: they
come from `kv_b_proj`, whose weight seen per head `[N, Dn + Dv, R]` is W_UK (its first Dn rows: keys without
position, qk_nope_head_dim) and W_UV (the next Dv rows: values, v_head_dim).

The three entry points, each a plain function with the shapes it takes (N: this rank's query heads):
- `write_latent`: one latent row per new token into its slot.
- `prefill` (expanded form): the chunk's context latents (cached and new) up-projected into per-head K_nope and
  V, attention with the causal mask: the up-projection of a context token is shared by all the chunk's query
  rows, and SDPA runs on ordinary heads (cheaper than absorbing when many rows attend).
- `decode` (weights absorbed): the query is folded into latent space, q_nope · W_UK per head, so each score is
  `q_lat · c_kv + q_pe · k_pe` against the cached rows as they are (one shared 'KV head' of R + P, values its
  first R), and the output stays in latent space until W_UV: a decode step reads R + P values per context token,
  never N · (Dn + Dv).

`MLAAttentionBackend` runs a step with them; device variants subclass it and replace `decode` (and `write_latent`
where their cache write differs) behind the same shapes: `CpuMLABackend` (the native paged decode kernel, the
latent rows as one shared KV head), NPU and FlashInfer (mla_npu.py, mla_flashinfer.py).

Under tensor parallelism on CPU the ranks share the pool's one latent plane: each writes the same rows (the
latent comes from replicated weights and the all-reduced hidden state, identical on every rank).
"""

from __future__ import annotations

import importlib

import torch
import torch.nn.functional as F

from pdcluster.engine.attention import native
from pdcluster.engine.attention.metadata import AttentionMetadata, PrefillChunk
from pdcluster.engine.attention.torch_backend import TorchAttentionBackend, TorchAttentionMetadata
from pdcluster.engine.config import ModelConfig
from pdcluster.engine.kv_cache import dequantize_rows, quantize_rows


def write_latent(latent_cache: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor,
                 slots: torch.Tensor) -> torch.Tensor:
    """latent_cache [num_blocks, block_size, 1, row]; c_kv [T, R] (normalized); k_pe [T, P] (roped); slots [T]
    int64 flat slots. Writes the rows `cat(c_kv, k_pe)` (quantized for an int8 pool) and returns them as read
    back: [T, R + P] of c_kv's dtype (an int8 pool's rows dequantized)."""
    rows = torch.cat((c_kv, k_pe), dim=-1)
    stored = quantize_rows(rows) if latent_cache.dtype == torch.int8 else rows.to(latent_cache.dtype)
    latent_cache.view(-1, stored.shape[-1]).index_copy_(0, slots, stored)
    return readable(stored, c_kv.dtype)


def readable(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Latent rows as attention reads them: int8 rows dequantized to `dtype`, float rows as they are."""
    return dequantize_rows(rows, dtype) if rows.dtype == torch.int8 else rows


def gather_latent(latent_cache: torch.Tensor, block_table: torch.Tensor, length: int,
                  dtype: torch.dtype) -> torch.Tensor:
    """The latent rows of positions 0..length-1 of one sequence: [length, R + P] of `dtype`."""
    bs = latent_cache.shape[1]
    blocks = latent_cache.index_select(0, block_table[:-(-length // bs)].long())
    return readable(blocks.reshape(-1, blocks.shape[-1])[:length], dtype)


def absorb_query(q_nope: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
    """q_nope [B, N, Dn], w_uk [N, Dn, R] -> q_nope · W_UK per head, [B, N, R]: the query in latent space."""
    return torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)


def unabsorb_output(o_latent: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
    """o_latent [B, N, R], w_uv [N, Dv, R] -> per-head values [B, N, Dv]."""
    return torch.bmm(o_latent.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)


def prefill(q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor, kv_b_weight: torch.Tensor,
            num_cached: int, scale: float) -> torch.Tensor:
    """Expanded MLA of one chunk. q_nope [n, N, Dn], q_pe [n, N, P] (roped) at positions num_cached..; latent
    [num_cached + n, R + P] the sequence's rows from position 0 (readable); kv_b_weight [N, Dn + Dv, R].
    Returns [n, N, Dv]."""
    n, heads, dn = q_nope.shape
    r = kv_b_weight.shape[-1]
    kv = F.linear(latent[:, :r], kv_b_weight.reshape(-1, r)).view(latent.shape[0], heads, -1)
    k_pe = latent[:, None, r:]
    k = torch.cat((kv[..., :dn], k_pe.expand(-1, heads, -1)), dim=-1)
    v, dv = kv[..., dn:], kv.shape[-1] - dn
    if dv < k.shape[-1]:
        # V padded to the query / key head size: SDPA's flash kernels take one head size for all three (else the
        # math path, with its [heads, n, keys] score matrix); the padding columns of the output are dropped
        v = F.pad(v, (0, k.shape[-1] - dv))
    q = torch.cat((q_nope, q_pe), dim=-1)
    qs, ks, vs = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
    if num_cached == 0:
        o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale)
    else:
        rows = torch.arange(num_cached, num_cached + n, device=q.device)[:, None]
        mask = torch.arange(latent.shape[0], device=q.device)[None, :] <= rows
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale)
    return o[0, ..., :dv].transpose(0, 1)


def decode(q: torch.Tensor, latent_cache: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor,
           scale: float, latent_rank: int, meta: TorchAttentionMetadata | None = None) -> torch.Tensor:
    """Absorbed MLA decode, one query token per sequence. q [B, N, R + P]: the absorbed query (q_nope · W_UK)
    then q_pe; latent_cache [num_blocks, block_size, 1, R + P]; block_tables [B, max_blocks] int32; context_lens
    [B] int32 (the new token included); latent_rank R. Every row of the cache is a key, its first R values the
    value. Returns the output in latent space, [B, N, R]. `meta` (rows sorted by context length): its cached
    padding mask and row groups; without it one group over the whole table."""
    bs = latent_cache.shape[1]
    if meta is None:
        meta = TorchAttentionMetadata(torch.empty(0), q.shape[0], block_tables, context_lens)
    bias = meta.decode_bias(bs, q.dtype)
    out = None
    groups = meta.decode_groups(bs)
    for start, end, m in groups:
        tables = block_tables[start:end, :m]
        b = tables.shape[0]
        rows = latent_cache.flatten(1).index_select(0, tables.reshape(-1))      # [b * m, bs * row]
        keys = readable(rows.view(b, 1, m * bs, -1), q.dtype)                   # [b, 1, L, R + P]
        # the whole rows as values, the k_pe columns of the output dropped: one head size lets SDPA take its
        # flash kernel (bf16 on CPU: 2-5x the math path that values of another width get)
        o = F.scaled_dot_product_attention(q[start:end, None], keys, keys, attn_mask=bias[start:end, ..., :m * bs],
                                           scale=scale)[:, 0, :, :latent_rank]
        if len(groups) == 1:
            return o
        if out is None:
            out = q.new_empty(q.shape[0], q.shape[1], latent_rank)
        out[start:end] = o
    assert out is not None
    return out


class MLAAttentionBackend:
    """A step of MLA for every layer: the latent rows written, decode rows absorbed, prefill chunks expanded.
    Per-step metadata as the torch backend's (its padding masks and decode row groups)."""
    name = "torch"

    def __init__(self, num_heads: int, kv_lora_rank: int, qk_rope_head_dim: int, qk_nope_head_dim: int,
                 v_head_dim: int, scale: float) -> None:
        """`num_heads`: this rank's; `scale`: the softmax scale (qk_head_dim ** -0.5 times DeepSeek's YaRN
        mscale correction)."""
        self.num_heads, self.kv_lora_rank, self.qk_rope_head_dim = num_heads, kv_lora_rank, qk_rope_head_dim
        self.qk_nope_head_dim, self.v_head_dim, self.scale = qk_nope_head_dim, v_head_dim, scale

    @staticmethod
    def prepare(meta: AttentionMetadata) -> TorchAttentionMetadata:
        return TorchAttentionBackend.prepare(meta)

    def forward(self, q_nope: torch.Tensor, q_pe: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor,
                latent_cache: torch.Tensor, kv_b_weight: torch.Tensor, meta: TorchAttentionMetadata) -> torch.Tensor:
        """q_nope [T, N, Dn], q_pe [T, N, P] (roped), c_kv [T, R] (normalized), k_pe [T, P] (roped),
        latent_cache [num_blocks, block_size, 1, R + P], kv_b_weight [N, Dn + Dv, R] -> [T, N, Dv]."""
        rows = self.write_latent(latent_cache, c_kv, k_pe, meta)
        nd, dn = meta.num_decode_tokens, self.qk_nope_head_dim
        out = q_nope.new_empty(q_nope.shape[0], self.num_heads, self.v_head_dim)
        if nd:
            w_uk, w_uv = kv_b_weight[:, :dn], kv_b_weight[:, dn:]
            q = torch.cat((absorb_query(q_nope[:nd], w_uk), q_pe[:nd]), dim=-1)
            out[:nd] = unabsorb_output(self.decode(q, latent_cache, meta), w_uv)
        for chunk in meta.prefills:
            s, e = chunk.start, chunk.end
            latent = rows[s:e] if chunk.num_cached == 0 else self.chunk_latent(latent_cache, chunk, q_nope.dtype)
            out[s:e] = prefill(q_nope[s:e], q_pe[s:e], latent, kv_b_weight, chunk.num_cached, self.scale)
        return out

    def write_latent(self, latent_cache: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor,
                     meta: TorchAttentionMetadata) -> torch.Tensor:
        return write_latent(latent_cache, c_kv, k_pe, meta.slot_index)

    def chunk_latent(self, latent_cache: torch.Tensor, chunk: PrefillChunk, dtype: torch.dtype) -> torch.Tensor:
        """The rows a chunk after cached tokens attends to (the cached ones and its own, already written)."""
        return gather_latent(latent_cache, chunk.block_table, chunk.num_cached + chunk.end - chunk.start, dtype)

    def decode(self, q: torch.Tensor, latent_cache: torch.Tensor, meta: TorchAttentionMetadata) -> torch.Tensor:
        """q [B, N, R + P] (absorbed, then q_pe) -> [B, N, R]; the device variants replace this."""
        tables, lens = meta.decode_block_tables, meta.decode_context_lens
        assert tables is not None and lens is not None, "a step with decode rows"
        return decode(q, latent_cache, tables, lens, self.scale, self.kv_lora_rank, meta)


class CpuMLABackend(MLAAttentionBackend):
    """CPU: the absorbed decode through the native paged decode kernel (paged_decode.c): the latent rows are both
    its keys and its values (one KV head of R + P values, int8 rows included; the k_pe columns of the output are
    dropped), read straight from the pool blocks. Without a C compiler: the torch decode."""
    name = "cpu"

    def __init__(self, num_heads: int, kv_lora_rank: int, qk_rope_head_dim: int, qk_nope_head_dim: int,
                 v_head_dim: int, scale: float) -> None:
        super().__init__(num_heads, kv_lora_rank, qk_rope_head_dim, qk_nope_head_dim, v_head_dim, scale)
        native.load()   # build now (once per machine), not in the first decode step

    def decode(self, q: torch.Tensor, latent_cache: torch.Tensor, meta: TorchAttentionMetadata) -> torch.Tensor:
        kernel = native.decode_kernel(q.dtype, latent_cache.dtype) if q.device.type == "cpu" else None
        tables, lens = meta.decode_block_tables, meta.decode_context_lens
        if kernel is None or tables is None or lens is None:
            return super().decode(q, latent_cache, meta)
        out = native.paged_decode(kernel, q.contiguous(), latent_cache, latent_cache, tables, lens, self.scale)
        return out[..., :self.kv_lora_rank]


# The regular attention backend's name -> the MLA backend serving the same device ("module:Class"; the device
# modules are imported only when selected).
_MLA_BACKENDS = {
    "torch": "pdcluster.engine.attention.mla:MLAAttentionBackend",
    "cpu": "pdcluster.engine.attention.mla:CpuMLABackend",
    "npu": "pdcluster.engine.attention.mla_npu:NpuMLABackend",
    "flashinfer": "pdcluster.engine.attention.mla_flashinfer:FlashInferMLABackend",
}


def mla_backend(config: ModelConfig, tp_size: int, regular_backend: str) -> MLAAttentionBackend:
    """The MLA backend of an MLA model (`config.mla`) for this rank's heads, on the device of `regular_backend`."""
    from pdcluster.engine.layers.rotary import mla_softmax_scale

    mla = config.mla
    assert mla is not None, "an MLA model"
    cls = get_mla_backend_class(regular_backend)
    return cls(config.num_heads // tp_size, mla.kv_lora_rank, mla.qk_rope_head_dim, mla.qk_nope_head_dim,
               mla.v_head_dim, mla_softmax_scale(mla.qk_head_dim, config.rope_scaling))


def get_mla_backend_class(regular_backend: str):
    """The MLA backend for the device whose regular attention backend is `regular_backend` (its `name`);
    the torch one where that device has none (yet)."""
    module, cls = _MLA_BACKENDS.get(regular_backend, _MLA_BACKENDS["torch"]).split(":")
    try:
        return getattr(importlib.import_module(module), cls)
    except ModuleNotFoundError as exc:
        if exc.name != module:
            raise
        return MLAAttentionBackend
