"""Engine output equals transformers: greedy tokens for Llama (GQA), Qwen2 (bias, tied), Mistral (MQA)
under continuous batching, chunked prefill, prefix caching and preemption; prefill logits for RoPE
scaling variants; sharded and bf16 loading."""

from __future__ import annotations

import json
import os

import pytest
import torch
from engine_helpers import hf_greedy, make_prompts, run_all, run_staggered

from pdcluster.control.sampling_params import SamplingParams
from pdcluster.engine.testing import load_hf_model, make_tiny_model, prefill_logits

pytestmark = pytest.mark.slow  # reference runs of transformers models


@pytest.mark.parametrize("arch,backend", [("llama", None), ("qwen2", None), ("mistral", None), ("llama", "torch")])
def test_greedy_tokens_match_transformers_with_staggered_arrivals(arch, backend, tiny_models, make_engine):
    """(backend None: the device default, `cpu` here; `torch`: the gather + SDPA path cuda and compiler-less
    CPU hosts run.)"""
    model = tiny_models[arch]
    prompts = make_prompts()
    engine = make_engine(model, attention_backend=backend)
    got = run_staggered(engine, prompts)
    want = hf_greedy(model, prompts)
    for i, p in enumerate(prompts):
        assert got[str(i)] == want[i], f"{arch} prompt {i} (len {len(p)})"
    assert engine.get_stats().num_decode_tokens > 0 and engine.get_stats().num_prefill_tokens == sum(map(len, prompts))


def _engine_logits(engine, ids):
    return prefill_logits(engine, ids).cpu()   # any device: compared on CPU


VARIANTS = {
    "llama3_rope": dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "linear_rope": dict(rope_scaling={"rope_type": "linear", "factor": 4.0}),
    "mqa": dict(num_key_value_heads=1),
    "mha_tied": dict(num_key_value_heads=4, tie_word_embeddings=True),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_prefill_logits_match_transformers_llama_variants(variant, tmp_path, make_engine):
    model = make_tiny_model(str(tmp_path / variant), "llama", seed=3, **VARIANTS[variant])
    engine = make_engine(model)
    ids = make_prompts([300], seed=5)[0]
    with torch.no_grad():
        want = load_hf_model(model)(torch.tensor([ids])).logits[0]
    got = _engine_logits(engine, ids)
    assert (got - want).abs().max().item() <= 1e-3


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_prefill_logits_match_transformers(arch, tiny_models, make_engine):
    model = tiny_models[arch]
    engine = make_engine(model)
    ids = make_prompts([257], seed=9)[0]
    with torch.no_grad():
        want = load_hf_model(model)(torch.tensor([ids])).logits[0]
    assert (_engine_logits(engine, ids) - want).abs().max().item() <= 1e-3


def test_sharded_safetensors_load_the_same_weights(tmp_path, tiny_llama, make_engine):
    sharded = make_tiny_model(str(tmp_path / "sharded"), "llama", max_shard_size="40KB")
    index = json.load(open(os.path.join(sharded, "model.safetensors.index.json")))
    assert len(set(index["weight_map"].values())) > 1
    ids = make_prompts([50], seed=2)[0]
    a = _engine_logits(make_engine(sharded), ids)
    b = _engine_logits(make_engine(tiny_llama), ids)
    assert torch.equal(a, b)


def test_bf16_loading_runs(tiny_llama, make_engine):
    engine = make_engine(tiny_llama, dtype="bfloat16")
    assert engine.runner.model.lm_head.weight.dtype == torch.bfloat16
    assert engine.kv_pool.dtype == torch.bfloat16
    ids = make_prompts([40], seed=4)[0]
    with torch.no_grad():
        want = load_hf_model(tiny_llama)(torch.tensor([ids])).logits[0]
    got = _engine_logits(engine, ids)
    assert torch.isfinite(got).all()
    assert (got - want).abs().max().item() < 0.25      # bf16 rounding, same model
    out = run_all(engine, make_prompts([5, 30], seed=1), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert [len(o) for o in out] == [8, 8]


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="oneDNN not built into this torch")
def test_bf16_cpu_projections_use_onednn_packed_weights_bitwise_equal(tiny_llama, make_engine):
    """(fp32 also runs on packed weights: the token-exact tests against transformers cover it.) The packed
    copies replace the dense weights, so packing costs no memory. Where oneDNN packs no bf16 weight, the strip
    layout (engine/layers/strips_gemm.c) takes its place, equal within bf16 rounding."""
    engine = make_engine(tiny_llama, dtype="bfloat16", device="cpu")   # oneDNN: a CPU-only test
    model = engine.runner.model
    layer = model.model.layers[0]
    assert layer.self_attn.qkv_proj.packed is not None and layer.mlp.packed_halves is not None
    assert layer.mlp.gate_up_proj.packed is None        # used only through its packed halves
    for proj in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
        assert proj.weight.numel() == 0 and proj.weight.dtype == torch.bfloat16
    ids = make_prompts([40], seed=4)[0]
    packed = _engine_logits(engine, ids)
    torch.backends.mkldnn.enabled = False               # loaded without packing: plain F.linear on dense weights
    try:
        plain = make_engine(tiny_llama, dtype="bfloat16", device="cpu")
    finally:
        torch.backends.mkldnn.enabled = True
    assert plain.runner.model.model.layers[0].self_attn.qkv_proj.packed is None
    unpacked = _engine_logits(plain, ids)
    if getattr(layer.self_attn.qkv_proj.packed, "strips", False):
        # a CPU where oneDNN packs no bf16 weight (AVX2 only): our strip matmul, fp32 sums in another order than
        # torch's per-row GEMV, each output rounded once to bf16 as there
        assert (unpacked.float() - packed.float()).abs().max() <= 0.02 * packed.float().abs().max()
        assert torch.equal(unpacked.argmax(-1), packed.argmax(-1))
    else:
        assert torch.equal(unpacked, packed)


@pytest.mark.parametrize("chunked", [True, False])
def test_chunked_prefill_on_off_gives_same_tokens(chunked, tiny_llama, make_engine):
    prompts = make_prompts([300, 70, 5, 129, 33])
    budget = 48 if chunked else 512
    engine = make_engine(tiny_llama, enable_chunked_prefill=chunked, max_num_batched_tokens=budget)
    got = run_staggered(engine, prompts, first=3)
    want = hf_greedy(tiny_llama, prompts)
    assert [got[str(i)] for i in range(len(prompts))] == want


def test_prefix_cache_hits_give_same_tokens(tiny_qwen2, make_engine):
    shared = make_prompts([70], seed=11)[0]
    tails = make_prompts([1, 9, 40, 20], seed=12)
    prompts = [shared + t for t in tails] + [shared]
    engine = make_engine(tiny_qwen2, block_size=16)
    got = [run_all(engine, [p], prefix=f"p{i}-")[0] for i, p in enumerate(prompts)]   # one after another
    assert engine.get_stats().prefix_cache_hit_tokens >= 4 * 64
    assert engine.get_stats().prefix_cache_query_tokens == sum(map(len, prompts))
    assert got == hf_greedy(tiny_qwen2, prompts)


def test_prefix_caching_disabled_has_no_hits(tiny_llama, make_engine):
    shared = make_prompts([40], seed=11)[0]
    engine = make_engine(tiny_llama, enable_prefix_caching=False)
    run_all(engine, [shared + [5]], prefix="a")
    run_all(engine, [shared + [6]], prefix="b")
    assert engine.get_stats().prefix_cache_hit_tokens == 0


def test_preemption_when_pool_is_small_gives_same_tokens(tiny_mistral, make_engine):
    prompts = make_prompts([60, 45, 70, 30, 50, 64], seed=21)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    engine = make_engine(tiny_mistral, num_gpu_blocks_override=14, block_size=16, max_num_batched_tokens=256)
    got = run_all(engine, prompts, params)
    assert engine.get_stats().num_preemptions > 0
    from pdcluster.engine.testing import load_hf_model as _hf

    hf = _hf(tiny_mistral)
    with torch.no_grad():
        for p, g in zip(prompts, got, strict=True):
            ref = hf.generate(torch.tensor([p]), max_new_tokens=32, do_sample=False, eos_token_id=None,
                              min_new_tokens=0)[0, len(p):].tolist()
            assert len(g) == 32
            assert g[:len(ref)] == ref     # ref may stop early at EOS; ignore_eos goes on


def test_seeded_sampling_reproducible_across_runs_and_batches(tiny_llama, make_engine):
    prompt = make_prompts([23], seed=31)[0]
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=24, ignore_eos=True)
    alone = run_all(make_engine(tiny_llama), [prompt], seeded)[0]
    again = run_all(make_engine(tiny_llama, seed=99), [prompt], seeded)[0]
    others = make_prompts([5, 80, 200], seed=32)
    mixed_params = [SamplingParams(temperature=0.8, max_tokens=20), seeded,
                    SamplingParams(temperature=0, max_tokens=30),
                    SamplingParams(temperature=1.0, seed=7, max_tokens=10)]
    batched = run_all(make_engine(tiny_llama, max_num_batched_tokens=64), [others[0], prompt, others[1], others[2]],
                      mixed_params)[1]
    assert alone == again == batched
    other_seed = run_all(make_engine(tiny_llama), [prompt], SamplingParams(temperature=1.0, top_p=0.9, seed=4321,
                                                                            max_tokens=24, ignore_eos=True))[0]
    assert other_seed != alone


SLIDING = {   # every layer windowed (Mistral v0.1 style); only layers >= max_window_layers (Qwen2)
    "mistral": dict(sliding_window=24),
    "qwen2": dict(use_sliding_window=True, sliding_window=20, max_window_layers=1),
}


@pytest.mark.parametrize("arch", sorted(SLIDING))
def test_sliding_window_models_match_transformers(arch, tmp_path, make_engine):
    """Prompts and generations far longer than the window, staggered, with chunked prefill (chunks shorter and
    longer than the window) and a prefix-cache hit: tokens equal transformers' sliding-window attention."""
    from pdcluster.engine.config import ModelConfig

    model = make_tiny_model(str(tmp_path / arch), arch, seed=7, **SLIDING[arch])
    config = ModelConfig.from_pretrained(model)
    window = SLIDING[arch]["sliding_window"]
    assert config.max_model_len == 512      # the context is not capped to the window
    assert config.layer_windows == ([window, window] if arch == "mistral" else [0, window])
    prompts = make_prompts([300, 5, 70, 23, 129, 40], seed=31)
    prompts.append(prompts[0][:200] + [7, 8, 9])        # shares 12 full blocks with the first prompt
    engine = make_engine(model, block_size=16, max_num_batched_tokens=64)
    got = run_staggered(engine, prompts, params=SamplingParams(temperature=0, max_tokens=48), first=3)
    want = hf_greedy(model, prompts, max_new_tokens=48)
    for i, p in enumerate(prompts):
        assert got[str(i)] == want[i], f"{arch} prompt {i} (len {len(p)})"
    assert engine.get_stats().prefix_cache_hit_tokens >= 192
    with torch.no_grad():
        hf_logits = load_hf_model(model)(torch.tensor([prompts[0]])).logits[0]
    assert (_engine_logits(engine, prompts[0]) - hf_logits).abs().max().item() <= 1e-3


def test_sliding_window_config_follows_transformers():
    from pdcluster.engine.config import ModelConfig

    base = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                max_position_embeddings=8192)
    mistral = dict(base, architectures=["MistralForCausalLM"])
    assert ModelConfig.from_dict(mistral).layer_windows == [4096] * 4            # transformers' default
    assert ModelConfig.from_dict({**mistral, "sliding_window": None}).layer_windows == [0] * 4
    qwen2 = dict(base, architectures=["Qwen2ForCausalLM"], sliding_window=128, max_window_layers=2)
    assert ModelConfig.from_dict(qwen2).layer_windows == [0] * 4                 # use_sliding_window false
    assert ModelConfig.from_dict({**qwen2, "use_sliding_window": True}).layer_windows == [0, 0, 128, 128]
    types = ["sliding_attention", "full_attention"] * 2
    with_types = {**qwen2, "use_sliding_window": True, "layer_types": types}
    assert ModelConfig.from_dict(with_types).layer_windows == [128, 0, 128, 0]
    llama = dict(base, architectures=["LlamaForCausalLM"], sliding_window=64)
    assert ModelConfig.from_dict(llama).layer_windows == [0] * 4
    assert ModelConfig.from_dict(mistral).max_model_len == 8192
