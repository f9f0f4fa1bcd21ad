"""bf16 weights on CPUs where oneDNN packs none (engine/layers/bf16_strips.c): the strip layout, the product against
an fp32-accumulated reference within bf16 rounding (vector and plain C paths, every tail), and engine/layers/linear.py
choosing it where oneDNN refuses a bf16 weight."""

from __future__ import annotations

import pytest
import torch
from bf16_helpers import assert_bf16_close, needs_native, reference

from pdcluster.engine.attention import native
from pdcluster.engine.layers.linear import Linear, onednn_packed, strips_packed

needs_vector = pytest.mark.skipif(not native.bf16_strips_vectorized(), reason="no AVX2 + FMA on this CPU")


@needs_native
@pytest.mark.parametrize("n", [16, 40, 7])
def test_strip_layout_holds_each_weight_once_in_strip_order(n: int) -> None:
    k = 5
    w = torch.arange(n * k, dtype=torch.float32).reshape(n, k).to(torch.bfloat16)
    packed = native.bf16_strips(w)
    assert packed.shape == w.shape and packed.is_contiguous()
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
    if not portable and not native.bf16_strips_vectorized():
        pytest.skip("no AVX2 + FMA on this CPU")
    g = torch.Generator().manual_seed(n * k)
    w = torch.randn(n, k, generator=g).to(torch.bfloat16)
    bias = torch.randn(n, generator=g).to(torch.bfloat16)
    packed = native.bf16_strips(w)
    for m in (1, 5, 6, 7, 13, 48, 50, 97):
        x = torch.randn(m, k, generator=g).to(torch.bfloat16)
        for b in (None, bias):
            got = native.bf16_strips_gemm(x, packed, b, portable=portable)
            assert got is not None
            assert_bf16_close(got, x, w, b)
        got32 = native.bf16_strips_gemm(x.float(), packed, bias.float(), portable=portable)
        assert got32 is not None and got32.dtype == torch.float32
        want = reference(x, w, bias)
        assert ((got32.double() - want).abs() <= 2 ** -20 * (x.double().abs() @ w.double().abs().T) + 1e-6).all()


@needs_native
def test_strided_rows_of_x_are_read_in_place() -> None:
    g = torch.Generator().manual_seed(3)
    w = torch.randn(48, 64, generator=g).to(torch.bfloat16)
    x = torch.randn(9, 100, generator=g)[:, 10:74]   # fp32 rows 100 apart
    got = native.bf16_strips_gemm(x, native.bf16_strips(w), portable=not native.bf16_strips_vectorized())
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
    assert onednn_packed(w.float()) is None   # only bf16 weights: an fp32 one keeps F.linear where oneDNN refuses
    monkeypatch.setenv("PDCLUSTER_BF16_GEMV", "0")
    assert strips_packed(w) is None   # the A/B switch
