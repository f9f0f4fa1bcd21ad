"""Quantized checkpoint formats (engine/quant/formats.py): each format is produced by its real tool where one installs
(compressed-tensors) or by a reference packer written from the format's documented layout (GPTQ, AWQ, msModelSlim),
then read back through read_checkpoint_quant / split_name / roles / assemble, as the loader does."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from quant_helpers import awq_checkpoint, gptq_checkpoint
from torch import nn

from pdcluster.engine.quant.formats import (
    CheckpointQuant,
    compressed_tensors_config,
    compressed_tensors_tensors,
    read_checkpoint_quant,
)
from pdcluster.engine.quant.scheme import QuantizedWeight, QuantScheme, quantize_weight

ct = pytest.importorskip("compressed_tensors")
from compressed_tensors.compressors import BaseCompressor  # noqa: E402
from compressed_tensors.compressors.model_compressors import ModelCompressor  # noqa: E402
from compressed_tensors.quantization import (  # noqa: E402
    QuantizationArgs,
    QuantizationConfig,
    QuantizationScheme,
    apply_quantization_config,
    preset_name_to_scheme,
)
from compressed_tensors.quantization.lifecycle.forward import quantize  # noqa: E402
from compressed_tensors.quantization.utils import calculate_qparams  # noqa: E402

Q_PROJ = "model.layers.0.self_attn.q_proj"
DOWN = "model.layers.0.mlp.down_proj"
EXPERT = "model.layers.0.mlp.experts.3.down_proj"


def _write_config(tmp_path, config: dict) -> str:
    with open(os.path.join(tmp_path, "config.json"), "w") as f:
        json.dump(config, f)
    return str(tmp_path)


def _load(cq: CheckpointQuant, tensors: dict[str, torch.Tensor]) -> tuple[dict[str, QuantizedWeight], set[str]]:
    """What the loader does: route each tensor, assemble a module once its roles have all arrived."""
    parts: dict[str, dict[str, torch.Tensor]] = {}
    plain = set()
    for name, t in tensors.items():
        split = cq.split_name(name)
        if split is None:
            plain.add(name)
        else:
            parts.setdefault(split[0], {})[split[1]] = t
    out = {}
    for module, p in parts.items():
        assert cq.roles(module) <= set(p), (module, cq.roles(module), set(p))
        out[module] = cq.assemble(module, p)
    return out, plain


def _tiny_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    root = nn.Module()
    root.model = nn.Module()
    root.model.embed_tokens = nn.Embedding(16, 64)
    layer = nn.Module()
    layer.input_layernorm = nn.LayerNorm(64)
    layer.self_attn = nn.Module()
    layer.self_attn.q_proj = nn.Linear(64, 48, bias=False)
    layer.mlp = nn.Module()
    layer.mlp.down_proj = nn.Linear(64, 40, bias=False)
    root.model.layers = nn.ModuleList([layer])
    root.lm_head = nn.Linear(64, 16, bias=False)
    return root


# ---- compressed-tensors: the real producer ---------------------------------------------------------------------

CT_CASES = {
    "w4a16-group-sym": dict(weights=QuantizationArgs(num_bits=4, strategy="group", group_size=32, symmetric=True)),
    "w4a16-group-asym": dict(weights=QuantizationArgs(num_bits=4, strategy="group", group_size=32, symmetric=False)),
    "w8a16-channel": dict(weights=QuantizationArgs(num_bits=8, strategy="channel", symmetric=True)),
    "w8a16-channel-asym": dict(weights=QuantizationArgs(num_bits=8, strategy="channel", symmetric=False)),
    "w8a8-dynamic": dict(weights=QuantizationArgs(num_bits=8, strategy="channel", symmetric=True),
                         input_activations=QuantizationArgs(num_bits=8, strategy="token", dynamic=True)),
    "w8a8-static": dict(weights=QuantizationArgs(num_bits=8, strategy="channel", symmetric=True),
                        input_activations=QuantizationArgs(num_bits=8, strategy="tensor", dynamic=False)),
}


def _ct_produce(tmp_path, case: dict) -> tuple[nn.Module, dict[str, torch.Tensor], dict, dict]:
    """llm-compressor's save path without calibration: qparams from min/max, compress_model, update_config."""
    model = _tiny_model()
    original = {n: m.weight.detach().clone() for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    cfg = QuantizationConfig(config_groups={"group_0": QuantizationScheme(targets=["Linear"], **case)},
                             ignore=["lm_head"])
    apply_quantization_config(model, cfg, show_progress=False)
    for _, mod in model.named_modules():
        scheme = getattr(mod, "quantization_scheme", None)
        if scheme is None:
            continue
        w = mod.weight.detach()
        if scheme.weights.strategy == "group":
            w = w.reshape(w.shape[0], -1, scheme.weights.group_size)
            lo, hi = w.amin(-1), w.amax(-1)
        else:
            lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
        scale, zp = calculate_qparams(lo, hi, scheme.weights)
        mod.weight_scale.data.copy_(scale)
        if hasattr(mod, "weight_zero_point"):
            mod.weight_zero_point.data.copy_(zp)
        if hasattr(mod, "input_scale"):
            mod.input_scale.data.fill_(0.0625)
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    _write_config(tmp_path, {"model_type": "llama"})
    compressor.update_config(str(tmp_path))
    with open(os.path.join(tmp_path, "config.json")) as f:
        config = json.load(f)
    return model, {k: v.detach().clone() for k, v in model.state_dict().items()}, config, original


@pytest.mark.parametrize("case", list(CT_CASES))
def test_compressed_tensors_from_real_producer(tmp_path, case):
    model, tensors, config, original = _ct_produce(tmp_path, CT_CASES[case])
    cq = read_checkpoint_quant(str(tmp_path), config)
    assert cq is not None and cq.method == "compressed-tensors"
    assert cq.scheme_for("model.embed_tokens") is None
    assert cq.scheme_for("model.layers.0.input_layernorm") is None
    assert cq.scheme_for("lm_head") is None
    assert cq.scheme_for(EXPERT) == cq.scheme_for(Q_PROJ)
    weights, plain = _load(cq, tensors)
    assert set(weights) == {Q_PROJ, DOWN}
    assert plain == {"model.embed_tokens.weight", "model.layers.0.input_layernorm.weight",
                     "model.layers.0.input_layernorm.bias", "lm_head.weight"}
    for module, qw in weights.items():
        scheme = model.get_submodule(module).quantization_scheme
        local = {k.removeprefix(module + "."): v for k, v in tensors.items() if k.startswith(module + ".")}
        # the library's own decompression of the same tensors is the reference, bit for bit
        fmt = config["quantization_config"]["format"]
        ref = BaseCompressor.get_value_from_registry(fmt).decompress(local, scheme)["weight"]
        assert torch.equal(qw.dequantize(), ref)
        # and the integers are the library's quantization of the original weight
        zp = getattr(model.get_submodule(module), "weight_zero_point", None)
        q = quantize(original[module], local["weight_scale"], None if zp is None else _ct_zp(local, scheme),
                     scheme.weights, dtype=torch.int8)
        expect = q.to(torch.int32) + (8 if scheme.weights.num_bits == 4 and not scheme.weights.symmetric else 0)
        assert torch.equal(qw.qweight.to(torch.int32), expect)
        assert qw.scheme == cq.scheme_for(module)
        if case == "w8a8-static":
            assert float(qw.input_scale) == 0.0625 and float(qw.input_offset) == 0.0


def _ct_zp(local: dict[str, torch.Tensor], scheme: QuantizationScheme) -> torch.Tensor:
    zp = local["weight_zero_point"]
    if "weight_packed" not in local:
        return zp
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    out_f = int(local["weight_shape"][0])
    return unpack_from_int32(zp, scheme.weights.num_bits, torch.Size((out_f, zp.shape[1])), packed_dim=0)


# ---- compressed-tensors: what we write, read by the library and by us ---------------------------------------------

WRITE_CASES = {
    "w8a8": QuantScheme.named("w8a8"),
    "w8a16": QuantScheme.named("w8a16"),
    "w4a16": QuantScheme.named("w4a16", group_size=32),
    "w4a16-asym": QuantScheme(4, 32, symmetric=False),
}


@pytest.mark.parametrize("case", list(WRITE_CASES))
def test_compressed_tensors_round_trip(tmp_path, case):
    scheme = WRITE_CASES[case]
    torch.manual_seed(1)
    weights = {Q_PROJ: torch.randn(48, 64), EXPERT: torch.randn(40, 64)}
    qws = {m: quantize_weight(w, scheme) for m, w in weights.items()}
    config = compressed_tensors_config(scheme, ignore=["lm_head"])
    tensors: dict[str, torch.Tensor] = {"lm_head.weight": torch.randn(16, 64)}
    for module, qw in qws.items():
        tensors.update(compressed_tensors_tensors(module, qw, scheme))

    parsed = QuantizationConfig.model_validate(config)  # the library accepts our config as its own
    lib_scheme = parsed.config_groups["group_0"]
    assert parsed.format == config["format"] == ("int-quantized" if case == "w8a8" else "pack-quantized")
    if case in ("w4a16", "w8a8"):  # what llm-compressor writes for its presets (group 128 -> 32 here)
        preset = preset_name_to_scheme("W4A16" if case == "w4a16" else "W8A8", ["Linear"])
        if case == "w4a16":
            preset.weights.group_size = 32
        assert lib_scheme.weights.model_dump() == preset.weights.model_dump()
        assert (lib_scheme.input_activations and lib_scheme.input_activations.model_dump()) == (
            preset.input_activations and preset.input_activations.model_dump())
    for module, qw in qws.items():
        local = {k.removeprefix(module + "."): v for k, v in tensors.items() if k.startswith(module + ".")}
        ref = BaseCompressor.get_value_from_registry(config["format"]).decompress(local, lib_scheme)["weight"]
        torch.testing.assert_close(ref, qw.dequantize(), rtol=0, atol=1e-6)

    cq = read_checkpoint_quant(_write_config(tmp_path, {"quantization_config": config}),
                               {"quantization_config": config})
    assert cq is not None and cq.scheme_for(Q_PROJ) == scheme and cq.scheme_for("lm_head") is None
    back, plain = _load(cq, tensors)
    assert plain == {"lm_head.weight"}
    for module, qw in qws.items():
        assert torch.equal(back[module].qweight, qw.qweight)
        assert torch.equal(back[module].scales, qw.scales)
        assert (back[module].zeros is None) == (qw.zeros is None)
        if qw.zeros is not None:
            assert torch.equal(back[module].zeros, qw.zeros)


def test_compressed_tensors_regex_targets_and_ignore(tmp_path):
    config = compressed_tensors_config(QuantScheme.named("w8a8"), ignore=["lm_head", "re:.*mlp.gate$"])
    config["config_groups"]["group_1"] = {
        "targets": ["re:.*down_proj$"], "format": "pack-quantized", "input_activations": None,
        "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32}}
    cq = read_checkpoint_quant(str(tmp_path), {"quantization_config": config})
    assert cq is not None
    assert cq.scheme_for("model.layers.1.mlp.gate") is None
    assert cq.scheme_for(EXPERT) == QuantScheme(4, 32)           # the pattern beats the class target
    assert cq.scheme_for(Q_PROJ) == QuantScheme.named("w8a8")
    assert cq.roles(EXPERT) == {"weight_packed", "weight_scale", "weight_shape"}
    assert cq.roles(Q_PROJ) == {"weight", "weight_scale"}
    assert cq.split_name(Q_PROJ + ".bias") is None
    assert cq.split_name(EXPERT + ".weight_packed") == (EXPERT, "weight_packed")


# ---- GPTQ -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("bits,group,sym,v1", [(4, 32, True, True), (4, 32, False, True), (4, -1, False, False),
                                               (8, 32, True, False), (8, -1, False, True)])
def test_gptq(tmp_path, bits, group, sym, v1):
    torch.manual_seed(2)
    qc = {"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": False, "sym": sym,
          "checkpoint_format": "gptq" if v1 else "gptq_v2", "true_sequential": True, "damp_percent": 0.01}
    cq = read_checkpoint_quant(str(tmp_path), {"quantization_config": qc})
    assert cq is not None and cq.method == "gptq"
    assert cq.scheme_for(Q_PROJ) == QuantScheme(bits, max(group, 0), sym)
    for plain in ("lm_head", "model.embed_tokens", "model.norm", "model.layers.0.mlp.gate"):
        assert cq.scheme_for(plain) is None
    tensors, deq = {}, {}
    for module, shape in ((Q_PROJ, (48, 64)), (EXPERT, (40, 64))):
        parts, deq[module] = gptq_checkpoint(torch.randn(*shape), bits, group, sym, v1)
        tensors.update({f"{module}.{k}": v for k, v in parts.items()})
    tensors[Q_PROJ + ".bias"] = torch.zeros(48)
    weights, plain = _load(cq, tensors)
    assert plain == {Q_PROJ + ".bias"}
    for module, qw in weights.items():
        torch.testing.assert_close(qw.dequantize(), deq[module], rtol=0, atol=1e-6)
        assert (qw.zeros is None) == sym
        assert int(qw.qweight.min()) >= (-(1 << (bits - 1)) if sym or bits == 8 else 0)


def test_gptq_act_order(tmp_path):
    qc = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": True, "sym": True}
    cq = read_checkpoint_quant(str(tmp_path), {"quantization_config": qc})
    parts, deq = gptq_checkpoint(torch.randn(48, 64), 4, 32, True, True)
    torch.testing.assert_close(cq.assemble(Q_PROJ, parts).dequantize(), deq, rtol=0, atol=1e-6)  # trivial g_idx
    parts["g_idx"] = parts["g_idx"][torch.randperm(64)]
    with pytest.raises(ValueError, match=r"q_proj\.g_idx.*desc_act"):
        cq.assemble(Q_PROJ, parts)


def test_gptq_dynamic_and_lm_head(tmp_path):
    qc = {"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": True, "lm_head": True,
          "dynamic": {"-:.*down_proj": {}, r"+:.*q_proj": {"bits": 8, "group_size": -1}}}
    cq = read_checkpoint_quant(str(tmp_path), {"quantization_config": qc})
    assert cq.scheme_for("lm_head") == QuantScheme(4, 128)
    assert cq.scheme_for(DOWN) is None and cq.split_name(DOWN + ".qweight") is None
    assert cq.scheme_for(Q_PROJ) == QuantScheme(8, 0)
    assert cq.roles(Q_PROJ) == {"qweight", "qzeros", "scales", "g_idx"}


# ---- AWQ ------------------------------------------------------------------------------------------------------

def test_awq(tmp_path):
    torch.manual_seed(3)
    qc = {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm",
          "modules_to_not_convert": ["visual"]}
    cq = read_checkpoint_quant(str(tmp_path), {"quantization_config": qc})
    assert cq is not None and cq.method == "awq"
    assert cq.scheme_for(Q_PROJ) == QuantScheme(4, 32, symmetric=False)
    assert cq.scheme_for("visual.blocks.0.attn.qkv") is None and cq.scheme_for("lm_head") is None
    tensors, deq = {}, {}
    for module, shape in ((Q_PROJ, (48, 64)), (EXPERT, (40, 64))):
        parts, deq[module] = awq_checkpoint(torch.randn(*shape), 32)
        tensors.update({f"{module}.{k}": v for k, v in parts.items()})
    weights, plain = _load(cq, tensors)
    assert not plain
    for module, qw in weights.items():
        torch.testing.assert_close(qw.dequantize(), deq[module], rtol=0, atol=1e-6)
        assert qw.zeros is not None and 0 <= int(qw.qweight.min()) and int(qw.qweight.max()) <= 15


# ---- msModelSlim: reference export from its documented formulas ----------------------------------------------------

def _float32_as_int64(t: torch.Tensor) -> torch.Tensor:
    """vllm-ascend's scale_from_float_to_int64: the float32 bit pattern as int32, widened to int64."""
    return torch.from_numpy(np.frombuffer(t.numpy().astype(np.float32).tobytes(), dtype=np.int32).astype(np.int64))


def _modelslim_static(w: torch.Tensor, bias: torch.Tensor | None, input_scale: float, input_offset: float,
                      int64_deq: bool) -> dict[str, torch.Tensor]:
    w_scale = w.abs().amax(1) / 127
    q = torch.clamp(torch.round(w / w_scale[:, None]), -128, 127)
    in_scale = torch.tensor([input_scale], dtype=torch.float16)
    deq = in_scale.float() * w_scale
    fp_bias = torch.zeros(w.shape[0]) if bias is None else bias
    quant_bias = torch.round(fp_bias / deq) - input_offset * q.sum(1)
    return {"weight": q.to(torch.int8), "input_scale": in_scale,
            "input_offset": torch.tensor([input_offset], dtype=torch.float16),
            "deq_scale": _float32_as_int64(deq) if int64_deq else deq, "quant_bias": quant_bias.to(torch.int32)}


@pytest.mark.parametrize("int64_deq", [True, False])
def test_modelslim_w8a8_static(tmp_path, int64_deq):
    torch.manual_seed(4)
    w, bias = torch.randn(48, 64) * 0.1, torch.randn(48) * 0.5
    parts = _modelslim_static(w, bias, 0.02, 3.0, int64_deq)
    down = _modelslim_static(torch.randn(40, 64) * 0.1, None, 0.05, -2.0, int64_deq)
    tensors = {f"{Q_PROJ}.{k}": v for k, v in parts.items()} | {f"{DOWN}.{k}": v for k, v in down.items()}
    tensors[Q_PROJ + ".bias"] = bias
    norm = "model.layers.0.input_layernorm.module"  # an anti-outlier norm: stays an ordinary tensor for the loader
    tensors.update({norm + ".weight": torch.ones(64), norm + ".bias": torch.zeros(64)})
    desc = {"model_quant_type": "W8A8", "version": "1.0.0", "model.embed_tokens.weight": "FLOAT",
            "model.layers.0.input_layernorm.weight": "W8A8", "lm_head.weight": "FLOAT"}
    desc.update({name: "W8A8" for name in tensors})
    with open(tmp_path / "quant_model_description.json", "w") as f:
        json.dump(desc, f)
    cq = read_checkpoint_quant(str(tmp_path), {"model_type": "qwen2"})
    assert cq is not None and cq.method == "msmodelslim"
    assert cq.scheme_for(Q_PROJ) == QuantScheme(8, 0, True, "int8_static")
    assert cq.scheme_for("model.layers.0.input_layernorm") is None and cq.scheme_for("lm_head") is None
    assert cq.roles(Q_PROJ) == {"weight", "input_scale", "input_offset", "deq_scale", "quant_bias"}
    assert cq.split_name(Q_PROJ + ".bias") == (Q_PROJ, "bias")
    weights, plain = _load(cq, tensors)
    assert plain == {norm + ".weight", norm + ".bias"} and set(weights) == {Q_PROJ, DOWN}
    qw = weights[Q_PROJ]
    assert torch.equal(qw.qweight, parts["weight"])
    assert float(qw.input_scale) == float(parts["input_scale"]) and float(qw.input_offset) == 3.0
    torch.testing.assert_close(qw.dequantize(), w, rtol=0, atol=float(qw.scales.max()) / 2 + 1e-6)
    parts_with_bias = {k.removeprefix(Q_PROJ + "."): v for k, v in tensors.items() if k.startswith(Q_PROJ + ".")}
    folded = cq.bias(Q_PROJ, parts_with_bias)
    deq = qw.scales.reshape(-1) * qw.input_scale
    assert folded is not None and bool(((folded - bias).abs() <= deq / 2 + 1e-6).all())
    assert cq.bias(DOWN, {k.removeprefix(DOWN + "."): v for k, v in tensors.items() if k.startswith(DOWN + ".")}) \
        is None
    # the canonical form computes what the NPU computes: (x_q @ q.T + quant_bias) * deq_scale
    x = torch.randn(5, 64)
    x_q = torch.clamp(torch.round(x / qw.input_scale + qw.input_offset), -128, 127)
    deq_stored = parts["deq_scale"] if not int64_deq else deq
    npu = (x_q.double() @ qw.qweight.double().t() + parts["quant_bias"].double()) * deq_stored.double()
    ours = ((x_q - qw.input_offset) * qw.input_scale).double() @ qw.dequantize().double().t() + folded.double()
    torch.testing.assert_close(ours, npu, rtol=1e-5, atol=1e-5)
    parts_with_bias["bias"] = bias + 1.0
    with pytest.raises(ValueError, match=r"q_proj\.quant_bias does not fold .*q_proj\.bias"):
        cq.bias(Q_PROJ, parts_with_bias)


def test_modelslim_dynamic_and_w8a16(tmp_path):
    torch.manual_seed(5)
    w = torch.randn(48, 64)
    scale = (w.abs().amax(1, keepdim=True) / 127).to(torch.bfloat16)
    q = torch.clamp(torch.round(w / scale.float()), -128, 127).to(torch.int8)
    lo, hi = w.amin(1, keepdim=True), w.amax(1, keepdim=True)
    a_scale = (hi - lo) / 255
    a_off = torch.round(-128 - lo / a_scale)
    a_q = torch.clamp(torch.round(w / a_scale) + a_off, -128, 127).to(torch.int8)
    tensors = {f"{Q_PROJ}.weight": q, f"{Q_PROJ}.weight_scale": scale,
               f"{Q_PROJ}.weight_offset": torch.zeros_like(scale),
               f"{DOWN}.weight": a_q, f"{DOWN}.weight_scale": a_scale, f"{DOWN}.weight_offset": a_off,
               f"{Q_PROJ}.bias": torch.randn(48)}
    desc = {"model_quant_type": "W8A8_DYNAMIC"} | {n: "W8A8_DYNAMIC" for n in tensors if n.startswith(Q_PROJ)} \
        | {n: "W8A16" for n in tensors if n.startswith(DOWN)}
    with open(tmp_path / "quant_model_description.json", "w") as f:
        json.dump(desc, f)
    cq = read_checkpoint_quant(str(tmp_path), {})
    assert cq.scheme_for(Q_PROJ) == QuantScheme(8, 0, True, "int8_dynamic")
    assert cq.scheme_for(DOWN) == QuantScheme(8, 0, False)
    weights, plain = _load(cq, tensors)
    assert plain == {f"{Q_PROJ}.bias"}  # an ordinary bias: W8A8_DYNAMIC adds it in float
    assert weights[Q_PROJ].zeros is None
    torch.testing.assert_close(weights[Q_PROJ].dequantize(), q.float() * scale.float(), rtol=0, atol=0)
    torch.testing.assert_close(weights[DOWN].dequantize(), (a_q.float() - a_off) * a_scale, rtol=0, atol=1e-7)
    bad = {k.removeprefix(Q_PROJ + "."): v for k, v in tensors.items() if k.startswith(Q_PROJ + ".")}
    bad["weight_offset"] = torch.ones_like(scale)
    with pytest.raises(ValueError, match=r"q_proj\.weight_offset is non-zero"):
        cq.assemble(Q_PROJ, bad)


# ---- refusals ------------------------------------------------------------------------------------------------------

def test_not_quantized(tmp_path):
    assert read_checkpoint_quant(str(tmp_path), {"model_type": "llama"}) is None


@pytest.mark.parametrize("qc,match", [
    ({"quant_method": "bitsandbytes"}, r"quant_method 'bitsandbytes'"),
    ({"quant_method": "gptq", "bits": 3, "group_size": 128}, r"bits 3"),
    ({"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"}, r"checkpoint_format 'marlin'"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, r"version 'gemv'"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "exllama"}, r"version 'exllama'"),
])
def test_refused_configs(tmp_path, qc, match):
    with pytest.raises(ValueError, match=match):
        read_checkpoint_quant(str(tmp_path), {"quantization_config": qc})


@pytest.mark.parametrize("preset,match", [("FP8_DYNAMIC", r"float weights"), ("NVFP4", r"nvfp4|float weights"),
                                          ("W4A16", r"group_0.*actorder 'group'")])
def test_refused_compressed_tensors(tmp_path, preset, match):
    scheme = preset_name_to_scheme(preset, ["Linear"])
    if preset == "W4A16":
        scheme.weights.actorder = "group"
    fmt = {"FP8_DYNAMIC": "float-quantized", "NVFP4": "nvfp4-pack-quantized"}.get(preset, "pack-quantized")
    scheme.format = fmt
    qc = QuantizationConfig(config_groups={"group_0": scheme}, format=fmt,
                            quantization_status="compressed").model_dump()
    with pytest.raises(ValueError, match=match):
        read_checkpoint_quant(str(tmp_path), {"quantization_config": qc})
    scheme = preset_name_to_scheme("W8A8", ["Linear"])
    scheme.input_activations.symmetric = False
    qc = QuantizationConfig(config_groups={"group_0": scheme}, format="int-quantized",
                            quantization_status="compressed").model_dump()
    with pytest.raises(ValueError, match=r"asymmetric int8 activations"):
        read_checkpoint_quant(str(tmp_path), {"quantization_config": qc})


def test_refused_modelslim_type(tmp_path):
    with open(tmp_path / "quant_model_description.json", "w") as f:
        json.dump({"model_quant_type": "W4A8_DYNAMIC", f"{Q_PROJ}.weight": "W4A8_DYNAMIC"}, f)
    with pytest.raises(ValueError, match=r"q_proj\.weight: quant type 'W4A8_DYNAMIC'"):
        read_checkpoint_quant(str(tmp_path), {})


def test_missing_and_malformed_tensors(tmp_path):
    scheme = QuantScheme.named("w4a16", group_size=32)
    qw = quantize_weight(torch.randn(48, 64), scheme)
    cq = read_checkpoint_quant(str(tmp_path), {"quantization_config": compressed_tensors_config(scheme, [])})
    parts = {k.removeprefix(Q_PROJ + "."): v for k, v in compressed_tensors_tensors(Q_PROJ, qw, scheme).items()}
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.q_proj\.weight_scale is missing"):
        cq.assemble(Q_PROJ, {k: v for k, v in parts.items() if k != "weight_scale"})
    with pytest.raises(ValueError, match=r"q_proj\.weight_scale has shape \[48, 3\], expected \[48, 2\]"):
        cq.assemble(Q_PROJ, parts | {"weight_scale": torch.ones(48, 3)})
    with pytest.raises(ValueError, match=r"q_proj\.weight_packed has dtype torch\.int64"):
        cq.assemble(Q_PROJ, parts | {"weight_packed": parts["weight_packed"].long()})
    gptq = read_checkpoint_quant(str(tmp_path), {"quantization_config": {"quant_method": "gptq", "bits": 4,
                                                                         "group_size": 32, "sym": True}})
    gparts, _ = gptq_checkpoint(torch.randn(48, 64), 4, 32, True, True)
    with pytest.raises(ValueError, match=r"q_proj\.scales has shape \[2, 40\], expected \[2, 48\]"):
        gptq.assemble(Q_PROJ, gparts | {"scales": gparts["scales"][:, :40]})
    with pytest.raises(ValueError, match=r"q_proj\.qzeros: sym=true but the zero points are not 8"):
        gptq.assemble(Q_PROJ, gparts | {"qzeros": torch.zeros_like(gparts["qzeros"])})
    awq = read_checkpoint_quant(str(tmp_path), {"quantization_config": {"quant_method": "awq", "bits": 4,
                                                                        "group_size": 32, "version": "GEMM"}})
    aparts, _ = awq_checkpoint(torch.randn(48, 64), 32)
    with pytest.raises(ValueError, match=r"q_proj\.qzeros is missing"):
        awq.assemble(Q_PROJ, {k: v for k, v in aparts.items() if k != "qzeros"})
