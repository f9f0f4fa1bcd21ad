"""The strip matmul (engine/layers/strips_gemm.c): the strip layout, the product of bf16 and fp32 weights against an
fp64 reference (bf16 outputs within bf16 rounding; vector and plain C paths, every tail), and engine/layers/linear.py
choosing it where oneDNN refuses a bf16 weight and for fp32 weights on CPUs with AVX2 and no AVX-512."""

from __future__ import annotations

import pytest
import torch
from bf16_helpers import assert_bf16_close, needs_native, reference

from pdcluster.engine.attention import native
from pdcluster.engine.layers.linear import Linear, cpu_packed, strips_for_fp32, strips_packed

needs_vector = pytest.mark.skipif(not native.strips_vector_level() > 0, reason="no AVX2 + FMA on this CPU")


@needs_native
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n", [16, 40, 7])
def test_strip_layout_holds_each_weight_once_in_strip_order(n: int, dtype: torch.dtype) -> None:
    k = 5
    w = torch.arange(n * k, dtype=torch.float32).reshape(n, k).to(dtype)
    packed = native.strips_layout(w)
    assert packed.shape == w.shape and packed.dtype == dtype and packed.is_contiguous()
    flat = packed.reshape(-1)
    for c in range(n):
        s, j = divmod(c, native.STRIP)
        width = min(native.STRIP, n - s * native.STRIP)
        for i in range(k):
            assert flat[s * native.STRIP * k + i * width + j] == w[c, i]


@needs_native
@pytest.mark.parametrize("portable", [False, True])
@pytest.mark.parametrize("n,k", [(16, 1), (40, 7), (1536, 576), (35, 600), (200, 300)])
def test_product_matches_fp32_reference(portable: bool, n: int, k: int) -> None:
    """Row counts around the register tile (6) and the work item (48); k past one pass (256); n with a narrow last
    strip; bf16 and fp32 activations, with and without a bias."""
    if not portable and not native.strips_vector_level() > 0:
        pytest.skip("no AVX2 + FMA on this CPU")
    g = torch.Generator().manual_seed(n * k)
    w = torch.randn(n, k, generator=g).to(torch.bfloat16)
    bias = torch.randn(n, generator=g).to(torch.bfloat16)
    packed = native.strips_layout(w)
    for m in (1, 5, 6, 7, 13, 48, 50, 97):
        x = torch.randn(m, k, generator=g).to(torch.bfloat16)
        for b in (None, bias):
            got = native.strips_gemm(x, packed, b, portable=portable)
            assert got is not None
            assert_bf16_close(got, x, w, b)
        got32 = native.strips_gemm(x.float(), packed, bias.float(), portable=portable)
        assert got32 is not None and got32.dtype == torch.float32
        want = reference(x, w, bias)
        assert ((got32.double() - want).abs() <= 2 ** -20 * (x.double().abs() @ w.double().abs().T) + 1e-6).all()


@needs_native
@pytest.mark.parametrize("portable", [False, True])
@pytest.mark.parametrize("n,k", [(16, 1), (40, 7), (35, 600), (200, 300)])
def test_fp32_weights_match_fp64_reference(portable: bool, n: int, k: int) -> None:
    """fp32 weights: fp32 sums of fp32 products, so within fp32 summation error of the exact product."""
    if not portable and not native.strips_vector_level() > 0:
        pytest.skip("no AVX2 + FMA on this CPU")
    g = torch.Generator().manual_seed(n + k)
    w, bias = torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    packed = native.strips_layout(w)
    for m in (1, 6, 7, 48, 97):
        x = torch.randn(m, k, generator=g)
        for b in (None, bias):
            got = native.strips_gemm(x, packed, b, portable=portable)
            assert got is not None and got.dtype == torch.float32
            slack = 2 ** -20 * (x.double().abs() @ w.double().abs().T) + 1e-6
            assert ((got.double() - reference(x, w, b)).abs() <= slack).all()


@needs_native
def test_weights_past_the_cache_bound_go_strip_major() -> None:
    """A weight over BIG_WEIGHT (16 MiB) with rows in several chunks: the strip-major order, same product."""
    g = torch.Generator().manual_seed(11)
    w = torch.randn(8200, 520, generator=g)   # 17 MB of fp32, a narrow last strip
    x = torch.randn(100, 520, generator=g)
    got = native.strips_gemm(x, native.strips_layout(w), portable=not native.strips_vector_level() > 0)
    assert got is not None
    assert ((got.double() - reference(x, w)).abs() <= 2 ** -20 * (x.double().abs() @ w.double().abs().T) + 1e-6).all()


@needs_native
def test_strided_rows_of_x_are_read_in_place() -> None:
    g = torch.Generator().manual_seed(3)
    w = torch.randn(48, 64, generator=g).to(torch.bfloat16)
    x = torch.randn(9, 100, generator=g)[:, 10:74]   # fp32 rows 100 apart
    got = native.strips_gemm(x, native.strips_layout(w), portable=not native.strips_vector_level() > 0)
    assert got is not None
    assert ((got.double() - reference(x, w)).abs() <= 1e-4).all()


@needs_vector
def test_linear_uses_strips_where_onednn_packs_no_bf16_weight(monkeypatch) -> None:
    """Wherever this runs: oneDNN's refusal is forced, the layer then multiplies through the strips (its dense weight
    released), equal to the fp32 product within bf16 rounding, for a decode row and a prompt's rows."""
    def refuse(*args, **kwargs):
        raise RuntimeError("no bf16 packing on this CPU")

    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", refuse)
    g = torch.Generator().manual_seed(5)
    layer = Linear(96, 80, bias=True)
    w = torch.randn(80, 96, generator=g).to(torch.bfloat16)
    layer.to(torch.bfloat16)
    layer.weight.data.copy_(w)
    layer.bias.data.copy_(torch.randn(80, generator=g).to(torch.bfloat16))
    bias = layer.bias.detach().clone()
    layer.prepack()
    assert getattr(layer.packed, "strips", False) and layer.weight.numel() == 0
    for m in (1, 33):
        x = torch.randn(2, m, 96, generator=g).to(torch.bfloat16)
        y = layer(x)
        assert y.shape == (2, m, 80)
        assert_bf16_close(y.reshape(-1, 80), x.reshape(-1, 96), w, bias)
    monkeypatch.setenv("PDCLUSTER_NATIVE_MATMUL", "0")
    assert strips_packed(w) is None   # the A/B switch


@needs_vector
@pytest.mark.parametrize("level", [1, 2])
def test_fp32_weights_take_strips_only_without_avx512(monkeypatch, level: int) -> None:
    """AVX2 without AVX-512 (level 1): fp32 layers multiply through the strips, equal to the exact product within
    fp32 summation error; with AVX-512 (level 2) oneDNN's packing stays."""
    monkeypatch.setattr(native, "strips_vector_level", lambda: level)
    g = torch.Generator().manual_seed(8)
    layer = Linear(96, 80, bias=True)
    w, bias = torch.randn(80, 96, generator=g), torch.randn(80, generator=g)
    layer.weight.data.copy_(w)
    layer.bias.data.copy_(bias)
    layer.prepack()
    assert strips_for_fp32() == (level == 1)
    assert bool(getattr(layer.packed, "strips", False)) == (level == 1) and layer.weight.numel() == 0
    x = torch.randn(33, 96, generator=g)
    slack = 2 ** -20 * (x.double().abs() @ w.double().abs().T) + 1e-5
    assert ((layer(x).double() - reference(x, w, bias)).abs() <= slack).all()
    monkeypatch.setenv("PDCLUSTER_NATIVE_MATMUL", "0")
    assert not strips_for_fp32() and not getattr(cpu_packed(w), "strips", False)
