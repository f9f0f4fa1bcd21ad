"""Sliding-window block freeing: blocks that fell out of every layer's window are released while a request
runs, with tokens equal to transformers and to the same engine without freeing."""

from __future__ import annotations

import pytest
from engine_helpers import hf_greedy, make_prompts, run_all

from pdcluster.control.sampling_params import SamplingParams
from pdcluster.engine.block_manager import FREED_BLOCK, BlockManager
from pdcluster.engine.config import ModelConfig
from pdcluster.engine.sequence import Sequence
from pdcluster.engine.testing import make_tiny_model

WINDOW, BS = 24, 8


@pytest.fixture(scope="module")
def windowed(tmp_path_factory) -> str:
    return make_tiny_model(str(tmp_path_factory.mktemp("mistral_sw")), "mistral", seed=7, sliding_window=WINDOW)


def _run_tracking_blocks(engine, prompts, params) -> tuple[list[list[int]], int]:
    """Greedy outputs and the most KV blocks in use after any step."""
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    results, most = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out.outputs[0].token_ids
        most = max(most, engine.get_stats().num_used_blocks)
    return [results[f"r{i}"] for i in range(len(prompts))], most


def test_kv_window_is_the_window_of_every_layer():
    assert ModelConfig.from_dict(_cfg(sliding_window=32)).kv_window == 32
    assert ModelConfig.from_dict(_cfg(sliding_window=None)).kv_window == 0
    qwen2 = _cfg(architectures=["Qwen2ForCausalLM"], use_sliding_window=True, sliding_window=20)
    assert ModelConfig.from_dict({**qwen2, "max_window_layers": 1}).kv_window == 0    # layer 0 sees everything
    assert ModelConfig.from_dict({**qwen2, "max_window_layers": 0}).kv_window == 20


def _cfg(**kw) -> dict:
    base = dict(architectures=["MistralForCausalLM"], vocab_size=64, hidden_size=16, intermediate_size=32,
                num_hidden_layers=2, num_attention_heads=2)
    return {**base, **kw}


def test_free_outside_window_keeps_entries_positional():
    bm = BlockManager(num_blocks=16, block_size=4)
    seq = Sequence("s", list(range(3, 30)), SamplingParams(), [], 100, 0)   # 27 tokens, 7 blocks
    assert bm.allocate(seq, seq.num_tokens)
    table = list(seq.block_table)
    seq.num_computed_tokens = 27
    bm.cache_full_blocks(seq)
    # the next token (position 27) with window 10 sees 18..27: blocks 0..3 (tokens 0..15) are dead
    assert bm.free_outside_window(seq, 10) == 4
    assert seq.block_table[:4] == [FREED_BLOCK] * 4 and seq.block_table[4:] == table[4:]
    assert seq.num_freed_blocks == 4 and bm.num_free_blocks == 16 - 3
    assert bm.free_outside_window(seq, 10) == 0                      # idempotent
    assert [bm.hash_to_block[h] for h in seq.block_hashes(4)[:4]] == table[:4]   # still in the prefix cache
    bm.free(seq)
    assert bm.num_free_blocks == 16 and all(c == 0 for c in bm.ref_counts)


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_generation_far_past_the_window_uses_bounded_blocks(backend, windowed, make_engine):
    """A 300-token prompt in 32-token chunks plus 150 generated tokens (19x the window): a handful of blocks in
    use at any time, tokens equal to transformers and to the engine that keeps every block."""
    prompts = make_prompts([300, 41], seed=5)
    params = SamplingParams(temperature=0, max_tokens=150, ignore_eos=True)
    freeing = make_engine(windowed, block_size=BS, max_num_batched_tokens=32, attention_backend=backend)
    assert freeing.scheduler.sliding_window == WINDOW
    got, most = _run_tracking_blocks(freeing, prompts, params)
    keeping = make_engine(windowed, block_size=BS, max_num_batched_tokens=32, attention_backend=backend)
    keeping.scheduler.sliding_window = 0
    kept, most_kept = _run_tracking_blocks(keeping, prompts, params)
    assert got == kept == hf_greedy(windowed, prompts, max_new_tokens=150)
    per_seq = (WINDOW + 32) // BS + 2     # the window plus one step's tokens, each end in a partial block
    assert most <= 2 * per_seq < most_kept
    assert most_kept >= (300 + 150) // BS
    # the released full blocks stayed in the prefix cache: the same prompt again hits all of its full blocks
    assert run_all(freeing, prompts[:1], params, prefix="again") == got[:1]
    assert freeing.get_stats().prefix_cache_hit_tokens == 300 // BS * BS


def test_freeing_avoids_preemption_and_keeps_prefix_cache(windowed, make_engine):
    """Four long requests in a pool that holds their windows but not their whole contexts: no preemption, exact
    tokens. (Released full blocks stay in the prefix cache, evicted least recently freed first.)"""
    prompts = make_prompts([200, 180, 220, 190], seed=9)
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    engine = make_engine(windowed, block_size=BS, num_gpu_blocks_override=64, max_num_batched_tokens=64)
    assert engine.model_config.max_model_len == 512
    got = run_all(engine, prompts, params)
    assert engine.get_stats().num_preemptions == 0
    assert got == hf_greedy(windowed, prompts, max_new_tokens=60)


def test_preempted_windowed_sequences_recompute_exactly(windowed, make_engine):
    """A pool too small even for five windows (16 blocks): sequences with released blocks get preempted and
    recomputed (their table rebuilt from the prefix cache and fresh blocks), tokens still exact."""
    prompts = make_prompts([64, 59, 67, 57, 65], seed=3)
    params = SamplingParams(temperature=0, max_tokens=42, ignore_eos=True)
    engine = make_engine(windowed, block_size=BS, num_gpu_blocks_override=16, max_num_batched_tokens=16)
    got = run_all(engine, prompts, params)
    assert engine.get_stats().num_preemptions > 0
    assert got == hf_greedy(windowed, prompts, max_new_tokens=42)


def test_hold_blocks_requests_keep_every_block(windowed, make_engine):
    """A prefill node's request (hold_blocks) keeps its whole block table: it is sent to the decode node."""
    engine = make_engine(windowed, block_size=BS, max_num_batched_tokens=32)
    prompt = make_prompts([100], seed=1)[0]
    engine.add_request("p", prompt, SamplingParams(temperature=0, max_tokens=1), hold_blocks=True)
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    ids = outs[-1].block_ids
    assert len(ids) == -(-100 // BS) and FREED_BLOCK not in ids[1:] and len(set(ids)) == len(ids)
    engine.abort("p")
