"""What a quantized linear layer is, independent of the checkpoint format it came in and the kernel that runs it.

Canonical form (`QuantizedWeight`), one per linear layer: integer weights `qweight` [out, in] (int8 storage for
every bit width: signed, except int4 with zero points, 0..15), float32 `scales` and optional `zeros`
[out, groups] with groups = in / group_size (1 when a scale covers a whole output channel):

    w[o, i] = (qweight[o, i] - zeros[o, i // g]) * scales[o, i // g]        (zeros = 0 when symmetric)

Formats (formats.py) read their tensors into this and write it out; kernels (kernels.py) pack it for a device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SCHEMES = ("w8a8", "w8a8_static", "w8a16", "w4a16")


@dataclass(frozen=True)
class QuantScheme:
    weight_bits: int                 # 8 or 4
    group_size: int = 0              # 0: one scale (and zero) per output channel
    symmetric: bool = True           # False: zero points
    activations: str = "none"        # "none" (weight-only) | "int8_dynamic" (per token) | "int8_static" (per tensor)

    def __post_init__(self) -> None:
        if self.weight_bits not in (4, 8):
            raise ValueError(f"quantization: {self.weight_bits}-bit weights are not supported (4 or 8)")
        if self.group_size < 0:
            raise ValueError(f"quantization: group_size must be >= 0, got {self.group_size}")
        if self.activations not in ("none", "int8_dynamic", "int8_static"):
            raise ValueError(f"quantization: activations {self.activations!r} not supported")
        if self.activations != "none" and self.weight_bits != 8:
            raise ValueError("quantization: int8 activations need 8-bit weights (W8A8)")

    @property
    def name(self) -> str:
        return f"w{self.weight_bits}a{8 if self.activations != 'none' else 16}"

    # int4 asymmetric weights are unsigned (0..15) as GPTQ / AWQ store them; 8-bit ones stay signed (int8 storage,
    # zero points shifted by -128 alike)
    @property
    def qmin(self) -> int:
        return 0 if not self.symmetric and self.weight_bits == 4 else -(1 << (self.weight_bits - 1))

    @property
    def qmax(self) -> int:
        return 15 if not self.symmetric and self.weight_bits == 4 else (1 << (self.weight_bits - 1)) - 1

    @classmethod
    def named(cls, name: str, group_size: int | None = None) -> QuantScheme:
        """The scheme `convert_model(quantization=name)` writes: w8a8 (per-channel int8 weights, dynamic per-token
        int8 activations), w8a8_static (per-tensor int8 activations with calibrated scales), w8a16 (per-channel
        int8), w4a16 (int4, groups of 128)."""
        if name == "w8a8":
            return cls(8, group_size or 0, True, "int8_dynamic")
        if name == "w8a8_static":
            return cls(8, group_size or 0, True, "int8_static")
        if name == "w8a16":
            return cls(8, group_size or 0, True)
        if name == "w4a16":
            return cls(4, 128 if group_size is None else group_size, True)
        raise ValueError(f"quantization: {name!r} is not one of {', '.join(SCHEMES)}")


@dataclass
class QuantizedWeight:
    qweight: torch.Tensor                    # int8 [out, in], values in [scheme.qmin, scheme.qmax]
    scales: torch.Tensor                     # float32 [out, groups]
    zeros: torch.Tensor | None = None        # float32 [out, groups]; None when symmetric
    input_scale: torch.Tensor | None = None  # int8_static: float32 scalar, x_q = round(x / input_scale) + input_offset
    input_offset: torch.Tensor | None = None  # int8_static: float32 scalar
    scheme: QuantScheme | None = None         # set by the loader from the checkpoint's config

    @property
    def group_size(self) -> int:
        return self.qweight.shape[1] // self.scales.shape[1]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float weight [out, in] this stands for (the reference every kernel is tested against)."""
        g = self.group_size
        q = self.qweight.to(torch.float32)
        if self.zeros is not None:
            q = q - self.zeros.repeat_interleave(g, dim=1)
        return (q * self.scales.repeat_interleave(g, dim=1)).to(dtype)


def quantize_weight(weight: torch.Tensor, scheme: QuantScheme) -> QuantizedWeight:
    """Round-to-nearest quantization of a float weight [out, in] (no calibration): per output channel or per
    group of `scheme.group_size` inputs, symmetric (scale = max|w| / qmax) or asymmetric (min..max onto
    qmin..qmax)."""
    out_features, in_features = weight.shape
    g = scheme.group_size or in_features
    if in_features % g:
        raise ValueError(f"quantization: {in_features} inputs do not split into groups of {g}")
    w = weight.detach().to(torch.float32).reshape(out_features, in_features // g, g)
    if scheme.symmetric:
        scales = (w.abs().amax(dim=-1) / scheme.qmax).clamp(min=1e-12)
        q = torch.round(w / scales[..., None]).clamp(scheme.qmin, scheme.qmax)
        zeros = None
    else:
        lo, hi = w.amin(dim=-1).clamp(max=0.0), w.amax(dim=-1).clamp(min=0.0)
        scales = ((hi - lo) / (scheme.qmax - scheme.qmin)).clamp(min=1e-12)
        zeros = torch.round(scheme.qmin - lo / scales)
        q = torch.round(w / scales[..., None] + zeros[..., None]).clamp(scheme.qmin, scheme.qmax)
    return QuantizedWeight(q.reshape(out_features, in_features).to(torch.int8), scales, zeros)


def merge_rows(weights: list[QuantizedWeight]) -> QuantizedWeight:
    """Shards of one merged layer (q/k/v, gate/up), stacked along the output rows. They must share a scheme and,
    with static activation scales, the scales (one input, one quantization of it)."""
    first = weights[0]
    if len(weights) == 1:
        return first

    def same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
        return (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))

    if any(w.scheme != first.scheme or (w.zeros is None) != (first.zeros is None) or w.group_size != first.group_size
           or not same(w.input_scale, first.input_scale) or not same(w.input_offset, first.input_offset)
           for w in weights):
        raise ValueError("quantized checkpoint: the shards of a merged layer (q/k/v or gate/up) are quantized "
                         "differently; they must share one scheme (and static activation scales)")
    zeros = None if first.zeros is None else torch.cat([w.zeros for w in weights])  # type: ignore[misc]
    return QuantizedWeight(torch.cat([w.qweight for w in weights]), torch.cat([w.scales for w in weights]), zeros,
                           first.input_scale, first.input_offset, scheme=first.scheme)
