"""The matmuls of quantized linear layers: `pack` prepares a layer's canonical weight (scheme.py) once for the
device's kernel, `quant_linear` multiplies by it.

CPU kernels (torch's own, chosen per scheme; conventions measured on torch 2.13):
- W8A16, per-channel symmetric: `aten._weight_int8pack_mm(x, q [out, in] int8, scales [out])` = x @ (q * s)^T,
  x and scales in the activation dtype (fp32 / bf16 / fp16).
- W4A16, groups: `aten._convert_weight_to_int4pack_for_cpu(u [out, in] int32 in 0..15)` and
  `aten._weight_int4pack_mm_for_cpu(x, packed, group, scales_and_zeros [groups, out, 2])`, whose dequantization
  is w = (u - 8) * scale + zero (tinygemm's convention); it takes out_features divisible by 16. Symmetric q in
  -8..7: u = q + 8, zero = 0; with zero points z (q in 0..15): u = q, zero = (8 - z) * scale.
- W8A8: activations quantized per token (dynamic: scale = max|x_row| / 127) or with the checkpoint's per-tensor
  scale and offset (static), then `torch._int_mm` (int8 x int8 -> int32) and the rescale; a static offset's
  contribution (offset x the weight's row sums) is precomputed.
- Anything else (8-bit groups or zero points, other devices): the weight dequantized once at pack time into the
  activation dtype, then the dense matmul — correct, not smaller (`PackedWeight.kernel` says "dequantized").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pdcluster.engine.quant.scheme import QuantizedWeight, QuantScheme


@dataclass
class PackedWeight:
    kernel: str                       # "int8pack" | "int4pack" | "int8mm" | "dequantized"
    scheme: QuantScheme
    out_features: int
    in_features: int
    dtype: torch.dtype                # the activations'
    weight: torch.Tensor              # the kernel's weight tensor
    scales: torch.Tensor | None = None          # int8pack: [out]; int4pack: scales_and_zeros; int8mm: [out] fp32
    input_scale: float = 0.0                     # int8mm, static activations
    input_offset: int = 0
    offset_rows: torch.Tensor | None = None      # int8mm, static: offset x row sums of q, fp32 [out]


def pack(qw: QuantizedWeight, scheme: QuantScheme, device: torch.device, act_dtype: torch.dtype) -> PackedWeight:
    out_features, in_features = qw.qweight.shape
    base = dict(scheme=scheme, out_features=out_features, in_features=in_features, dtype=act_dtype)
    if device.type == "cpu":
        if scheme.activations != "none" and qw.zeros is None and qw.scales.shape[1] == 1:
            packed = PackedWeight("int8mm", weight=qw.qweight.t().contiguous(), scales=qw.scales[:, 0].float(),
                                  **base)  # type: ignore[arg-type]
            if scheme.activations == "int8_static":
                assert qw.input_scale is not None and qw.input_offset is not None
                packed.input_scale = float(qw.input_scale)
                packed.input_offset = int(float(qw.input_offset))
                packed.offset_rows = packed.input_offset * qw.qweight.to(torch.float32).sum(dim=1)
            return packed
        if scheme.weight_bits == 8 and scheme.activations == "none" and qw.zeros is None and qw.scales.shape[1] == 1:
            return PackedWeight("int8pack", weight=qw.qweight.contiguous(), scales=qw.scales[:, 0].to(act_dtype),
                                **base)  # type: ignore[arg-type]
        if scheme.weight_bits == 4 and out_features % 16 == 0 and qw.group_size in (32, 64, 128, 256):
            if qw.zeros is None:
                u, zero = qw.qweight.to(torch.int32) + 8, torch.zeros_like(qw.scales)
            else:
                u, zero = qw.qweight.to(torch.int32), (8 - qw.zeros) * qw.scales
            weight = torch.ops.aten._convert_weight_to_int4pack_for_cpu(u.contiguous(), 1)
            scales_and_zeros = torch.stack((qw.scales.t(), zero.t()), dim=-1).to(act_dtype).contiguous()
            return PackedWeight("int4pack", weight=weight, scales=scales_and_zeros, **base)  # type: ignore[arg-type]
    weight = qw.dequantize(act_dtype).to(device)
    return PackedWeight("dequantized", weight=weight, input_scale=float(qw.input_scale or 0.0),
                        input_offset=int(float(qw.input_offset or 0)), **base)  # type: ignore[arg-type]


def quant_linear(x: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] (the activation dtype) @ the layer's weight^T (+ bias) -> [..., out]."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    kernel = packed.kernel
    if kernel == "int8pack":
        y = torch.ops.aten._weight_int8pack_mm(x2, packed.weight, packed.scales)
    elif kernel == "int4pack":
        assert packed.scales is not None
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, packed.weight, packed.in_features // packed.scales.shape[0],
                                                       packed.scales)
    elif kernel == "int8mm":
        y = _int8_matmul(x2, packed)
    else:
        if packed.scheme.activations != "none":   # what W8A8 multiplies: the activations quantized, dequantized
            xq, scale = quantize_activations(x2.float(), packed)
            x2 = ((xq.float() - packed.input_offset) * scale).to(packed.dtype)
        y = F.linear(x2, packed.weight)
    if bias is not None:
        y = y + bias
    return y.reshape(*shape[:-1], packed.out_features)


def quantize_activations(x: torch.Tensor, packed: PackedWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 rows of x and their scale ([rows, 1] per token; a scalar tensor when static)."""
    if packed.scheme.activations == "int8_static":
        scale = torch.tensor(packed.input_scale)
        return torch.round(x / scale + packed.input_offset).clamp_(-128, 127).to(torch.int8), scale
    scale = (x.abs().amax(dim=-1, keepdim=True) / 127.0).clamp_(min=1e-12)
    return torch.round(x / scale).clamp_(-128, 127).to(torch.int8), scale


def _int8_matmul(x: torch.Tensor, packed: PackedWeight) -> torch.Tensor:
    xq, scale = quantize_activations(x.float(), packed)
    acc = torch._int_mm(xq, packed.weight).to(torch.float32)
    if packed.offset_rows is not None:
        acc -= packed.offset_rows
    assert packed.scales is not None
    return (acc * scale * packed.scales).to(packed.dtype)


def resident_bytes(packed: PackedWeight) -> int:
    """Bytes the packed layer keeps in memory (weight and scales)."""
    total = packed.weight.numel() * packed.weight.element_size()
    for t in (packed.scales, packed.offset_rows):
        if t is not None:
            total += t.numel() * t.element_size()
    return total
