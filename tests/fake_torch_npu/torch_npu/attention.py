"""`torch_npu.npu_fused_infer_attention_score` (FIA): prefill and decode attention, paged or not.

Follows Ascend/op-plugin docs/context/torch_npu-npu_fused_infer_attention_score.md (torch_npu 自定义API参考; on
hiascend.com e.g. https://www.hiascend.com/document/detail/zh/Pytorch/700/apiref/apilist/ptaoplist_001232.html);
the sparse modes as ops-transformer docs/zh/context/sparse_mode参数说明.md draws them; the paged calls as
vllm-ascend makes them (vllm_ascend/attention/attention_v1.py: TND + block_table + sparse_mode=3 with the
2048 x 2048 mask, actual_seq_lengths = cumulative query ends, actual_seq_lengths_kv = per-request lengths; BSH
decode with block_table).

Semantics emulated (float32 math, output in the query's dtype):
- layouts BSH, BSND, BNSD, TND. Q_S = 1 (not TND) is the incremental branch: actual_seq_lengths, sparse_mode,
  pre_tokens and next_tokens are ignored there ("Q_S为1时该参数无效"); a mask may hide key positions.
- GQA: query head h reads KV head h // (num_heads // num_key_value_heads).
- sparse_mode (Q_S > 1 or TND; i = query row, j = key column of one request, q / kv their lengths):
  0 without mask: all keys; 0 with mask: mask == 0 and i - pre_tokens <= j <= i + next_tokens (origin top
  left); 1: mask == 0; 2: j <= i; 3: j <= i + kv - q; 4 (band, origin bottom right):
  -pre_tokens <= j - (i + kv - q) <= next_tokens. Modes 2-4 take the compressed 2048 x 2048 mask.
  atten_mask: True / 1 = not computed.
- page attention (block_table): key/value caches (blocknum, blocksize, KV_N * D) or, for BNSD / TND queries,
  (blocknum, KV_N, blocksize, D); request b's key t is in block block_table[b, t // block_size].
- int8 key/value with antiquant_scale/antiquant_offset (per-tensor (2,), per-channel (2, H) / (2, N, D) /
  (2, N, 1, D): row 0 for key, row 1 for value) or key_/value_antiquant_scale/offset with modes 0 (per-channel)
  and 5 (per-token and per-head, paged: (blocknum, N, blocksize) float32): value = (int8 + offset) * scale.
- rows that see no key (or kv length 0) give zeros; softmax_lse (float32, (B, N, Q_S, 1), TND (T, N, 1)) is
  log(sum(exp(s - max))) + max, -inf for such rows; with softmax_lse_flag=False a [1] zero tensor.
Restrictions raised as RuntimeError (the doc's rule in the message); documented features the emulator does not
implement (pse_shift, full/post quantization, left padding, shared prefix, MLA rope, NZ caches, the *_NBSD / NTD
layouts, per-token antiquant modes 1-4) raise NotImplementedError.
"""

from __future__ import annotations

import math
from itertools import pairwise

import torch

from torch_npu import _state

OP = "npu_fused_infer_attention_score"
INT_MAX = 2147483647
COMPRESSED_MASK = 2048
_QUERY_DTYPES = (torch.float16, torch.bfloat16)
_KV_DTYPES = (torch.float16, torch.bfloat16, torch.int8)
_MASK_DTYPES = (torch.bool, torch.int8, torch.uint8)
_LAYOUTS = ("BSH", "BSND", "BNSD", "TND")
_checked_mask: tuple[torch.Tensor, int] | None = None
_DOC_LAYOUTS_NOT_EMULATED = ("BNSD_BSND", "BSH_NBSD", "BSND_NBSD", "BNSD_NBSD", "TND_NTD", "NTD_TND")


def _fail(msg: str) -> None:
    raise RuntimeError(f"{OP}: {msg}")


def _ints(name: str, v) -> list[int] | None:
    if v is None:
        return None
    if isinstance(v, torch.Tensor):
        if v.dtype.is_floating_point or v.dim() != 1:
            _fail(f"{name}: a 1-D int array is expected; got {v.dtype} {tuple(v.shape)}")
        return [int(x) for x in v.tolist()]
    return [int(x) for x in v]


def _per_batch(name: str, lens: list[int], batch: int) -> list[int]:
    """"传入长度为1时，每个Batch使用相同seqlen；传入长度大于等于Batch时取seqlen的前Batch个数。其他长度不支持。" """
    if len(lens) == 1:
        return lens * batch
    if len(lens) >= batch:
        return lens[:batch]
    _fail(f"{name}: length {len(lens)} is not supported with batch {batch} (1 or >= batch)")


def _cumulative(name: str, cum: list[int], total: int) -> list[int]:
    """TND: each element is the sum of this and all earlier batches' lengths, so non-decreasing and >= 0."""
    if any(c < 0 for c in cum) or any(b < a for a, b in pairwise(cum)):
        _fail(f"{name}: TND needs non-decreasing, non-negative cumulative lengths; got {cum}")
    if cum and cum[-1] > total:
        _fail(f"{name}: the last cumulative length {cum[-1]} exceeds T = {total}")
    return [b - a for a, b in zip([0] + cum[:-1], cum, strict=True)]


def _split_query(query: torch.Tensor, layout: str, num_heads: int) -> tuple[torch.Tensor, int]:
    """The query as [B, S, N, D] (TND: [1, T, N, D]) and D."""
    want = 3 if layout in ("BSH", "TND") else 4
    if query.dim() != want:
        _fail(f"query: input_layout {layout} needs a {want}-D query; got {tuple(query.shape)}")
    if layout == "BSH":
        if query.shape[2] % num_heads:
            _fail(f"query: H = {query.shape[2]} is not a multiple of num_heads = {num_heads}")
        d = query.shape[2] // num_heads
        return query.view(query.shape[0], query.shape[1], num_heads, d), d
    n_axis = {"BSND": 2, "BNSD": 1, "TND": 1}[layout]
    if query.shape[n_axis] != num_heads:
        _fail(f"num_heads = {num_heads} must equal the N axis of the {layout} query ({query.shape[n_axis]})")
    if layout == "BNSD":
        return query.transpose(1, 2), query.shape[3]
    if layout == "TND":
        return query.unsqueeze(0), query.shape[2]
    return query, query.shape[3]


def _dense_kv(t: torch.Tensor, layout: str, kv_heads: int, d: int, name: str) -> torch.Tensor:
    """Non-paged key/value as [B, S, KV_N, D] (TND: [1, T, KV_N, D])."""
    want = 3 if layout in ("BSH", "TND") else 4
    if t.dim() != want:
        _fail(f"{name}: input_layout {layout} needs a {want}-D tensor; got {tuple(t.shape)}")
    if layout == "BSH":
        if t.shape[2] != kv_heads * d:
            _fail(f"{name}: H = {t.shape[2]} must be num_key_value_heads * D = {kv_heads * d}")
        return t.view(t.shape[0], t.shape[1], kv_heads, d)
    n_axis = {"BSND": 2, "BNSD": 1, "TND": 1}[layout]
    if t.shape[n_axis] != kv_heads or t.shape[-1] != d:
        _fail(f"{name}: the N axis ({t.shape[n_axis]}) must equal num_key_value_heads = {kv_heads} and D = {d}")
    if layout == "BNSD":
        return t.transpose(1, 2)
    return t.unsqueeze(0) if layout == "TND" else t


def _paged_kv(t: torch.Tensor, layout: str, kv_heads: int, d: int, block_size: int, name: str) -> torch.Tensor:
    """A paged cache as [blocknum, blocksize, KV_N, D]."""
    if t.dim() == 3:
        if t.shape[1] != block_size or t.shape[2] != kv_heads * d:
            _fail(f"{name}: a (blocknum, blocksize, H) cache must be (*, {block_size}, {kv_heads * d}); got "
                  f"{tuple(t.shape)}")
        if kv_heads * d > 65535:
            _fail(f"{name}: with a (blocknum, blocksize, H) cache KV_N * D must not exceed 65535")
        return t.view(t.shape[0], block_size, kv_heads, d)
    if t.dim() == 4:
        if layout not in ("BNSD", "TND"):
            _fail(f"{name}: a (blocknum, KV_N, blocksize, D) cache is supported only for BNSD / TND queries; for "
                  "BSH / BSND the cache must be (blocknum, blocksize, H)")
        if tuple(t.shape[1:]) != (kv_heads, block_size, d):
            _fail(f"{name}: a (blocknum, KV_N, blocksize, D) cache must be (*, {kv_heads}, {block_size}, {d}); got "
                  f"{tuple(t.shape)}")
        return t.transpose(1, 2)
    _fail(f"{name}: a paged cache must be 3-D or 4-D; got {tuple(t.shape)}")


def _check_block_size(block_size: int, kv_dtype: torch.dtype, incremental: bool) -> None:
    if block_size <= 0:
        _fail("block_size must be set (> 0) with block_table")
    if incremental:
        align = 32 if kv_dtype == torch.int8 else 16
        if block_size % align:
            _fail(f"page attention with Q_S = 1: block_size must be {align}-aligned for {kv_dtype} key/value "
                  f"(float16/bfloat16: 16, int8: 32); got {block_size}")
    elif block_size % 128 or not 128 <= block_size <= 512:
        _fail(f"page attention with Q_S > 1: block_size must be a multiple of 128 between 128 and 512; got "
              f"{block_size}")


def _check_compressed_mask(mask: torch.Tensor | None, sparse_mode: int) -> None:
    shapes = [(COMPRESSED_MASK,) * 2, (1,) + (COMPRESSED_MASK,) * 2, (1, 1) + (COMPRESSED_MASK,) * 2]
    if mask is None or tuple(mask.shape) not in shapes:
        _fail(f"sparse_mode = {sparse_mode} needs the optimized atten_mask of shape (2048, 2048), (1, 2048, 2048) or "
              f"(1, 1, 2048, 2048); got {None if mask is None else tuple(mask.shape)}")
    global _checked_mask
    if _checked_mask is not None and mask is _checked_mask[0] and mask._version == _checked_mask[1]:
        return   # callers pass one mask to every layer of every step; held here so its identity stays unique
    m = mask.reshape(COMPRESSED_MASK, COMPRESSED_MASK).bool()
    if not torch.equal(m, torch.ones_like(m).triu(1)):
        _fail(f"sparse_mode = {sparse_mode}: the 2048 x 2048 atten_mask must be the compressed lower-triangular "
              "mask (1 strictly above the diagonal)")
    _checked_mask = (mask, mask._version)


def _user_mask(mask: torch.Tensor, b: int, q_len: int, kv_len: int, incremental: bool) -> torch.Tensor:
    """Request b's [q_len, kv_len] slice of a full mask (True = hidden)."""
    m = mask.bool()
    if incremental:   # (B, KV_S), (B, 1, KV_S), (B, 1, 1, KV_S)
        m = m.reshape(m.shape[0], m.shape[-1])
        return m[b if m.shape[0] > 1 else 0, :kv_len].unsqueeze(0)
    while m.dim() > 3:   # (B, 1, Q_S, KV_S) / (1, 1, Q_S, KV_S) -> (B or 1, Q_S, KV_S)
        m = m[:, 0]
    if m.dim() == 3:
        m = m[b if m.shape[0] > 1 else 0]
    return m[:q_len, :kv_len]


def _visible(q_len: int, kv_len: int, sparse_mode: int, pre: int, nxt: int, user: torch.Tensor | None) -> torch.Tensor:
    i = torch.arange(q_len).unsqueeze(1)
    j = torch.arange(kv_len).unsqueeze(0)
    if sparse_mode == 0:
        if user is None:
            return torch.ones(q_len, kv_len, dtype=torch.bool)
        return ~user & (j >= i - pre) & (j <= i + nxt)
    if sparse_mode == 1:
        return ~user
    if sparse_mode == 2:
        return j <= i
    diag = i + kv_len - q_len
    if sparse_mode == 3:
        return j <= diag
    return (j - diag >= -pre) & (j - diag <= nxt)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
            visible: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [q, N, D], k/v [kv, N, D] float32 -> out [q, N, D], lse [N, q]."""
    scores = torch.einsum("qnd,knd->nqk", q, k) * scale
    scores = scores.masked_fill(~visible.unsqueeze(0), float("-inf"))
    row_max = scores.amax(dim=-1, keepdim=True)
    has_key = torch.isfinite(row_max)
    row_max = torch.where(has_key, row_max, torch.zeros_like(row_max))
    p = torch.exp(scores - row_max)
    total = p.sum(dim=-1, keepdim=True)
    out = torch.einsum("nqk,knd->qnd", p / total.clamp_min(torch.finfo(torch.float32).tiny), v)
    lse = torch.where(has_key, torch.log(total) + row_max, torch.full_like(row_max, float("-inf")))
    return out, lse.squeeze(-1)


class _Antiquant:
    """int8 key/value -> float32: (x + offset) * scale, with the scale/offset that apply to each token."""

    def __init__(self, layout: str, kv_heads: int, d: int, paged: bool, incremental: bool, q_dtype: torch.dtype,
                 combined: tuple, separated: tuple, modes: tuple[int, int], antiquant_mode: int) -> None:
        self.per_token_paged = False
        scale, offset = combined
        k_scale, k_offset, v_scale, v_offset = separated
        if k_scale is not None or v_scale is not None or k_offset is not None or v_offset is not None:
            self._separated(layout, kv_heads, d, paged, incremental, q_dtype, separated, modes)
            return
        if scale is None:
            _fail("int8 key/value need antiquant_scale (or key_antiquant_scale / value_antiquant_scale)")
        if antiquant_mode != 0:
            raise NotImplementedError(f"{OP}: antiquant_mode = {antiquant_mode} (per-token) is not emulated")
        per_channel = {"BSH": (2, kv_heads * d), "BSND": (2, kv_heads, d), "BNSD": (2, kv_heads, 1, d),
                       "TND": (2, kv_heads, d)}[layout]
        for name, t in (("antiquant_scale", scale), ("antiquant_offset", offset)):
            if t is None:
                continue
            if tuple(t.shape) not in ((2,), per_channel):
                _fail(f"{name}: per-tensor shape (2,) or per-channel {per_channel} for {layout}; got {tuple(t.shape)}")
            if t.dtype != q_dtype:
                _fail(f"{name}: dtype must be the query's ({q_dtype}); got {t.dtype}")
        self.k = self._rows(scale[0], None if offset is None else offset[0], kv_heads, d)
        self.v = self._rows(scale[1], None if offset is None else offset[1], kv_heads, d)

    @staticmethod
    def _rows(scale: torch.Tensor, offset: torch.Tensor | None, kv_heads: int, d: int):
        """Per-tensor or per-channel (scale, offset) as float32 broadcastable to [tokens, KV_N, D]."""
        def shaped(t):
            t = t.float()
            return t.reshape(1, 1, 1) if t.numel() == 1 else t.reshape(1, kv_heads, d)
        return shaped(scale), None if offset is None else shaped(offset)

    def _separated(self, layout, kv_heads, d, paged, incremental, q_dtype, separated, modes) -> None:
        k_scale, k_offset, v_scale, v_offset = separated
        if (k_scale is None) != (v_scale is None) or (k_offset is None) != (v_offset is None):
            _fail("key_antiquant_scale and value_antiquant_scale (and the two offsets) must both be given or both "
                  "be None")
        if k_scale is None:
            _fail("key_antiquant_offset / value_antiquant_offset need the matching scales")
        if modes[0] != modes[1]:
            raise NotImplementedError(f"{OP}: key_antiquant_mode {modes[0]} with value_antiquant_mode {modes[1]} is "
                                      "not emulated")
        mode = modes[0]
        if not incremental and paged:
            _fail("separate key/value antiquant parameters do not support page attention when Q_S > 1")
        if mode == 0:
            shapes = ((1, kv_heads, 1, d), (1, kv_heads, d), (1, kv_heads * d))
            for name, t in (("key_antiquant_scale", k_scale), ("value_antiquant_scale", v_scale),
                            ("key_antiquant_offset", k_offset), ("value_antiquant_offset", v_offset)):
                if t is not None and (tuple(t.shape) not in shapes or t.dtype != q_dtype):
                    _fail(f"{name}: per-channel mode needs shape (1, N, 1, D), (1, N, D) or (1, H) and the query's "
                          f"dtype {q_dtype}; got {tuple(t.shape)} {t.dtype}")
            self.k = self._rows(k_scale, k_offset, kv_heads, d)
            self.v = self._rows(v_scale, v_offset, kv_heads, d)
            return
        if mode == 5:
            if not (paged and incremental):
                _fail("antiquant mode 5 (per-token, per-head, page attention managed) needs block_table and Q_S = 1")
            for name, t in (("key_antiquant_scale", k_scale), ("value_antiquant_scale", v_scale),
                            ("key_antiquant_offset", k_offset), ("value_antiquant_offset", v_offset)):
                if t is not None and (t.dim() != 3 or t.shape[1] != kv_heads or t.dtype != torch.float32):
                    _fail(f"{name}: mode 5 needs float32 (blocknum, N, blocksize) with N = {kv_heads}; got "
                          f"{tuple(t.shape)} {t.dtype}")
            self.per_token_paged = True
            self.k = (k_scale.transpose(1, 2), None if k_offset is None else k_offset.transpose(1, 2))
            self.v = (v_scale.transpose(1, 2), None if v_offset is None else v_offset.transpose(1, 2))
            return
        raise NotImplementedError(f"{OP}: key/value antiquant mode {mode} is not emulated (0 and 5 are)")

    @staticmethod
    def _apply(x: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None) -> torch.Tensor:
        x = x.float()
        return (x if offset is None else x + offset) * scale

    def dense(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self._apply(k, *self.k), self._apply(v, *self.v)

    def paged(self, k: torch.Tensor, v: torch.Tensor, blocks: torch.Tensor, kv_len: int):
        """k/v: the gathered [tokens, KV_N, D] of these blocks."""
        if not self.per_token_paged:
            return self.dense(k, v)

        def per_token(t):   # (blocknum, blocksize, N) -> [tokens, N, 1]
            return None if t is None else t[blocks].reshape(-1, t.shape[-1])[:kv_len].unsqueeze(-1)
        return (self._apply(k, per_token(self.k[0]), per_token(self.k[1])),
                self._apply(v, per_token(self.v[0]), per_token(self.v[1])))


def npu_fused_infer_attention_score(
        query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, pse_shift=None, atten_mask=None,
        actual_seq_lengths=None, actual_seq_lengths_kv=None, dequant_scale1=None, quant_scale1=None,
        dequant_scale2=None, quant_scale2=None, quant_offset2=None, antiquant_scale=None, antiquant_offset=None,
        block_table=None, query_padding_size=None, kv_padding_size=None, key_antiquant_scale=None,
        key_antiquant_offset=None, value_antiquant_scale=None, value_antiquant_offset=None, key_shared_prefix=None,
        value_shared_prefix=None, actual_shared_prefix_len=None, query_rope=None, key_rope=None,
        key_rope_antiquant_scale=None, num_heads: int = 1, scale: float = 1.0, pre_tokens: int = INT_MAX,
        next_tokens: int = INT_MAX, input_layout: str = "BSH", num_key_value_heads: int = 0, sparse_mode: int = 0,
        inner_precise: int = 0, block_size: int = 0, antiquant_mode: int = 0, softmax_lse_flag: bool = False,
        key_antiquant_mode: int = 0, value_antiquant_mode: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(attention_out, softmax_lse); see the module docstring for what is emulated and which doc it follows."""
    _state.record(OP)
    unsupported = {"pse_shift": pse_shift, "dequant_scale1": dequant_scale1, "quant_scale1": quant_scale1,
                   "dequant_scale2": dequant_scale2, "quant_scale2": quant_scale2, "quant_offset2": quant_offset2,
                   "query_padding_size": query_padding_size, "kv_padding_size": kv_padding_size,
                   "key_shared_prefix": key_shared_prefix, "value_shared_prefix": value_shared_prefix,
                   "actual_shared_prefix_len": actual_shared_prefix_len, "query_rope": query_rope,
                   "key_rope": key_rope}
    given = [name for name, v in unsupported.items() if v is not None]
    if given:
        raise NotImplementedError(f"{OP}: {', '.join(given)} not emulated")
    if input_layout in _DOC_LAYOUTS_NOT_EMULATED:
        raise NotImplementedError(f"{OP}: input_layout {input_layout} is not emulated ({', '.join(_LAYOUTS)} are)")
    if input_layout not in _LAYOUTS:
        _fail(f"input_layout {input_layout!r} is not supported")

    # dtypes, contiguity, heads
    if query.dtype not in _QUERY_DTYPES:
        _fail(f"query: dtype {query.dtype} is not supported (float16, bfloat16)")
    for name, t in (("key", key), ("value", value)):
        if t.dtype not in _KV_DTYPES:
            _fail(f"{name}: dtype {t.dtype} is not supported (float16, bfloat16, int8)")
    if key.dtype != value.dtype or key.shape != value.shape:
        _fail(f"key and value must have exactly the same shape and dtype; got {tuple(key.shape)} {key.dtype} and "
              f"{tuple(value.shape)} {value.dtype}")
    if key.dtype != torch.int8 and key.dtype != query.dtype:
        _fail(f"key/value dtype {key.dtype} must match the query's {query.dtype} (or be int8 with antiquant)")
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not t.is_contiguous():
            _fail(f"{name}: non-contiguous tensors are not supported (不支持非连续的Tensor)")
    if num_heads < 1:
        _fail(f"num_heads must be >= 1; got {num_heads}")
    kv_heads = num_key_value_heads or num_heads
    if num_heads % kv_heads:
        _fail(f"num_heads = {num_heads} must be divisible by num_key_value_heads = {kv_heads}")
    if num_heads // kv_heads > 64:
        _fail(f"num_heads / num_key_value_heads must not exceed 64; got {num_heads // kv_heads}")
    if inner_precise not in (0, 1, 2, 3):
        _fail(f"inner_precise must be 0, 1, 2 or 3; got {inner_precise}")

    q4, d = _split_query(query, input_layout, num_heads)
    tnd = input_layout == "TND"
    q_seq = _ints("actual_seq_lengths", actual_seq_lengths)
    kv_seq = _ints("actual_seq_lengths_kv", actual_seq_lengths_kv)
    paged = block_table is not None

    # query lengths and the branch (incremental = Q_S is 1, not TND)
    if tnd:
        if q_seq is None or kv_seq is None:
            _fail("TND needs actual_seq_lengths and actual_seq_lengths_kv (their length is the batch)")
        q_lens = _cumulative("actual_seq_lengths", q_seq, query.shape[0])
        batch = len(q_lens)
        q_starts = [c - n for c, n in zip(q_seq, q_lens, strict=True)]
    else:
        batch, q_s = q4.shape[0], q4.shape[1]
        if q_s == 1 or q_seq is None:
            q_lens = [q_s] * batch
        else:
            q_lens = _per_batch("actual_seq_lengths", q_seq, batch)
            if any(n > q_s or n < 0 for n in q_lens):
                _fail(f"actual_seq_lengths {q_lens}: each must be <= the query's S = {q_s}")
        q_starts = [0] * batch
    incremental = not tnd and q4.shape[1] == 1

    # sparse mode and mask
    if atten_mask is not None:
        if atten_mask.dtype not in _MASK_DTYPES:
            _fail(f"atten_mask: dtype {atten_mask.dtype} is not supported (bool, int8, uint8)")
        if not atten_mask.is_contiguous():
            _fail("atten_mask: non-contiguous tensors are not supported")
    if incremental:
        mode, pre, nxt = 0, INT_MAX, INT_MAX   # "Q_S为1时该参数无效"
        if atten_mask is not None and (atten_mask.dim() not in (2, 3, 4) or atten_mask.shape[0] != batch
                                       or any(s != 1 for s in atten_mask.shape[1:-1])):
            _fail(f"atten_mask: with Q_S = 1 the mask is (B, KV_S), (B, 1, KV_S) or (B, 1, 1, KV_S) with B = "
                  f"{batch}; got {tuple(atten_mask.shape)}")
    else:
        mode, pre, nxt = sparse_mode, pre_tokens, next_tokens
        if mode in (5, 6, 7, 8):
            _fail(f"sparse_mode = {mode} (prefix / global / dilated / block_local) is not supported yet")
        if mode not in (0, 1, 2, 3, 4):
            _fail(f"sparse_mode only supports 0, 1, 2, 3, 4 when Q_S > 1; got {mode}")
        if tnd and not ((mode == 0 and atten_mask is None) or (mode == 3 and atten_mask is not None)):
            _fail("TND supports sparse_mode = 0 without atten_mask or sparse_mode = 3 with atten_mask only")
        if mode in (2, 3, 4):
            _check_compressed_mask(atten_mask, mode)
        if mode == 1 and atten_mask is None:
            _fail("sparse_mode = 1 (allMask) needs the full atten_mask")

    # keys: paged or dense, and their lengths
    if paged:
        if block_table.dtype != torch.int32:
            _fail(f"block_table: dtype must be int32; got {block_table.dtype}")
        if block_table.dim() != 2 or block_table.shape[0] != batch:
            _fail(f"block_table must be 2-D with its first dim equal to B = {batch}; got {tuple(block_table.shape)}")
        if kv_seq is None:
            _fail("page attention needs actual_seq_lengths_kv")
        if not incremental and key.dtype == torch.int8:
            _fail("page attention with Q_S > 1 supports float16 / bfloat16 key and value only (no antiquant)")
        _check_block_size(block_size, key.dtype, incremental)
        k_all = _paged_kv(key, input_layout, kv_heads, d, block_size, "key")
        v_all = _paged_kv(value, input_layout, kv_heads, d, block_size, "value")
        kv_lens = _per_batch("actual_seq_lengths_kv", kv_seq, batch)
        max_blocks = max((math.ceil(n / block_size) for n in kv_lens), default=0)
        if block_table.shape[1] < max_blocks:
            _fail(f"block_table's second dim ({block_table.shape[1]}) must not be smaller than maxBlockNumPerSeq "
                  f"({max_blocks})")
        if sum(math.ceil(n / block_size) for n in kv_lens) > key.shape[0]:
            _fail(f"blocknum ({key.shape[0]}) is smaller than the blocks actual_seq_lengths_kv needs")
        kv_s = block_table.shape[1] * block_size
        kv_starts = [0] * batch
    else:
        k_all = _dense_kv(key, input_layout, kv_heads, d, "key")
        v_all = _dense_kv(value, input_layout, kv_heads, d, "value")
        if not tnd and k_all.shape[0] != batch:
            _fail(f"key batch {k_all.shape[0]} must equal the query's {batch} (tensorlist is not emulated)")
        if tnd:
            kv_lens = _cumulative("actual_seq_lengths_kv", kv_seq, key.shape[0])
            if len(kv_lens) != batch:
                _fail("actual_seq_lengths and actual_seq_lengths_kv must have the same length in TND")
            kv_starts = [c - n for c, n in zip(kv_seq, kv_lens, strict=True)]
        else:
            kv_s = k_all.shape[1]
            kv_lens = [kv_s] * batch if kv_seq is None else _per_batch("actual_seq_lengths_kv", kv_seq, batch)
            if any(n > kv_s or n < 0 for n in kv_lens):
                _fail(f"actual_seq_lengths_kv {kv_lens}: each must be <= the key/value S = {kv_s}")
            kv_starts = [0] * batch
    if atten_mask is not None and mode in (0, 1):
        need_kv = max(kv_lens, default=0) if tnd else kv_s
        if atten_mask.shape[-1] < need_kv or (not incremental and atten_mask.shape[-2] < max(q_lens, default=0)):
            _fail(f"atten_mask {tuple(atten_mask.shape)} must cover (Q_S, KV_S) = ({max(q_lens, default=0)}, "
                  f"{need_kv}) (page attention: KV_S >= maxBlockNumPerSeq * blockSize)")

    dequant = None
    if key.dtype == torch.int8:
        dequant = _Antiquant(input_layout, kv_heads, d, paged, incremental, query.dtype,
                             (antiquant_scale, antiquant_offset),
                             (key_antiquant_scale, key_antiquant_offset, value_antiquant_scale, value_antiquant_offset),
                             (key_antiquant_mode, value_antiquant_mode), antiquant_mode)
    elif any(t is not None for t in (antiquant_scale, antiquant_offset, key_antiquant_scale, value_antiquant_scale)):
        _fail("antiquant parameters are supported only with int8 key/value")

    group = num_heads // kv_heads
    out4 = torch.zeros(q4.shape, dtype=torch.float32, device=query.device)
    lse4 = torch.full((q4.shape[0], q4.shape[1], num_heads), float("-inf"), device=query.device)
    for b in range(batch):
        q_len, kv_len = q_lens[b], kv_lens[b]
        if q_len == 0 or kv_len == 0:
            continue
        if paged:
            blocks = block_table[b, :math.ceil(kv_len / block_size)].long()
            if blocks.numel() and (int(blocks.min()) < 0 or int(blocks.max()) >= k_all.shape[0]):
                _fail(f"block_table row {b} names a block outside [0, {k_all.shape[0]}) (the device does not check "
                      "block ids; the result would be undefined)")
            k = k_all[blocks].reshape(-1, kv_heads, d)[:kv_len]
            v = v_all[blocks].reshape(-1, kv_heads, d)[:kv_len]
            k, v = dequant.paged(k, v, blocks, kv_len) if dequant else (k.float(), v.float())
        else:
            row = 0 if tnd else b
            k = k_all[row, kv_starts[b]:kv_starts[b] + kv_len]
            v = v_all[row, kv_starts[b]:kv_starts[b] + kv_len]
            k, v = dequant.dense(k, v) if dequant else (k.float(), v.float())
        user = None
        if atten_mask is not None and mode in (0, 1):
            user = _user_mask(atten_mask, b, q_len, kv_len, incremental)
        visible = _visible(q_len, kv_len, mode, pre, nxt, user)
        row = 0 if tnd else b
        q = q4[row, q_starts[b]:q_starts[b] + q_len].float()
        o, lse = _attend(q, k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1), scale, visible)
        out4[row, q_starts[b]:q_starts[b] + q_len] = o
        lse4[row, q_starts[b]:q_starts[b] + q_len] = lse.transpose(0, 1)

    out = out4.to(query.dtype)
    if input_layout == "BSH":
        out = out.reshape(query.shape)
    elif input_layout == "BNSD":
        out = out.transpose(1, 2).contiguous()
    elif tnd:
        out = out[0]
    if not softmax_lse_flag:
        return out, torch.zeros(1, dtype=torch.float32, device=query.device)
    lse = lse4[0].unsqueeze(-1) if tnd else lse4.transpose(1, 2).unsqueeze(-1).contiguous()
    return out, lse
