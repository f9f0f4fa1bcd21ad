"""Calibrated W8A8 (engine/quant/smoothing.py): the activation maxima the engine records equal transformers' own
layer inputs, SmoothQuant's folding leaves the float model's logits unchanged on every dense architecture, it cuts
W8A8's error where a layer's input has outlier channels, and w8a8_static writes calibrated per-tensor scales that
the engine serves. The accuracy on the real model is in test_quant_accuracy.py."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from pdcluster.cli.main import app
from pdcluster.engine.convert import convert_model, is_converted, read_manifest
from pdcluster.engine.quant.smoothing import CALIBRATION_PROMPTS, activation_maxima, read_prompts, smoothing_from
from pdcluster.engine.testing import make_tiny_model, prefill_logits

SIZE = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=32)
PROMPTS = CALIBRATION_PROMPTS[:4]
TOKENS = list(range(3, 60))


def float_copy(src: str, dst: str, transform=lambda name, t: t) -> str:
    """`src` (a tiny HF checkpoint) with every tensor passed through `transform`, as float32."""
    os.makedirs(dst)
    for f in os.listdir(src):
        if f != "model.safetensors" and os.path.isfile(os.path.join(src, f)):
            with open(os.path.join(src, f), "rb") as a, open(os.path.join(dst, f), "wb") as b:
                b.write(a.read())
    source = load_file(os.path.join(src, "model.safetensors"))
    tensors = {n: transform(n, t).float().contiguous() for n, t in source.items()}
    save_file(tensors, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    return dst


def logits(make_engine, model: str) -> torch.Tensor:
    return prefill_logits(make_engine(model), TOKENS)


def test_activation_maxima_equal_the_inputs_transformers_computes(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = make_tiny_model(str(tmp_path / "m"), "llama", **SIZE)
    got = activation_maxima(src, PROMPTS)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(src)
    want: list[dict[str, torch.Tensor]] = [{} for _ in model.model.layers]

    def hook(i: int, key: str):
        def record(_m, inp):
            m = inp[0].reshape(-1, inp[0].shape[-1]).abs().amax(0)
            want[i][key] = torch.maximum(want[i][key], m) if key in want[i] else m
        return record

    for i, layer in enumerate(model.model.layers):
        layer.self_attn.q_proj.register_forward_pre_hook(hook(i, "qkv"))
        layer.mlp.gate_proj.register_forward_pre_hook(hook(i, "gate_up"))
        layer.self_attn.o_proj.register_forward_pre_hook(hook(i, "o"))
        layer.mlp.down_proj.register_forward_pre_hook(hook(i, "down"))
    with torch.no_grad():
        for p in PROMPTS:
            text = tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                           add_generation_prompt=True) if tok.chat_template else p
            ids = tok.encode(text, add_special_tokens=not tok.chat_template)
            model(torch.tensor([ids[:min(512, model.config.max_position_embeddings - 1)]]))
    for i, layer in enumerate(want):
        assert set(got[i]) == set(layer)
        for key in layer:
            torch.testing.assert_close(got[i][key], layer[key], rtol=1e-4, atol=1e-5, msg=f"layer {i} {key}")


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
def test_smoothing_leaves_the_float_model_unchanged(arch, tmp_path, make_engine):
    """Folding 1/s into the norms, v_proj and up_proj rows and s into the next layer's columns is exact in float
    (qwen2: q/k/v biases; qwen3: q/k norms; GQA: o_proj's factors shared by the heads of one KV head)."""
    src = make_tiny_model(str(tmp_path / "m"), arch, **SIZE)
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    smoothing = smoothing_from(src, PROMPTS, config["num_attention_heads"], config["num_key_value_heads"], 0.6)
    factors = torch.cat([f[k] for f in smoothing.factors for k in ("qkv", "gate_up", "down", "o")])
    assert (factors - 1).abs().max() > 0.5 and factors.std() > 0.05 * factors.mean(), "smoothing should change things"
    smoothed = float_copy(src, str(tmp_path / "smoothed"), smoothing.apply)
    before = load_file(os.path.join(src, "model.safetensors"))
    after = load_file(os.path.join(smoothed, "model.safetensors"))
    changed = {n for n in before if not torch.equal(before[n].float(), after[n])}
    assert {n.split(".", 3)[-1] for n in changed} >= {
        "input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_proj.weight",
        "self_attn.v_proj.weight", "self_attn.o_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"}
    torch.testing.assert_close(logits(make_engine, smoothed), logits(make_engine, src), rtol=1e-4, atol=1e-4)


def test_smoothquant_cuts_w8a8_error_where_inputs_have_outlier_channels(tmp_path, make_engine):
    """A few input channels 40x larger than the rest (as LLM activations have) ruin per-token int8 activations;
    calibrated smoothing moves their range into the weights."""
    src = make_tiny_model(str(tmp_path / "m"), "llama", **SIZE)

    def outliers(name: str, t: torch.Tensor) -> torch.Tensor:
        if name.endswith("layernorm.weight"):
            t = t.clone()
            t[[3, 77]] *= 40.0
        return t

    src = float_copy(src, str(tmp_path / "outliers"), outliers)
    want = logits(make_engine, src)
    plain = convert_model(src, str(tmp_path / "rtn"), "float32", quantization="w8a8")
    smooth = convert_model(src, str(tmp_path / "sq"), "float32", quantization="w8a8", calibration="default")
    error_plain = (logits(make_engine, plain) - want).pow(2).mean().item()
    error_smooth = (logits(make_engine, smooth) - want).pow(2).mean().item()
    assert error_smooth < 0.5 * error_plain, (error_smooth, error_plain)
    manifest = read_manifest(smooth)
    assert manifest is not None and manifest["calibration"].startswith("default smoothquant")
    assert is_converted(smooth, src, "float32", quantization="w8a8", calibration="default")
    assert not is_converted(smooth, src, "float32", quantization="w8a8")
    assert not is_converted(plain, src, "float32", quantization="w8a8", calibration="default")
    assert not os.path.exists(os.path.join(smooth, ".calibration")), "the scratch conversion is removed"


def test_w8a8_static_writes_calibrated_input_scales_the_engine_serves(tmp_path, make_engine):
    src = make_tiny_model(str(tmp_path / "m"), "llama", **SIZE)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps(p) for p in PROMPTS) + "\n")
    out = convert_model(src, str(tmp_path / "static"), "float32", quantization="w8a8_static",
                        calibration=str(prompts))
    with open(os.path.join(out, "config.json")) as f:
        group = json.load(f)["quantization_config"]["config_groups"]["group_0"]
    assert group["input_activations"]["dynamic"] is False and group["input_activations"]["strategy"] == "tensor"
    with safe_open(os.path.join(out, "model.safetensors"), "pt") as f:
        scales = {n.removesuffix(".input_scale"): f.get_tensor(n) for n in f.keys() if n.endswith("input_scale")}
    assert len(scales) == 2 * 7 and all(float(s) > 0 for s in scales.values())
    for i in range(2):   # one input, one scale: q/k/v share theirs, gate/up theirs
        p = f"model.layers.{i}"
        assert torch.equal(scales[f"{p}.self_attn.q_proj"], scales[f"{p}.self_attn.v_proj"])
        assert torch.equal(scales[f"{p}.mlp.gate_proj"], scales[f"{p}.mlp.up_proj"])
    assert read_manifest(out)["calibration"].startswith("prompts.jsonl sha256:")
    got, want = logits(make_engine, out), logits(make_engine, src)
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.8
    assert (got - want).abs().max() < 0.25 * want.abs().max()
    # without a file, static scales are calibrated on the built-in prompts
    default = convert_model(src, str(tmp_path / "static-default"), "float32", quantization="w8a8_static")
    assert read_manifest(default)["calibration"].startswith("default")
    assert is_converted(default, src, "float32", quantization="w8a8_static")


def test_calibration_prompt_files_and_refusals(tmp_path):
    text = tmp_path / "prompts.txt"
    text.write_text("first prompt\nstill the first\n\n\nsecond prompt\n")
    assert read_prompts(str(text)) == ["first prompt\nstill the first", "second prompt"]
    jsonl = tmp_path / "prompts.jsonl"
    jsonl.write_text('"a"\n{"text": "b"}\n\n{"prompt": "c"}\n')
    assert read_prompts(str(jsonl)) == ["a", "b", "c"]
    jsonl.write_text('"a"\n{"other": 1}\n')
    with pytest.raises(ValueError, match=r"prompts.jsonl:2"):
        read_prompts(str(jsonl))
    (tmp_path / "empty.txt").write_text("\n\n")
    with pytest.raises(ValueError, match="no calibration prompts"):
        read_prompts(str(tmp_path / "empty.txt"))
    src = make_tiny_model(str(tmp_path / "m"), "llama", **SIZE)
    with pytest.raises(ValueError, match="only for W8A8"):
        convert_model(src, str(tmp_path / "w4"), "float32", quantization="w4a16", calibration="default")
    with pytest.raises(ValueError, match="only for W8A8"):
        convert_model(src, str(tmp_path / "fp"), "float32", calibration="default")
    with pytest.raises(FileNotFoundError):
        convert_model(src, str(tmp_path / "nofile"), "float32", quantization="w8a8",
                      calibration=str(tmp_path / "missing.txt"))
    with pytest.raises(ValueError, match="strength"):
        convert_model(src, str(tmp_path / "alpha"), "float32", quantization="w8a8", calibration="default",
                      smoothing_strength=1.5)
    assert not [p for p in os.listdir(tmp_path) if p not in ("m", "prompts.txt", "prompts.jsonl", "empty.txt")], \
        "a refused conversion leaves nothing behind"


def test_cli_converts_calibrated(tmp_path):
    src = make_tiny_model(str(tmp_path / "m"), "llama", **SIZE)
    result = CliRunner().invoke(app, ["convert", src, str(tmp_path / "out"), "--dtype", "float32",
                                      "--quantization", "w8a8", "--calibration", "default",
                                      "--smoothing-strength", "0.7"])
    assert result.exit_code == 0, result.output
    assert "w8a8, calibrated (default)" in result.output
    assert read_manifest(str(tmp_path / "out"))["calibration"] == "default smoothquant 0.7"
    result = CliRunner().invoke(app, ["convert", src, str(tmp_path / "bad"), "--quantization", "w8a16",
                                      "--calibration", "default"])
    assert result.exit_code == 2 and "only for W8A8" in result.output
