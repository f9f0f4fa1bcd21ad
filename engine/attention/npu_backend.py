"""Ascend attention through torch_npu's fused operators, called the way vllm-ascend calls them
(vllm_ascend/attention/attention_v1.py).

- KV write: `torch_npu._npu_reshape_and_cache(key, value, key_cache, value_cache, slot_indices)` on the step's
  flat int32 slot mapping, one call per layer (an int8 pool: the rows quantized first, scale bytes included).
- Decode (one query token per sequence): `npu_fused_infer_attention_score` in BSH, paged: the layer's K and V
  caches seen as (blocknum, blocksize, KV_N * D), the int32 block table, actual_seq_lengths_kv = context
  lengths, num_key_value_heads for GQA. With Q_S = 1 the operator ignores sparse_mode / pre_tokens, so a
  sliding window is a (B, 1, KV_S) mask hiding what lies before each row's window.
- Prefill chunks: one call per chunk, BSND with B = 1, paged (block table of the sequence, the keys are its
  cached positions plus the chunk's), causal as sparse_mode 3 (bottom-right aligned, so the chunk's rows see
  every cached key) with the compressed 2048 x 2048 mask; a window is sparse_mode 4 (band) with
  pre_tokens = window - 1, next_tokens = 0.
- int8 pool (rows: D int8 values then their fp16 scale, engine/kv_cache.py): decode runs paged on the int8
  cache itself with per-token, per-head antiquant (key_/value_antiquant_mode 5, scales (blocknum, KV_N,
  blocksize) float32, read out of the rows each step), the query padded with two zeros so the scale bytes
  add nothing to a score and the two extra output columns are dropped. The kernel then sees a head size of
  D + 2 (e.g. 130): no restriction the emulator implements forbids it, but whether Ascend's kernel takes an
  unaligned D in this mode is unverified (the fallback would be scales kept beside the values, a layout
  change). The fused paged prefill takes no
  int8 KV (its doc), so an int8 prefill chunk gathers its visible blocks, dequantizes them and runs the same
  operator unpaged.

The paged prefill needs block_size a multiple of 128 in 128..512 (the engine's NPU default is 128), decode
16-aligned (int8: 32). Everything runs under the CPU emulator of these operators in tests
(tests/fake_torch_npu, tests/test_npu_backend.py); not run on Ascend hardware.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from pdcluster.engine.attention.metadata import AttentionMetadata, PrefillChunk
from pdcluster.engine.kv_cache import SCALE_BYTES, SCALE_DTYPE, dequantize_rows, quantize_rows

_COMPRESSED_MASK = 2048   # sparse modes 2-4 take this lower-triangular mask (1 = not computed)


@dataclass
class NpuAttentionMetadata(AttentionMetadata):
    """The step's metadata as the fused operators take it, built once per step and shared by the layers."""
    decode_lens: list[int] = field(default_factory=list)   # actual_seq_lengths_kv of the decode rows
    _window_masks: dict = field(default_factory=dict, repr=False)

    def decode_window_mask(self, block_size: int, window: int) -> torch.Tensor:
        """(B, 1, KV_S) bool, True = hidden: each decode row's positions before its last `window`."""
        if window not in self._window_masks:
            tables = self.decode_block_tables
            assert tables is not None, "a step with decode rows"
            cols = torch.arange(tables.shape[1] * block_size, device=tables.device)[None, :]
            lens = torch.tensor(self.decode_lens, device=tables.device)[:, None]
            self._window_masks[window] = (cols < lens - window).unsqueeze(1).contiguous()
        return self._window_masks[window]


class NpuAttentionBackend:
    name = "npu"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        import torch_npu  # imported only when this backend is selected (docs/design.md §9)

        self.ops = torch_npu
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim ** -0.5
        self._mask: torch.Tensor | None = None

    @staticmethod
    def prepare(meta: AttentionMetadata) -> NpuAttentionMetadata:
        """int32, contiguous block tables (the operator's rule) and host-side lengths, once per step."""
        tables = meta.decode_block_tables
        lens = [] if meta.decode_context_lens is None else meta.decode_context_lens.tolist()
        prefills = [PrefillChunk(p.start, p.end, p.num_cached, _int32(p.block_table)) for p in meta.prefills]
        return NpuAttentionMetadata(_int32(meta.slot_mapping), meta.num_decode_tokens,
                                    None if tables is None else _int32(tables), meta.decode_context_lens, prefills,
                                    decode_lens=lens)

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 meta: NpuAttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """The new rows into their slots, as stored (quantized for an int8 pool)."""
        if k_cache.dtype == torch.int8:
            k, v = quantize_rows(k), quantize_rows(v)
        else:
            k, v = k.contiguous(), v.contiguous()
        self.ops._npu_reshape_and_cache(key=k, value=v, key_cache=k_cache, value_cache=v_cache,
                                        slot_indices=meta.slot_mapping)
        return k, v

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: NpuAttentionMetadata, window: int = 0) -> torch.Tensor:
        """q: [T, Hq, D]; k, v: [T, Hkv, D]; caches: a layer's [num_blocks, block_size, Hkv, row] (row = D, int8:
        D + 2). Returns [T, Hq, D]."""
        k, v = self.write_kv(k, v, k_cache, v_cache, meta)
        nd = meta.num_decode_tokens
        if nd == q.shape[0] and not meta.prefills:
            return self._decode(q, k_cache, v_cache, meta, window)
        out = torch.empty_like(q)
        if nd:
            out[:nd] = self._decode(q[:nd], k_cache, v_cache, meta, window)
        for chunk in meta.prefills:
            rows = slice(chunk.start, chunk.end)
            out[rows] = self._prefill(q[rows], k_cache, v_cache, chunk, window)
        return out

    # ---- decode ----------------------------------------------------------------------------------------

    def _decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: NpuAttentionMetadata,
                window: int) -> torch.Tensor:
        b, hq, d = q.shape
        nb, bs, hkv, row = k_cache.shape
        quant = {}
        if k_cache.dtype == torch.int8:
            q = F.pad(q, (0, SCALE_BYTES))   # zeros against the scale bytes: they add nothing to a score
            quant = dict(key_antiquant_scale=_row_scales(k_cache), value_antiquant_scale=_row_scales(v_cache),
                         key_antiquant_mode=5, value_antiquant_mode=5)
        mask = meta.decode_window_mask(bs, window) if window else None
        out, _ = self.ops.npu_fused_infer_attention_score(
            q.reshape(b, 1, hq * row).contiguous(), k_cache.view(nb, bs, hkv * row), v_cache.view(nb, bs, hkv * row),
            atten_mask=mask, block_table=meta.decode_block_tables, actual_seq_lengths_kv=meta.decode_lens,
            num_heads=hq, num_key_value_heads=hkv, scale=self.scale, input_layout="BSH", block_size=bs, **quant)
        return out.view(b, hq, row)[..., :d]

    # ---- prefill ---------------------------------------------------------------------------------------

    def _prefill(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, chunk: PrefillChunk,
                 window: int) -> torch.Tensor:
        """One chunk: its rows attend to the sequence's keys up to their own position (the chunk's new keys are
        already in the cache), within `window` if set."""
        n, c = q.shape[0], chunk.num_cached
        nb, bs, hkv, row = k_cache.shape
        if k_cache.dtype != torch.int8:
            base = 0
            kv = dict(key=k_cache.view(nb, bs, hkv * row), value=v_cache.view(nb, bs, hkv * row),
                      block_table=chunk.block_table.unsqueeze(0), block_size=bs)
            kv_cols = chunk.block_table.shape[0] * bs
        else:   # the paged prefill takes no int8 KV: attend to the dequantized blocks this chunk can see
            first = max(0, c - window + 1) if window else 0
            base = first // bs * bs
            blocks = chunk.block_table[first // bs:].long()
            kv = dict(key=dequantize_rows(k_cache[blocks].flatten(0, 1)[:c + n - base], q.dtype).unsqueeze(0),
                      value=dequantize_rows(v_cache[blocks].flatten(0, 1)[:c + n - base], q.dtype).unsqueeze(0))
            kv_cols = c + n - base
        kv_len = c + n - base
        mask: dict[str, torch.Tensor | int]
        if n == 1:   # Q_S = 1 is the operator's incremental branch: no sparse modes there, a window is a mask
            cols = torch.arange(kv_cols, device=q.device)
            mask = dict(atten_mask=(cols < kv_len - window).view(1, 1, -1)) if window else {}
        elif window:
            mask = dict(atten_mask=self._causal_mask(q.device), sparse_mode=4, pre_tokens=window - 1, next_tokens=0)
        else:
            mask = dict(atten_mask=self._causal_mask(q.device), sparse_mode=3)
        out, _ = self.ops.npu_fused_infer_attention_score(
            query=q.contiguous().unsqueeze(0), **kv, actual_seq_lengths=[n], actual_seq_lengths_kv=[kv_len],
            num_heads=self.num_heads, num_key_value_heads=hkv, scale=self.scale, input_layout="BSND", **mask)
        return out[0]

    def _causal_mask(self, device: torch.device) -> torch.Tensor:
        """The compressed mask sparse modes 3 and 4 take: 2048 x 2048, 1 strictly above the diagonal; one per
        backend (the operator reads its shape, not a per-step mask)."""
        if self._mask is None or self._mask.device != device:
            with torch.inference_mode(False):   # made inside a step, kept across steps: a normal tensor
                ones = torch.ones(_COMPRESSED_MASK, _COMPRESSED_MASK, dtype=torch.bool, device=device)
                self._mask = ones.triu_(1)
        return self._mask


def _int32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.int32 and t.is_contiguous() else t.to(torch.int32).contiguous()


def _row_scales(cache: torch.Tensor) -> torch.Tensor:
    """An int8 cache's per-(token, head) scales as antiquant mode 5 takes them: (blocknum, KV_N, blocksize)
    float32."""
    d = cache.shape[-1] - SCALE_BYTES
    scales = cache[..., d:].contiguous().view(SCALE_DTYPE)[..., 0]   # [blocknum, blocksize, KV_N]
    return scales.float().transpose(1, 2).contiguous()
