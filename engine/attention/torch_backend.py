"""Reference attention over the paged KV pool in plain torch ops; runs on any device.

New K/V go into their slots with one indexed write per layer; reads go through block tables
(a gather of just the blocks a sequence owns), never a copy or concat of the whole cache.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pdcluster.engine.attention.metadata import AttentionMetadata


class TorchAttentionBackend:
    name = "torch"
    cpu_decode_chunk_bytes = 4 << 20   # gathered K+V per decode attention call on CPU (see _decode)

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.gqa = num_heads != num_kv_heads
        # Reused gather buffers for decode: a fresh multi-MB tensor per layer would cost page faults.
        self._k_buf: torch.Tensor | None = None
        self._v_buf: torch.Tensor | None = None

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 meta: AttentionMetadata) -> None:
        k_cache[meta.slot_blocks, meta.slot_offsets] = k
        v_cache[meta.slot_blocks, meta.slot_offsets] = v

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, window: int = 0) -> torch.Tensor:
        """q: [T, Hq, D]; k, v: [T, Hkv, D]; caches: per-layer views [num_blocks, block_size, Hkv, D];
        window > 0: sliding-window attention, each token sees its last `window` positions (itself included).
        Returns [T, Hq, D]."""
        self.write_kv(k, v, k_cache, v_cache, meta)
        nd = meta.num_decode_tokens
        if nd == q.shape[0] and not meta.prefills:
            return self._decode(q, k_cache, v_cache, meta, window)
        out = torch.empty_like(q)
        if nd:
            out[:nd] = self._decode(q[:nd], k_cache, v_cache, meta, window)
        for chunk in meta.prefills:
            # [1, H, n, D]: with a batch dimension CPU SDPA takes its flash kernel (~2x faster than the math
            # path 3-D inputs get, and no [H, n, n] score matrix).
            qs = q[chunk.start:chunk.end].transpose(0, 1)[None]
            n = chunk.end - chunk.start
            if chunk.num_cached == 0:
                ks = k[chunk.start:chunk.end].transpose(0, 1)[None]
                vs = v[chunk.start:chunk.end].transpose(0, 1)[None]
            else:
                total = chunk.num_cached + n
                ks = k_cache[chunk.block_table].flatten(0, 1)[:total].transpose(0, 1)[None]
                vs = v_cache[chunk.block_table].flatten(0, 1)[:total].transpose(0, 1)[None]
            if chunk.num_cached == 0 and (not window or n <= window):
                o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=self.gqa)
            else:
                q_pos = torch.arange(chunk.num_cached, chunk.num_cached + n, device=q.device)[:, None]
                k_pos = torch.arange(ks.shape[2], device=q.device)[None, :]
                mask = k_pos <= q_pos
                if window:
                    mask &= k_pos > q_pos - window
                o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, enable_gqa=self.gqa)
            out[chunk.start:chunk.end] = o[0].transpose(0, 1)
        return out

    def _decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, window: int = 0) -> torch.Tensor:
        tables, bs = meta.decode_block_tables, k_cache.shape[1]
        bias = meta.decode_bias(bs, q.dtype, window)
        groups = meta.decode_groups(bs)
        # On CPU, gather and attend a few rows at a time: gathered K/V small enough to still be in cache when
        # SDPA reads it. One 128-row x 512-token call goes back to DRAM and runs ~2x slower.
        chunked = k_cache.device.type == "cpu"
        block_bytes = 2 * k_cache[0].numel() * k_cache.element_size()   # K and V of one block
        calls = []   # (start row, end row, blocks)
        for start, end, m in groups:
            rows = max(1, self.cpu_decode_chunk_bytes // (m * block_bytes)) if chunked else end - start
            calls += [(s, min(end, s + rows), m) for s in range(start, end, rows)]
        if len(calls) == 1:
            return self._decode_group(q, tables[:, :calls[0][2]], bias[..., :calls[0][2] * bs], k_cache, v_cache)
        out = torch.empty_like(q)
        for start, end, m in calls:
            out[start:end] = self._decode_group(q[start:end], tables[start:end, :m],
                                                bias[start:end, ..., :m * bs], k_cache, v_cache)
        return out

    def _decode_group(self, q: torch.Tensor, tables: torch.Tensor, bias: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor) -> torch.Tensor:
        b, m = tables.shape
        n, bs = b * m, k_cache.shape[1]
        if self._k_buf is None or self._k_buf.shape[0] < n or self._k_buf.dtype != k_cache.dtype \
                or self._k_buf.device != k_cache.device:
            shape = (max(n, 2 * (self._k_buf.shape[0] if self._k_buf is not None else 0)), k_cache[0].numel())
            self._k_buf = torch.empty(shape, dtype=k_cache.dtype, device=k_cache.device)
            self._v_buf = torch.empty_like(self._k_buf)
        idx = tables.reshape(-1)
        # Each block of one layer's K (or V) is one contiguous row in the block-major pool.
        k = torch.index_select(k_cache.flatten(1), 0, idx, out=self._k_buf[:n])
        v = torch.index_select(v_cache.flatten(1), 0, idx, out=self._v_buf[:n])
        hkv, d = self.num_kv_heads, self.head_dim
        ks = k.view(b, m * bs, hkv, d).transpose(1, 2)   # [B, Hkv, L, D]
        vs = v.view(b, m * bs, hkv, d).transpose(1, 2)
        # The query heads sharing one KV head act as that head's query rows: no GQA expansion, and on CPU
        # this SDPA call is several times faster than enable_gqa (bf16) or explicit matmuls on strided K/V.
        qg = q.reshape(b, hkv, self.num_heads // hkv, d)
        o = F.scaled_dot_product_attention(qg, ks, vs, attn_mask=bias)
        return o.reshape(b, self.num_heads, d)
