"""Reference attention over the paged KV pool in plain torch ops; runs on any device.

New K/V go into their slots with one `index_copy_` per layer and cache on the flat slot index (no per-index host
sync); reads go through block tables (a gather of just the blocks a sequence owns), never a copy or concat of
the whole cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import pairwise

import torch
import torch.nn.functional as F

from pdcluster.engine.attention.metadata import AttentionMetadata, PrefillChunk
from pdcluster.engine.kv_cache import dequantize_rows, quantize_rows


@dataclass
class TorchAttentionMetadata(AttentionMetadata):
    """The step's metadata plus what the torch decode path derives from it: built on first use (the CPU
    backend's native kernel needs neither), once per step, and shared by the layers."""
    _bias: dict = field(default_factory=dict, repr=False)
    _groups: list[tuple[int, int, int]] | None = field(default=None, repr=False)
    _slots: torch.Tensor | None = field(default=None, repr=False)

    @property
    def slot_index(self) -> torch.Tensor:
        """The slot mapping as the int64 index `index_copy_` takes, converted once per step."""
        if self._slots is None:
            self._slots = self.slot_mapping.long()
        return self._slots

    def decode_bias(self, block_size: int, dtype: torch.dtype, window: int = 0) -> torch.Tensor:
        """[B, 1, 1, max_blocks * block_size] additive mask, 0 or -inf: hides each row's padding and, with
        window > 0, the positions more than `window` back."""
        key = (dtype, window)
        if key not in self._bias:
            tables, lens = self.decode_block_tables, self.decode_context_lens
            assert tables is not None and lens is not None, "a step with decode rows"
            device = tables.device
            lens = lens.to(device, torch.long)[:, None]
            cols = torch.arange(tables.shape[1] * block_size, device=device)[None, :]
            hidden = cols >= lens
            if window:
                hidden |= cols < lens - window
            bias = torch.zeros(hidden.shape, dtype=dtype, device=device).masked_fill_(hidden, float("-inf"))
            self._bias[key] = bias[:, None, None, :]
        return self._bias[key]

    def decode_groups(self, block_size: int) -> list[tuple[int, int, int]]:
        """(start row, end row, blocks) groups of decode rows, so a group attends over only `blocks` blocks
        instead of the batch maximum (`decode_groups` below); one group over every column if the rows are
        not sorted by context length."""
        if self._groups is None:
            tables, lens = self.decode_block_tables, self.decode_context_lens
            assert tables is not None and lens is not None, "a step with decode rows"
            blocks = ((lens.long() + block_size - 1) // block_size).tolist()
            ordered = all(a <= b for a, b in pairwise(blocks))
            whole = [(0, len(blocks), tables.shape[1])]
            self._groups = decode_groups(blocks) if ordered else whole
        return self._groups


def decode_groups(blocks: list[int], overhead: int = 8) -> list[tuple[int, int, int]]:
    """Split decode rows (sorted by ascending block count) into (start, end, blocks) groups minimising the
    padded attention work: a group costs rows * its largest block count, plus `overhead` (in row-blocks)
    for its extra gather and attention calls. Exact O(n^2) dynamic program; n is at most max_num_seqs."""
    n = len(blocks)
    best = [0] + [0] * n
    cut = [0] * (n + 1)
    for i in range(1, n + 1):
        widest = blocks[i - 1]
        best[i], cut[i] = min((best[j] + (i - j) * widest + overhead, j) for j in range(i))
    groups = []
    i = n
    while i > 0:
        groups.append((cut[i], i, blocks[i - 1]))
        i = cut[i]
    return groups[::-1]


class TorchAttentionBackend:
    name = "torch"
    cpu_decode_chunk_bytes = 4 << 20   # gathered K+V per decode attention call on CPU (see _decode)
    prefill_tile_tokens = 2048         # query rows and keys per attention call of a long prefill chunk

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.gqa = num_heads != num_kv_heads
        # Reused gather buffers for decode: a fresh multi-MB tensor per layer would cost page faults.
        self._k_buf: torch.Tensor | None = None
        self._v_buf: torch.Tensor | None = None

    @staticmethod
    def prepare(meta: AttentionMetadata) -> TorchAttentionMetadata:
        """This backend's metadata for one step; the runner calls it once per step, the layers get the result."""
        return TorchAttentionMetadata(meta.slot_mapping, meta.num_decode_tokens, meta.decode_block_tables,
                                      meta.decode_context_lens, meta.prefills)

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 meta: TorchAttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """Writes the new K/V rows into their slots (quantized first for an int8 pool); returns them as stored."""
        if k_cache.dtype == torch.int8:
            k, v = quantize_rows(k), quantize_rows(v)
        slots = meta.slot_index
        k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, k.to(k_cache.dtype))
        v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, v.to(v_cache.dtype))
        return k, v

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: TorchAttentionMetadata, window: int = 0) -> torch.Tensor:
        """q: [T, Hq, D]; k, v: [T, Hkv, D]; caches: per-layer views [num_blocks, block_size, Hkv, D];
        window > 0: sliding-window attention, each token sees its last `window` positions (itself included).
        An int8 pool's rows are dequantized wherever they are read, the chunk's own new K/V included, so a
        prefix-cache hit attends to exactly the values a recomputation would. Returns [T, Hq, D]."""
        k, v = self.write_kv(k, v, k_cache, v_cache, meta)
        nd = meta.num_decode_tokens
        if nd == q.shape[0] and not meta.prefills:
            return self._decode(q, k_cache, v_cache, meta, window)
        out = torch.empty_like(q)
        if nd:
            out[:nd] = self._decode(q[:nd], k_cache, v_cache, meta, window)
        for chunk in meta.prefills:
            out[chunk.start:chunk.end] = self._prefill(q[chunk.start:chunk.end], k[chunk.start:chunk.end],
                                                       v[chunk.start:chunk.end], k_cache, v_cache, chunk, window)
        return out

    def _prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, chunk: PrefillChunk, window: int) -> torch.Tensor:
        """One prefill chunk: q, k, v [n, H, D] (k, v as stored). Keys it attends to are read from the cache
        only from the first position its window can see. Up to `prefill_tile_tokens` keys: one SDPA call;
        beyond, `_prefill_tiled` (bounded memory, whatever the context length)."""
        n, c, bs = q.shape[0], chunk.num_cached, k_cache.shape[1]
        first = max(0, c - window + 1) if window else 0    # the first key position any row of the chunk sees
        if c + n - first > self.prefill_tile_tokens:
            return self._prefill_tiled(q, k_cache, v_cache, chunk.block_table, c, window)
        # [1, H, n, D]: with a batch dimension CPU SDPA takes its flash kernel (faster than the math path
        # 3-D inputs get, measured in docs/benchmarks.md, and no [H, n, n] score matrix).
        qs = q.transpose(0, 1)[None]
        if c == 0:
            ks = _readable(k, q.dtype).transpose(0, 1)[None]
            vs = _readable(v, q.dtype).transpose(0, 1)[None]
            base = 0
        else:
            base = first // bs * bs
            blocks = chunk.block_table[first // bs:]
            ks = _readable(k_cache[blocks].flatten(0, 1)[:c + n - base], q.dtype).transpose(0, 1)[None]
            vs = _readable(v_cache[blocks].flatten(0, 1)[:c + n - base], q.dtype).transpose(0, 1)[None]
        if c == 0 and (not window or n <= window):
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=self.gqa)
        else:
            mask = _visible(c, n, base, ks.shape[2], window, q.device)
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, enable_gqa=self.gqa)
        return o[0].transpose(0, 1)

    def _prefill_tiled(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor,
                       c: int, window: int) -> torch.Tensor:
        """Attention of a long chunk (rows at positions c.., keys in the cache through its block `table`) in
        tiles of at most `prefill_tile_tokens` query rows x keys, merged with an online softmax on each tile's
        log-sum-exp: memory is bounded by the tile, never by the context or the chunk. Per query tile: first
        its diagonal (its own keys, causal), then the context before it, tile by tile back to the first
        position its window sees (so window-released blocks are never read)."""
        n, hq, d = q.shape
        hkv = self.num_kv_heads
        g, tile = hq // hkv, self.prefill_tile_tokens
        out = torch.empty_like(q)
        for qs in range(0, n, tile):
            m = min(n, qs + tile) - qs
            q_lo, q_hi = c + qs, c + qs + m                 # positions of this query tile
            qt = q[qs:qs + m]
            qh = qt.transpose(0, 1)[None]                   # [1, Hq, m, D]
            kt, vt = _gather(k_cache, table, q_lo, q_hi, q.dtype), _gather(v_cache, table, q_lo, q_hi, q.dtype)
            kt, vt = (kt.repeat_interleave(g, dim=1), vt.repeat_interleave(g, dim=1)) if g > 1 else (kt, vt)
            if not window or m <= window:
                acc, lse = _attend_lse(qh, kt.transpose(0, 1)[None], vt.transpose(0, 1)[None], None, causal=True)
            else:
                bias = _bias(_visible(q_lo, m, q_lo, m, window, q.device), q.dtype)
                acc, lse = _attend_lse(qh, kt.transpose(0, 1)[None], vt.transpose(0, 1)[None], bias)
            acc, lse = acc[0].float(), lse[0]
            first = max(0, q_lo - window + 1) if window else 0
            q_grouped = None
            for k_hi in range(q_lo, first, -tile):
                k_lo = max(first, k_hi - tile)
                kt, vt = _gather(k_cache, table, k_lo, k_hi, q.dtype), _gather(v_cache, table, k_lo, k_hi, q.dtype)
                if not window or k_lo > q_hi - 1 - window:
                    # Every row sees every key: the query heads sharing a KV head become its rows, no mask.
                    if q_grouped is None:
                        q_grouped = qt.reshape(m, hkv, g, d).permute(1, 2, 0, 3).reshape(1, hkv, g * m, d)
                    o, tile_lse = _attend_lse(q_grouped, kt.transpose(0, 1)[None], vt.transpose(0, 1)[None], None)
                    o, tile_lse = o.reshape(hq, m, d), tile_lse.reshape(hq, m)
                else:
                    visible = _visible(q_lo, m, k_lo, k_hi - k_lo, window, q.device)
                    if g > 1:
                        kt, vt = kt.repeat_interleave(g, dim=1), vt.repeat_interleave(g, dim=1)
                    o, tile_lse = _attend_lse(qh, kt.transpose(0, 1)[None], vt.transpose(0, 1)[None],
                                              _bias(visible, q.dtype))
                    o, tile_lse = o[0], tile_lse[0].masked_fill(~visible.any(-1), float("-inf"))
                total = torch.logaddexp(lse, tile_lse)       # finite: every row saw its own key on the diagonal
                acc = acc * torch.exp(lse - total)[..., None] + o.float() * torch.exp(tile_lse - total)[..., None]
                lse = total
            out[qs:qs + m] = acc.transpose(0, 1).to(q.dtype)
        return out

    def _decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: TorchAttentionMetadata, window: int = 0) -> torch.Tensor:
        tables, context_lens, bs = meta.decode_block_tables, meta.decode_context_lens, k_cache.shape[1]
        assert tables is not None and context_lens is not None, "a step with decode rows"
        bias = meta.decode_bias(bs, q.dtype, window)
        groups = meta.decode_groups(bs)
        # On CPU, gather and attend a few rows at a time: gathered K/V small enough to still be in cache when
        # SDPA reads it; one call over a big batch goes back to DRAM (measured in docs/benchmarks.md).
        chunked = k_cache.device.type == "cpu"
        block_bytes = 2 * k_cache[0].numel() * k_cache.element_size()   # K and V of one block
        calls = []   # (start row, end row, blocks)
        for start, end, m in groups:
            rows = max(1, self.cpu_decode_chunk_bytes // (m * block_bytes)) if chunked else end - start
            calls += [(s, min(end, s + rows), m) for s in range(start, end, rows)]
        # With a window, a call starts at the first block its rows can see: O(window) reads however long the
        # context, and blocks released out of the window (FREED_BLOCK entries) are mostly not even gathered.
        lens = context_lens.tolist() if window else []
        out = None if len(calls) == 1 else torch.empty_like(q)
        for start, end, m in calls:
            lo = max(0, min(lens[start:end]) - window) // bs if window else 0
            o = self._decode_group(q[start:end], tables[start:end, lo:m], bias[start:end, ..., lo * bs:m * bs],
                                   k_cache, v_cache)
            if out is None:
                return o
            out[start:end] = o
        assert out is not None   # None only with one call, which returned above
        return out

    def _decode_group(self, q: torch.Tensor, tables: torch.Tensor, bias: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor) -> torch.Tensor:
        b, m = tables.shape
        n, bs = b * m, k_cache.shape[1]
        k_buf, v_buf = self._k_buf, self._v_buf
        if k_buf is None or v_buf is None or k_buf.shape[0] < n or k_buf.dtype != k_cache.dtype \
                or k_buf.device != k_cache.device:
            shape = (max(n, 2 * (k_buf.shape[0] if k_buf is not None else 0)), k_cache[0].numel())
            k_buf = self._k_buf = torch.empty(shape, dtype=k_cache.dtype, device=k_cache.device)
            v_buf = self._v_buf = torch.empty_like(k_buf)
        idx = tables.reshape(-1)
        # Each block of one layer's K (or V) is one contiguous row of that layer's cache.
        k = torch.index_select(k_cache.flatten(1), 0, idx, out=k_buf[:n])
        v = torch.index_select(v_cache.flatten(1), 0, idx, out=v_buf[:n])
        hkv, d = self.num_kv_heads, self.head_dim
        ks = _readable(k.view(b, m * bs, hkv, -1), q.dtype).transpose(1, 2)   # [B, Hkv, L, D]
        vs = _readable(v.view(b, m * bs, hkv, -1), q.dtype).transpose(1, 2)
        # The query heads sharing one KV head act as that head's query rows: no GQA expansion, and on CPU
        # this SDPA call is several times faster than enable_gqa (bf16) or explicit matmuls on strided K/V.
        qg = q.reshape(b, hkv, self.num_heads // hkv, d)
        o = F.scaled_dot_product_attention(qg, ks, vs, attn_mask=bias)
        return o.reshape(b, self.num_heads, d)


def _visible(q_first: int, rows: int, k_first: int, keys: int, window: int, device: torch.device) -> torch.Tensor:
    """[rows, keys] bool: which keys (positions k_first..) each query (positions q_first..) attends to."""
    q_pos = torch.arange(q_first, q_first + rows, device=device)[:, None]
    k_pos = torch.arange(k_first, k_first + keys, device=device)[None, :]
    mask = k_pos <= q_pos
    if window:
        mask &= k_pos > q_pos - window
    return mask


def _gather(cache: torch.Tensor, table: torch.Tensor, lo: int, hi: int, dtype: torch.dtype) -> torch.Tensor:
    """K or V rows of positions lo..hi-1 ([hi - lo, Hkv, D], readable) from the blocks of `table` holding them."""
    bs = cache.shape[1]
    rows = torch.index_select(cache.flatten(1), 0, table[lo // bs:-(-hi // bs)]).view(-1, *cache.shape[2:])
    return _readable(rows[lo % bs:lo % bs + hi - lo], dtype)


def _bias(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill_(~visible, float("-inf"))


def _attend_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None,
                causal: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention [1, H, m, D] x [1, H, L, D] (+ an additive [m, L] bias, or causal with m == L) and each
    row's log-sum-exp of the scaled scores [1, H, m] (fp32). CPU: the flash kernel SDPA uses, which returns it;
    elsewhere explicit fp32 matmuls (an [H, m, L] score tile). A row that sees no key gets 0 and any lse."""
    if q.device.type == "cpu":
        return _cpu_flash(q, k, v, is_causal=causal, attn_mask=bias)
    return _attend_lse_matmul(q, k, v, bias, causal)


def _attend_lse_matmul(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None,
                       causal: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * q.shape[-1] ** -0.5
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu_(1), float("-inf"))
    if bias is not None:
        s = s + bias.float()
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse[..., None]).nan_to_num_(0.0)
    return torch.matmul(p, v.float()), lse


_cpu_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def _readable(kv: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """K/V rows as attention reads them: int8 pool rows dequantized to `dtype`, float rows as they are."""
    return dequantize_rows(kv, dtype) if kv.dtype == torch.int8 else kv
