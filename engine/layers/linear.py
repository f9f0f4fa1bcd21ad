"""Linear layers whose parameters are left uninitialized: every value comes from the checkpoint.

`MergedLinear` stores several projections (q/k/v or gate/up) as one matrix so one matmul serves them;
`load_shard` copies one checkpoint tensor into its rows.

A quantized checkpoint (engine/quant/) hands a layer `QuantizedWeight`s instead (`load_quantized`, per shard
of a MergedLinear); `prepack` then packs them for the device's kernel (`quant`) and drops the float weight,
which was never written (its pages were never touched), and `forward` multiplies by the packed weight.

bf16 on CPU: up to GEMV_MAX_ROWS[layout] rows (decode) the product runs in the native GEMV
(engine/layers/bf16_gemv.c), which reads oneDNN's packed weight in place (no second copy), faster than oneDNN's own
matmul there; more rows take oneDNN's (`packed_matmul`, also the body of the compiled model's opaque op,
engine/compiled.py). On CPUs with AVX2 and no AVX-512 every fp32 product, and every bf16 one where oneDNN packs no
bf16 weight (CPUs without avx512_bf16), runs in engine/layers/strips_gemm.c over the weight in its strip layout
(`strips_packed`). `PDCLUSTER_NATIVE_MATMUL=0` in the environment when a model is loaded turns both native kernels
off for its layers (for A/B measurements)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from pdcluster.engine.parallel import TPGroup

if TYPE_CHECKING:
    from pdcluster.engine.lora.layers import LoRALayer
    from pdcluster.engine.quant.kernels import PackedWeight
    from pdcluster.engine.quant.scheme import QuantizedWeight


def cpu_packed(weight: torch.Tensor) -> torch.Tensor | None:
    """The weight laid out for CPU matmuls; None on other devices (their own BLAS): oneDNN's blocked layout, or
    engine/layers/strips_gemm.c's strips where that kernel is the faster one (`strips_packed`).
    F.linear re-packs the weight on every call, so the packed matmul is faster (measured in
    docs/benchmarks.md); bf16 results are bitwise equal (except up to GEMV_MAX_ROWS rows, where the native GEMV
    reads it: equal up to summation order), fp32 ones equal up to summation order.
    `torch.backends.mkldnn.enabled = False` turns it off."""
    if weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16, torch.float16) \
            or not torch.backends.mkldnn.is_available() or not torch.backends.mkldnn.enabled:
        return None
    if weight.dtype == torch.float32 and strips_for_fp32():
        return strips_packed(weight)
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 128)   # hint: a typical decode batch
    except RuntimeError:   # bf16 on a CPU without avx512_bf16 (AVX2): the strip layout; fp16 there: plain F.linear
        return strips_packed(weight) if weight.dtype == torch.bfloat16 else None
    packed.gemv = gemv_layout(packed, weight)   # (read by `linear`)
    return packed


def native_matmul() -> bool:
    """Whether weights may be laid out for this project's own CPU matmul kernels (bf16_gemv.c, strips_gemm.c):
    `PDCLUSTER_NATIVE_MATMUL=0` in the environment when a model is loaded keeps oneDNN's (for A/B measurements)."""
    return os.environ.get("PDCLUSTER_NATIVE_MATMUL", "1") != "0"


def strips_for_fp32() -> bool:
    """fp32 weights in the strip layout on CPUs with AVX2 and no AVX-512: there oneDNN's fp32 matmul takes 1.0-1.6x
    strips_gemm.c's time (docs/benchmarks.md "CPUs with AVX2 only"); with AVX-512 oneDNN's is twice as wide."""
    from pdcluster.engine.attention import native

    return native_matmul() and native.strips_vector_level() == 1


def strips_packed(weight: torch.Tensor) -> torch.Tensor | None:
    """A bf16 or fp32 weight in engine/layers/strips_gemm.c's layout (same shape and bytes); None where that kernel
    has no vector path (or PDCLUSTER_NATIVE_MATMUL=0). For bf16 weights on CPUs where oneDNN packs none (torch then
    multiplies bf16 one row at a time), fp32 ones where `strips_for_fp32`."""
    from pdcluster.engine.attention import native

    if weight.dim() != 2 or not native_matmul() or native.strips_vector_level() == 0:
        return None
    packed = native.strips_layout(weight.detach())
    packed.strips = True   # type: ignore[attr-defined]   # (read by `packed_matmul`)
    return packed


# Rows up to which a bf16 CPU matmul over a oneDNN-packed weight runs in the native GEMV, per block width of
# oneDNN's layout: measured faster than oneDNN up to here (benchmarks/bf16_gemv.py, docs/benchmarks.md "bf16 GEMV
# (#27)"). 64-channel blocks (AVX512-BF16 without AMX): up to 8 rows. 32-channel blocks (AMX): one row (the
# kernel's tiles then hold two strips, and oneDNN's AMX matmul is ahead from 2-4 rows).
GEMV_MAX_ROWS = {64: 8, 32: 1}


def gemv_layout(packed: torch.Tensor, weight: torch.Tensor) -> tuple[int, int, int, int] | None:
    """(buffer address, padded input count, channels per block, GEMV_MAX_ROWS of that width) of a oneDNN-packed
    bf16 weight that the native GEMV reads in place, or None (not bf16, no native library, PDCLUSTER_NATIVE_MATMUL=0,
    or a layout it does not take). oneDNN's layout is opaque (blocks of 64 channels on AVX512-BF16, of 32 with
    AMX), so each block width it may have chosen is tried: the padded input count taken from the buffer size,
    checked once by a product against oneDNN's own."""
    from pdcluster.engine.attention import native

    if weight.dtype != torch.bfloat16 or weight.dim() != 2 or not native_matmul() or native.load() is None:
        return None
    try:
        address, nbytes = torch.ops.mkldnn.data_ptr(packed), torch.ops.mkldnn._nbytes(packed)
    except (AttributeError, RuntimeError):   # (ops of torch's mkldnn build)
        return None
    n, k = weight.shape
    if n == 0 or k == 0:
        return None
    x = torch.randn(2, k, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    want = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "").float()
    for block in native.BF16_BLOCKS:
        kpad, rest = divmod(nbytes // 2, -(-n // block) * block)
        if rest or kpad < k or kpad % 2:
            continue
        got = native.bf16_gemm(x, address, n, block, kpad)
        if got is not None and (got.float() - want).abs().max() <= 2 ** -6 * want.abs().max():
            return address, kpad, block, GEMV_MAX_ROWS[block]
    return None   # another layout


def release(weight: nn.Parameter) -> None:
    """Drop a weight's dense values once packed copies serve every matmul with it: the packed copy is the
    only one kept, so packing costs no extra memory. Its dtype and device stay readable."""
    weight.data = weight.data.new_empty(0)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           packed: torch.Tensor | None) -> torch.Tensor:
    if packed is not None:
        if torch.compiler.is_compiling():   # engine/compiled.py: inductor cannot lower this op itself
            from pdcluster.engine.compiled import packed_linear

            return packed_linear(x, packed, bias)
        return packed_matmul(x, packed, bias)
    return F.linear(x, weight, bias)


def packed_matmul(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ W.T (+ bias) over the weight `cpu_packed` made: the native GEMV up to its row limit, else oneDNN's."""
    if getattr(packed, "strips", False):   # (set by strips_packed)
        from pdcluster.engine.attention.native import strips_gemm

        y = strips_gemm(x.reshape(-1, x.shape[-1]), packed, bias)
        assert y is not None   # (strips_packed found the library)
        return y.reshape(*x.shape[:-1], packed.shape[0])
    gemv = getattr(packed, "gemv", None)   # (set by cpu_packed)
    if gemv is not None and x.numel() <= gemv[3] * x.shape[-1] and x.dtype == torch.bfloat16 \
            and (bias is None or bias.dtype == torch.bfloat16):
        return _gemv(x, packed, bias, gemv)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def _gemv(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
          layout: tuple[int, int, int, int]) -> torch.Tensor:
    from pdcluster.engine.attention.native import bf16_gemm

    n, k = packed.shape
    address, kpad, block, _ = layout
    y = bf16_gemm(x.reshape(-1, k).contiguous(), address, n, block, kpad, None if bias is None else bias.contiguous())
    assert y is not None   # (gemv_layout found the library)
    return y.reshape(*x.shape[:-1], n)


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.packed: torch.Tensor | None = None   # see prepack
        self.packable = True                       # False when the owner multiplies by slices of the weight
        self.quantized: dict[str, QuantizedWeight] = {}   # a quantized checkpoint's weights, per shard, until packed
        self.quant: PackedWeight | None = None     # ... packed for the kernel (engine/quant/kernels.py)
        self.lora: LoRALayer | None = None         # adapters' deltas added to the output (engine/lora/layers.py)

    def load_quantized(self, weight: QuantizedWeight, shard: str = "") -> None:
        """A quantized checkpoint's weight (of one shard of a MergedLinear) in place of the float one."""
        if weight.qweight.shape[1] != self.weight.shape[1]:
            raise ValueError(f"quantized weight has {weight.qweight.shape[1]} inputs, the layer {self.weight.shape[1]}")
        self.quantized[shard] = weight

    def prepack(self) -> None:
        """Once the weights are loaded: multiply by a oneDNN-packed copy where that is faster, in place of the
        weight; a quantized layer by its weights packed for the kernel."""
        if self.quantized:
            self._pack_quantized()
            return
        self.packed = cpu_packed(self.weight) if self.packable else None
        if self.packed is not None:
            release(self.weight)

    def _pack_quantized(self) -> None:
        from pdcluster.engine.quant.kernels import pack
        from pdcluster.engine.quant.scheme import merge_rows

        order = list(getattr(self, "shard_offsets", {"": None}))
        missing = [s for s in order if s not in self.quantized]
        if missing:
            raise ValueError(f"quantized checkpoint: shards {missing} of a merged layer are not quantized like the "
                             "rest")
        weight = merge_rows([self.quantized[s] for s in order])
        if weight.qweight.shape != self.weight.shape:
            raise ValueError(f"quantized weight has shape {tuple(weight.qweight.shape)}, the layer "
                             f"{tuple(self.weight.shape)}")
        assert weight.scheme is not None
        self.quant = pack(weight, weight.scheme, self.weight.device, self.weight.dtype)
        self.quantized = {}
        release(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant is not None:
            from pdcluster.engine.quant.kernels import quant_linear

            out = quant_linear(x, self.quant, self.bias)
        else:
            out = linear(x, self.weight, self.bias, self.packed)
        if self.lora is not None:   # (a row-parallel layer's partial delta: before its all-reduce)
            self.lora.add_(x, out)
        return out


class MergedLinear(Linear):
    def __init__(self, in_features: int, shard_sizes: dict[str, int], bias: bool = False) -> None:
        super().__init__(in_features, sum(shard_sizes.values()), bias)
        self.shard_offsets: dict[str, tuple[int, int]] = {}
        start = 0
        for name, size in shard_sizes.items():
            self.shard_offsets[name] = (start, size)
            start += size

    def load_shard(self, param: nn.Parameter, shard: str, loaded: torch.Tensor) -> None:
        start, size = self.shard_offsets[shard]
        if loaded.shape[0] != size:
            raise ValueError(f"shard {shard}: checkpoint has {loaded.shape[0]} rows, model expects {size}")
        param.data[start:start + size].copy_(loaded)


class RowParallelLinear(Linear):
    """Input features split across the tensor-parallel ranks (o_proj, down_proj): each rank multiplies its
    slice of the activations by its columns of the weight, one all-reduce sums the parts."""

    def __init__(self, in_features: int, out_features: int, tp: TPGroup) -> None:
        super().__init__(in_features // tp.size, out_features)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(super().forward(x))
