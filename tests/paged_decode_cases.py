"""Paged-attention cases for the native kernels (tests/test_native_decode.py, test_kv_int8.py, test_native_prefill.py,
benchmarks/prefill_attention.py): a pool of scattered blocks with its block tables and context lengths, the torch
backend's decode metadata for it, a prefill chunk over such a pool, and dense fp32 references."""

from __future__ import annotations

import shutil

import pytest
import torch

from pdcluster.engine.attention.metadata import AttentionMetadata
from pdcluster.engine.attention.torch_backend import TorchAttentionBackend
from pdcluster.engine.kv_cache import dequantize_rows, quantize_rows

needs_compiler = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                                    reason="no C compiler: the CPU backend runs the torch path")


def paged_case(dtype, batch, hq, hkv, d, bs, seed=0, max_len=200):
    """A pool with scattered blocks, per-row context lengths, and q rows that are a strided view (as the
    attention layer's q is: a slice of the fused q/k tensor)."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, max_len, (batch,), generator=g)
    lens[0] = max_len                      # one row with a full last block or a long context
    blocks = [int(-(-n // bs)) for n in lens]
    num_blocks = sum(blocks) + 3
    pool = torch.randn(num_blocks, 2, 2, bs, hkv, d, generator=g).to(dtype)   # 2 layers: blocks are strided
    k_cache, v_cache = pool[:, 1, 0], pool[:, 1, 1]
    perm = torch.randperm(num_blocks, generator=g).tolist()
    width = max(blocks)
    tables, used = [], 0
    for n in blocks:
        row = perm[used:used + n]
        used += n
        tables.append(row + [row[0]] * (width - n))
    tables = torch.tensor(tables)
    qk = torch.randn(batch, hq + hkv, d, generator=g).to(dtype)
    q = qk[:, :hq]
    return q, k_cache, v_cache, tables, lens


def decode_meta(tables, lens):
    """The torch backend's per-step metadata for a decode-only step over these rows."""
    none = torch.zeros(0, dtype=torch.int32)
    return TorchAttentionBackend.prepare(AttentionMetadata(
        slot_mapping=none, num_decode_tokens=len(lens), decode_block_tables=tables,
        decode_context_lens=lens.to(torch.int32)))


def dense_attention(q, k_cache, v_cache, tables, lens, bs, window=0):
    """fp32 attention of each row over its first `len` tokens (the last `window` of them if window > 0),
    built token by token from the table."""
    hq, hkv = q.shape[1], k_cache.shape[2]
    out = []
    for i, n in enumerate(lens.tolist()):
        pos = torch.arange(max(0, n - window) if window else 0, n)
        blk = tables[i][pos // bs]
        k = k_cache[blk, pos % bs].float().repeat_interleave(hq // hkv, dim=1).transpose(0, 1)   # [Hq, n, D]
        v = v_cache[blk, pos % bs].float().repeat_interleave(hq // hkv, dim=1).transpose(0, 1)
        out.append(torch.nn.functional.scaled_dot_product_attention(q[i].float()[:, None], k, v)[:, 0])
    return torch.stack(out)


def prefill_case(dtype, cached, n, hq, hkv, d, bs, seed=0, int8=False):
    """A pool whose blocks (scattered, strided: 2 layers) hold `cached + n` positions of K/V; q for the last n."""
    g = torch.Generator().manual_seed(seed)
    total = cached + n
    nblocks = -(-total // bs)
    pool_blocks = nblocks + 4
    row = d + 2 if int8 else d
    pool = torch.zeros(pool_blocks, 2, 2, bs, hkv, row, dtype=torch.int8 if int8 else dtype)
    k_cache, v_cache = pool[:, 1, 0], pool[:, 1, 1]
    table = torch.randperm(pool_blocks, generator=g)[:nblocks].to(torch.int32)
    k = torch.randn(total, hkv, d, generator=g).to(dtype)
    v = torch.randn(total, hkv, d, generator=g).to(dtype)
    if int8:
        k, v = quantize_rows(k), quantize_rows(v)
    for p in range(total):
        k_cache[table[p // bs], p % bs] = k[p]
        v_cache[table[p // bs], p % bs] = v[p]
    if int8:
        k, v = dequantize_rows(k, dtype), dequantize_rows(v, dtype)
    q = torch.randn(n, hq + hkv, d, generator=g).to(dtype)[:, :hq]   # strided rows, as the layer's q
    return q, k, v, k_cache, v_cache, table


def dense_causal(q, k, v, cached, window=0):
    """fp32 attention of rows at positions cached.. over keys 0..: causal, and within `window` if > 0."""
    n, hq, _ = q.shape
    g = hq // k.shape[1]
    pos_q = torch.arange(cached, cached + n)[:, None]
    pos_k = torch.arange(k.shape[0])[None, :]
    visible = pos_k <= pos_q
    if window:
        visible &= pos_k > pos_q - window
    kk = k.float().repeat_interleave(g, 1).transpose(0, 1)
    vv = v.float().repeat_interleave(g, 1).transpose(0, 1)
    return torch.nn.functional.scaled_dot_product_attention(q.float().transpose(0, 1), kk, vv,
                                                            attn_mask=visible).transpose(0, 1)
