"""Kernels that multiply activations by a quantized weight (#31): `pack` once per layer, `quant_linear` per call.

`pack` picks a kernel from the device, the scheme and the activation dtype (PackedWeight.kernel says which):

CPU
- "int8pack" (W8A16, per-channel symmetric), variant "native": our kernel (engine/quant/int8_gemv.c, every row
  count, any width): the weight packed at load into blocks of 16 output channels (int8, the same bytes give or
  take padding), fp32 scales and accumulation; decode reads it faster than oneDNN reads bf16, where torch's kernel
  reads int8 slower (docs/benchmarks.md). Variant "aten", where the native library is not built: aten
  `_weight_int8pack_mm(x, w [out, in] int8, scales [out])`, scales in the activation dtype (bf16 scales round the
  canonical fp32 ones, ~2^-9 relative); it needs `in % 16 == 0` (other widths crash the process in torch 2.13, so
  they go to the fallback).
- "int4pack" (W4A16, groups of a multiple of 32, per-channel included): aten `_convert_weight_to_int4pack_for_cpu`
  + `_weight_int4pack_mm_for_cpu(x, packed, kernel_group, scales_and_zeros)`. Found empirically, the
  convention is tinygemm's: w = (q_u4 - 8) * scale + zero, q_u4 in 0..15, scales_and_zeros [groups, out, 2]
  in the activation dtype (fp32, bf16, fp16 all accepted), kernel_group in {32, 64, 128, 256}. Canonical
  symmetric int4 (-8..7): q_u4 = q + 8, zero = 0. Asymmetric (q 0..15, w = (q - z) * s): q_u4 = q,
  zero = (8 - z) * s. Larger canonical groups (per-channel) repeat their scale over kernel groups. The kernel
  wants out % 16 == 0: other widths are padded with zero rows and the output is sliced.
- "int8mm" (W8A8, dynamic and static), variant "native": our kernel (engine/quant/int8_w8a8.c, any shape), taken
  for every layer and batch wherever the native library loads. The weight packed at load for AVX-512 VNNI's
  vpdpbusd (blocks of 16 output channels, 4 consecutive inputs per channel lane), with its fp32 scales and the
  int32 sums of its rows; the activations quantized inside the call (per-token dynamic or per-tensor static, the
  same fp32 formula and round-half-even as quantize_activations_*), fed as x_q + 128 (u8 x s8 products) and the
  sums corrected by (128 + offset) * row sums; int32 accumulation, then ((float)acc * x_scale) * w_scale + bias
  in fp32 as "int_mm" does: the output is bit-identical to it. A portable C path without AVX-512 VNNI. Why: on
  SmolLM2's small layers the separate torch ops of quantization and rescale cost more than the product, and
  neither _int_mm nor oneDNN's int8 GEMM beat oneDNN bf16 at 32 rows. Measured (benchmarks/quant_kernels.py,
  2 threads, time vs dense bf16 at 1 / 32 rows): SmolLM2 576->1536 0.55 / 0.65 and 1536->576 0.56 / 0.54
  (_int_mm 1.5 / 1.1, oneDNN int8 3.0 / 1.3); 2048->11008 0.23 / 0.61 and 11008->2048 0.17 / 0.68 (oneDNN int8
  0.38 / 0.62 and 0.30 / 0.62, even within that run's noise) (docs/benchmarks.md).
  Variant "onednn": oneDNN `onednn::qlinear_pointwise`, weight prepacked by
  `onednn::qlinear_prepack`. The activations go in as uint8 with zero point 128 + offset (x_u8 = x_q + 128):
  int8 activations take a reference path in oneDNN that is ~300x slower. Per-token scales are not accepted
  (only a per-tensor one), so dynamic runs with x_scale 1 and fp32 output, then multiplies by the token
  scales; static passes its per-tensor scale and zero point and gets the act dtype straight out.
  Used, where the native library did not load, for layers of at least ONEDNN_INT8_MIN_WEIGHTS weights, when a
  probe at first use shows the u8 x s8 products are not saturated (CPUs without VNNI accumulate pairs in int16);
  else variant "int_mm":
  `torch._int_mm(x_q, w_q^T)` (int32, no shape constraints on CPU), rescale by
  x_scale[:, None] * w_scale[None, :]; static subtracts input_offset * row sums of w_q (computed at pack time).
  Measured (benchmarks/quant_kernels.py, 1 thread): on 2048x6144..11008x2048 oneDNN is 0.5-0.75x dense bf16 at
  32 rows where _int_mm is 0.9-1.0x, and about even at 1 row; on SmolLM2's layers _int_mm is faster throughout.

NPU (torch_npu, as vLLM-Ascend calls it; weights transposed to [in, out])
- "npu_wqbmm" (W8A16 / W4A16): `npu_weight_quant_batchmatmul(x, w, antiquant_scale, antiquant_offset,
  antiquant_group_size=g)`, whose convention is w = (q + antiquant_offset) * antiquant_scale, so
  antiquant_offset = -zeros (int4 asymmetric: q - 8 signed and offset = 8 - zeros). Scales / offsets are
  [out] per channel or [in / g, out] per group, in the activation dtype; int4 weights are packed 8 to an int32
  by `npu_convert_weight_to_int4pack` ([in, out / 8]).
- "npu_w8a8" (dynamic): `npu_dynamic_quant(x)` -> (x_q, per-token scale) then `npu_quant_matmul(x_q, w,
  w_scale fp32, pertoken_scale=..., bias, output_dtype)`.
- "npu_w8a8_static": `npu_quantize(x, 1 / input_scale, input_offset, qint8, -1, False)` then
  `npu_quant_matmul(x_q, w, deq_scale = input_scale * w_scale, bias=quant_bias)`, quant_bias the int32
  -offset * row sums of w_q; deq_scale fp32 for bf16 output, `npu_trans_quant_param` (int64) for fp16.

CUDA (torch's own CUDA kernels, each enabled by a probe on the device at first use; never run on hardware here:
`make gpu-check` runs tests/test_quant_cuda.py where a GPU is lent)
- "int8mm" variant "int_mm" (W8A8): `torch._int_mm`, cuBLASLt's int8 GEMM with int32 accumulation. Its CUDA
  contract: more than 16 rows, in % 8 == 0 and out % 8 == 0; fewer rows (decode) are padded with zero rows to
  CUDA_INT_MM_MIN_ROWS and the output sliced.
- "int8pack" (W8A16 per channel): `_weight_int8pack_mm` where this torch build has its CUDA kernel.
- "int4pack" variant "tinygemm" (W4A16, bf16 activations): `_convert_weight_to_int4pack(q_u4 packed two to a
  uint8 [out, in / 2] (even column in the high nibble), inner_k_tiles)` + `_weight_int4pack_mm(x, packed, group,
  scales_and_zeros)`, the same (q_u4 - 8) * scale + zero convention and [groups, out, 2] table as the CPU kernel;
  in % (inner_k_tiles * 16) == 0 (inner_k_tiles 8, 4 or 2), out padded to 16 like on CPU.

Everything else ("dequantized": group-wise int8, zero points on 8-bit weights, odd widths, fp32 on NPU, ...):
the weight dequantized once at pack time into the activation dtype (correct, not smaller), then F.linear; W8A8
schemes quantize and dequantize the activations the same way first.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from pdcluster.engine.attention import native
from pdcluster.engine.attention.native import int8_blocks, int8_gemm, w8a8_blocks, w8a8_gemm
from pdcluster.engine.quant.scheme import QuantizedWeight, QuantScheme

KERNELS = ("int8pack", "int4pack", "int8mm", "npu_wqbmm", "npu_w8a8", "npu_w8a8_static", "dequantized")
_INT4_KERNEL_GROUPS = (256, 128, 64, 32)
# oneDNN's int8 GEMM costs ~0.1 ms more per call than _int_mm: it pays off from about this many weights (measured:
# faster at 2048x6144 and up, slower at SmolLM2's 576x1536)
ONEDNN_INT8_MIN_WEIGHTS = 1 << 22
CUDA_INT_MM_MIN_ROWS = 17   # torch._int_mm on CUDA: "self.size(0) needs to be greater than 16"


@dataclass
class PackedWeight:
    kernel: str                      # one of KERNELS
    scheme: QuantScheme
    out_features: int
    in_features: int
    device: torch.device
    act_dtype: torch.dtype
    weight: torch.Tensor | None = None           # in the kernel's layout
    scales: torch.Tensor | None = None           # kernel-specific: see each _pack_* function
    zeros: torch.Tensor | None = None
    group_size: int = 0                          # the group size the kernel is called with
    input_scale: float = 1.0                     # int8_static
    input_offset: int = 0                        # int8_static
    extra: dict[str, torch.Tensor] = field(default_factory=dict)
    variant: str = ""                            # int8mm: "native" | "onednn" | "int_mm"; int8pack: "native" | "aten"


def pack(qw: QuantizedWeight, scheme: QuantScheme, device: torch.device, act_dtype: torch.dtype,
         kernel: str | None = None, variant: str | None = None) -> PackedWeight:
    """The weight in the layout of the fastest correct kernel for `device` (`kernel` / `variant` force one, for
    tests and benchmarks; it must be able to take the weight)."""
    device = torch.device(device)
    kernel = kernel or _choose(qw, scheme, device, act_dtype)
    out_features, in_features = qw.qweight.shape
    base = PackedWeight(kernel, scheme, out_features, in_features, device, act_dtype)
    if kernel == "int8mm":
        big = out_features * in_features >= ONEDNN_INT8_MIN_WEIGHTS
        onednn = device.type == "cpu" and big and _onednn_int8_exact()
        ours = device.type == "cpu" and _native_w8a8()
        base.variant = variant or ("native" if ours else "onednn" if onednn else "int_mm")
    if kernel == "int4pack":
        base.variant = variant or ("tinygemm" if device.type == "cuda" else "cpu")
    if kernel == "int8pack":
        base.variant = variant or ("native" if device.type == "cpu" and native.load() is not None else "aten")
        return _pack_int8pack(base, qw)
    if kernel == "int4pack":
        return _pack_int4pack(base, qw)
    if kernel == "int8mm":
        return _pack_w8a8(base, qw)
    if kernel == "npu_wqbmm":
        return _pack_npu_wqbmm(base, qw)
    if kernel in ("npu_w8a8", "npu_w8a8_static"):
        return _pack_npu_w8a8(base, qw)
    if kernel == "dequantized":
        base.weight = qw.dequantize(act_dtype).to(device)
        _set_static(base, qw)
        return base
    raise ValueError(f"quantization: unknown kernel {kernel!r} (one of {', '.join(KERNELS)})")


def _choose(qw: QuantizedWeight, scheme: QuantScheme, device: torch.device, act_dtype: torch.dtype) -> str:
    out_features, in_features = qw.qweight.shape
    group = qw.group_size   # from the shapes: a tensor-parallel rank's part may hold one group of its inputs
    per_channel = group == in_features
    if device.type == "cpu":
        if scheme.activations != "none":
            if per_channel and qw.zeros is None:
                return "int8mm"
        elif scheme.weight_bits == 8:
            if per_channel and qw.zeros is None and (in_features % 16 == 0 or native.load() is not None):
                return "int8pack"
        elif group % 32 == 0:
            return "int4pack"
        return "dequantized"
    if device.type == "cuda":
        if scheme.activations != "none":
            if per_channel and qw.zeros is None and in_features % 8 == 0 and out_features % 8 == 0 \
                    and _cuda_kernel_works("int_mm", device):
                return "int8mm"
        elif scheme.weight_bits == 8:
            if per_channel and qw.zeros is None and _cuda_kernel_works("int8pack", device):
                return "int8pack"
        elif group % 32 == 0 and in_features % 32 == 0 and act_dtype == torch.bfloat16 \
                and _cuda_kernel_works("tinygemm", device):
            return "int4pack"
        return "dequantized"
    if device.type == "npu" and act_dtype in (torch.bfloat16, torch.float16):
        if scheme.activations != "none":
            if per_channel and qw.zeros is None:
                return "npu_w8a8" if scheme.activations == "int8_dynamic" else "npu_w8a8_static"
        elif scheme.weight_bits == 8 or out_features % 8 == 0:
            return "npu_wqbmm"
    return "dequantized"


def _set_static(packed: PackedWeight, qw: QuantizedWeight) -> None:
    if packed.scheme.activations == "int8_static":
        if qw.input_scale is None:
            raise ValueError("quantization: int8_static activations need an input_scale")
        packed.input_scale = float(qw.input_scale)
        packed.input_offset = int(round(float(qw.input_offset))) if qw.input_offset is not None else 0


def _pack_int8pack(p: PackedWeight, qw: QuantizedWeight) -> PackedWeight:
    if p.variant == "native":
        p.weight = int8_blocks(qw.qweight)
        p.scales = qw.scales[:, 0].to(torch.float32).contiguous()
        return p
    p.weight = qw.qweight.contiguous().to(p.device)
    p.scales = qw.scales[:, 0].to(p.act_dtype).contiguous().to(p.device)
    return p


def _pack_int4pack(p: PackedWeight, qw: QuantizedWeight) -> PackedWeight:
    group = qw.group_size
    kernel_group = next(g for g in _INT4_KERNEL_GROUPS if group % g == 0)
    repeat = group // kernel_group
    scales = qw.scales.repeat_interleave(repeat, dim=1)          # [out, in / kernel_group]
    if qw.zeros is None:
        q = qw.qweight.to(torch.int32) + 8
        zeros = torch.zeros_like(scales)
    else:
        q = qw.qweight.to(torch.int32)
        zeros = (8.0 - qw.zeros.repeat_interleave(repeat, dim=1)) * scales
    pad = -p.out_features % 16
    if pad:
        q = F.pad(q, (0, 0, 0, pad), value=8)
        scales, zeros = F.pad(scales, (0, 0, 0, pad)), F.pad(zeros, (0, 0, 0, pad))
    if p.variant == "tinygemm":
        p.weight = torch.ops.aten._convert_weight_to_int4pack(tinygemm_nibbles(q).to(p.device),
                                                              tinygemm_inner_k_tiles(p.in_features))
    else:
        p.weight = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.contiguous(), 1).to(p.device)
    p.scales = torch.stack([scales.t(), zeros.t()], dim=-1).to(p.act_dtype).contiguous().to(p.device)
    p.group_size = kernel_group
    return p


def tinygemm_nibbles(q_u4: torch.Tensor) -> torch.Tensor:
    """[out, in] values 0..15 -> uint8 [out, in / 2], columns 2j (high nibble) and 2j + 1 (low) in byte j: what
    `_convert_weight_to_int4pack` takes on CUDA (as torchao packs it)."""
    q = q_u4.to(torch.int32)
    return ((q[:, ::2] << 4) | q[:, 1::2]).to(torch.uint8).contiguous()


def tinygemm_inner_k_tiles(in_features: int) -> int:
    return next(t for t in (8, 4, 2) if in_features % (t * 16) == 0)


def _pack_w8a8(p: PackedWeight, qw: QuantizedWeight) -> PackedWeight:
    _set_static(p, qw)
    w_scale = qw.scales[:, 0].to(torch.float32).contiguous()
    if p.variant == "native":
        p.weight, p.extra["wsum"] = w8a8_blocks(qw.qweight)
    elif p.variant == "onednn":
        p.weight = torch.ops.onednn.qlinear_prepack(qw.qweight.contiguous(), None)
        p.extra["w_zero"] = torch.zeros(p.out_features, dtype=torch.int32)
    else:
        p.weight = qw.qweight.contiguous().to(p.device)
        if p.scheme.activations == "int8_static":
            corr = (p.input_offset * qw.qweight.to(torch.int32).sum(dim=1)).to(torch.int32)
            p.extra["offset_corr"] = corr.to(p.device)
    p.scales = w_scale.to(p.device)
    return p


def _pack_npu_wqbmm(p: PackedWeight, qw: QuantizedWeight) -> PackedWeight:
    import torch_npu

    q = qw.qweight.to(torch.int32)
    offset = None if qw.zeros is None else -qw.zeros
    if qw.zeros is not None and p.scheme.weight_bits == 4:    # 0..15 to signed int4, the offset absorbs the 8
        q, offset = q - 8, 8.0 - qw.zeros
    per_channel = qw.scales.shape[1] == 1
    p.group_size = 0 if per_channel else qw.group_size
    shape = (lambda t: t[:, 0]) if per_channel else (lambda t: t.t())   # [out] or [groups, out]
    p.scales = shape(qw.scales).to(p.act_dtype).contiguous().to(p.device)
    p.zeros = None if offset is None else shape(offset).to(p.act_dtype).contiguous().to(p.device)
    w = q.t().contiguous().to(p.device)                          # [in, out]
    if p.scheme.weight_bits == 4:
        p.weight = torch_npu.npu_convert_weight_to_int4pack(w)  # int32 [in, out / 8]
    else:
        p.weight = w.to(torch.int8)
    return p


def _pack_npu_w8a8(p: PackedWeight, qw: QuantizedWeight) -> PackedWeight:
    import torch_npu

    _set_static(p, qw)
    p.weight = qw.qweight.t().contiguous().to(p.device)         # int8 [in, out]
    w_scale = qw.scales[:, 0].to(torch.float32)
    if p.kernel == "npu_w8a8":
        p.scales = w_scale.to(p.device)
        return p
    deq = w_scale * p.input_scale
    p.scales = (torch_npu.npu_trans_quant_param(deq.to(p.device)) if p.act_dtype == torch.float16
                else deq.to(p.device))
    p.extra["quant_bias"] = (-p.input_offset * qw.qweight.to(torch.int32).sum(dim=1)).to(torch.int32).to(p.device)
    p.extra["inv_input_scale"] = torch.full((p.in_features,), 1.0 / p.input_scale, dtype=p.act_dtype,
                                            device=p.device)
    p.extra["input_offset"] = torch.full((p.in_features,), float(p.input_offset), dtype=p.act_dtype,
                                         device=p.device)
    return p


@functools.cache
def _cuda_kernel_works(kind: str, device: torch.device) -> bool:
    """Whether this torch build runs `kind` ("int_mm", "int8pack", "tinygemm") on `device` and gets the
    reference's answer (a build without the CUDA kernel raises; an older GPU may lack tinygemm)."""
    try:
        g = torch.Generator().manual_seed(0)
        q = torch.randint(-8, 8, (64, 128), generator=g, dtype=torch.int8)
        x = torch.randn(4, 128, generator=g)
        scheme = QuantScheme(4 if kind == "tinygemm" else 8, 32 if kind == "tinygemm" else 0, True,
                             "int8_dynamic" if kind == "int_mm" else "none")
        qw = QuantizedWeight(q, torch.full((64, 128 // (scheme.group_size or 128)), 0.01), scheme=scheme)
        packed = pack(qw, scheme, device, torch.bfloat16, {"int_mm": "int8mm", "int8pack": "int8pack",
                                                           "tinygemm": "int4pack"}[kind])
        got = quant_linear(x.to(device, torch.bfloat16), packed).float().cpu()
        xr = x.bfloat16().float()
        if kind == "int_mm":
            xq, x_scale = quantize_activations_dynamic(xr)
            xr = xq.float() * x_scale
        want = xr @ qw.dequantize().t()
        return bool(torch.allclose(got, want, rtol=2e-2, atol=2e-2))
    except (RuntimeError, NotImplementedError, AttributeError):
        return False


def _native_w8a8() -> bool:
    lib = native.load()
    return lib is not None and getattr(lib, "w8a8_gemm", None) is not None


@functools.cache
def _onednn_int8_exact() -> bool:
    """Whether oneDNN's u8 x s8 GEMM is exact for the extreme int8 values (on CPUs without VNNI it sums pairs
    of products in int16, which saturates)."""
    try:
        k, n = 64, 16
        w = torch.full((n, k), -128, dtype=torch.int8)
        w[1::2] = 127
        x = torch.full((2, k), 255, dtype=torch.uint8)
        x[1] = 0
        y = torch.ops.onednn.qlinear_pointwise(x, 1.0, 128, torch.ops.onednn.qlinear_prepack(w, None), torch.ones(n),
                                               torch.zeros(n, dtype=torch.int32), None, 1.0, 0, torch.float32,
                                               "none", [], "")
        ref = ((x.to(torch.int64) - 128) @ w.to(torch.int64).t()).to(torch.float32)
        return bool(torch.equal(y, ref))
    except (RuntimeError, AttributeError):
        return False


def quantize_activations_dynamic(x2d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token symmetric int8: scale = max|x_row| / 127, x_q = round(x / scale). Returns (x_q int8 [m, in],
    scale float32 [m, 1])."""
    xf = x2d.to(torch.float32)
    scale = xf.abs().amax(dim=-1, keepdim=True).clamp(min=1e-10) / 127.0
    return torch.round(xf / scale).clamp_(-127, 127).to(torch.int8), scale


def quantize_activations_static(x2d: torch.Tensor, input_scale: float, input_offset: int) -> torch.Tensor:
    """Per-tensor: x_q = clamp(round(x / input_scale) + input_offset, -128, 127)."""
    return (torch.round(x2d.to(torch.float32) / input_scale) + input_offset).clamp_(-128, 127).to(torch.int8)


def quant_linear(x: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] (packed.act_dtype) times the quantized weight, plus bias: [..., out] in x's dtype."""
    lead = x.shape[:-1]
    x2d = x.reshape(-1, packed.in_features)
    if not x2d.is_contiguous():
        x2d = x2d.contiguous()
    y = _KERNEL_FNS[packed.kernel](x2d, packed, bias)
    return y.reshape(*lead, packed.out_features)


def _add_bias(y: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return y if bias is None else y + bias.to(y.dtype)


def _run_int8pack(x: torch.Tensor, p: PackedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    assert p.weight is not None and p.scales is not None
    if p.variant == "native":   # (the kernel takes fp32 or bf16 activations; fp16 through fp32)
        y = int8_gemm(x if x.dtype == torch.bfloat16 else x.to(torch.float32), p.weight, p.scales)
        assert y is not None   # packed "native" only where the library loaded
        return _add_bias(y.to(x.dtype), bias)
    return _add_bias(torch.ops.aten._weight_int8pack_mm(x.to(p.act_dtype), p.weight, p.scales), bias)


def _run_int4pack(x: torch.Tensor, p: PackedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    mm = torch.ops.aten._weight_int4pack_mm if p.variant == "tinygemm" else torch.ops.aten._weight_int4pack_mm_for_cpu
    y = mm(x.to(p.act_dtype), p.weight, p.group_size, p.scales)
    if y.shape[-1] != p.out_features:
        y = y[:, :p.out_features]
    return _add_bias(y, bias)


def _run_int8mm(x: torch.Tensor, p: PackedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    if p.variant == "int_mm":
        return _run_int_mm(x, p, bias)
    if p.variant == "native":   # (fp32 or bf16 activations; fp16 through fp32, exactly)
        assert p.weight is not None and p.scales is not None
        static = p.scheme.activations == "int8_static"
        y = w8a8_gemm(x if x.dtype == torch.bfloat16 else x.to(torch.float32), p.weight, p.scales, p.extra["wsum"],
                      None if bias is None else bias.to(torch.float32).contiguous(),
                      p.input_scale if static else None, p.input_offset)
        assert y is not None   # packed "native" only where the library loaded
        return y.to(x.dtype)
    w_zero = p.extra["w_zero"]
    if p.scheme.activations == "int8_dynamic":
        xq, x_scale = quantize_activations_dynamic(x)
        x_u8 = (xq.to(torch.int16) + 128).to(torch.uint8)
        y = torch.ops.onednn.qlinear_pointwise(x_u8, 1.0, 128, p.weight, p.scales, w_zero, None, 1.0, 0,
                                               torch.float32, "none", [], "")
        y = y.mul_(x_scale)
        if bias is not None:
            y = y.add_(bias.to(torch.float32))
        return y.to(x.dtype)
    x_u8 = (quantize_activations_static(x, p.input_scale, p.input_offset).to(torch.int16) + 128).to(torch.uint8)
    fused_bias = None if bias is None else bias.to(torch.float32)
    return torch.ops.onednn.qlinear_pointwise(x_u8, p.input_scale, p.input_offset + 128, p.weight, p.scales, w_zero,
                                              fused_bias, 1.0, 0, x.dtype, "none", [], "")


def _run_int_mm(x: torch.Tensor, p: PackedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    assert p.weight is not None and p.scales is not None
    min_rows = CUDA_INT_MM_MIN_ROWS if x.device.type == "cuda" else 0
    if p.scheme.activations == "int8_dynamic":
        xq, x_scale = quantize_activations_dynamic(x)
        acc = int_mm(xq, p.weight.t(), min_rows)
    else:
        xq = quantize_activations_static(x, p.input_scale, p.input_offset)
        acc = int_mm(xq, p.weight.t(), min_rows) - p.extra["offset_corr"]
        x_scale = torch.tensor(p.input_scale, dtype=torch.float32, device=x.device)
    y = acc.to(torch.float32).mul_(x_scale).mul_(p.scales)
    if bias is not None:
        y = y.add_(bias.to(torch.float32))
    return y.to(x.dtype)


def int_mm(a: torch.Tensor, b: torch.Tensor, min_rows: int = 0) -> torch.Tensor:
    """torch._int_mm(a, b) (int8 x int8 -> int32), `a` padded with zero rows up to `min_rows` and the result cut."""
    rows = a.shape[0]
    if rows >= min_rows:
        return torch._int_mm(a, b)
    return torch._int_mm(F.pad(a, (0, 0, 0, min_rows - rows)), b)[:rows]


def _run_npu_wqbmm(x: torch.Tensor, p: PackedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    import torch_npu

    return torch_npu.npu_weight_quant_batchmatmul(x, p.weight, antiquant_scale=p.scales, antiquant_offset=p.zeros,
                                                  antiquant_group_size=p.group_size, bias=bias)


def _run_npu_w8a8(x: torch.Tensor, p: PackedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    import torch_npu

    if p.kernel == "npu_w8a8":
        xq, x_scale = torch_npu.npu_dynamic_quant(x)
        return torch_npu.npu_quant_matmul(xq, p.weight, p.scales, pertoken_scale=x_scale, bias=bias,
                                          output_dtype=x.dtype)
    xq = torch_npu.npu_quantize(x, p.extra["inv_input_scale"], p.extra["input_offset"], torch.qint8, -1, False)
    y = torch_npu.npu_quant_matmul(xq, p.weight, p.scales, bias=p.extra["quant_bias"], output_dtype=x.dtype)
    return _add_bias(y, bias)


def _run_dequantized(x: torch.Tensor, p: PackedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    if p.scheme.activations == "int8_dynamic":   # what W8A8 multiplies: the activations quantized, dequantized
        xq, x_scale = quantize_activations_dynamic(x)
        x = (xq.to(torch.float32) * x_scale).to(p.act_dtype)
    elif p.scheme.activations == "int8_static":
        xq = quantize_activations_static(x, p.input_scale, p.input_offset)
        x = ((xq.to(torch.float32) - p.input_offset) * p.input_scale).to(p.act_dtype)
    assert p.weight is not None
    return F.linear(x.to(p.act_dtype), p.weight, None if bias is None else bias.to(p.act_dtype))


_KERNEL_FNS = {"int8pack": _run_int8pack, "int4pack": _run_int4pack, "int8mm": _run_int8mm,
               "npu_wqbmm": _run_npu_wqbmm, "npu_w8a8": _run_npu_w8a8, "npu_w8a8_static": _run_npu_w8a8,
               "dequantized": _run_dequantized}


def resident_bytes(packed: PackedWeight) -> int:
    """Bytes the packed weight keeps in memory (weight, scales, zero points, precomputed corrections)."""
    tensors = [packed.weight, packed.scales, packed.zeros, *packed.extra.values()]
    total = 0
    for t in tensors:
        if t is None:
            continue
        total += t.numel() * t.element_size()
    return total
