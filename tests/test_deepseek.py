"""DeepSeek-V2 / V2-Lite / V3 through the engine against transformers (fp32 greedy tokens, bf16 and int8-pool logits
within tolerance), and the MLA pieces on their own: the latent pool layout, the absorbed decode against the expanded
form, both checkpoint layouts of the experts."""

from __future__ import annotations

import json
import os

import pytest
import torch
from engine_helpers import hf_greedy, make_prompts, run_all, run_staggered
from paged_decode_cases import needs_compiler
from safetensors.torch import load_file, save_file

from pdcluster.control.sampling_params import SamplingParams
from pdcluster.engine.attention import native
from pdcluster.engine.attention.metadata import AttentionMetadata, PrefillChunk
from pdcluster.engine.attention.mla import (
    CpuMLABackend,
    MLAAttentionBackend,
    absorb_query,
    decode,
    prefill,
    unabsorb_output,
)
from pdcluster.engine.config import ModelConfig
from pdcluster.engine.kv_cache import KVCachePool, make_pool, quantize_rows
from pdcluster.engine.testing import load_hf_model, make_tiny_model, prefill_logits

ARCHS = ("deepseek_v2", "deepseek_v2_lite", "deepseek_v3")


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("deepseek")
    return {arch: make_tiny_model(str(root / arch), arch) for arch in ARCHS}


def _hf_logits(model: str, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return load_hf_model(model)(torch.tensor([ids])).logits[0]


# ------------------------------------------------------------------------------------------ through the engine


@pytest.mark.slow   # transformers reference runs
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_tokens_match_transformers_staggered_and_chunked(arch, deepseek, make_engine):
    """Decodes (absorbed) and prefill chunks (expanded, later chunks reading earlier latents from the pool) in the
    same steps."""
    model = deepseek[arch]
    prompts = make_prompts([1, 3, 17, 40, 100, 33, 129])
    engine = make_engine(model, block_size=16, max_num_batched_tokens=48)
    got = run_staggered(engine, prompts, first=3)
    want = hf_greedy(model, prompts)
    for i, p in enumerate(prompts):
        assert got[str(i)] == want[i], f"{arch} prompt {i} (len {len(p)})"
    assert engine.kv_pool.latent and engine.kv_pool.tensor.shape[1] == 1
    assert engine.get_stats().num_decode_tokens > 0


@pytest.mark.slow   # transformers reference runs
def test_prefix_cache_hits_give_the_same_tokens(deepseek, make_engine):
    model = deepseek["deepseek_v3"]
    shared = make_prompts([70], seed=11)[0]
    prompts = [shared + t for t in make_prompts([1, 9, 40], seed=12)] + [shared]
    engine = make_engine(model, block_size=16)
    got = [run_all(engine, [p], prefix=f"p{i}-")[0] for i, p in enumerate(prompts)]   # one after another
    assert engine.get_stats().prefix_cache_hit_tokens >= 3 * 64
    assert got == hf_greedy(model, prompts)


@pytest.mark.slow   # transformers reference runs
def test_preemption_gives_the_same_tokens(deepseek, make_engine):
    model = deepseek["deepseek_v2"]
    prompts = make_prompts([60, 45, 70, 30, 50], seed=21)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    engine = make_engine(model, num_gpu_blocks_override=12, block_size=16, max_num_batched_tokens=256)
    got = run_all(engine, prompts, params)
    assert engine.get_stats().num_preemptions > 0
    hf = load_hf_model(model)
    with torch.no_grad():
        for p, g in zip(prompts, got, strict=True):
            ref = hf.generate(torch.tensor([p]), max_new_tokens=24, do_sample=False, eos_token_id=None)[0, len(p):]
            assert g[:len(ref)] == ref.tolist()


@pytest.mark.slow   # transformers reference runs
def test_int8_latent_pool_stays_close_to_transformers(deepseek, make_engine):
    model = deepseek["deepseek_v3"]
    engine = make_engine(model, kv_cache_dtype="int8", block_size=16)
    pool = engine.kv_pool
    cfg = engine.model_config
    assert pool.tensor.dtype == torch.int8 and pool.tensor.shape[-1] == cfg.kv_latent_dim + 2
    ids = make_prompts([90], seed=4)[0]
    want = _hf_logits(model, ids)
    got = prefill_logits(engine, ids)
    assert not torch.equal(got, want)
    assert (got - want).abs().max().item() < 0.05 * want.abs().max().item()
    # decode reads the int8 rows too: the logprob of each token it chose, against transformers' fp32 logprob of
    # that token in the same sequence (teacher-forced)
    prompt = make_prompts([50], seed=6)[0]
    engine.add_request("d", prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0))
    done = []
    while engine.has_unfinished_requests():
        done += [o for o in engine.step() if o.finished]
    tokens, entries = done[0].outputs[0].token_ids, done[0].outputs[0].logprobs
    ref = torch.log_softmax(_hf_logits(model, prompt + tokens)[len(prompt) - 1:-1], dim=-1)
    got = torch.tensor([e[0] for e in entries])
    assert (got - ref[torch.arange(len(tokens)), tokens]).abs().max().item() < 0.05


@pytest.mark.slow   # transformers reference runs
@pytest.mark.parametrize("arch", ["deepseek_v2_lite", "deepseek_v3"])
def test_bf16_logits_within_tolerance(arch, deepseek, make_engine):
    """Against transformers in bf16 (fp32 routers in both). bf16 rounding differs between the two (other attention
    kernels), and a token whose top experts nearly tie then routes differently: the bound is per position, and a
    few positions (such flips) may exceed it."""
    model = deepseek[arch]
    engine = make_engine(model, dtype="bfloat16", block_size=16)
    ids = make_prompts([80], seed=8)[0]
    with torch.no_grad():
        want = load_hf_model(model, torch.bfloat16)(torch.tensor([ids])).logits[0].float()
    per_position = (prefill_logits(engine, ids) - want).abs().amax(-1)
    assert per_position.quantile(0.9).item() < 0.06


def test_stacked_expert_checkpoint_loads_like_per_expert(deepseek, tmp_path, make_engine):
    """Experts as one [E, 2I, H] gate_up_proj and [E, H, I] down_proj (transformers 5's in-memory layout) load the
    same weights as the Hub's per-expert tensors."""
    src = deepseek["deepseek_v3"]
    dst = tmp_path / "stacked"
    dst.mkdir()
    for f in os.listdir(src):
        if f != "model.safetensors":
            (dst / f).write_bytes(open(os.path.join(src, f), "rb").read())
    tensors = load_file(os.path.join(src, "model.safetensors"))
    prefix, experts = "model.layers.1.mlp.experts", 8
    gate_up = [torch.cat((tensors.pop(f"{prefix}.{e}.gate_proj.weight"), tensors.pop(f"{prefix}.{e}.up_proj.weight")))
               for e in range(experts)]
    down = [tensors.pop(f"{prefix}.{e}.down_proj.weight") for e in range(experts)]
    tensors[f"{prefix}.gate_up_proj"], tensors[f"{prefix}.down_proj"] = torch.stack(gate_up), torch.stack(down)
    save_file(tensors, str(dst / "model.safetensors"))
    ids = make_prompts([30], seed=2)[0]
    assert torch.equal(prefill_logits(make_engine(str(dst)), ids), prefill_logits(make_engine(src), ids))


def test_converted_checkpoint_loads_the_same_weights(deepseek, tmp_path, make_engine):
    from pdcluster.engine.convert import convert_model

    src = deepseek["deepseek_v2"]
    out = convert_model(src, str(tmp_path / "converted"), dtype="float32")
    ids = make_prompts([30], seed=3)[0]
    assert torch.equal(prefill_logits(make_engine(out), ids), prefill_logits(make_engine(src), ids))


def test_config_parsing_follows_the_deepseek_rules(deepseek):
    v2 = ModelConfig.from_pretrained(deepseek["deepseek_v2"])
    lite = ModelConfig.from_pretrained(deepseek["deepseek_v2_lite"])
    v3 = ModelConfig.from_pretrained(deepseek["deepseek_v3"])
    assert v2.kv_latent_dim == lite.kv_latent_dim == 24 + 6
    assert v2.mla.q_lora_rank == 40 and lite.mla.q_lora_rank is None
    assert v2.moe.sparse_layers == (1,) and v2.shared_expert_intermediate_size == 64
    assert (v2.moe.scoring, v2.moe.group_score, v2.moe.num_groups, v2.moe.norm_topk_prob) == \
        ("softmax", "max", 4, False)
    assert lite.moe.num_groups == 1
    assert (v3.moe.scoring, v3.moe.group_score, v3.moe.correction_bias, v3.moe.routed_scaling_factor) == \
        ("sigmoid", "top2_sum", True, 2.5)
    with open(os.path.join(deepseek["deepseek_v3"], "config.json")) as f:
        raw = json.load(f)
    raw.update(first_k_dense_replace=1, moe_layer_freq=2, num_hidden_layers=6)
    assert ModelConfig.from_dict(raw).moe.sparse_layers == (2, 4)


# ------------------------------------------------------------------------------------------ the latent pool


def test_latent_pool_has_one_plane_per_layer_whatever_the_tensor_parallel_size(deepseek):
    cfg = ModelConfig.from_pretrained(deepseek["deepseek_v3"])
    cpu = torch.device("cpu")
    for tp in (1, 2):
        assert KVCachePool.shape_for(cfg, 5, 16, torch.float32, tp) == (cfg.num_layers, 1, 5, 16, 1, 30)
        assert KVCachePool.bytes_per_block(cfg, 16, torch.bfloat16, tp) == cfg.num_layers * 16 * 30 * 2
        assert KVCachePool.bytes_per_block(cfg, 16, torch.int8, tp) == cfg.num_layers * 16 * 32
    pool, ranks = make_pool(cfg, 16, torch.float32, cpu, 2, lambda per_block: 3)
    assert pool.latent and pool.kv_planes == 1 and pool.tensor.shape == (cfg.num_layers, 1, 3, 16, 1, 30)
    latent, none = pool.layer_views(1, rank=1)
    assert none is None and latent.data_ptr() == pool.tensor[1, 0].data_ptr()
    assert ranks is not None
    other = ranks.pool(cfg, cpu, 2)   # rank 1 binds the same plane
    assert other.latent and other.layer_views(1, 1)[0].data_ptr() == latent.data_ptr()
    assert pool.block_bytes == cfg.num_layers * 16 * 30 * 4


def test_streaming_llm_is_refused_for_a_latent_pool(deepseek):
    """Moving cached keys to new positions would need the rope part apart from the latent: refused up front."""
    from pdcluster.engine.args import EngineArgs
    from pdcluster.engine.llm_engine import LLMEngine

    with pytest.raises(ValueError, match="MLA"):
        LLMEngine(EngineArgs(model=deepseek["deepseek_v2_lite"], dtype="float32", num_gpu_blocks_override=64,
                             block_size=16, streaming_window=64))


# ------------------------------------------------------------------------------------------ MLA attention


def _random_mla(seed: int, heads=3, dn=12, dv=10, r=24, p=6, bs=4, lens=(1, 7, 13, 4)):
    g = torch.Generator().manual_seed(seed)
    nblocks = sum(-(-n // bs) for n in lens) + 2
    perm = torch.randperm(nblocks, generator=g)
    tables, used = [], 0
    for n in lens:
        k = -(-n // bs)
        tables.append(perm[used:used + k].tolist())
        used += k
    width = max(map(len, tables))
    table_t = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    cache = torch.randn(nblocks, bs, 1, r + p, generator=g)
    kv_b = torch.randn(heads, dn + dv, r, generator=g) * 0.3
    q_nope = torch.randn(len(lens), heads, dn, generator=g)
    q_pe = torch.randn(len(lens), heads, p, generator=g)
    return cache, table_t, torch.tensor(lens, dtype=torch.int32), kv_b, q_nope, q_pe


@pytest.mark.parametrize("seed", [0, 1])
def test_absorbed_decode_equals_the_expanded_form(seed):
    """The last token of each sequence: q_nope · W_UK folded into the query, scores against the latent rows,
    output through W_UV, equals up-projecting every cached latent into per-head K / V and attending."""
    cache, tables, lens, kv_b, q_nope, q_pe = _random_mla(seed)
    scale, dn, r = 0.17, 12, 24
    q = torch.cat((absorb_query(q_nope, kv_b[:, :dn]), q_pe), dim=-1)
    absorbed = unabsorb_output(decode(q, cache, tables, lens, scale, r), kv_b[:, dn:])
    for b, n in enumerate(lens.tolist()):
        latent = cache[tables[b]].flatten(0, 1)[:n, 0]
        expanded = prefill(q_nope[b:b + 1], q_pe[b:b + 1], latent, kv_b, n - 1, scale)
        torch.testing.assert_close(absorbed[b], expanded[0], rtol=1e-5, atol=1e-5)


@needs_compiler
@pytest.mark.parametrize("dtype, cache_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                                (torch.float32, torch.int8), (torch.bfloat16, torch.int8)])
def test_native_cpu_decode_matches_the_torch_decode(dtype, cache_dtype):
    """The CPU backend runs the absorbed decode through the paged decode kernel, the latent rows as one KV head."""
    cache, tables, lens, _, _, _ = _random_mla(3, lens=(1, 9, 16, 5))
    cache = quantize_rows(cache) if cache_dtype == torch.int8 else cache.to(dtype)
    q = torch.randn(4, 3, 30).to(dtype)
    meta = MLAAttentionBackend.prepare(AttentionMetadata(torch.zeros(4, dtype=torch.int32), 4, tables, lens))
    got = CpuMLABackend(3, 24, 6, 12, 10, 0.2).decode(q, cache, meta)
    want = decode(q, cache, tables, lens, 0.2, 24)
    assert native.decode_kernel(dtype, cache_dtype) is not None
    torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=1e-5 if dtype == torch.float32 else 2e-2)


def test_backend_step_mixes_decode_and_chunked_prefill_over_an_int8_pool():
    """One step: two decode rows (absorbed) then a prefill chunk after cached tokens (expanded); with an int8 pool
    every read sees the dequantized rows, so the result equals the float computation over those values."""
    torch.manual_seed(0)
    heads, dn, dv, r, p, bs = 2, 12, 10, 24, 6, 4
    be = MLAAttentionBackend(heads, r, p, dn, dv, scale=0.2)
    kv_b = torch.randn(heads, dn + dv, r) * 0.3
    cache8 = torch.zeros(12, bs, 1, r + p + 2, dtype=torch.int8)
    history = torch.randn(12 * bs, r + p)
    cache8.view(-1, r + p + 2).copy_(quantize_rows(history))
    tables = torch.tensor([[3, 1, 0], [5, 0, 0], [7, 8, 9]], dtype=torch.int32)
    positions = [9, 2]                      # the decode rows' new tokens; the chunk: positions 6..10 of sequence 2
    slots = [int(tables[i, q // bs]) * bs + q % bs for i, q in enumerate(positions)]
    slots += [int(tables[2, q // bs]) * bs + q % bs for q in range(6, 11)]
    t = len(slots)
    c_kv, k_pe = torch.randn(t, r), torch.randn(t, p)
    q_nope, q_pe = torch.randn(t, heads, dn), torch.randn(t, heads, p)
    meta = be.prepare(AttentionMetadata(torch.tensor(slots, dtype=torch.int32), 2, tables[:2, :3],
                                        torch.tensor([10, 3], dtype=torch.int32),
                                        [PrefillChunk(2, t, 6, tables[2])]))
    out = be.forward(q_nope, q_pe, c_kv, k_pe, cache8, kv_b, meta)
    from pdcluster.engine.kv_cache import dequantize_rows

    floats = dequantize_rows(cache8, torch.float32)   # after the step's writes
    for row, (seq, n) in enumerate([(0, 10), (1, 3)]):
        latent = floats[tables[seq]].flatten(0, 1)[:n, 0]
        want = prefill(q_nope[row:row + 1], q_pe[row:row + 1], latent, kv_b, n - 1, 0.2)
        torch.testing.assert_close(out[row], want[0], rtol=1e-5, atol=1e-5)
    latent = floats[tables[2]].flatten(0, 1)[:11, 0]
    torch.testing.assert_close(out[2:], prefill(q_nope[2:], q_pe[2:], latent, kv_b, 6, 0.2), rtol=1e-5, atol=1e-5)
    written = floats.view(-1, r + p)[torch.tensor(slots)]
    assert (written - torch.cat((c_kv, k_pe), -1)).abs().max() < 0.05
