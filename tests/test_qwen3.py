"""Qwen3, Qwen3-MoE and Mixtral through the engine equal transformers: greedy tokens (fp32) under staggered arrivals
and chunked prefill, prefill logits for the config variants (tied / untied, sliding windows, dense and sparse layers
mixed by decoder_sparse_step / mlp_only_layers), bf16 logits within rounding; prefix-cache hits, preemption and an
int8 KV pool on each; the config parsing of the MoE fields;
`convert_model` from the HF checkpoint and from a GGUF file of it (qwen3, qwen3moe) gives the same model."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import hf_greedy, make_prompts, run_all, run_staggered
from gguf_helpers import write_gguf

from pdcluster.control.sampling_params import SamplingParams
from pdcluster.engine.config import ModelConfig
from pdcluster.engine.convert import convert_model
from pdcluster.engine.layers.mlp import GatedMLP
from pdcluster.engine.layers.moe import FusedMoE
from pdcluster.engine.testing import load_hf_model, make_tiny_model, prefill_logits

ARCHS = ("qwen3", "qwen3_moe", "mixtral")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, str]:
    return {arch: make_tiny_model(str(tmp_path_factory.mktemp(arch)), arch) for arch in ARCHS}


def _hf_logits(model_dir: str, ids: list[int], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    with torch.no_grad():
        return load_hf_model(model_dir, dtype)(torch.tensor([ids])).logits[0].float()


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_tokens_match_transformers_staggered_and_chunked(arch, tiny, make_engine):
    prompts = make_prompts([300, 1, 17, 40, 129, 3], seed=2)
    engine = make_engine(tiny[arch], enable_chunked_prefill=True, max_num_batched_tokens=48)
    got = run_staggered(engine, prompts, first=3)
    want = hf_greedy(tiny[arch], prompts)
    for i, p in enumerate(prompts):
        assert got[str(i)] == want[i], f"{arch} prompt {i} (len {len(p)})"


@pytest.mark.slow   # transformers reference runs
@pytest.mark.parametrize("arch", ARCHS)
def test_prefix_hits_preemption_and_int8_kv(arch, tiny, make_engine):
    model = tiny[arch]
    shared = make_prompts([70], seed=11)[0]
    prompts = [shared + t for t in make_prompts([1, 9, 40], seed=12)] + [shared]
    engine = make_engine(model, block_size=16)
    got = [run_all(engine, [p], prefix=f"p{i}-")[0] for i, p in enumerate(prompts)]   # one after another
    assert engine.get_stats().prefix_cache_hit_tokens >= 3 * 64
    assert got == hf_greedy(model, prompts)

    prompts = make_prompts([60, 45, 70, 30, 50], seed=21)
    params = SamplingParams(temperature=0, max_tokens=24)   # stops at EOS, as hf_greedy does
    engine = make_engine(model, num_gpu_blocks_override=12, block_size=16, max_num_batched_tokens=256)
    assert run_all(engine, prompts, params) == hf_greedy(model, prompts, 24)
    assert engine.get_stats().num_preemptions > 0

    engine = make_engine(model, kv_cache_dtype="int8", block_size=16)
    assert engine.kv_pool.tensor.dtype == torch.int8
    ids = make_prompts([90], seed=4)[0]
    want, got = _hf_logits(model, ids), prefill_logits(engine, ids)
    assert not torch.equal(got, want)
    # per position; a token whose router scores are near-tied may pick another expert under int8 rounding
    error = (got - want).abs().max(dim=-1).values
    assert (error < 0.05 * want.abs().max()).float().mean().item() >= 0.95, error


VARIANTS = {
    "qwen3_untied_sliding": ("qwen3", dict(tie_word_embeddings=False, use_sliding_window=True, sliding_window=24,
                                           max_window_layers=1)),
    "qwen3_moe_sparse_step": ("qwen3_moe", dict(num_hidden_layers=4, decoder_sparse_step=2, mlp_only_layers=[3],
                                                norm_topk_prob=False, num_experts_per_tok=3)),
    "mixtral_sliding": ("mixtral", dict(sliding_window=24, num_experts_per_tok=3)),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_prefill_logits_match_transformers(variant, tmp_path, make_engine):
    arch, overrides = VARIANTS[variant]
    model = make_tiny_model(str(tmp_path / variant), arch, seed=3, **overrides)
    ids = make_prompts([90], seed=5)[0]
    got = prefill_logits(make_engine(model), ids).cpu()
    assert (got - _hf_logits(model, ids)).abs().max().item() <= 1e-3


def test_dense_and_sparse_layers_follow_the_config(tmp_path, make_engine):
    _, overrides = VARIANTS["qwen3_moe_sparse_step"]
    model = make_tiny_model(str(tmp_path / "m"), "qwen3_moe", **overrides)
    cfg = ModelConfig.from_pretrained(model)
    assert cfg.qk_norm and cfg.moe is not None
    assert cfg.moe.sparse_layers == (1,) and cfg.moe.top_k == 3 and not cfg.moe.norm_topk_prob
    layers = make_engine(model).runner.model.model.layers
    assert [type(layer.mlp) for layer in layers] == [GatedMLP, FusedMoE, GatedMLP, GatedMLP]
    assert layers[1].self_attn.q_norm is not None and layers[1].self_attn.head_dim == 24
    if torch.backends.mkldnn.is_available():   # the packed experts are the only copy kept
        assert layers[1].mlp.packed is not None and layers[1].mlp.w13.numel() == 0


def test_mixtral_routes_every_layer():
    cfg = ModelConfig.from_dict(dict(architectures=["MixtralForCausalLM"], hidden_size=64, intermediate_size=96,
                                     num_hidden_layers=3, num_attention_heads=4, vocab_size=100, num_local_experts=8,
                                     num_experts_per_tok=2, sliding_window=None))
    assert cfg.moe is not None and cfg.moe.sparse_layers == (0, 1, 2) and cfg.moe.intermediate_size == 96
    assert cfg.moe.norm_topk_prob and cfg.kv_window == 0 and not cfg.qk_norm


@pytest.mark.parametrize("arch", ARCHS)
def test_bf16_logits_close_to_fp32_transformers(arch, tiny, make_engine):
    engine = make_engine(tiny[arch], dtype="bfloat16", device="cpu")
    ids = make_prompts([40], seed=4)[0]
    got = prefill_logits(engine, ids).cpu()
    want = _hf_logits(tiny[arch], ids)
    assert torch.isfinite(got).all()
    # bf16 rounding of the same model, as transformers' own bf16 run is
    hf_bf16_error = (_hf_logits(tiny[arch], ids, torch.bfloat16) - want).abs().max().item()
    assert (got - want).abs().max().item() <= max(0.25, 2 * hf_bf16_error)


@pytest.mark.parametrize("arch,gguf_arch", [("qwen3", "qwen3"), ("qwen3_moe", "qwen3moe"), ("mixtral", "llama")])
def test_converted_checkpoints_give_the_same_logits(arch, gguf_arch, tmp_path, make_engine):
    # llama.cpp's qwen3moe routes every layer: no dense layer in the GGUF case
    src = make_tiny_model(str(tmp_path / arch), arch, **({"mlp_only_layers": []} if arch == "qwen3_moe" else {}))
    sources = {"hf": src}
    if gguf_arch is not None:
        sources["gguf"] = write_gguf(src, str(tmp_path / f"{arch}.gguf"), gguf_arch)
    ids = make_prompts([60], seed=6)[0]
    want = prefill_logits(make_engine(src), ids)
    assert (want.cpu() - _hf_logits(src, ids)).abs().max().item() <= 1e-3
    for kind, source in sources.items():
        out = convert_model(source, str(tmp_path / f"converted_{kind}"), dtype="float32")
        assert ModelConfig.from_pretrained(out).moe == ModelConfig.from_pretrained(src).moe, kind
        assert torch.equal(prefill_logits(make_engine(out), ids), want), kind


@pytest.mark.slow   # inductor compiles the body
def test_compiled_body_runs_the_experts_as_one_opaque_op(tiny, make_engine):
    engine = make_engine(tiny["qwen3_moe"], enforce_eager=False)
    prompts = make_prompts([1, 17, 40], seed=3)
    got = run_staggered(engine, prompts, first=2)
    assert engine.runner.compiled is not None, "the compiled body fell back to eager"
    want = hf_greedy(tiny["qwen3_moe"], prompts)
    assert [got[str(i)] for i in range(len(prompts))] == want
