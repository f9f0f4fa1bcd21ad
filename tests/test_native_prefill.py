"""The native CPU paged-prefill kernel (engine/attention/paged_prefill.c) against dense causal attention, and the
CPU backend's prefill against the torch backend's."""

from __future__ import annotations

import ctypes

import pytest
import torch
from avx2_build import build_avx2, cpu_flags, needs_avx2_cpu
from paged_decode_cases import dense_causal, needs_compiler, prefill_case

from pdcluster.engine.attention import native
from pdcluster.engine.attention.cpu_backend import CpuAttentionBackend
from pdcluster.engine.attention.metadata import PrefillChunk
from pdcluster.engine.attention.torch_backend import TorchAttentionBackend

needs_kernel = pytest.mark.skipif(not ({"avx512f"} <= cpu_flags() or {"avx2", "fma", "f16c"} <= cpu_flags()),
                                  reason="the prefill kernel has AVX-512 and AVX2 paths only")


def _tolerance(dtype, ref):
    if dtype == torch.float32:
        return 1e-5
    # the final rounding to the storage dtype, plus (bf16) p rounded to bf16 before the weighted V sum
    ulp = 2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -10
    return 2 * ulp * max(1.0, ref.abs().max().item())


@needs_compiler
@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("cached,n,hq,hkv,d,bs", CASES := [
    (0, 100, 9, 3, 64, 16),     # SmolLM2's heads: GQA 3, rows not a multiple of the 16-row item
    (37, 70, 8, 2, 128, 7),     # a chunk after cached context; blocks not a multiple of anything
    (0, 300, 4, 4, 256, 16),    # MHA, the widest head
    (130, 1, 4, 1, 64, 1),      # one row (a one-token chunk), one-token blocks, MQA
    (64, 64, 2, 1, 64, 64),     # tile-aligned everything
    (200, 40, 6, 2, 128, 16),   # items of 16, 16 and 8 rows (AVX2: every row group of its two passes) over 4 tiles
])
def test_kernel_matches_dense_attention(dtype, cached, n, hq, hkv, d, bs):
    assert_matches_dense(native.prefill_kernel(dtype), dtype, cached, n, hq, hkv, d, bs)


def assert_matches_dense(kernel, dtype, cached, n, hq, hkv, d, bs, window=0, int8=False, q_scale=1.0):
    """q_scale: sharper softmaxes (scores far below a row's maximum underflow to 0; both sides' rounding errors grow
    with the scores)."""
    assert kernel is not None
    q, k, v, k_cache, v_cache, table = prefill_case(dtype, cached, n, hq, hkv, d, bs, seed=n + window, int8=int8)
    q = q * q_scale if q_scale != 1.0 else q
    first = max(0, cached - window + 1) if window else 0
    for b in range(first // bs):   # a released block may hold anything: the window must keep the kernel out
        k_cache[table[b]] = float("nan")
        v_cache[table[b]] = float("nan")
    out = native.paged_prefill(kernel, q, k_cache, v_cache, table, cached, d ** -0.5, window)
    assert out is not None and out.shape == (n, hq, d) and out.dtype == dtype
    ref = dense_causal(q, k, v, cached, window)
    assert (out.float() - ref).abs().max().item() <= _tolerance(dtype, ref) * q_scale


@needs_avx2_cpu
def test_the_avx2_build_matches_dense_attention(tmp_path):
    """CPUs with AVX2 but not AVX-512 (AMD Zen 2/3, Intel before Skylake-SP) take an 8-lane path: built here for
    such a CPU (-march=x86-64-v3) whatever this one has, over every case above for each query dtype, an int8 pool,
    and sliding windows."""
    lib = build_avx2(native.SOURCES[1], tmp_path / "paged_prefill_avx2.so")
    for fn in (getattr(lib, symbol) for symbol in native._PREFILL_SYMBOLS.values()):
        fn.argtypes, fn.restype = native._PREFILL_ARGTYPES, ctypes.c_int
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        kernel = getattr(lib, native._PREFILL_SYMBOLS[(dtype, dtype)])
        for case in CASES:
            assert_matches_dense(kernel, dtype, *case)
        for window in (1, 40, 500):
            assert_matches_dense(kernel, dtype, 90, 80, 6, 2, 64, 16, window=window)
        assert_matches_dense(kernel, dtype, 100, 30, 4, 2, 64, 16, q_scale=40.0)
        assert_matches_dense(getattr(lib, native._PREFILL_SYMBOLS[(dtype, torch.int8)]), dtype, 20, 50, 8, 2, 64, 16,
                             int8=True)


@needs_compiler
@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [1, 5, 40, 64, 500])
def test_kernel_sliding_window(window, dtype):
    """Rows see their last `window` positions; the cache before the window's first position is never read
    (its blocks are poisoned with NaN here, as a released block may hold anything). bf16: the AMX path where the
    CPU has it."""
    assert_matches_dense(native.prefill_kernel(dtype), dtype, 90, 80, 6, 2, 64, 16, window=window)


@needs_compiler
@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_int8_cache(dtype):
    """An int8 pool: rows dequantized with their fp16 scale, as the torch path reads them."""
    q, k, v, k_cache, v_cache, table = prefill_case(dtype, 20, 50, 8, 2, 64, 16, int8=True)
    out = native.paged_prefill(native.prefill_kernel(dtype, torch.int8), q, k_cache, v_cache, table, 20, 0.125)
    ref = dense_causal(q, k, v, 20)
    assert out is not None and (out.float() - ref).abs().max().item() <= _tolerance(dtype, ref)


@needs_compiler
def test_head_size_without_a_path_returns_none():
    kernel = native.prefill_kernel(torch.float32)
    q, _, _, k_cache, v_cache, table = prefill_case(torch.float32, 0, 10, 4, 2, 80, 16)
    assert native.paged_prefill(kernel, q, k_cache, v_cache, table, 0, 80 ** -0.5) is None


@needs_compiler
def test_refuses_a_table_too_short_for_the_positions():
    q, _, _, k_cache, v_cache, table = prefill_case(torch.float32, 30, 10, 4, 2, 64, 16)
    with pytest.raises(ValueError, match="cannot hold"):
        native.paged_prefill(native.prefill_kernel(torch.float32), q, k_cache, v_cache, table[:2], 30, 0.125)


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cached,window", [(0, 0), (50, 0), (50, 33)])
def test_cpu_backend_prefill_equals_torch_backend(dtype, cached, window):
    """One chunk through both backends' `_prefill` (the torch one: SDPA): same answer (d 80 falls back)."""
    for d in (64, 80):
        n, hq, hkv, bs = 45, 8, 4, 16
        q, k, v, k_cache, v_cache, table = prefill_case(dtype, cached, n, hq, hkv, d, bs, seed=cached + d)
        chunk = PrefillChunk(start=0, end=n, num_cached=cached, block_table=table)
        new_k, new_v = k[cached:], v[cached:]
        cpu = CpuAttentionBackend(hq, hkv, d)._prefill(q, new_k, new_v, k_cache, v_cache, chunk, window)
        ref = TorchAttentionBackend(hq, hkv, d)._prefill(q, new_k, new_v, k_cache, v_cache, chunk, window)
        tol = 1e-5 if dtype == torch.float32 else 2.0 ** -5
        assert (cpu.float() - ref.float()).abs().max().item() < tol


@needs_compiler
@pytest.mark.parametrize("amx,amx_kernel", [(False, False), (True, False), (True, True)])
def test_cpu_backend_prefill_takes_torch_flash_where_the_cpu_has_amx(monkeypatch, amx, amx_kernel):
    """With AMX for the query dtype, a bf16 prefill goes to the kernel's AMX path where the library has it
    (`native.prefill_amx`: faster than torch's flash SDPA, docs/benchmarks.md "Prefill attention"), else to torch's
    flash SDPA (on the tiles, 3-4x the AVX512-BF16 kernel); without AMX, and for an int8 pool either way, to the
    native kernel."""
    from pdcluster.engine.attention import cpu_backend

    monkeypatch.setattr(cpu_backend, "cpu_has_amx", lambda dtype: amx and dtype == torch.bfloat16)
    monkeypatch.setattr(native, "prefill_amx", lambda: amx_kernel)
    calls = []
    real = native.paged_prefill
    monkeypatch.setattr(native, "paged_prefill", lambda *a, **kw: calls.append(a[1].dtype) or real(*a, **kw))
    n, hq, hkv, d, bs, cached = 45, 8, 4, 64, 16, 50
    for dtype in (torch.float32, torch.bfloat16):
        q, k, v, k_cache, v_cache, table = prefill_case(dtype, cached, n, hq, hkv, d, bs, seed=3)
        chunk = PrefillChunk(start=0, end=n, num_cached=cached, block_table=table)
        out = CpuAttentionBackend(hq, hkv, d)._prefill(q, k[cached:], v[cached:], k_cache, v_cache, chunk, 0)
        ref = TorchAttentionBackend(hq, hkv, d)._prefill(q, k[cached:], v[cached:], k_cache, v_cache, chunk, 0)
        if amx and not amx_kernel and dtype == torch.bfloat16:
            assert torch.equal(out, ref)
    native_bf16 = not amx or amx_kernel
    assert calls == ([torch.float32, torch.bfloat16] if native_bf16 else [torch.float32])
    assert CpuAttentionBackend._native_prefill(torch.zeros(1, dtype=torch.bfloat16), torch.zeros(1, dtype=torch.int8))


def test_the_environment_switch_sends_every_prefill_to_the_torch_path(monkeypatch):
    """PDCLUSTER_NATIVE_PREFILL=0 at import (native.NATIVE_PREFILL): for A/B runs (benchmarks/env_ab.py)."""
    q, k = torch.zeros(1), torch.zeros(1, dtype=torch.int8)
    assert CpuAttentionBackend._native_prefill(q, q) and CpuAttentionBackend._native_prefill(q, k)   # fp32: no AMX
    monkeypatch.setattr(native, "NATIVE_PREFILL", False)
    assert not CpuAttentionBackend._native_prefill(q, q) and not CpuAttentionBackend._native_prefill(q, k)
