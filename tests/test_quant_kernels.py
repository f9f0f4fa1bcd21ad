"""The quantized matmuls (engine/quant/kernels.py) against straightforward fp32 references, per scheme, activation
dtype and shape: weight-only schemes against F.linear with the dequantized weight; W8A8 against per-token (or
per-tensor) quantization of x, an exact integer matmul and the rescale. The CPU must pick the fast kernels. The NPU
branch runs under a fake torch_npu whose operators follow the documented numeric contracts."""

from __future__ import annotations

import sys
from types import ModuleType

import pytest
import torch
import torch.nn.functional as F

from pdcluster.engine.quant.kernels import (
    ONEDNN_INT8_MIN_WEIGHTS,
    _native_w8a8,
    _onednn_int8_exact,
    pack,
    quant_linear,
    quantize_activations_dynamic,
    quantize_activations_static,
    resident_bytes,
)
from pdcluster.engine.quant.scheme import QuantizedWeight, QuantScheme, quantize_weight

CPU = torch.device("cpu")
W8A8_DYNAMIC = QuantScheme(8, 0, True, "int8_dynamic")
W8A8_STATIC = QuantScheme(8, 0, True, "int8_static")
CASES = [  # (scheme, the kernel the CPU takes)
    (QuantScheme(8), "int8pack"),
    (QuantScheme(8, 128), "dequantized"),
    (QuantScheme(8, 0, symmetric=False), "dequantized"),
    (QuantScheme(4, 32), "int4pack"),
    (QuantScheme(4, 128), "int4pack"),
    (QuantScheme(4, 32, symmetric=False), "int4pack"),
    (QuantScheme(4, 128, symmetric=False), "int4pack"),
    (QuantScheme(4, 0), "int4pack"),
    (W8A8_DYNAMIC, "int8mm"),
    (W8A8_STATIC, "int8mm"),
]
SHAPES = [(96, 256), (200, 512)]                        # (out, in): odd out widths (200: int4 pads to 208)
ROWS = [(1,), (7,), (32,), (2, 5)]
# max |got - want| / max |want|: fp32 is summation order only; bf16 is the output's rounding (2^-9) plus, for the
# int8 / int4 kernels, the scales rounded to bf16
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1.2e-2}


def _weight(scheme: QuantScheme, out_features: int, in_features: int) -> QuantizedWeight:
    torch.manual_seed(out_features + in_features + scheme.weight_bits)
    qw = quantize_weight(torch.randn(out_features, in_features) * 0.05, scheme)
    qw.scheme = scheme
    if scheme.activations == "int8_static":
        qw.input_scale, qw.input_offset = torch.tensor(0.021), torch.tensor(-3.0)
    return qw


def _reference(x: torch.Tensor, qw: QuantizedWeight, scheme: QuantScheme, bias: torch.Tensor | None) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1]).to(torch.float32)
    if scheme.activations == "none":
        y = F.linear(rows, qw.dequantize())
    else:
        if scheme.activations == "int8_dynamic":
            scale = rows.abs().amax(dim=1, keepdim=True).clamp(min=1e-10) / 127.0
            xq = torch.round(rows / scale).clamp(-127, 127)
        else:
            assert qw.input_scale is not None and qw.input_offset is not None
            scale = qw.input_scale
            xq = (torch.round(rows / scale) + qw.input_offset).clamp(-128, 127) - qw.input_offset
        acc = xq.to(torch.float64) @ qw.qweight.to(torch.float64).t()          # exact
        y = (acc * scale.to(torch.float64) * qw.scales[:, 0].to(torch.float64)).to(torch.float32)
    if bias is not None:
        y = y + bias.to(torch.float32)
    return y.reshape(*x.shape[:-1], -1)


def _check(packed, qw, scheme, dtype, in_features, bias) -> None:
    for lead in ROWS:
        x = torch.randn(*lead, in_features).to(dtype)
        got = quant_linear(x, packed, bias)
        want = _reference(x, qw, scheme, bias)
        assert got.shape == want.shape and got.dtype == dtype
        err = float((got.to(torch.float32) - want).abs().max() / want.abs().max())
        assert err < TOLERANCE[dtype], (lead, err)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("scheme, kernel", CASES, ids=lambda c: getattr(c, "name", None) and
                         f"{c.name}-g{c.group_size}-{'sym' if c.symmetric else 'asym'}-{c.activations}")
def test_cpu_kernels_equal_the_reference(scheme, kernel, shape, dtype):
    out_features, in_features = shape
    qw = _weight(scheme, out_features, in_features)
    bias = torch.randn(out_features).to(dtype) if out_features == 200 else None
    packed = pack(qw, scheme, CPU, dtype)
    assert packed.kernel == kernel                 # the fast kernel, not the fallback
    if kernel == "int8mm":   # ours wherever it builds; else small layers: oneDNN's per-call overhead is not worth it
        assert packed.variant == ("native" if _native_w8a8() else "int_mm")
    _check(packed, qw, scheme, dtype, in_features, bias)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("scheme", [W8A8_DYNAMIC, W8A8_STATIC], ids=["dynamic", "static"])
@pytest.mark.parametrize("kernel, variant", [("int8mm", "int_mm"), ("int8mm", "onednn"), ("int8mm", "native"),
                                             ("dequantized", None)])
def test_every_w8a8_path_equals_the_integer_reference(scheme, kernel, variant, dtype):
    if variant == "onednn" and not _onednn_int8_exact():
        pytest.skip("oneDNN's u8 x s8 GEMM saturates on this CPU")
    if variant == "native" and not _native_w8a8():
        pytest.skip("the native library did not build")
    qw = _weight(scheme, 200, 512)
    bias = torch.randn(200).to(dtype)
    packed = pack(qw, scheme, CPU, dtype, kernel=kernel, variant=variant)
    _check(packed, qw, scheme, dtype, 512, bias)


def test_large_w8a8_layers_take_native_else_onednn_where_it_is_exact():
    qw = quantize_weight(torch.randn(ONEDNN_INT8_MIN_WEIGHTS // 1024, 1024), W8A8_DYNAMIC)
    packed = pack(qw, W8A8_DYNAMIC, CPU, torch.bfloat16)
    want = "native" if _native_w8a8() else "onednn" if _onednn_int8_exact() else "int_mm"
    assert packed.kernel == "int8mm" and packed.variant == want


def test_shapes_the_fast_kernels_cannot_take_fall_back(monkeypatch):
    from pdcluster.engine.attention import native

    monkeypatch.setattr(native, "load", lambda: None)   # no native library: W8A16 takes torch's int8pack_mm
    for scheme, in_features in ((QuantScheme(8), 200), (QuantScheme(4, 16), 256), (QuantScheme(4, 0), 200)):
        qw = _weight(scheme, 96, in_features)
        packed = pack(qw, scheme, CPU, torch.float32)
        assert packed.kernel == "dequantized", scheme   # int8pack_mm needs in % 16, int4pack groups of 32k
        _check(packed, qw, scheme, torch.float32, in_features, torch.randn(96))
    qw = _weight(QuantScheme(8), 96, 256)
    packed = pack(qw, QuantScheme(8), CPU, torch.bfloat16)
    assert (packed.kernel, packed.variant) == ("int8pack", "aten") and packed.weight.shape == (96, 256)
    _check(packed, qw, QuantScheme(8), torch.bfloat16, 256, None)


def test_packed_weights_take_their_bits():
    dense = 1024 * 2048 * 2   # bf16
    sizes = {}
    for name, scheme in (("w8a16", QuantScheme(8)), ("w8a8", W8A8_DYNAMIC), ("w4a16", QuantScheme(4, 128)),
                         ("w4a16-asym", QuantScheme(4, 128, symmetric=False))):
        qw = quantize_weight(torch.randn(1024, 2048), scheme)
        sizes[name] = resident_bytes(pack(qw, scheme, CPU, torch.bfloat16))
    assert 0.5 * dense <= sizes["w8a16"] < 0.51 * dense and 0.5 * dense <= sizes["w8a8"] < 0.51 * dense
    # int4: half of int8, plus a bf16 scale and zero per 128 weights (1.6 %)
    assert 0.25 * dense <= sizes["w4a16"] < 0.27 * dense and sizes["w4a16-asym"] == sizes["w4a16"]
    int_mm = resident_bytes(pack(quantize_weight(torch.randn(1024, 2048), W8A8_DYNAMIC), W8A8_DYNAMIC, CPU,
                                 torch.bfloat16, kernel="int8mm", variant="int_mm"))
    assert 0.5 * dense <= int_mm < 0.51 * dense


# --- NPU: the torch_npu operators vLLM-Ascend calls, emulated from their documented numeric contracts ---

def _unpack_int4(w: torch.Tensor) -> torch.Tensor:
    """int32 [k, n / 8] (8 signed nibbles, lowest first) -> int32 [k, n]."""
    nibbles = torch.stack([(w >> (4 * i)) & 15 for i in range(8)], dim=-1).reshape(w.shape[0], -1)
    return torch.where(nibbles > 7, nibbles - 16, nibbles)


def _fake_torch_npu() -> ModuleType:
    npu = ModuleType("torch_npu")
    calls: list[str] = []

    def convert_weight_to_int4pack(w: torch.Tensor) -> torch.Tensor:
        assert w.dtype == torch.int32 and w.shape[1] % 8 == 0 and int(w.min()) >= -8 and int(w.max()) <= 7
        u = (w & 15).reshape(w.shape[0], -1, 8)
        return sum(u[..., i] << (4 * i) for i in range(8)).to(torch.int32)

    def weight_quant_batchmatmul(x, weight, antiquant_scale, antiquant_offset=None, quant_scale=None,
                                 quant_offset=None, bias=None, antiquant_group_size=0):
        calls.append("npu_weight_quant_batchmatmul")
        assert x.dtype in (torch.float16, torch.bfloat16) and antiquant_scale.dtype == x.dtype
        w = (_unpack_int4(weight) if weight.dtype == torch.int32 else weight).to(torch.float32)   # [k, n]
        expand = (lambda t: t.to(torch.float32).repeat_interleave(antiquant_group_size, dim=0)) \
            if antiquant_group_size else (lambda t: t.to(torch.float32).reshape(1, -1))
        if antiquant_offset is not None:
            assert antiquant_offset.shape == antiquant_scale.shape
            w = w + expand(antiquant_offset)
        y = x.to(torch.float32) @ (w * expand(antiquant_scale))
        return (y if bias is None else y + bias.to(torch.float32)).to(x.dtype)

    def dynamic_quant(x):
        scale = x.to(torch.float32).abs().amax(dim=-1).clamp(min=1e-10) / 127.0
        return torch.round(x.to(torch.float32) / scale[..., None]).clamp(-127, 127).to(torch.int8), scale

    def quantize(x, scales, zero_points, dtype, axis=-1, div_mode=True):
        assert dtype == torch.qint8 and not div_mode
        return torch.round(x.to(torch.float32) * scales.to(torch.float32) + zero_points.to(torch.float32)) \
            .clamp(-128, 127).to(torch.int8)

    def quant_matmul(x1, x2, scale, offset=None, pertoken_scale=None, bias=None, output_dtype=None):
        calls.append("npu_quant_matmul")
        assert x1.dtype == torch.int8 and x2.dtype == torch.int8 and x1.shape[-1] == x2.shape[0]
        acc = (x1.to(torch.int64) @ x2.to(torch.int64)).to(torch.float64)
        if bias is not None and bias.dtype == torch.int32:     # int32 bias joins the accumulator
            acc, bias = acc + bias.to(torch.float64), None
        y = acc * scale.to(torch.float64)
        if pertoken_scale is not None:
            y = y * pertoken_scale.to(torch.float64)[:, None]
        if bias is not None:
            y = y + bias.to(torch.float64)
        return y.to(output_dtype)

    npu.npu_convert_weight_to_int4pack = convert_weight_to_int4pack
    npu.npu_weight_quant_batchmatmul = weight_quant_batchmatmul
    npu.npu_dynamic_quant = dynamic_quant
    npu.npu_quantize = quantize
    npu.npu_quant_matmul = quant_matmul
    npu.calls = calls
    return npu


NPU_CASES = [(QuantScheme(8), "npu_wqbmm"), (QuantScheme(8, 0, symmetric=False), "npu_wqbmm"),
             (QuantScheme(4, 32), "npu_wqbmm"), (QuantScheme(4, 128, symmetric=False), "npu_wqbmm"),
             (W8A8_DYNAMIC, "npu_w8a8"), (W8A8_STATIC, "npu_w8a8_static")]


@pytest.mark.parametrize("scheme, kernel", NPU_CASES, ids=lambda c: getattr(c, "name", None) and
                         f"{c.name}-g{c.group_size}-{'sym' if c.symmetric else 'asym'}-{c.activations}")
def test_npu_branch_under_emulated_torch_npu(monkeypatch, scheme, kernel):
    """The NPU layouts and arguments (tensors stay on the CPU: the emulated ops run there)."""
    fake = _fake_torch_npu()
    monkeypatch.setitem(sys.modules, "torch_npu", fake)
    qw = _weight(scheme, 96, 256)
    bias = torch.randn(96).bfloat16()
    packed = pack(qw, scheme, CPU, torch.bfloat16, kernel=kernel)
    _check(packed, qw, scheme, torch.bfloat16, 256, bias)
    assert fake.calls and set(fake.calls) <= {"npu_weight_quant_batchmatmul", "npu_quant_matmul"}
    if scheme.weight_bits == 4:
        assert packed.weight.dtype == torch.int32 and packed.weight.shape == (256, 96 // 8)


# ---- CUDA paths, checked here without a GPU (tests/test_quant_cuda.py runs them on one) -------------------------

def test_int_mm_pads_decode_rows_past_the_cuda_minimum():
    from pdcluster.engine.quant.kernels import CUDA_INT_MM_MIN_ROWS, int_mm

    g = torch.Generator().manual_seed(0)
    b = torch.randint(-127, 128, (24, 64), generator=g, dtype=torch.int8)
    for rows in (1, 5, 16, 17, 40):
        a = torch.randint(-127, 128, (rows, 64), generator=g, dtype=torch.int8)
        got = int_mm(a, b.t(), CUDA_INT_MM_MIN_ROWS)
        assert got.shape == (rows, 24) and torch.equal(got, a.to(torch.int32) @ b.to(torch.int32).t())


def test_tinygemm_nibbles_put_even_columns_in_the_high_nibble():
    from pdcluster.engine.quant.kernels import tinygemm_inner_k_tiles, tinygemm_nibbles

    q = torch.randint(0, 16, (8, 64), generator=torch.Generator().manual_seed(1), dtype=torch.int32)
    packed = tinygemm_nibbles(q)
    assert packed.dtype == torch.uint8 and packed.shape == (8, 32)
    assert torch.equal(packed.to(torch.int32) >> 4, q[:, ::2]) and torch.equal(packed.to(torch.int32) & 15, q[:, 1::2])
    assert [tinygemm_inner_k_tiles(n) for n in (4096, 576, 96)] == [8, 4, 2]


@pytest.mark.parametrize("works", [True, False])
def test_cuda_kernel_choice_follows_the_probes(works, monkeypatch):
    """On a CUDA device each scheme takes torch's CUDA kernel where the probe found it working, else the weight is
    dequantized at load; W4A16 only with bf16 activations (tinygemm's)."""
    from pdcluster.engine.quant import kernels

    monkeypatch.setattr(kernels, "_cuda_kernel_works", lambda kind, device: works)
    cuda = torch.device("cuda")
    cases = {(QuantScheme(8, 0, True, "int8_dynamic"), torch.bfloat16): "int8mm",
             (QuantScheme(8, 0, True), torch.bfloat16): "int8pack",
             (QuantScheme(4, 128, True), torch.bfloat16): "int4pack",
             (QuantScheme(4, 128, True), torch.float16): "dequantized",
             (QuantScheme(8, 128, True), torch.bfloat16): "dequantized"}
    for (scheme, dtype), kernel in cases.items():
        qw = quantize_weight(torch.randn(64, 256), scheme)
        assert kernels._choose(qw, scheme, cuda, dtype) == (kernel if works else "dequantized"), (scheme, dtype)


# ---- the native W8A16 kernel (engine/quant/int8_gemv.c) --------------------------------------------------------

def _native():
    from pdcluster.engine.attention import native

    if native.load() is None:
        pytest.skip("no C compiler: the native kernels are not built")
    return native


def test_int8_blocks_layout():
    native = _native()
    q = torch.randint(-128, 128, (35, 9), generator=torch.Generator().manual_seed(0), dtype=torch.int8)
    w = native.int8_blocks(q)
    assert w.shape == (3, 10, 16) and w.dtype == torch.int8    # ceil(35 / 16) blocks, 9 inputs padded to 10
    for b, i, c in ((0, 0, 0), (0, 1, 0), (1, 7, 7), (2, 8, 2)):
        assert w[b, i, c] == q[16 * b + c, i]
    assert not w[2, :, 3:].any() and not w[:, 9].any()          # padding: channels 35.., input 9


# (n, k): whole blocks and pairs, n not a multiple of 16, k odd, k = 1, and a k whose rows overflow a panel
GEMM_SHAPES = [(96, 576), (40, 100), (17, 7), (33, 1), (20, 4099)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", GEMM_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_native_int8_gemm_equals_the_reference(shape, dtype):
    """Tiles of 1..16 rows and 16-row tiles with a remainder, one row in place and packed (odd k), the vector
    paths (bf16 x from two rows: vdpbf16ps where the CPU has it) and the portable C path, against the fp64 product
    of x and the dequantized weight."""
    native = _native()
    g = torch.Generator().manual_seed(shape[0] + shape[1])
    n, k = shape
    q = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    scales = torch.rand(n, generator=g) * 0.02
    w = native.int8_blocks(q)
    for rows in (1, 2, 3, 4, 5, 8, 13, 40):
        x = torch.randn(rows, k, generator=g).to(dtype)
        want = x.double() @ (q.double() * scales.double()[:, None]).t()
        rtol = 1e-5 if dtype == torch.float32 else 2 ** -8   # summation order; bf16: the output's rounding
        for portable in (False, True):
            got = native.int8_gemm(x, w, scales, portable=portable)
            assert got is not None and got.dtype == dtype and got.shape == (rows, n)
            torch.testing.assert_close(got.double(), want, rtol=rtol, atol=1e-5 * want.abs().max().item(),
                                       msg=lambda m, r=rows, p=portable: f"{r} rows, portable {p}: {m}")


def test_native_int8_gemm_threads_and_bad_arguments():
    native = _native()
    g = torch.Generator().manual_seed(3)
    q = torch.randint(-128, 128, (300, 256), generator=g, dtype=torch.int8)
    scales, w = torch.rand(300, generator=g), native.int8_blocks(q)
    x = torch.randn(5, 256, generator=g).bfloat16()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = native.int8_gemm(x, w, scales)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, native.int8_gemm(x, w, scales))   # each block's sums do not depend on the split
    assert native.int8_gemm(x[:0], w, scales).shape == (0, 300)
    with pytest.raises(ValueError, match="int8_blocks"):
        native.int8_gemm(x, q, scales)                          # the row-major weight
    with pytest.raises(ValueError, match="int8_blocks"):
        native.int8_gemm(x[:, :200], w, scales)                 # another width


def test_w8a16_on_cpu_takes_the_native_kernel_at_every_batch():
    native = _native()
    scheme = QuantScheme(8, 0, True)
    for in_features in (576, 200):   # any width (torch's int8pack_mm needs a multiple of 16)
        qw = quantize_weight(torch.randn(72, in_features), scheme)
        packed = pack(qw, scheme, CPU, torch.bfloat16)
        assert (packed.kernel, packed.variant) == ("int8pack", "native")
        assert torch.equal(packed.weight, native.int8_blocks(qw.qweight))
        # resident: the int8 weight (72 channels padded to 80) and fp32 scales
        assert resident_bytes(packed) == 80 * (in_features + in_features % 2) + 72 * 4
        for rows in (1, 7, 32, 100):
            x = torch.randn(rows, in_features).bfloat16()
            want = x.float() @ qw.dequantize().t()
            torch.testing.assert_close(quant_linear(x, packed).float(), want, rtol=2e-2, atol=2e-2)
    fp16 = pack(qw, scheme, CPU, torch.float16)   # through the fp32 path
    x = torch.randn(3, 200).half()
    torch.testing.assert_close(quant_linear(x, fp16).float(), x.float() @ qw.dequantize().t(), rtol=2e-3, atol=2e-3)


# (n, k): k not a multiple of 4 or 16, k = 1, n not a multiple of 16, a k whose rows overflow a panel of rows
W8A8_SHAPES = [(96, 576), (40, 101), (17, 7), (33, 1), (200, 258), (24, 70001)]


def _w8a8_reference(x, q, scales, bias, static):
    """_run_int_mm's arithmetic: torch's quantization, an exact int32 product, ((float)acc * x_scale) * w_scale,
    + bias, in fp32, then x's dtype. (The int64 product: torch._int_mm is wrong on CPU for k = 1, torch 2.13.)"""
    if static is None:
        xq, x_scale = quantize_activations_dynamic(x)
        acc = (xq.long() @ q.long().t()).int()
    else:
        xq = quantize_activations_static(x, *static)
        acc = (xq.long() @ q.long().t()).int() - static[1] * q.int().sum(dim=1, dtype=torch.int32)
        x_scale = torch.tensor(static[0], dtype=torch.float32)
    y = acc.to(torch.float32).mul_(x_scale).mul_(scales)
    if bias is not None:
        y = y.add_(bias)
    return y.to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", W8A8_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_native_w8a8_gemm_is_bit_exact_with_the_torch_reference(shape, dtype):
    """Tiles of 1..16 rows and a remainder, dynamic and static (offset -3) activations, with and without bias, the
    VNNI and the portable C paths: every output equals the torch reference's bit for bit."""
    native = _native()
    g = torch.Generator().manual_seed(shape[0] * 7 + shape[1])
    n, k = shape
    q = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    scales = torch.rand(n, generator=g) * 0.02
    w, wsum = native.w8a8_blocks(q)
    assert w.shape == (-(-n // 16), -(-k // 4), 16, 4) and torch.equal(wsum, q.int().sum(dim=1))
    for rows in ((1, 2, 3, 16, 17, 40) if k > 10000 else (1, 2, 3, 4, 5, 8, 13, 16, 17, 40)):
        x = (torch.randn(rows, k, generator=g) * 3).to(dtype)
        x[0, 0] = 0.5 * 3 * 0.02   # some value near a rounding tie under the static scale
        for bias in (None, torch.randn(n, generator=g)):
            for static in (None, (0.021, -3)):
                want = _w8a8_reference(x, q, scales, bias, static)
                for portable in (False, True):
                    got = native.w8a8_gemm(x, w, scales, wsum, bias, *(static or (None, 0)), portable=portable)
                    assert got is not None and got.dtype == dtype and got.shape == (rows, n)
                    assert torch.equal(got, want), (rows, bias is not None, static, portable,
                                                     (got.float() - want.float()).abs().max())


def test_native_w8a8_layout_threads_and_bad_arguments():
    native = _native()
    q = torch.randint(-128, 128, (35, 9), generator=torch.Generator().manual_seed(1), dtype=torch.int8)
    w, _ = native.w8a8_blocks(q)
    assert w.shape == (3, 3, 16, 4)                              # ceil(35 / 16) blocks, ceil(9 / 4) groups
    for b, i, c in ((0, 0, 0), (0, 5, 0), (1, 7, 7), (2, 8, 2)):
        assert w[b, i // 4, c, i % 4] == q[16 * b + c, i]
    assert not w[2, :, 3:].any() and not w[:, 2, :, 1:].any()    # padding: channels 35.., inputs 9..
    g = torch.Generator().manual_seed(3)
    q = torch.randint(-128, 128, (300, 256), generator=g, dtype=torch.int8)
    scales, (w, wsum) = torch.rand(300, generator=g), native.w8a8_blocks(q)
    x = torch.randn(37, 256, generator=g).bfloat16()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = native.w8a8_gemm(x, w, scales, wsum)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, native.w8a8_gemm(x, w, scales, wsum))
    assert native.w8a8_gemm(x[:0], w, scales, wsum).shape == (0, 300)
    with pytest.raises(ValueError, match="w8a8_blocks"):
        native.w8a8_gemm(x, q, scales, wsum)                     # the row-major weight
    with pytest.raises(ValueError, match="w8a8_blocks"):
        native.w8a8_gemm(x[:, :200], w, scales, wsum)            # another width


@pytest.mark.parametrize("scheme", [W8A8_DYNAMIC, W8A8_STATIC], ids=["dynamic", "static"])
def test_w8a8_native_variant_equals_int_mm_bit_for_bit(scheme):
    """quant_linear through the native variant (bf16, fp32 and fp16 activations, bias) equals the "int_mm" one."""
    _native()
    qw = _weight(scheme, 200, 330)
    for dtype in (torch.bfloat16, torch.float32, torch.float16):
        ours = pack(qw, scheme, CPU, dtype)
        assert (ours.kernel, ours.variant) == ("int8mm", "native")
        theirs = pack(qw, scheme, CPU, dtype, kernel="int8mm", variant="int_mm")
        bias = torch.randn(200).to(dtype)
        for lead in ((1,), (7,), (3, 11)):
            x = torch.randn(*lead, 330).to(dtype)
            assert torch.equal(quant_linear(x, ours, bias), quant_linear(x, theirs, bias)), (dtype, lead)
