"""The native CPU paged-decode kernel (engine/attention/paged_decode.c) against dense attention."""

from __future__ import annotations

import ctypes
import logging

import pytest
import torch
from avx2_build import build_avx2, needs_avx2_cpu
from paged_decode_cases import decode_meta, dense_attention, needs_compiler, paged_case

from pdcluster.engine.attention import native
from pdcluster.engine.attention.cpu_backend import CpuAttentionBackend
from pdcluster.engine.attention.torch_backend import TorchAttentionBackend
from pdcluster.engine.kv_cache import dequantize_rows, quantize_rows

CASES = [   # batch, hq, hkv, d, bs, max_len
    (9, 16, 8, 128, 16, 200),    # GQA, the benchmark's head size (vector path on AVX-512 and AVX2)
    (1, 8, 2, 64, 7, 200),       # one row: KV heads split across threads; blocks not a multiple of the tile
    (5, 12, 1, 80, 32, 200),     # MQA, head size without a vector path (plain C)
    (4, 4, 4, 16, 1, 200),       # MHA, one-token blocks
    # the vector paths' softmax chunks (16 tiles) and register row groups (AVX-512: 4 rows at 64, 2 at 128, 1 at
    # 256; AVX2: 3 rows):
    (3, 24, 4, 64, 16, 700),     # 6 query rows a KV head (a group of 4, one of 2), three chunks
    (3, 8, 2, 128, 5, 400),      # 5-token tiles: a chunk is 80 tokens
    (2, 6, 2, 256, 16, 300),     # head size 256, one row at a time
    # the AVX2 path's register groups (3 rows x 4 vectors): SmolLM2's heads, the CPU's 128-token blocks
    (4, 9, 3, 64, 128, 700),
    (2, 4, 4, 64, 16, 300),      # MHA in the vector path: one row where a register group holds 3
]


def assert_matches_dense(kernel, dtype, batch, hq, hkv, d, bs, max_len):
    q, k_cache, v_cache, tables, lens = paged_case(dtype, batch, hq, hkv, d, bs, max_len=max_len)
    out = native.paged_decode(kernel, q, k_cache, v_cache, tables, lens, d ** -0.5)
    assert out.shape == (batch, hq, d) and out.dtype == dtype
    ref = dense_attention(q, k_cache, v_cache, tables, lens, bs)
    err = (out.float() - ref).abs().max().item()
    if dtype == torch.float32:
        assert err < 1e-5
    else:   # only the final rounding to the storage dtype: at most one unit in the last place
        ulp = 2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -10
        assert err <= ulp * max(1.0, ref.abs().max().item())


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("batch,hq,hkv,d,bs,max_len", CASES)
def test_kernel_matches_dense_attention(dtype, batch, hq, hkv, d, bs, max_len):
    kernel = native.decode_kernel(dtype)
    assert kernel is not None
    assert_matches_dense(kernel, dtype, batch, hq, hkv, d, bs, max_len)


@needs_avx2_cpu
def test_the_avx2_build_matches_dense_attention(tmp_path):
    """CPUs with AVX2 but not AVX-512 (AMD Zen 2/3, Intel before Skylake-SP) take an 8-lane path: built here for
    such a CPU (-march=x86-64-v3) whatever this one has, over every case above, float and int8 caches."""
    lib = build_avx2(native.SOURCES[0], tmp_path / "paged_decode_avx2.so")
    for fn in (getattr(lib, symbol) for symbol in native._SYMBOLS.values()):
        fn.argtypes, fn.restype = native._ARGTYPES, ctypes.c_int
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for case in CASES:
            assert_matches_dense(getattr(lib, native._SYMBOLS[(dtype, dtype)]), dtype, *case)
        for hkv, d in ((2, 64), (4, 128), (1, 256)):
            q, k, v, tables, lens = paged_case(dtype, 5, 4, hkv, d, 16, max_len=300)
            k8, v8 = quantize_rows(k), quantize_rows(v)
            out = native.paged_decode(getattr(lib, native._SYMBOLS[(dtype, torch.int8)]), q, k8, v8, tables, lens,
                                      d ** -0.5).float()
            ref = dense_attention(q, dequantize_rows(k8, torch.float32), dequantize_rows(v8, torch.float32), tables,
                                  lens, 16)
            assert (out - ref).abs().max() < (1e-4 if dtype == torch.float32 else 2e-2)


@needs_compiler
@pytest.mark.parametrize("window", [1, 5, 16, 37])
@pytest.mark.parametrize("d,bs", [(128, 16), (80, 7)])
def test_kernel_sliding_window(window, d, bs):
    """window > 0: each row attends to its last `window` tokens (a window start inside a block, at a block
    boundary, longer than some contexts)."""
    kernel = native.decode_kernel(torch.float32)
    q, k_cache, v_cache, tables, lens = paged_case(torch.float32, 6, 8, 2, d, bs, seed=window, max_len=90)
    out = native.paged_decode(kernel, q, k_cache, v_cache, tables, lens, d ** -0.5, window)
    assert (out - dense_attention(q, k_cache, v_cache, tables, lens, bs, window)).abs().max().item() < 1e-5
    full = native.paged_decode(kernel, q, k_cache, v_cache, tables, lens, d ** -0.5)
    assert (out - full).abs().max().item() > 1e-3   # the window changed the answer


@needs_compiler
@pytest.mark.parametrize("window", [0, 9])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_backend_decode_equals_torch_backend(dtype, window):
    """Same metadata through both backends: the CPU backend's kernel agrees with gather + SDPA."""
    batch, hq, hkv, d, bs = 6, 8, 4, 64, 16
    q, k_cache, v_cache, tables, lens = paged_case(dtype, batch, hq, hkv, d, bs, seed=3)
    order = torch.argsort(lens)   # sorted by context length, as the runner orders decode rows (grouped gathers)
    q, tables, lens = q[order], tables[order], lens[order]
    meta = decode_meta(tables, lens)
    assert len(meta.decode_groups(bs)) > 1
    cpu = CpuAttentionBackend(hq, hkv, d)._decode(q, k_cache, v_cache, meta, window)
    ref = TorchAttentionBackend(hq, hkv, d)._decode(q, k_cache, v_cache, meta, window)
    tol = 1e-5 if dtype == torch.float32 else 2.0 ** -6
    assert (cpu.float() - ref.float()).abs().max().item() < tol


@needs_compiler
@pytest.mark.slow
def test_built_kernel_is_reused_from_the_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("PDCLUSTER_CACHE_DIR", str(tmp_path))
    native.load.cache_clear()
    try:
        assert native.load() is not None
        built = list(tmp_path.glob("paged_attention-*.so"))
        assert len(built) == 1
        native.load.cache_clear()
        monkeypatch.setattr(native, "_build", lambda *a: pytest.fail("rebuilt although the cached build exists"))
        assert native.load() is not None
    finally:
        native.load.cache_clear()


def test_without_a_compiler_the_cpu_backend_uses_the_torch_path(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("PDCLUSTER_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    native.load.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="pdcluster.engine.attention.native"):
            backend = CpuAttentionBackend(4, 2, 16)
        assert native.decode_kernel(torch.float32) is None
        assert "torch path" in caplog.text
        q, k_cache, v_cache, tables, lens = paged_case(torch.float32, 3, 4, 2, 16, 4, max_len=30)
        out = backend._decode(q, k_cache, v_cache, decode_meta(tables, lens))
        assert (out - dense_attention(q, k_cache, v_cache, tables, lens, 4)).abs().max().item() < 1e-5
    finally:
        native.load.cache_clear()
