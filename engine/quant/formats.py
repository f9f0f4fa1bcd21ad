"""Quantized checkpoints as the real tools write them, read into (and written from) the canonical form of scheme.py.

`read_checkpoint_quant(model_dir, config)` picks the format from config.json's "quantization_config" (or, as vLLM
does, the older key "compression_config") or from msModelSlim's quant_model_description.json, and returns a
`CheckpointQuant`. The loader then routes every checkpoint tensor through `split_name` (None: an ordinary tensor),
collects a module's parts until `roles(module)` have all arrived and calls `assemble`. `scheme_for` answers from the
config alone: None for ignored modules, norms, embeddings and lm_head (unless the config quantizes it); `split_name`
only claims tensors of modules `scheme_for` quantizes, so a quantized tensor of a module the config says is plain
reaches the loader as an unknown name instead of being misread. `optional_roles(module)` are further tensors
split_name claims that need not arrive (passed to assemble/bias when they have). A module's X.bias stays an ordinary
float tensor except where `bias(module, parts)` returns one (msModelSlim W8A8, below).

Canonical conventions beyond scheme.py: 4-bit weights with zero points are unsigned (q in 0..15, zeros in the same
units); 8-bit weights with zero points keep signed int8 q and zeros shifted by -128 alike (the unsigned 0..255 of
`QuantScheme.qmin/qmax` does not fit int8 storage), so w = (q - zeros) * scales holds either way. Static activations
carry input_scale/input_offset as 0-d float32 tensors.

compressed-tensors (llm-compressor; quant_method "compressed-tensors"), per module X of a matching config group:
    "int-quantized" / "naive-quantized": X.weight int8 [out, in] (signed q), X.weight_scale float [out, groups]
        (channel: [out, 1], tensor: [1]), X.weight_zero_point int8 [out, groups] when asymmetric,
        X.input_scale [1] for static per-tensor int8 activations.
    "pack-quantized": X.weight_packed int32 [out, ceil(in * bits / 32)], q + 2^(bits-1) packed densely along the
        input dim, lowest bits first; X.weight_shape int [2] = (out, in); X.weight_scale as above;
        X.weight_zero_point int32 [ceil(out * bits / 32), groups] (zero point + 2^(bits-1), packed along out) when
        asymmetric. Signed q and zero points: w = (q - zp) * scale.
    Groups: targets "Linear" (every linear layer; recognised by name: not a norm/embedding), exact module names or
    "re:" patterns (re.match); "ignore" likewise. Only int weights of 4/8 bits, strategies channel/group/tensor,
    activations none / dynamic per-token / static per-tensor symmetric int8.
GPTQ (AutoGPTQ / GPTQModel / optimum; quant_method "gptq"), per module X:
    X.qweight int32 [in * bits / 32, out] (unsigned q packed along the input dim, lowest bits first),
    X.qzeros int32 [groups, out * bits / 32] (packed along out), X.scales fp16 [groups, out], X.g_idx int32 [in]
    (always written; must be i // group_size: act-order permutations are refused). w = (q - z) * s where
    z = stored + 1 for checkpoint_format "gptq" (AutoGPTQ's off-by-one) and z = stored for "gptq_v2". sym=true
    means z = 2^(bits-1) everywhere (canonical q = stored q - 2^(bits-1), no zeros). Quantized: every linear layer
    except MoE routers ("gate"), lm_head unless "lm_head": true, modules outside "modules_in_block_to_quantize",
    and GPTQModel "dynamic" overrides ("-:regex" unquantized, "+:regex" other bits/group_size/sym).
AWQ (AutoAWQ GEMM; quant_method "awq", version "gemm"), per module X:
    X.qweight int32 [in, out / 8], X.qzeros int32 [groups, out / 8], X.scales fp16 [groups, out]; 4-bit only;
    each word holds 8 consecutive output columns in the order [0, 2, 4, 6, 1, 3, 5, 7] (nibble i = column
    order[i]); w = (q - z) * s, unsigned q and z (zero_point true).
msModelSlim (quant_model_description.json: "model_quant_type" plus one type per tensor name: "FLOAT", "W8A8",
"W8A8_DYNAMIC", "W8A16"; a module's type is that of X.weight; the description lists every tensor, so `roles` is
exactly what it lists for X). q is signed int8 [out, in] in X.weight, per output channel:
    W8A8 (static): X.input_scale [1], X.input_offset [1] (x_q = round(x / input_scale + input_offset)),
        X.deq_scale [out] = input_scale * weight_scale as float32, or (fp16 models) as int64 holding the float32's
        bit pattern, X.quant_bias int32 [out]. The NPU computes (x_q @ q.T + quant_bias) * deq_scale, so
        quant_bias = round(bias / deq_scale) - input_offset * q.sum(1): the offset correction (which a kernel
        re-derives from the canonical qweight and input_offset) plus the layer's float bias folded in. Canonical:
        scales = deq_scale / input_scale (msModelSlim's own fake-quant reader does the same), zeros None, and
        `CheckpointQuant.bias(module, parts)` gives the folded float bias back, (quant_bias + input_offset *
        q.sum(1)) * deq_scale, or None when it is zero: the loader uses it for the layer's bias, instead of any
        X.bias (a claimed part, checked against it when present).
    W8A8_DYNAMIC: X.weight_scale, X.weight_offset [out, 1] (offset must be 0: vllm-ascend ignores it), dynamic
        per-token activations.
    W8A16: X.weight_scale, X.weight_offset [out, 1] (or [out, in / group_size] with a top-level "group_size"),
        w = (q - offset) * scale.
    Anti-outlier norms ("<norm>.bias", or "<norm>.module.weight" / ".module.bias"; FLOAT in the description) stay
    ordinary tensors: the loader gives the RMSNorm its bias (engine/layers/layernorm.py). kv-cache / attention
    quantization and the other types are refused.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable

import torch

from pdcluster.engine.quant.scheme import QuantizedWeight, QuantScheme

MODELSLIM_DESCRIPTION = "quant_model_description.json"
# The compressed-tensors release whose config and tensor layout `compressed_tensors_config/_tensors` write.
COMPRESSED_TENSORS_VERSION = "0.20.1"
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)           # nibble i of an AWQ word holds column AWQ_ORDER[i] of its 8
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)   # column j sits in nibble AWQ_REVERSE_ORDER[j]
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64)


def _err(module: str, message: str) -> ValueError:
    return ValueError(f"quantized checkpoint: {module}: {message}")


def _is_linear_name(module: str) -> bool:
    """Whether a module path names a linear layer (HF naming): not a norm, embedding or rotary table."""
    last = module.rsplit(".", 1)[-1]
    return not ("norm" in last or "embed" in last or last in ("wte", "wpe", "ln_f", "rotary_emb")
                or last.startswith("ln_"))


def _is_router(module: str) -> bool:
    # MoE routers are plain Linear modules that GPTQ/AWQ tools leave in float (vLLM builds them unquantized).
    return module.rsplit(".", 1)[-1] in ("gate", "router", "shared_expert_gate")


def _part(parts: dict[str, torch.Tensor], module: str, role: str, dtypes: tuple[torch.dtype, ...],
          shape: tuple[int, ...] | None = None) -> torch.Tensor:
    t = parts.get(role)
    if t is None:
        raise _err(module, f"tensor {module}.{role} is missing")
    if t.dtype not in dtypes:
        raise _err(module, f"tensor {module}.{role} has dtype {t.dtype}, expected one of {list(dtypes)}")
    if shape is not None and tuple(t.shape) != shape:
        raise _err(module, f"tensor {module}.{role} has shape {list(t.shape)}, expected {list(shape)}")
    return t


def _per_row(t: torch.Tensor, module: str, role: str, rows: int) -> torch.Tensor:
    """A per-output-channel tensor stored as [rows], [rows, 1] or (per tensor) [1], as float32 [rows, 1]."""
    if t.numel() == 1:
        return t.reshape(1, 1).to(torch.float32).expand(rows, 1).clone()
    if tuple(t.shape) not in ((rows,), (rows, 1)):
        raise _err(module, f"tensor {module}.{role} has shape {list(t.shape)}, expected [{rows}] or [{rows}, 1]")
    return t.reshape(rows, 1).to(torch.float32)


def _scalar(t: torch.Tensor, module: str, role: str) -> torch.Tensor:
    if t.numel() != 1:
        raise _err(module, f"tensor {module}.{role} has shape {list(t.shape)}, expected one value")
    return t.reshape(()).to(torch.float32)


def unpack_int32(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 words -> unsigned values (int32), 32 // bits per word along `dim`, lowest bits first."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    x = packed.to(torch.int32).movedim(dim, -1).unsqueeze(-1)
    values = (x >> shifts) & ((1 << bits) - 1)  # arithmetic shift, then the mask drops the sign bits
    return values.reshape(*x.shape[:-2], -1).movedim(-1, dim)


def pack_int32(values: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Unsigned values (< 2^bits) -> int32 words along `dim`, lowest bits first; zero-padded to whole words."""
    per_word = 32 // bits
    v = values.to(torch.int64).movedim(dim, -1)
    pad = -v.shape[-1] % per_word
    if pad:
        v = torch.nn.functional.pad(v, (0, pad))
    words = (v.reshape(*v.shape[:-1], -1, per_word) << torch.arange(0, 32, bits, dtype=torch.int64)).sum(-1)
    words = torch.where(words >= 1 << 31, words - (1 << 32), words)  # the uint32 bit pattern as int32
    return words.to(torch.int32).movedim(-1, dim).contiguous()


def _to_canonical(q: torch.Tensor, zeros: torch.Tensor | None, bits: int, signed: bool,
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """q (and zeros, same units) from a format's signed or unsigned integers to the canonical convention."""
    half = 1 << (bits - 1)
    if zeros is None:
        return (q if signed else q - half).to(torch.int8).contiguous(), None
    if bits == 4 and signed:
        q, zeros = q + half, zeros + half
    elif bits == 8 and not signed:
        q, zeros = q - half, zeros - half
    return q.to(torch.int8).contiguous(), zeros.to(torch.float32).contiguous()


class CheckpointQuant:
    """How one checkpoint stores its quantized linear layers; a subclass per format."""

    method: str = ""

    def scheme_for(self, module: str) -> QuantScheme | None:
        raise NotImplementedError

    def roles(self, module: str) -> set[str]:
        raise NotImplementedError

    def optional_roles(self, module: str) -> set[str]:
        """Tensors claimed for the module besides `roles` (checked by assemble when given); none by default."""
        return set()

    def assemble(self, module: str, parts: dict[str, torch.Tensor]) -> QuantizedWeight:
        raise NotImplementedError

    def bias(self, module: str, parts: dict[str, torch.Tensor]) -> torch.Tensor | None:
        """The float bias folded into the module's quantized tensors (msModelSlim W8A8's quant_bias), which replaces
        any X.bias; None where the format keeps the bias as the ordinary tensor X.bias."""
        return None

    def split_name(self, tensor_name: str) -> tuple[str, str] | None:
        module, _, role = tensor_name.rpartition(".")
        if not module or self.scheme_for(module) is None:
            return None
        if role in self.roles(module) or role in self.optional_roles(module):
            return module, role
        return None

    def _scheme(self, module: str) -> QuantScheme:
        scheme = self.scheme_for(module)
        if scheme is None:
            raise _err(module, f"not a quantized module of this {self.method} checkpoint")
        return scheme


# ---- compressed-tensors --------------------------------------------------------------------------------------

_CT_FORMATS = ("int-quantized", "naive-quantized", "pack-quantized")


def _ct_match(module: str, target: str) -> bool:
    if target.startswith("re:"):
        return re.match(target[3:], module) is not None
    return target == module


def _ct_weight_scheme(key: str, weights: dict | None, acts: dict | None, outputs: dict | None) -> QuantScheme:
    if not isinstance(weights, dict):
        raise ValueError(f"quantization_config: {key}.weights is missing (weight-less groups are not supported)")
    if weights.get("type", "int") != "int":
        raise ValueError(f"quantization_config: {key}.weights.type {weights.get('type')!r}: float weights "
                         f"(fp8 / nvfp4 / mxfp) are not supported, only int")
    bits = weights.get("num_bits", 8)
    if bits not in (4, 8):
        raise ValueError(f"quantization_config: {key}.weights.num_bits {bits} is not supported (4 or 8)")
    strategy = weights.get("strategy") or ("group" if (weights.get("group_size") or 0) > 0 else "tensor")
    if strategy not in ("channel", "group", "tensor"):
        raise ValueError(f"quantization_config: {key}.weights.strategy {strategy!r} is not supported "
                         f"(channel, group, tensor)")
    group = int(weights.get("group_size") or 0) if strategy == "group" else 0
    if strategy == "group" and group <= 0:
        raise ValueError(f"quantization_config: {key}.weights.group_size must be > 0 for strategy group")
    if weights.get("dynamic"):
        raise ValueError(f"quantization_config: {key}.weights.dynamic is not supported")
    if weights.get("actorder") not in (None, False, "weight", "static"):
        raise ValueError(f"quantization_config: {key}.weights.actorder {weights.get('actorder')!r} "
                         f"(act-order with g_idx) is not supported")
    scale_dtype = weights.get("scale_dtype")
    if scale_dtype is not None and str(scale_dtype).removeprefix("torch.") not in ("float16", "bfloat16", "float32"):
        raise ValueError(f"quantization_config: {key}.weights.scale_dtype {scale_dtype!r} is not supported")
    if outputs:
        raise ValueError(f"quantization_config: {key}.output_activations (output quantization) is not supported")
    activations = "none"
    if acts:
        if acts.get("type", "int") != "int" or acts.get("num_bits", 8) != 8:
            raise ValueError(f"quantization_config: {key}.input_activations: only int8 activations are supported "
                             f"(got {acts.get('type')} {acts.get('num_bits')}-bit)")
        if not acts.get("symmetric", True):
            raise ValueError(f"quantization_config: {key}.input_activations.symmetric false: asymmetric int8 "
                             f"activations are not supported")
        a_strategy = acts.get("strategy") or "tensor"
        if a_strategy == "token" and acts.get("dynamic") is True:
            activations = "int8_dynamic"
        elif a_strategy == "tensor" and not acts.get("dynamic"):
            activations = "int8_static"
        else:
            raise ValueError(f"quantization_config: {key}.input_activations: strategy {a_strategy!r} with "
                             f"dynamic={acts.get('dynamic')!r} is not supported (dynamic token or static tensor)")
    try:
        return QuantScheme(bits, group, bool(weights.get("symmetric", True)), activations)
    except ValueError as e:
        raise ValueError(f"quantization_config: {key}: {e}") from None


class CompressedTensorsQuant(CheckpointQuant):
    method = "compressed-tensors"

    def __init__(self, qc: dict) -> None:
        fmt = qc.get("format")
        if qc.get("quantization_status", "compressed") != "compressed":
            raise ValueError(f"quantization_config.quantization_status {qc.get('quantization_status')!r}: only "
                             f"compressed checkpoints are supported (not fake-quantized float weights)")
        for key in ("sparsity_config", "transform_config", "kv_cache_scheme", "moe_sparsity_config"):
            if qc.get(key):
                raise ValueError(f"quantization_config.{key} is not supported (sparsity, transforms, quantized "
                                 f"KV cache)")
        self.ignore: list[str] = list(qc.get("ignore") or [])
        self.groups: list[tuple[list[str], QuantScheme, str]] = []
        groups = qc.get("config_groups") or {}
        if not groups:
            raise ValueError("quantization_config.config_groups is empty")
        for name, group in groups.items():
            key = f"config_groups.{name}"
            if not isinstance(group, dict):
                raise ValueError(f"quantization_config: {key}: preset-name groups are not supported; expected "
                                 f"a scheme with targets and weights")
            scheme = _ct_weight_scheme(key, group.get("weights"), group.get("input_activations"),
                                       group.get("output_activations"))
            group_fmt = group.get("format") or fmt
            if group_fmt not in _CT_FORMATS:
                raise ValueError(f"quantization_config: {key}.format {group_fmt!r} is not supported "
                                 f"({', '.join(_CT_FORMATS)}; float8, nvfp4, mxfp4, marlin-24 and sparse formats "
                                 f"are refused)")
            targets = list(group.get("targets") or [])
            for target in targets:
                if not target.startswith("re:") and "." not in target and target != "Linear":
                    raise ValueError(f"quantization_config: {key}.targets {target!r}: only 'Linear', module names "
                                     f"and 're:' patterns are supported")
            self.groups.append((targets, scheme, group_fmt))

    def _group(self, module: str) -> tuple[QuantScheme, str] | None:
        if any(_ct_match(module, pattern) for pattern in self.ignore):
            return None
        # vLLM's order: a name or pattern match first, then the class target
        for targets, scheme, fmt in self.groups:
            if any(t != "Linear" and _ct_match(module, t) for t in targets):
                return scheme, fmt
        if _is_linear_name(module) and not _is_router(module):   # vLLM builds MoE routers unquantized
            for targets, scheme, fmt in self.groups:
                if "Linear" in targets:
                    return scheme, fmt
        return None

    def scheme_for(self, module: str) -> QuantScheme | None:
        found = self._group(module)
        return None if found is None else found[0]

    def roles(self, module: str) -> set[str]:
        found = self._group(module)
        if found is None:
            raise _err(module, "not a quantized module of this compressed-tensors checkpoint")
        scheme, fmt = found
        roles = {"weight_packed", "weight_shape"} if fmt == "pack-quantized" else {"weight"}
        roles.add("weight_scale")
        if not scheme.symmetric:
            roles.add("weight_zero_point")
        if scheme.activations == "int8_static":
            roles.add("input_scale")
        return roles

    def assemble(self, module: str, parts: dict[str, torch.Tensor]) -> QuantizedWeight:
        found = self._group(module)
        if found is None:
            raise _err(module, "not a quantized module of this compressed-tensors checkpoint")
        scheme, fmt = found
        bits = scheme.weight_bits
        if fmt == "pack-quantized":
            shape = _part(parts, module, "weight_shape", _INT_DTYPES)
            if shape.numel() != 2:
                raise _err(module, f"tensor {module}.weight_shape has {shape.numel()} values, expected 2")
            out_f, in_f = (int(v) for v in shape.reshape(2).tolist())
            words = -(-in_f * bits // 32)
            packed = _part(parts, module, "weight_packed", (torch.int32,), (out_f, words))
            q = unpack_int32(packed, bits, 1)[:, :in_f] - (1 << (bits - 1))
        else:
            q = _part(parts, module, "weight", (torch.int8,)).to(torch.int32)
            if q.dim() != 2:
                raise _err(module, f"tensor {module}.weight has shape {list(q.shape)}, expected [out, in]")
            out_f, in_f = q.shape
        lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
        if q.numel() and (int(q.min()) < lo or int(q.max()) > hi):
            raise _err(module, f"tensor {module}.weight holds values outside the {bits}-bit range")
        groups = in_f // scheme.group_size if scheme.group_size else 1
        if scheme.group_size and in_f % scheme.group_size:
            raise _err(module, f"{in_f} inputs do not split into groups of {scheme.group_size}")
        scale = _part(parts, module, "weight_scale", _FLOAT_DTYPES)
        if scheme.group_size:
            if tuple(scale.shape) != (out_f, groups):
                raise _err(module, f"tensor {module}.weight_scale has shape {list(scale.shape)}, "
                                   f"expected [{out_f}, {groups}]")
            scales = scale.to(torch.float32)
        else:
            scales = _per_row(scale, module, "weight_scale", out_f)
        zeros = None
        if not scheme.symmetric:
            zp = _part(parts, module, "weight_zero_point", _INT_DTYPES)
            if fmt == "pack-quantized":
                zp_words = -(-out_f * bits // 32)
                if tuple(zp.shape) != (zp_words, groups) or zp.dtype != torch.int32:
                    raise _err(module, f"tensor {module}.weight_zero_point has shape {list(zp.shape)} "
                                       f"({zp.dtype}), expected int32 [{zp_words}, {groups}]")
                zp = unpack_int32(zp, bits, 0)[:out_f] - (1 << (bits - 1))
            elif zp.numel() == 1:
                zp = zp.reshape(1, 1).expand(out_f, groups)
            elif tuple(zp.shape) != (out_f, groups):
                raise _err(module, f"tensor {module}.weight_zero_point has shape {list(zp.shape)}, "
                                   f"expected [{out_f}, {groups}]")
            zeros = zp.to(torch.int32)
        elif "weight_zero_point" in parts and bool(parts["weight_zero_point"].ne(0).any()):
            raise _err(module, f"tensor {module}.weight_zero_point is non-zero in a symmetric scheme")
        qweight, zeros_f = _to_canonical(q, zeros, bits, signed=True)
        qw = QuantizedWeight(qweight, scales, zeros_f, scheme=scheme)
        if scheme.activations == "int8_static":
            qw.input_scale = _scalar(_part(parts, module, "input_scale", _FLOAT_DTYPES), module, "input_scale")
            qw.input_offset = torch.zeros((), dtype=torch.float32)
        return qw


def compressed_tensors_config(scheme: QuantScheme, ignore: list[str]) -> dict:
    """config.json's "quantization_config" for `scheme`, as llm-compressor writes it (`ModelCompressor.update_config`):
    int8 activations -> "int-quantized" (vLLM's W8A8 int8 path), weight-only -> "pack-quantized" (vLLM's WNA16
    path, int8 weights included), one group targeting every Linear except `ignore`."""
    weights = {"num_bits": scheme.weight_bits, "type": "int", "symmetric": scheme.symmetric,
               "group_size": scheme.group_size or None, "strategy": "group" if scheme.group_size else "channel",
               "dynamic": False}
    acts = None
    if scheme.activations != "none":
        dynamic = scheme.activations == "int8_dynamic"
        acts = {"num_bits": 8, "type": "int", "symmetric": True, "group_size": None,
                "strategy": "token" if dynamic else "tensor", "dynamic": dynamic}
    fmt = "int-quantized" if acts else "pack-quantized"
    return {
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": acts,
                                      "output_activations": None, "format": fmt}},
        "format": fmt,
        "global_compression_ratio": None,
        "ignore": list(ignore),
        "kv_cache_scheme": None,
        "moe_sparsity_config": None,
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
        "sparsity_config": {},
        "transform_config": {},
        "version": COMPRESSED_TENSORS_VERSION,
    }


def compressed_tensors_tensors(module: str, qw: QuantizedWeight, scheme: QuantScheme) -> dict[str, torch.Tensor]:
    """The checkpoint tensors of one module in the format `compressed_tensors_config(scheme, ...)` declares.
    Scales are written as float32 (the canonical precision; llm-compressor writes the model dtype, vLLM casts)."""
    bits = scheme.weight_bits
    half = 1 << (bits - 1)
    out_f, in_f = qw.qweight.shape
    q = qw.qweight.to(torch.int32)
    zp = None
    if not scheme.symmetric:
        if qw.zeros is None:
            raise _err(module, "an asymmetric scheme needs zeros")
        zp = torch.round(qw.zeros).to(torch.int32)
        if not torch.equal(zp.to(torch.float32), qw.zeros):
            raise _err(module, "compressed-tensors stores integer zero points; these zeros are fractional")
        if bits == 4:  # canonical unsigned 4-bit -> compressed-tensors' signed
            q, zp = q - half, zp - half
        if int(zp.min()) < -half or int(zp.max()) >= half:
            raise _err(module, f"zero points outside the signed {bits}-bit range")
    elif qw.zeros is not None and bool(qw.zeros.ne(0).any()):
        raise _err(module, "a symmetric scheme has non-zero zeros")
    prefix = f"{module}."
    scale = qw.scales.to(torch.float32).contiguous()
    if scheme.activations != "none":
        tensors = {prefix + "weight": q.to(torch.int8).contiguous(), prefix + "weight_scale": scale}
        if zp is not None:
            tensors[prefix + "weight_zero_point"] = zp.to(torch.int8).contiguous()
        if scheme.activations == "int8_static":
            if qw.input_scale is None:
                raise _err(module, "int8_static needs input_scale")
            if qw.input_offset is not None and float(qw.input_offset) != 0.0:
                raise _err(module, "compressed-tensors static activations are symmetric; input_offset must be 0")
            tensors[prefix + "input_scale"] = qw.input_scale.reshape(1).to(torch.float32)
        return tensors
    tensors = {prefix + "weight_packed": pack_int32(q + half, bits, 1),
               prefix + "weight_shape": torch.tensor([out_f, in_f], dtype=torch.int64),
               prefix + "weight_scale": scale}
    if zp is not None:
        tensors[prefix + "weight_zero_point"] = pack_int32(zp + half, bits, 0)
    return tensors


# ---- GPTQ ----------------------------------------------------------------------------------------------------

def _gptq_scheme(key: str, bits: object, group_size: object, sym: object) -> QuantScheme:
    if bits not in (4, 8):
        raise ValueError(f"quantization_config: {key}bits {bits!r} is not supported (4 or 8)")
    if not isinstance(group_size, int) or (group_size <= 0 and group_size != -1):
        raise ValueError(f"quantization_config: {key}group_size {group_size!r} must be -1 or > 0")
    return QuantScheme(int(bits), max(group_size, 0), bool(sym))


class GPTQQuant(CheckpointQuant):
    method = "gptq"

    def __init__(self, qc: dict) -> None:
        for key in ("is_marlin_format",):
            if qc.get(key):
                raise ValueError(f"quantization_config.{key}: the marlin repacked layout is not supported")
        fmt = qc.get("checkpoint_format") or qc.get("format") or "gptq"
        if fmt not in ("gptq", "gptq_v2"):
            raise ValueError(f"quantization_config.checkpoint_format {fmt!r} is not supported (gptq, gptq_v2)")
        if qc.get("pack_dtype", "int32") not in ("int32", "torch.int32"):
            raise ValueError(f"quantization_config.pack_dtype {qc.get('pack_dtype')!r} is not supported (int32)")
        self.v1 = fmt == "gptq"
        self.base = _gptq_scheme("", qc.get("bits"), qc.get("group_size", 128), qc.get("sym", True))
        self.desc_act = bool(qc.get("desc_act", False))
        self.lm_head = bool(qc.get("lm_head", False))
        blocks = qc.get("modules_in_block_to_quantize") or []
        self.only: list[str] = [m for b in blocks for m in (b if isinstance(b, list) else [b])]
        # GPTQModel's per-module overrides: "-:regex" leaves a module unquantized, "+:regex" / "regex" overrides
        self.dynamic: list[tuple[str, QuantScheme | None, bool]] = []
        for pattern, override in (qc.get("dynamic") or {}).items():
            if pattern.startswith("-:"):
                self.dynamic.append((pattern[2:], None, False))
                continue
            override = override or {}
            key = f"dynamic[{pattern!r}]."
            scheme = _gptq_scheme(key, override.get("bits", self.base.weight_bits),
                                  override.get("group_size", self.base.group_size or -1),
                                  override.get("sym", self.base.symmetric))
            self.dynamic.append((pattern.removeprefix("+:"), scheme, bool(override.get("desc_act", self.desc_act))))

    def _lookup(self, module: str) -> tuple[QuantScheme, bool] | None:
        if not _is_linear_name(module) or _is_router(module):
            return None
        if module.rsplit(".", 1)[-1] == "lm_head" and not self.lm_head:
            return None
        if self.only and module.rsplit(".", 1)[-1] != "lm_head" and not any(
                module.endswith("." + m) for m in self.only):
            return None
        for pattern, scheme, desc_act in self.dynamic:
            if re.match(pattern, module):
                return None if scheme is None else (scheme, desc_act)
        return self.base, self.desc_act

    def scheme_for(self, module: str) -> QuantScheme | None:
        found = self._lookup(module)
        return None if found is None else found[0]

    def roles(self, module: str) -> set[str]:
        self._scheme(module)
        return {"qweight", "qzeros", "scales", "g_idx"}  # AutoGPTQ, GPTQModel and optimum always write g_idx

    def assemble(self, module: str, parts: dict[str, torch.Tensor]) -> QuantizedWeight:
        scheme = self._scheme(module)
        bits = scheme.weight_bits
        per_word = 32 // bits
        qweight = _part(parts, module, "qweight", (torch.int32,))
        if qweight.dim() != 2:
            raise _err(module, f"tensor {module}.qweight has shape {list(qweight.shape)}, expected 2-D")
        in_f, out_f = qweight.shape[0] * per_word, qweight.shape[1]
        g = scheme.group_size or in_f
        if in_f % g or out_f % per_word:
            raise _err(module, f"[{out_f}, {in_f}] does not fit group size {g} / {bits}-bit packing")
        groups = in_f // g
        scales = _part(parts, module, "scales", _FLOAT_DTYPES, (groups, out_f))
        qzeros = _part(parts, module, "qzeros", (torch.int32,), (groups, out_f // per_word))
        g_idx = _part(parts, module, "g_idx", _INT_DTYPES, (in_f,))
        if not torch.equal(g_idx.to(torch.int64), torch.arange(in_f) // g):
            found = self._lookup(module)
            what = "desc_act (act-order) permutes the inputs" if found and found[1] else "g_idx is permuted"
            raise _err(module, f"tensor {module}.g_idx is not i // {g}: {what}; act-order GPTQ is not supported")
        q = unpack_int32(qweight, bits, 0).t()
        zeros = unpack_int32(qzeros, bits, 1).t()  # [out, groups]
        if self.v1:
            zeros = zeros + 1
        if scheme.symmetric:
            if bool(zeros.ne(1 << (bits - 1)).any()):
                raise _err(module, f"tensor {module}.qzeros: sym=true but the zero points are not {1 << (bits - 1)}"
                                   f" (checkpoint_format {'gptq' if self.v1 else 'gptq_v2'})")
            qw, zf = _to_canonical(q, None, bits, signed=False)
        else:
            qw, zf = _to_canonical(q, zeros, bits, signed=False)
        return QuantizedWeight(qw.contiguous(), scales.t().to(torch.float32).contiguous(), zf, scheme=scheme)


# ---- AWQ -----------------------------------------------------------------------------------------------------

class AWQQuant(CheckpointQuant):
    method = "awq"

    def __init__(self, qc: dict) -> None:
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(f"quantization_config.version {version!r} is not supported (only AutoAWQ's 'gemm' "
                             f"layout; gemv, gemv_fast, marlin and exllama pack differently)")
        bits = qc.get("bits", qc.get("w_bit"))
        if bits != 4:
            raise ValueError(f"quantization_config.bits {bits!r} is not supported (AWQ is 4-bit)")
        group = qc.get("group_size", qc.get("q_group_size", 128))
        if not isinstance(group, int) or (group <= 0 and group != -1):
            raise ValueError(f"quantization_config.group_size {group!r} must be -1 or > 0")
        if not qc.get("zero_point", True):
            raise ValueError("quantization_config.zero_point false is not supported (AWQ GEMM has zero points)")
        self.scheme = QuantScheme(4, max(group, 0), symmetric=False)
        self.skip: list[str] = list(qc.get("modules_to_not_convert") or [])

    def scheme_for(self, module: str) -> QuantScheme | None:
        if (not _is_linear_name(module) or _is_router(module) or module.rsplit(".", 1)[-1] == "lm_head"
                or any(s in module for s in self.skip)):  # vLLM: substring match
            return None
        return self.scheme

    def roles(self, module: str) -> set[str]:
        self._scheme(module)
        return {"qweight", "qzeros", "scales"}

    def assemble(self, module: str, parts: dict[str, torch.Tensor]) -> QuantizedWeight:
        scheme = self._scheme(module)
        qweight = _part(parts, module, "qweight", (torch.int32,))
        if qweight.dim() != 2:
            raise _err(module, f"tensor {module}.qweight has shape {list(qweight.shape)}, expected 2-D")
        in_f, out_f = qweight.shape[0], qweight.shape[1] * 8
        g = scheme.group_size or in_f
        if in_f % g:
            raise _err(module, f"{in_f} inputs do not split into groups of {g}")
        groups = in_f // g
        scales = _part(parts, module, "scales", _FLOAT_DTYPES, (groups, out_f))
        qzeros = _part(parts, module, "qzeros", (torch.int32,), (groups, out_f // 8))

        def columns(packed: torch.Tensor) -> torch.Tensor:
            v = unpack_int32(packed, 4, 1)
            return v.reshape(v.shape[0], -1, 8)[..., list(AWQ_REVERSE_ORDER)].reshape(v.shape[0], -1)

        qw, zf = _to_canonical(columns(qweight).t(), columns(qzeros).t(), 4, signed=False)
        return QuantizedWeight(qw.contiguous(), scales.t().to(torch.float32).contiguous(),
                               zf.contiguous() if zf is not None else None, scheme=scheme)


# ---- msModelSlim ---------------------------------------------------------------------------------------------

_MODELSLIM_TYPES = ("W8A8", "W8A8_DYNAMIC", "W8A16")


def _deq_scale_f32(t: torch.Tensor) -> torch.Tensor:
    """deq_scale as float32: stored as float32, or (fp16 models) as int64 whose low 32 bits are the float32's."""
    if t.dtype == torch.float32:
        return t
    return (t.to(torch.int64) & 0xFFFFFFFF).to(torch.int32).view(torch.float32)


class ModelSlimQuant(CheckpointQuant):
    method = "msmodelslim"

    def __init__(self, desc: dict) -> None:
        for key in ("kv_cache_type", "fa_quant_type"):
            if desc.get(key) not in (None, "", "FLOAT"):
                raise ValueError(f"{MODELSLIM_DESCRIPTION}: {key} {desc.get(key)!r} (quantized KV cache / "
                                 f"attention) is not supported")
        group = desc.get("group_size") or 0
        if not isinstance(group, int) or group < -1:
            raise ValueError(f"{MODELSLIM_DESCRIPTION}: group_size {group!r} is not supported")
        self.group_size = max(group, 0)
        self.types: dict[str, str] = {}          # module -> quant type of its weight
        self.tensors: dict[str, set[str]] = {}   # module -> the roles the description lists for it
        for key, kind in desc.items():
            if "." not in key or not isinstance(kind, str):
                continue  # model_quant_type, version, ...
            if kind != "FLOAT" and kind not in _MODELSLIM_TYPES:
                raise ValueError(f"{MODELSLIM_DESCRIPTION}: {key}: quant type {kind!r} is not supported "
                                 f"({', '.join(_MODELSLIM_TYPES)}, FLOAT)")
            module, _, role = key.rpartition(".")
            # anti-outlier norms are listed as "<norm>.module.weight", often typed like the model: not linear layers
            if role == "weight" and kind != "FLOAT" and _is_linear_name(module.removesuffix(".module")):
                self.types[module] = kind
            self.tensors.setdefault(module, set()).add(role)
        if self.group_size and any(t != "W8A16" for t in self.types.values()):
            raise ValueError(f"{MODELSLIM_DESCRIPTION}: group_size {group} is only supported with W8A16")
        for module, kind in self.types.items():
            companion = "deq_scale" if kind == "W8A8" else "weight_scale"
            if companion not in self.tensors[module]:
                raise ValueError(f"{MODELSLIM_DESCRIPTION}: {module}.weight is typed {kind!r} but "
                                 f"{module}.{companion} is not listed")
        self.quantized = bool(self.types)

    def scheme_for(self, module: str) -> QuantScheme | None:
        kind = self.types.get(module)
        if kind == "W8A8":
            return QuantScheme(8, 0, True, "int8_static")
        if kind == "W8A8_DYNAMIC":
            return QuantScheme(8, 0, True, "int8_dynamic")
        if kind == "W8A16":
            return QuantScheme(8, self.group_size, symmetric=False)
        return None

    def roles(self, module: str) -> set[str]:
        scheme = self._scheme(module)
        need = ({"weight", "input_scale", "input_offset", "deq_scale", "quant_bias"}
                if scheme.activations == "int8_static" else {"weight", "weight_scale", "weight_offset"})
        listed = self.tensors.get(module, set()) - {"bias"}
        missing = need - listed
        if missing:
            raise _err(module, f"{MODELSLIM_DESCRIPTION} lists no {', '.join(sorted(missing))} for this "
                               f"{self.types[module]} module")
        return listed

    def optional_roles(self, module: str) -> set[str]:
        # W8A8 folds the float bias into quant_bias: claim X.bias so it is not added a second time
        scheme = self.scheme_for(module)
        return {"bias"} if scheme is not None and scheme.activations == "int8_static" else set()

    def assemble(self, module: str, parts: dict[str, torch.Tensor]) -> QuantizedWeight:
        scheme = self._scheme(module)
        q = _part(parts, module, "weight", (torch.int8,))
        if q.dim() != 2:
            raise _err(module, f"tensor {module}.weight has shape {list(q.shape)}, expected [out, in]")
        out_f, in_f = q.shape
        if scheme.activations == "int8_static":
            input_scale = _scalar(_part(parts, module, "input_scale", _FLOAT_DTYPES), module, "input_scale")
            if not float(input_scale) > 0:
                raise _err(module, f"tensor {module}.input_scale is {float(input_scale)}, expected > 0")
            offset = _scalar(_part(parts, module, "input_offset", _FLOAT_DTYPES + _INT_DTYPES), module,
                             "input_offset")
            if float(offset) != round(float(offset)) or not -128 <= float(offset) <= 127:
                raise _err(module, f"tensor {module}.input_offset {float(offset)} is not an int8 value")
            deq = _deq_scale_f32(_part(parts, module, "deq_scale", (torch.float32, torch.int64, torch.int32),
                                       (out_f,)))
            _part(parts, module, "quant_bias", (torch.int32, torch.int64), (out_f,))
            if not bool(torch.isfinite(deq).all()) or bool((deq <= 0).any()):
                raise _err(module, f"tensor {module}.deq_scale is not a positive float32 (bit pattern)")
            scales = (deq / input_scale).reshape(out_f, 1)
            if "weight_scale" in parts:  # some exports also carry it: it must agree
                ws = _per_row(parts["weight_scale"].to(torch.float32), module, "weight_scale", out_f)
                if not torch.allclose(ws, scales, rtol=1e-2, atol=0):
                    raise _err(module, f"tensor {module}.weight_scale disagrees with deq_scale / input_scale")
            if "weight_offset" in parts and bool(parts["weight_offset"].ne(0).any()):
                raise _err(module, f"tensor {module}.weight_offset is non-zero; W8A8 weights are symmetric")
            return QuantizedWeight(q.clone(), scales, None, input_scale, offset, scheme=scheme)
        scale = _part(parts, module, "weight_scale", _FLOAT_DTYPES)
        offset_t = _part(parts, module, "weight_offset", _FLOAT_DTYPES + _INT_DTYPES)
        if scheme.group_size:
            groups = in_f // scheme.group_size
            if in_f % scheme.group_size or tuple(scale.shape) != (out_f, groups) or offset_t.shape != scale.shape:
                raise _err(module, f"tensors {module}.weight_scale/weight_offset have shapes {list(scale.shape)}/"
                                   f"{list(offset_t.shape)}, expected [{out_f}, {in_f // scheme.group_size}]")
            scales, offsets = scale.to(torch.float32), offset_t.to(torch.float32)
        else:
            scales = _per_row(scale, module, "weight_scale", out_f)
            offsets = _per_row(offset_t, module, "weight_offset", out_f)
        if not torch.equal(offsets, offsets.round()):
            raise _err(module, f"tensor {module}.weight_offset is fractional")
        if scheme.symmetric:
            if bool(offsets.ne(0).any()):
                raise _err(module, f"tensor {module}.weight_offset is non-zero: {self.types[module]} weights must "
                                   f"be symmetric (vllm-ascend ignores the offset)")
            return QuantizedWeight(q.clone(), scales, None, scheme=scheme)
        # W8A16: signed q and offsets are already the canonical 8-bit convention
        return QuantizedWeight(q.clone(), scales, offsets, scheme=scheme)

    def bias(self, module: str, parts: dict[str, torch.Tensor]) -> torch.Tensor | None:
        scheme = self._scheme(module)
        if scheme.activations != "int8_static":
            return None
        qw = self.assemble(module, parts)
        deq = _deq_scale_f32(parts["deq_scale"]).to(torch.float64)
        offset = int(float(parts["input_offset"].reshape(-1)[0]))  # assemble checked it is an int8 value
        folded = parts["quant_bias"].to(torch.int64) + offset * qw.qweight.to(torch.int64).sum(1)
        given = parts.get("bias")
        if given is not None:
            # quant_bias = round(bias / deq_scale) - offset * sum(q): the bias is within half a step of the folded one
            err = (folded.to(torch.float64) * deq - given.to(torch.float64).reshape(-1)).abs()
            if given.numel() != folded.numel() or bool((err > 0.5 * deq * (1 + 1e-3) + 1e-6).any()):
                raise _err(module, f"tensor {module}.quant_bias does not fold tensor {module}.bias")
        if not bool(folded.ne(0).any()):
            return None
        return (folded.to(torch.float64) * deq).to(torch.float32)


# ---- entry point ---------------------------------------------------------------------------------------------

_READERS: dict[str, Callable[[dict], CheckpointQuant]] = {
    "compressed-tensors": CompressedTensorsQuant, "gptq": GPTQQuant, "awq": AWQQuant}


def read_checkpoint_quant(model_dir: str, config: dict) -> CheckpointQuant | None:
    """The quantization of the checkpoint in `model_dir` (config = its config.json), None when it is not quantized.
    ValueError naming the key for anything unknown or unsupported."""
    qc = config.get("quantization_config") or config.get("compression_config")
    desc_path = os.path.join(model_dir, MODELSLIM_DESCRIPTION)
    if qc is not None and (qc.get("quant_method") or not os.path.isfile(desc_path)):
        method = qc.get("quant_method")
        reader = _READERS.get(str(method))
        if reader is None:
            raise ValueError(f"quantization_config.quant_method {method!r} is not supported "
                             f"({', '.join(_READERS)}, or msModelSlim's {MODELSLIM_DESCRIPTION})")
        return reader(qc)
    if os.path.isfile(desc_path):
        with open(desc_path) as f:
            desc = json.load(f)
        slim = ModelSlimQuant(desc)
        return slim if slim.quantized else None
    return None
