"""Long context: rope scaling as transformers reads it (llama3, yarn) over a 131072-position range, and prefill
chunks attending to long cached contexts in bounded tiles merged by log-sum-exp."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import hf_greedy, make_prompts, run_all

from pdcluster.control.sampling_params import SamplingParams
from pdcluster.engine.attention.metadata import PrefillChunk
from pdcluster.engine.attention.torch_backend import TorchAttentionBackend
from pdcluster.engine.config import ModelConfig
from pdcluster.engine.layers.rotary import RotaryEmbedding
from pdcluster.engine.testing import load_hf_model, make_tiny_model, tiny_config

LONG = 131072
ROPE = {
    "llama3": dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=8192),
    "yarn": dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=32768),
    "yarn_mscale": dict(rope_type="yarn", factor=16.0, original_max_position_embeddings=8192, beta_fast=16,
                        beta_slow=2, mscale=0.707, mscale_all_dim=1.0),
}


def long_model(path: str, rope: str) -> str:
    return make_tiny_model(path, "llama", seed=3, max_position_embeddings=LONG, rope_theta=500000.0,
                           rope_scaling=dict(ROPE[rope]))


@pytest.mark.parametrize("rope", sorted(ROPE))
def test_rotary_tables_equal_transformers(rope):
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    hf_cfg = tiny_config("llama", max_position_embeddings=LONG, rope_theta=500000.0, rope_scaling=dict(ROPE[rope]))
    config = ModelConfig.from_dict(hf_cfg.to_dict())
    assert config.rope_scaling["rope_type"] == ROPE[rope]["rope_type"]
    ours = RotaryEmbedding(config.head_dim, LONG, config.rope_theta, config.rope_scaling, torch.float32)
    hf = LlamaRotaryEmbedding(hf_cfg)
    positions = torch.tensor([0, 1, 17, 4095, 8191, 8192, 32767, 65536, LONG - 1])
    cos, sin = hf(torch.zeros(1, 1, 1), positions[None])
    assert torch.allclose(ours.cos[positions], cos[0], atol=1e-5)
    assert torch.allclose(ours.sin[positions], sin[0], atol=1e-5)


def test_yarn_defaults_follow_transformers():
    base = dict(architectures=["LlamaForCausalLM"], vocab_size=64, hidden_size=16, intermediate_size=32,
                num_hidden_layers=2, num_attention_heads=2)
    cfg = ModelConfig.from_dict({**base, "max_position_embeddings": 4096,
                                 "rope_scaling": {"rope_type": "yarn", "factor": None}})
    assert cfg.rope_scaling["original_max_position_embeddings"] == 4096 and cfg.rope_scaling["factor"] == 1.0
    cfg = ModelConfig.from_dict({**base, "max_position_embeddings": 16384, "original_max_position_embeddings": 4096,
                                 "rope_scaling": {"type": "yarn", "factor": None}})
    assert cfg.rope_scaling["factor"] == 4.0


def _one_shot(q, k, v, c, window, gqa):
    """Reference: every key the chunk sees in one masked SDPA."""
    n, total = q.shape[0], k.shape[0]
    q_pos, k_pos = torch.arange(c, c + n)[:, None], torch.arange(total)[None, :]
    mask = (k_pos <= q_pos) & ((k_pos > q_pos - window) if window else True)
    o = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                                         v.transpose(0, 1)[None], attn_mask=mask, enable_gqa=gqa)
    return o[0].transpose(0, 1)


@pytest.mark.parametrize("window", [0, 37, 100])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (4, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiled_prefill_equals_one_shot_attention(window, heads, dtype):
    """Chunks of 1..150 rows after 0..333 cached tokens, tiles of 16: equal to one SDPA over all keys."""
    hq, hkv = heads
    bs, d = 8, 16
    backend = TorchAttentionBackend(hq, hkv, d)
    backend.prefill_tile_tokens = 16
    gen = torch.Generator().manual_seed(0)
    for c, n in [(0, 150), (333, 1), (200, 17), (64, 100), (5, 40)]:
        total = c + n
        nblocks = -(-total // bs)
        table = torch.randperm(64, generator=gen)[:nblocks]
        k_cache = torch.randn(64, bs, hkv, d, generator=gen).to(dtype)
        v_cache = torch.randn(64, bs, hkv, d, generator=gen).to(dtype)
        q = torch.randn(n, hq, d, generator=gen).to(dtype)
        k_all = k_cache[table].flatten(0, 1)[:total]
        v_all = v_cache[table].flatten(0, 1)[:total]
        chunk = PrefillChunk(0, n, c, table)
        got = backend._prefill(q, k_all[c:], v_all[c:], k_cache, v_cache, chunk, window)
        want = _one_shot(q.float(), k_all.float(), v_all.float(), c, window, hq != hkv)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        assert (got.float() - want).abs().max().item() <= tol, (c, n)


@pytest.mark.parametrize("arch,window", [("llama", None), ("mistral", 40)])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_tiled_prefill_in_the_engine_matches(arch, window, kv_cache_dtype, tmp_path, make_engine):
    """Small tiles (32) force the tiled path for every chunk after the first tile: chunked and single-chunk
    prefills and a prefix-cache hit give transformers' tokens (fp32 pool) or the untiled engine's (int8)."""
    extra = {"sliding_window": window} if arch == "mistral" else {}
    model = make_tiny_model(str(tmp_path / arch), arch, seed=11, **extra)
    prompts = make_prompts([300, 77, 260], seed=4)
    prompts.append(prompts[0][:200] + [5, 6, 7])
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = {}
    for budget in (64, 512):
        for tile in (32, 2048):
            engine = make_engine(model, block_size=8, max_num_batched_tokens=budget, kv_cache_dtype=kv_cache_dtype)
            engine.runner.attn_backend.prefill_tile_tokens = tile
            outs[budget, tile] = run_all(engine, prompts, params)
    assert len({str(o) for o in outs.values()}) == 1
    if kv_cache_dtype == "auto":
        assert outs[64, 32] == hf_greedy(model, prompts, max_new_tokens=24)


@pytest.fixture(scope="module", params=["llama3", "yarn"])
def long_llama(request, tmp_path_factory) -> str:
    return long_model(str(tmp_path_factory.mktemp(f"long_{request.param}")), request.param)


def test_8k_prompt_matches_transformers(long_llama, make_engine):
    """An 8192-token prompt in 2048-token chunks (tiled attention over the cached context) on a 131072-position
    model: last-position logits and greedy tokens equal transformers (fp32)."""
    assert ModelConfig.from_pretrained(long_llama).max_model_len == LONG
    prompt = make_prompts([8192], seed=8)[0]
    engine = make_engine(long_llama, block_size=16, max_num_batched_tokens=2048, num_gpu_blocks_override=600)
    assert engine.model_config.max_model_len == 600 * 16
    got = run_all(engine, [prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    hf = load_hf_model(long_llama)
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)
    assert got == out[0, len(prompt):].tolist()


@pytest.mark.slow
def test_32k_prompt_runs_with_bounded_chunks(tmp_path, make_engine):
    """A 32768-token prompt (yarn, 131072 positions) prefilled in 4096-token chunks, then decoded: the same
    tokens as prefilling it in 1024-token chunks (different tilings of the same attention)."""
    model = long_model(str(tmp_path / "m"), "yarn")
    prompt = make_prompts([32768], seed=2)[0]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    outs = []
    for budget in (4096, 1024):
        engine = make_engine(model, block_size=16, max_num_batched_tokens=budget, num_gpu_blocks_override=2100)
        outs.append(run_all(engine, [prompt], params)[0])
        assert engine.get_stats().num_prefill_tokens == 32768
    assert outs[0] == outs[1] and len(outs[0]) == 16


def test_max_context_len_to_capture_is_accepted(tiny_llama, make_engine):
    """vLLM's CUDA-graph bound: accepted (and a node setting), no effect here (no graph capture)."""
    from pdcluster.node.config import ENGINE_KNOBS

    engine = make_engine(tiny_llama, max_context_len_to_capture=8192)
    assert engine.args.max_context_len_to_capture == 8192
    assert run_all(engine, [[5, 6, 7]], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))[0]
    assert "max_context_len_to_capture" in ENGINE_KNOBS


@pytest.mark.parametrize("causal", [False, True])
def test_tile_attention_matmul_path_equals_cpu_flash(causal):
    """The device-agnostic tile attention (fp32 matmuls, used off CPU) equals the CPU flash kernel's output and
    log-sum-exp, rows that see no key included (output 0)."""
    from pdcluster.engine.attention.torch_backend import _attend_lse_matmul, _bias, _cpu_flash

    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 3, 20, 16, generator=gen) for _ in range(3))
    visible = torch.rand(20, 20, generator=gen) > 0.3
    visible[4] = False
    bias = None if causal else _bias(visible, torch.float32)
    o, lse = _attend_lse_matmul(q, k, v, bias, causal)
    o_ref, lse_ref = _cpu_flash(q, k, v, is_causal=causal, attn_mask=bias)
    assert torch.allclose(o, o_ref, atol=1e-5)
    seen = slice(None) if causal else visible.any(-1)
    assert torch.allclose(lse[..., seen], lse_ref[..., seen], atol=1e-5)
    if not causal:
        assert (o[0, :, 4] == 0).all()
