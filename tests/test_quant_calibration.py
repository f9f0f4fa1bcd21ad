"""Calibrated W8A8 (engine/quant/smoothing.py): the activation maxima the engine records equal transformers' own
layer inputs (per routed expert for MoE layers), SmoothQuant's folding leaves the float model's logits unchanged on
every architecture (dense, MoE, MLA), it cuts W8A8's error where a layer's input has outlier channels, and
w8a8_static writes calibrated per-tensor scales (per expert) that the engine serves. The accuracy on the real model
is in test_quant_accuracy.py."""

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
MLA_SIZE = dict(hidden_size=128, intermediate_size=256, moe_intermediate_size=64, q_lora_rank=64, kv_lora_rank=64,
                qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
ARCH_SIZE = {"qwen3_moe": dict(SIZE, moe_intermediate_size=64), "mixtral": dict(SIZE, intermediate_size=64),
             "deepseek_v2": MLA_SIZE, "deepseek_v3": MLA_SIZE, "deepseek_v2_lite": dict(MLA_SIZE, q_lora_rank=None)}
MOE_ARCHS = ["qwen3_moe", "mixtral", "deepseek_v2", "deepseek_v3"]
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


# what smoothing must rewrite per architecture (tensor names less "model.layers.N.")
_ATTN = {"self_attn.q_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight"}
_MLA = {"self_attn.q_a_proj.weight", "self_attn.kv_a_proj_with_mqa.weight", "self_attn.q_a_layernorm.weight",
        "self_attn.q_b_proj.weight", "self_attn.kv_b_proj.weight", "self_attn.o_proj.weight"}
_DENSE = {"mlp.up_proj.weight", "mlp.down_proj.weight"}
_CHANGED = {
    "qwen3_moe": _ATTN | _DENSE | {"mlp.gate.weight", "mlp.experts.5.gate_proj.weight", "mlp.experts.5.up_proj.weight",
                                   "mlp.experts.5.down_proj.weight"},
    "mixtral": _ATTN | {"block_sparse_moe.gate.weight", "block_sparse_moe.experts.5.w1.weight",
                        "block_sparse_moe.experts.5.w3.weight", "block_sparse_moe.experts.5.w2.weight"},
    "deepseek_v2": _MLA | _DENSE | {"mlp.gate.weight", "mlp.experts.5.up_proj.weight", "mlp.experts.5.down_proj.weight",
                                    "mlp.shared_experts.up_proj.weight", "mlp.shared_experts.down_proj.weight"},
    "deepseek_v2_lite": _MLA - {"self_attn.q_a_proj.weight", "self_attn.q_a_layernorm.weight",
                                "self_attn.q_b_proj.weight"} | {"self_attn.q_proj.weight", "mlp.gate.weight"},
}
_CHANGED["deepseek_v3"] = _CHANGED["deepseek_v2"]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"] + MOE_ARCHS + ["deepseek_v2_lite"])
def test_smoothing_leaves_the_float_model_unchanged(arch, tmp_path, make_engine):
    """Folding 1/s into the norms, v_proj and up_proj rows and s into the next layer's columns is exact in float
    (qwen2: q/k/v biases; qwen3: q/k norms; GQA: o_proj's factors shared by the heads of one KV head). MoE: the
    router's columns take the post-attention norm's s back (routing unchanged), every expert its own down factors;
    MLA: q_a_layernorm / q_b_proj, kv_b_proj's value rows / o_proj, the input norm / q_a (q) and kv_a."""
    src = make_tiny_model(str(tmp_path / "m"), arch, **ARCH_SIZE.get(arch, SIZE))
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    smoothing = smoothing_from(src, PROMPTS, config["num_attention_heads"], config["num_key_value_heads"], 0.6)
    factors = torch.cat([v.reshape(-1) for f in smoothing.factors for v in f.values()])
    assert (factors - 1).abs().max() > 0.5 and factors.std() > 0.05 * factors.mean(), "smoothing should change things"
    smoothed = float_copy(src, str(tmp_path / "smoothed"), smoothing.apply)
    before = load_file(os.path.join(src, "model.safetensors"))
    after = load_file(os.path.join(smoothed, "model.safetensors"))
    changed = {n for n in before if not torch.equal(before[n].float(), after[n])}
    assert {n.split(".", 3)[-1] for n in changed} >= _CHANGED.get(arch, _ATTN | _DENSE) | {
        "input_layernorm.weight", "post_attention_layernorm.weight"}
    torch.testing.assert_close(logits(make_engine, smoothed), logits(make_engine, src), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_expert_maxima_equal_a_per_expert_reference(arch, tmp_path):
    """Each routed expert's down_proj input maxima (and token count), the shared experts', MLA's q_b / kv_b and the
    other inputs equal what transformers' model computes: its experts module's routed tokens run through each
    expert's own gate/up weights, one by one."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = make_tiny_model(str(tmp_path / "m"), arch, **ARCH_SIZE[arch])
    got = activation_maxima(src, PROMPTS)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(src)
    want: list[dict[str, torch.Tensor]] = [{} for _ in model.model.layers]

    def keep(i: int, key: str, x: torch.Tensor) -> None:
        m = x.detach().reshape(-1, x.shape[-1]).abs().amax(0)
        want[i][key] = torch.maximum(want[i][key], m) if key in want[i] else m

    def experts_reference(i: int, experts):
        def hook(_m, args):
            hidden, top_k_index = args[0], args[1]
            n = experts.gate_up_proj.shape[1] // 2
            maxima = torch.zeros(experts.gate_up_proj.shape[0], n)
            counts = torch.zeros(experts.gate_up_proj.shape[0], dtype=torch.int64)
            for e in range(maxima.shape[0]):
                rows = hidden[(top_k_index == e).any(-1)]
                counts[e] = rows.shape[0]
                if rows.shape[0]:
                    gate, up = rows @ experts.gate_up_proj[e, :n].T, rows @ experts.gate_up_proj[e, n:].T
                    maxima[e] = (torch.nn.functional.silu(gate) * up).abs().amax(0)
            seen = want[i]
            seen["experts_down"] = torch.maximum(seen["experts_down"], maxima) if "experts_down" in seen else maxima
            seen["experts_tokens"] = seen.get("experts_tokens", torch.zeros_like(counts)) + counts
        return hook

    for i, layer in enumerate(model.model.layers):
        outputs = {"qkv": layer.input_layernorm, "gate_up": layer.post_attention_layernorm}
        inputs = {"o": layer.self_attn.o_proj}
        if hasattr(layer.self_attn, "kv_a_layernorm"):
            outputs["kv_b"] = layer.self_attn.kv_a_layernorm
            outputs["q_b"] = layer.self_attn.q_a_layernorm
        mlp = getattr(layer, "block_sparse_moe", None) or layer.mlp
        if hasattr(mlp, "experts"):
            mlp.experts.register_forward_pre_hook(experts_reference(i, mlp.experts))
            if getattr(mlp, "shared_experts", None) is not None:
                inputs["shared_down"] = mlp.shared_experts.down_proj
        else:
            inputs["down"] = mlp.down_proj
        for key, module in outputs.items():
            module.register_forward_hook(lambda _m, _i, out, i=i, key=key: keep(i, key, out))
        for key, module in inputs.items():
            module.register_forward_pre_hook(lambda _m, inp, i=i, key=key: keep(i, key, inp[0]))
    with torch.no_grad():
        for p in PROMPTS:
            text = tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                           add_generation_prompt=True)
            model(torch.tensor([tok.encode(text, add_special_tokens=False)[:511]]))
    assert any("experts_down" in layer for layer in want)
    for i, layer in enumerate(want):
        assert set(got[i]) == set(layer), i
        for key in layer:
            torch.testing.assert_close(got[i][key], layer[key], rtol=1e-4, atol=1e-5, msg=f"layer {i} {key}")


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


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v2"])
def test_smoothquant_cuts_w8a8_error_on_moe_and_mla_outlier_channels(arch, tmp_path, make_engine):
    """The same outlier channels on an MoE model: the post-attention norm's feed every expert and the router (whose
    logits the smoothing leaves unchanged); on DeepSeek-V2 the input norm's feed MLA's q_a / kv_a projections."""
    src = make_tiny_model(str(tmp_path / "m"), arch, **ARCH_SIZE[arch])

    def outliers(name: str, t: torch.Tensor) -> torch.Tensor:
        if name.endswith(("input_layernorm.weight", "post_attention_layernorm.weight")):
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


def _never_routed(name: str, t: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V3's layer 1 with experts 6 and 7 (one routing group) never chosen: their correction bias sinks
    the group's score."""
    if name == "model.layers.1.mlp.gate.e_score_correction_bias":
        t = t.clone()
        t[7] = -100.0
    return t


@pytest.mark.parametrize("arch", MOE_ARCHS + ["deepseek_v2_lite"])
def test_w8a8_static_moe_and_mla_serve_calibrated_scales(arch, tmp_path, make_engine):
    """MoE and MLA models convert calibrated (the refusal is gone): one static scale per input (q_a/kv_a or q/kv_a
    share the input norm's, every routed and shared expert's gate/up the post-attention norm's), one per routed
    expert's down_proj; an expert no calibration token reached keeps factor 1 and its layer's largest down scale.
    The engine serves it close to the float model and about as close as dynamic W8A8."""
    src = make_tiny_model(str(tmp_path / "m"), arch, **ARCH_SIZE[arch])
    if arch == "deepseek_v3":
        src = float_copy(src, str(tmp_path / "routed"), _never_routed)
    out = convert_model(src, str(tmp_path / "static"), "float32", quantization="w8a8_static")
    dynamic = convert_model(src, str(tmp_path / "dynamic"), "float32", quantization="w8a8", calibration="default")
    with safe_open(os.path.join(out, "model.safetensors"), "pt") as f:
        names = set(f.keys())
        scales = {n.removesuffix(".input_scale"): f.get_tensor(n) for n in names if n.endswith("input_scale")}
    weights = {n.removesuffix(".weight") for n in names if n.endswith(".weight") and f"{n}_scale" in names}
    assert weights and set(scales) == weights and all(float(s) > 0 for s in scales.values())
    block = "block_sparse_moe" if arch == "mixtral" else "mlp"
    gate, up, down = ("w1", "w3", "w2") if arch == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    p = "model.layers.1."
    experts = [f"{p}{block}.experts.{e}." for e in range(8)]
    assert len({float(scales[x + gate]) for x in experts} | {float(scales[x + up]) for x in experts}) == 1
    downs = [float(scales[x + down]) for x in experts]
    if "deepseek" in arch:
        a = p + "self_attn."
        q = a + ("q_proj" if arch == "deepseek_v2_lite" else "q_a_proj")
        assert torch.equal(scales[q], scales[a + "kv_a_proj_with_mqa"])
        assert torch.equal(scales[experts[0] + gate], scales[p + "mlp.shared_experts.up_proj"])
    if arch == "deepseek_v3":
        smoothing = smoothing_from(src, CALIBRATION_PROMPTS, 4, 4, 0.6)
        counts = smoothing.maxima[1]["experts_tokens"]
        assert counts[6] == counts[7] == 0 and counts[:6].min() > 0
        assert torch.equal(smoothing.factors[1]["experts_down"][6:], torch.ones(2, 64))
        assert downs[6] == downs[7] == max(downs[:6])
    else:
        assert len(set(downs)) == 8, "one scale per expert"
    want = logits(make_engine, src)
    got, got_dynamic = logits(make_engine, out), logits(make_engine, dynamic)
    error, error_dynamic = (got - want).pow(2).mean().item(), (got_dynamic - want).pow(2).mean().item()
    agree = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
    # per-tensor static scales lose more than per-token dynamic ones (2.5-3x the squared error here), and every
    # routing flip a quantized input causes shows in the logits; measured: agreement 0.77-0.93, relative RMS error
    # 0.08-0.21 (DeepSeek-V3's sigmoid group routing the most sensitive)
    assert agree > 0.7
    assert (error / want.pow(2).mean().item()) ** 0.5 < 0.3
    assert error < 4 * error_dynamic, (error, error_dynamic)


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
