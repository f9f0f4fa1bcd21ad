"""The native bf16 GEMV (engine/layers/bf16_gemv.c) and its use by engine/layers/linear.py: against an fp32-accumulated
reference within bf16 rounding, in its own packing (`bf16_blocks`, every block width it takes, both paths) and on
oneDNN's packed weights, read in place."""

from __future__ import annotations

import pytest
import torch
from bf16_helpers import assert_bf16_close, needs_native, reference

from pdcluster.engine.attention import native
from pdcluster.engine.layers.linear import GEMV_MAX_ROWS, Linear, cpu_packed, gemv_layout, linear


@needs_native
@pytest.mark.parametrize("portable", [False, True])
@pytest.mark.parametrize("block", [16, 32, 64])
@pytest.mark.parametrize("n,k", [(64, 64), (100, 70), (17, 575), (960, 576), (33, 1)])
def test_kernel_matches_fp32_reference(portable: bool, block: int, n: int, k: int) -> None:
    g = torch.Generator().manual_seed(n * k + block)
    w = torch.randn(n, k, generator=g).to(torch.bfloat16)
    bias = torch.randn(n, generator=g).to(torch.bfloat16)
    kpad = k + k % 2 + (32 if k > 64 else 0)   # (padded inputs are zeros in the weight: any x there is ignored)
    packed = native.bf16_blocks(w, block, kpad)
    for m in (1, 2, 3, 4, 5, 8, 9, 17):
        x = torch.randn(m, k, generator=g).to(torch.bfloat16)
        for b in (None, bias):
            got = native.bf16_gemm(x, packed.data_ptr(), n, block, kpad, b, portable=portable)
            assert got is not None
            assert_bf16_close(got, x, w, b)


@needs_native
def test_kernel_rejects_layouts_it_has_no_path_for() -> None:
    w = native.bf16_blocks(torch.zeros(16, 8, dtype=torch.bfloat16), 16)
    with pytest.raises(ValueError):
        native.bf16_gemm(torch.zeros(1, 8, dtype=torch.bfloat16), w.data_ptr(), 16, 24, 8)
    with pytest.raises(ValueError):   # k beyond the packed inputs
        native.bf16_gemm(torch.zeros(1, 10, dtype=torch.bfloat16), w.data_ptr(), 16, 16, 8)


def _gemv_packed(n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
    packed = cpu_packed(w)
    if packed is None or getattr(packed, "gemv", None) is None:
        pytest.skip("no oneDNN bf16 packing in the layout the native GEMV reads on this machine")
    return w, packed


@pytest.mark.parametrize("n,k", [(960, 576), (576, 1536), (100, 70), (17, 64), (49152 // 16, 576)])
def test_linear_on_onednn_packed_weight(n: int, k: int) -> None:
    w, packed = _gemv_packed(n, k)
    g = torch.Generator().manual_seed(1)
    bias = torch.randn(n, generator=g).to(torch.bfloat16)
    max_rows = packed.gemv[3]
    assert max_rows == GEMV_MAX_ROWS[packed.gemv[2]]
    for m in (1, 2, 4, max_rows, max_rows + 1, 40):
        x = torch.randn(m, k, generator=g).to(torch.bfloat16)
        onednn = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
        got = linear(x, w, bias, packed)
        if m > max_rows:   # oneDNN's own matmul: bitwise
            assert torch.equal(got, onednn)
        else:   # fp32 sums in another order: within bf16 rounding of the exact product, and of oneDNN's
            assert_bf16_close(got, x, w, bias)
            assert ((got.float() - onednn.float()).abs() <= 2 ** -7 * onednn.float().abs() + 1e-3).all()
    x3 = torch.randn(2, 3, k, generator=g).to(torch.bfloat16)   # leading dims, as any caller may pass
    assert_bf16_close(linear(x3, w, None, packed).reshape(6, n), x3.reshape(6, k), w)


def test_env_turns_the_gemv_off(monkeypatch: pytest.MonkeyPatch) -> None:
    _gemv_packed(64, 64)
    monkeypatch.setenv("PDCLUSTER_NATIVE_MATMUL", "0")
    packed = cpu_packed(torch.ones(64, 64, dtype=torch.bfloat16))
    assert packed is not None and packed.gemv is None


def test_fp32_weights_get_no_bf16_gemv() -> None:
    packed = cpu_packed(torch.ones(64, 64))
    if packed is None:
        pytest.skip("oneDNN not built into this torch")
    assert getattr(packed, "gemv", None) is None   # (oneDNN's fp32 packing, or the strips: tests/test_strips_gemm.py)


def _layer(w: torch.Tensor, bias: torch.Tensor | None = None) -> Linear:
    layer = Linear(w.shape[1], w.shape[0], bias=bias is not None).to(torch.bfloat16)
    layer.weight.data.copy_(w)
    if bias is not None:
        assert layer.bias is not None
        layer.bias.data.copy_(bias)
    layer.prepack()
    return layer


def test_linear_module_with_bias_lora_and_row_shards() -> None:
    """Linear.forward (bias, a LoRA delta added after the product) and a weight split by input columns as
    RowParallelLinear's ranks hold it: each rank's part through the GEMV, summed like the all-reduce."""
    w, _ = _gemv_packed(192, 576, seed=3)
    g = torch.Generator().manual_seed(4)
    bias = torch.randn(192, generator=g).to(torch.bfloat16)
    layer = _layer(w, bias)
    assert layer.packed is not None and layer.packed.gemv is not None and layer.weight.numel() == 0
    x = torch.randn(3, 576, generator=g).to(torch.bfloat16)
    base = layer(x)
    assert_bf16_close(base, x, w, bias)

    class Delta:   # the interface Linear.forward calls (engine/lora/layers.py LoRALayer.add_)
        def add_(self, x: torch.Tensor, out: torch.Tensor) -> None:
            out.add_(1.0)

    layer.lora = Delta()  # type: ignore[assignment]
    assert torch.equal(layer(x), base + 1.0)

    halves = [_layer(w[:, :288].contiguous()), _layer(w[:, 288:].contiguous())]
    assert all(h.packed is not None and h.packed.gemv is not None for h in halves)
    parts = [h(x[:, i * 288:(i + 1) * 288].contiguous()).float() for i, h in enumerate(halves)]
    want = reference(x, w)
    assert ((parts[0] + parts[1]).double() - want).abs().max() <= 2 ** -7 * want.abs().max()


def test_compiled_body_takes_the_eager_dispatch() -> None:
    """Under torch.compile `linear` calls the opaque engine/compiled.py packed_linear, whose body is the eager
    dispatch: the GEMV for decode rows, oneDNN's op beyond."""
    w, packed = _gemv_packed(64, 128)
    compiled = torch.compile(lambda x: linear(x, w, None, packed), backend="eager", fullgraph=True)
    g = torch.Generator().manual_seed(5)
    one, many = (torch.randn(m, 128, generator=g).to(torch.bfloat16) for m in (1, 3 * max(GEMV_MAX_ROWS.values())))
    assert torch.equal(compiled(one), linear(one, w, None, packed))
    assert_bf16_close(compiled(one), one, w)
    assert torch.equal(compiled(many), torch.ops.mkldnn._linear_pointwise(many, packed, None, "none", [], ""))


def test_the_layout_is_found_for_each_block_width_oneDNN_may_choose(monkeypatch: pytest.MonkeyPatch) -> None:
    """oneDNN packs 64-channel blocks on AVX512-BF16 and 32-channel ones with AMX: whichever this machine's did,
    the detection tries each width (the buffer size fixes the padding) and keeps the one whose product agrees;
    with only a wrong width to try it finds none."""
    w, packed = _gemv_packed(192, 200, seed=5)
    address, kpad, block, max_rows = packed.gemv
    assert block in native.BF16_BLOCKS and kpad >= 200 and max_rows == GEMV_MAX_ROWS[block]
    monkeypatch.setattr(native, "BF16_BLOCKS", tuple(b for b in native.BF16_BLOCKS if b != block))
    assert gemv_layout(packed, w) is None
    monkeypatch.setattr(native, "BF16_BLOCKS", (16, block))
    assert gemv_layout(packed, w) == (address, kpad, block, max_rows)
