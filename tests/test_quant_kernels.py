"""The quantized matmuls against the straightforward reference: the weight dequantized in fp32 (for W8A8 also the
activations quantized the same way), per scheme, activation dtype and shape; the CPU picks torch's kernels."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdcluster.engine.quant.kernels import pack, quant_linear, quantize_activations, resident_bytes
from pdcluster.engine.quant.scheme import QuantScheme, quantize_weight

CASES = [  # (scheme, kernel the CPU takes)
    (QuantScheme(8), "int8pack"),
    (QuantScheme(8, 128), "dequantized"),
    (QuantScheme(8, 0, symmetric=False), "dequantized"),
    (QuantScheme(4, 32), "int4pack"),
    (QuantScheme(4, 128), "int4pack"),
    (QuantScheme(4, 64, symmetric=False), "int4pack"),
    (QuantScheme(8, 0, True, "int8_dynamic"), "int8mm"),
    (QuantScheme(8, 0, True, "int8_static"), "int8mm"),
]
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2}   # relative to the output's largest magnitude


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scheme, kernel", CASES)
def test_kernels_equal_the_dequantized_reference(scheme, kernel, dtype):
    torch.manual_seed(0)
    out_features, in_features = 208, 256
    qw = quantize_weight(torch.randn(out_features, in_features), scheme)
    qw.scheme = scheme
    if scheme.activations == "int8_static":
        qw.input_scale, qw.input_offset = torch.tensor(0.02), torch.tensor(3.0)
    bias = torch.randn(out_features).to(dtype)
    packed = pack(qw, scheme, torch.device("cpu"), dtype)
    assert packed.kernel == kernel
    for shape in ((1, in_features), (7, in_features), (32, in_features), (2, 5, in_features)):
        x = torch.randn(shape).to(dtype)
        got = quant_linear(x, packed, bias)
        rows = x.reshape(-1, in_features).float()
        if scheme.activations != "none":   # the activations as W8A8 sees them
            xq, scale = quantize_activations(rows, packed)
            rows = (xq.float() - packed.input_offset) * scale
        want = (F.linear(rows, qw.dequantize()) + bias.float()).reshape(*shape[:-1], out_features)
        assert got.shape == want.shape and got.dtype == dtype
        err = (got.float() - want).abs().max() / want.abs().max()
        assert err < TOLERANCE[dtype], (shape, float(err))


def test_int4_layers_the_kernel_cannot_take_fall_back():
    scheme = QuantScheme(4, 32)
    qw = quantize_weight(torch.randn(200, 64), scheme)   # 200 outputs: not a multiple of 16
    packed = pack(qw, scheme, torch.device("cpu"), torch.float32)
    x = torch.randn(3, 64)
    assert packed.kernel == "dequantized"
    assert torch.allclose(quant_linear(x, packed), x @ qw.dequantize().T, atol=1e-5)


def test_packed_weights_take_their_bits():
    w = torch.randn(512, 1024)
    dense = w.numel() * 2   # bf16
    sizes = {}
    for name in ("w8a16", "w8a8", "w4a16"):
        scheme = QuantScheme.named(name)
        sizes[name] = resident_bytes(pack(quantize_weight(w, scheme), scheme, torch.device("cpu"), torch.bfloat16))
    assert 0.5 * dense < sizes["w8a16"] < 0.52 * dense and 0.5 * dense < sizes["w8a8"] < 0.52 * dense
    assert 0.25 * dense < sizes["w4a16"] < 0.27 * dense


def test_round_to_nearest_stays_within_half_a_step():
    w = torch.randn(64, 256)
    for scheme in (QuantScheme(8), QuantScheme(4, 64), QuantScheme(4, 32, symmetric=False)):
        qw = quantize_weight(w, scheme)
        assert scheme.qmin <= int(qw.qweight.min()) and int(qw.qweight.max()) <= scheme.qmax
        step = qw.scales.repeat_interleave(qw.group_size, dim=1)
        assert bool(((qw.dequantize() - w).abs() <= 0.5 * step + 1e-6).all()), scheme
