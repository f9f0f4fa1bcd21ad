"""Engine APIs and bad input: errors that name the problem, abort/hold_blocks, the P/D flow through the
decode-node entry points (add_request(remote_kv=True), remote_kv_landed / remote_kv_failed), the per-step
delta outputs, LLM and AsyncLLMEngine, the KV pool,
the attention backends and the device layer. Scheduler, block manager, KV connector and block hash
units are in test_engine_core.py."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from engine_helpers import GREEDY, hf_greedy, make_prompts, run_all

from pdcluster.control.sampling_params import SamplingParams
from pdcluster.engine.args import EngineArgs
from pdcluster.engine.kv_cache import KVCachePool
from pdcluster.engine.kv_connector import KVConnector


class Reservations(KVConnector):
    """Records what `on_remote_reserved` reports: request id -> (block ids, num_cached_tokens)."""

    def __init__(self) -> None:
        self.reserved: dict[str, tuple[list[int], int]] = {}

    def on_remote_reserved(self, request_id, block_ids, num_cached_tokens):
        self.reserved[request_id] = (list(block_ids), num_cached_tokens)


def reserve(engine, request_id, prompt, params=GREEDY):
    """add_request(remote_kv=True): (block ids, num_cached_tokens) from the connector, or None when refused."""
    if not engine.add_request(request_id, prompt, params, remote_kv=True):
        return None
    return engine.kv_connector.reserved[request_id]

# ---- loading errors ---------------------------------------------------------------------------

def _copy(src, dst):
    shutil.copytree(src, dst)
    return str(dst)


@pytest.mark.slow
def test_missing_model_dir_config_and_weights_are_named(tmp_path, tiny_llama):
    from pdcluster.engine.llm_engine import LLMEngine

    with pytest.raises(FileNotFoundError, match="does not exist"):
        LLMEngine(EngineArgs(model=str(tmp_path / "nope")))
    no_cfg = _copy(tiny_llama, tmp_path / "nocfg")
    os.remove(os.path.join(no_cfg, "config.json"))
    with pytest.raises(FileNotFoundError, match="config.json"):
        LLMEngine(EngineArgs(model=no_cfg))
    no_w = _copy(tiny_llama, tmp_path / "now")
    os.remove(os.path.join(no_w, "model.safetensors"))
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        LLMEngine(EngineArgs(model=no_w, num_gpu_blocks_override=8))
    no_tok = _copy(tiny_llama, tmp_path / "notok")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        os.remove(os.path.join(no_tok, f))
    with pytest.raises(FileNotFoundError, match="tokenizer"):
        LLMEngine(EngineArgs(model=no_tok))


def test_unsupported_architecture_lists_supported(tmp_path, tiny_llama):
    from pdcluster.engine.llm_engine import LLMEngine

    d = _copy(tiny_llama, tmp_path / "gpt")
    cfg_path = os.path.join(d, "config.json")
    cfg = json.load(open(cfg_path))
    cfg["architectures"], cfg["model_type"] = ["GPT2LMHeadModel"], "gpt2"
    json.dump(cfg, open(cfg_path, "w"))
    with pytest.raises(ValueError, match=r"GPT2LMHeadModel.*LlamaForCausalLM.*MistralForCausalLM.*Qwen2ForCausalLM"):
        LLMEngine(EngineArgs(model=d))


def test_bad_requests_raise_value_errors_naming_the_field(tiny_llama, make_engine):
    engine = make_engine(tiny_llama)
    with pytest.raises(ValueError, match="prompt_token_ids.*empty"):
        engine.add_request("a", [], GREEDY)
    with pytest.raises(ValueError, match="prompt_token_ids.*max_model_len=512"):
        engine.add_request("b", [5] * 513, GREEDY)
    with pytest.raises(ValueError, match="prompt_token_ids"):
        engine.add_request("c", [5, 100000], GREEDY)
    engine.add_request("d", [5, 6], GREEDY)
    with pytest.raises(ValueError, match="request_id"):
        engine.add_request("d", [5, 6], GREEDY)
    engine.abort("d")
    with pytest.raises(ValueError, match="dtype"):
        EngineArgs(model=tiny_llama, dtype="int8")
    with pytest.raises(ValueError, match="tensor_parallel_size: must be >= 1"):
        EngineArgs(model=tiny_llama, tensor_parallel_size=0)


def test_prompt_of_full_context_stops_by_length(tiny_llama, make_engine):
    engine = make_engine(tiny_llama, max_num_batched_tokens=128)
    out = run_all(engine, [make_prompts([512], seed=3)[0]],
                  SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    assert len(out[0]) == 1


# ---- request lifecycle ------------------------------------------------------------------------

def test_abort_frees_blocks_immediately_and_is_idempotent(tiny_llama, make_engine):
    engine = make_engine(tiny_llama)
    start = engine.get_stats().num_free_blocks
    engine.add_request("x", make_prompts([100])[0], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    engine.add_request("y", make_prompts([20])[0], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    engine.step()
    engine.step()
    assert engine.get_stats().num_free_blocks < start and engine.get_stats().num_running == 2
    engine.abort("x")
    engine.abort("x")
    engine.abort("unknown")
    assert engine.get_stats().num_running == 1
    engine.abort("y")
    assert engine.get_stats().num_free_blocks == start and not engine.has_unfinished_requests()


def test_stop_rules_eos_stop_ids_min_tokens_max_tokens(tiny_llama, make_engine):
    engine = make_engine(tiny_llama)
    prompt = make_prompts([12], seed=8)[0]
    free_run = run_all(engine, [prompt], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), "f")[0]
    stop_tok = free_run[5]
    first = free_run.index(stop_tok)
    engine.add_request("s", prompt, SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop_tok]))
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    last = outs[-1]
    assert last.finished and last.finish_reason == "stop" and last.outputs[0].stop_reason == stop_tok
    assert last.outputs[0].token_ids == free_run[:first + 1]
    assert [t for o in outs for t in o.new_token_ids] == free_run[:first + 1]
    engine.add_request("l", prompt, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert outs[-1].finish_reason == "length" and outs[-1].outputs[0].token_ids == free_run[:3]


def test_hold_blocks_keeps_blocks_until_abort_and_they_feed_the_prefix_cache(tiny_llama, make_engine):
    engine = make_engine(tiny_llama, block_size=16)
    start = engine.get_stats().num_free_blocks
    prompt = make_prompts([70], seed=40)[0]
    engine.add_request("p", prompt, SamplingParams(temperature=0, max_tokens=1), hold_blocks=True)
    outs = engine.step()
    assert outs[0].finished and len(outs[0].block_ids) == 5
    assert engine.get_stats().num_free_blocks == start - 5 and not engine.has_unfinished_requests()
    engine.abort("p")
    assert engine.get_stats().num_free_blocks == start
    run_all(engine, [prompt + [7]], GREEDY)
    assert engine.get_stats().prefix_cache_hit_tokens == 64


@pytest.mark.slow
def test_prefill_engine_to_decode_engine_via_reserved_blocks(tiny_llama, make_engine):
    """The P/D flow in one process: D reserves blocks for the prompt, P prefills with hold_blocks, its
    blocks are copied into D's, D decodes from the first token. Output must equal a local run."""
    prefill = make_engine(tiny_llama, block_size=16)
    decode = make_engine(tiny_llama, block_size=16, kv_connector=Reservations(), num_gpu_blocks_override=64)
    prompts = make_prompts([1, 37, 100, 16], seed=50)
    want = hf_greedy(tiny_llama, prompts)
    first_outputs = []
    for i, p in enumerate(prompts):
        blocks, cached = reserve(decode, f"d{i}", p, GREEDY)
        assert cached == 0 and len(blocks) == -(-len(p) // 16)
        prefill.add_request(f"p{i}", p, SamplingParams(temperature=0, max_tokens=1), hold_blocks=True)
        out = prefill.step()[0]
        for src, dst in zip(out.block_ids, blocks, strict=True):
            decode.kv_pool.block(dst).copy_(prefill.kv_pool.block(src))
        prefill.abort(f"p{i}")
        if i == 0:
            assert decode.get_stats().num_waiting_for_kv == 1 and not decode.step()   # never scheduled while waiting
        first_outputs.append(decode.remote_kv_landed(f"d{i}", out.new_token_ids[0]))
    assert all(o.new_token_ids == [w[0]] for o, w in zip(first_outputs, want, strict=True))
    got = {}
    while decode.has_unfinished_requests():
        for o in decode.step():
            if o.finished:
                got[o.request_id] = o.outputs[0].token_ids
    assert [got[f"d{i}"] for i in range(len(prompts))] == want
    # The prefilled prompt blocks went into D's prefix cache: a new reservation shares them.
    blocks, cached = reserve(decode, "again", prompts[2], GREEDY)
    assert cached == 96 and decode.get_stats().num_reserved_blocks == len(blocks) == 7
    decode.abort("again")


def test_remote_kv_reservation_limits_lifecycle_and_errors(tiny_llama, make_engine):
    decode = make_engine(tiny_llama, block_size=16, kv_connector=Reservations(), num_gpu_blocks_override=8)
    assert len(reserve(decode, "x", [6] * 100, GREEDY)[0]) == 7
    assert reserve(decode, "big", [5] * 20, GREEDY) is None
    assert decode.get_stats().num_waiting_for_kv == 1      # a failed reservation leaves nothing behind
    decode.abort("x")
    blocks, _ = reserve(decode, "one", [5] * 20, SamplingParams(max_tokens=1))
    stats = decode.get_stats()
    assert len(blocks) == 2 and stats.num_free_blocks == 6 and stats.num_reserved_blocks == 2
    assert not decode.has_unfinished_requests()            # waiting for KV is not schedulable work
    out = decode.remote_kv_landed("one", 9)
    assert out.finished and out.finish_reason == "length" and out.outputs[0].token_ids == [9]
    assert decode.get_stats().num_free_blocks == 8 and not decode.has_unfinished_requests()
    with pytest.raises(ValueError, match="request_id"):
        decode.remote_kv_landed("one", 9)                    # finished: no longer waiting
    reserve(decode, "two", [5] * 3, GREEDY)
    with pytest.raises(ValueError, match="request_id"):
        reserve(decode, "two", [5] * 3, GREEDY)
    with pytest.raises(ValueError, match="not waiting for remote KV"):
        decode.remote_kv_landed("nope", 9)
    decode.abort("two")
    decode.abort("two")     # idempotent
    assert decode.get_stats().num_reserved_blocks == 0


def test_two_reservations_sharing_a_cached_prefix(tiny_llama, make_engine):
    engine = make_engine(tiny_llama, block_size=16, kv_connector=Reservations(), num_gpu_blocks_override=16)
    prompt = make_prompts([40], seed=70)[0]
    run_all(engine, [prompt], SamplingParams(temperature=0, max_tokens=1))      # caches 2 full blocks
    a, cached_a = reserve(engine, "a", prompt, SamplingParams(max_tokens=2, ignore_eos=True))
    b, cached_b = reserve(engine, "b", prompt, GREEDY)
    assert cached_a == cached_b == 32 and a[:2] == b[:2] and a[2] != b[2]
    assert engine.get_stats().num_reserved_blocks == 6      # shared blocks count once per reservation
    out = engine.remote_kv_landed("a", 5)
    assert not out.finished and out.num_cached_tokens == 32
    engine.abort("b")
    while engine.has_unfinished_requests():
        engine.step()


def test_remote_kv_reserved_hook_runs_before_add_request_returns_and_refusal_adds_nothing(tiny_llama, make_engine):
    calls = []

    class Hook(KVConnector):
        def on_remote_reserved(self, request_id, block_ids, num_cached_tokens):
            stats = engine.get_stats()
            calls.append((request_id, list(block_ids), num_cached_tokens, stats.num_waiting_for_kv))

    engine = make_engine(tiny_llama, block_size=16, kv_connector=Hook(), num_gpu_blocks_override=8)
    assert engine.add_request("r", [5] * 40, GREEDY, remote_kv=True) is True
    assert len(calls) == 1 and calls[0][0] == "r" and len(calls[0][1]) == 3 and calls[0][2:] == (0, 1)
    assert engine.add_request("big", [5] * 100, GREEDY, remote_kv=True) is False
    assert len(calls) == 1 and "big" not in engine.scheduler.requests and engine.get_stats().num_free_blocks == 5
    assert engine.add_request("local", [5, 6], GREEDY) is True and len(calls) == 1   # no hook for a local prefill
    engine.abort("local")
    engine.abort("r")


def test_a_failing_reserved_hook_leaves_nothing_behind(tiny_llama, make_engine):
    class Broken(KVConnector):
        def on_remote_reserved(self, request_id, block_ids, num_cached_tokens):
            raise RuntimeError("no receiver")

    engine = make_engine(tiny_llama, block_size=16, kv_connector=Broken(), num_gpu_blocks_override=8)
    with pytest.raises(RuntimeError, match="no receiver"):
        engine.add_request("r", [5] * 40, GREEDY, remote_kv=True)
    assert not engine.scheduler.requests and engine.get_stats().num_free_blocks == 8


def test_remote_kv_failed_falls_back_to_a_local_prefill_with_the_same_output(tiny_llama, make_engine):
    engine = make_engine(tiny_llama, block_size=16, kv_connector=Reservations(), num_gpu_blocks_override=32)
    prompts = make_prompts([40, 23], seed=80)
    want = hf_greedy(tiny_llama, prompts)
    run_all(engine, [prompts[0][:32]], SamplingParams(temperature=0, max_tokens=1), "warm")   # 2 cached blocks
    blocks, cached = reserve(engine, "a", prompts[0])
    assert cached == 32 and len(blocks) == 3
    reserve(engine, "b", prompts[1])
    start = engine.get_stats()
    assert start.num_waiting_for_kv == 2 and not engine.has_unfinished_requests()
    engine.remote_kv_failed("a")
    with pytest.raises(ValueError, match="not waiting for remote KV"):
        engine.remote_kv_failed("a")   # failed once only
    engine.remote_kv_failed("unknown")   # no-op
    stats = engine.get_stats()
    assert stats.num_waiting_for_kv == 1 and stats.num_waiting == 1 and engine.has_unfinished_requests()
    assert stats.num_free_blocks == start.num_free_blocks + 3   # the 2 cached ones stay in the prefix cache, free
    got = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                got[o.request_id] = (o.outputs[0].token_ids, o.num_cached_tokens)
    assert got["a"] == (want[0], 32)            # prefix hits matched again at scheduling
    engine.remote_kv_failed("b")
    assert engine.has_unfinished_requests()
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                got[o.request_id] = (o.outputs[0].token_ids, o.num_cached_tokens)
    assert got["b"] == (want[1], 0)


def test_step_outputs_are_deltas_and_the_finished_one_carries_the_whole_completion(tiny_llama, make_engine):
    engine = make_engine(tiny_llama)
    engine.add_request("r", [5, 6, 7], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2))
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert len(outs) == 6 and [o.finished for o in outs] == [False] * 5 + [True]
    assert all(o.outputs == [] and o.finish_reason is None and o.text == "" for o in outs[:-1])
    assert all(len(o.new_token_ids) == 1 and len(o.logprobs) == 1 for o in outs)
    last = outs[-1]
    completion = last.outputs[0]
    assert last.finish_reason == completion.finish_reason == "length"
    assert completion.token_ids == [t for o in outs for t in o.new_token_ids]
    assert completion.logprobs == [lp for o in outs for lp in o.logprobs]
    assert completion.cumulative_logprob == pytest.approx(sum(lp[0] for lp in completion.logprobs))
    assert all(lp[0] <= 0 and len(lp[1]) == 2 for lp in completion.logprobs)
    engine.add_request("plain", [5, 6, 7], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    while engine.has_unfinished_requests():
        for o in engine.step():
            assert o.logprobs is None
            if o.finished:
                assert o.outputs[0].logprobs is None and o.outputs[0].cumulative_logprob is None


# ---- offline and async APIs -------------------------------------------------------------------

@pytest.mark.slow
def test_llm_generate_text_and_ids_in_order(tiny_llama):
    from pdcluster.engine import LLM
    from pdcluster.engine import SamplingParams as SP

    llm = LLM(model=tiny_llama, kv_cache_memory=4 << 20, max_num_seqs=4)
    start = llm.engine.get_stats().num_free_blocks
    prompts = ["Hello world!", make_prompts([50])[0], "The quick brown fox", make_prompts([3])[0], "A"]
    outs = llm.generate(prompts, sampling_params=SP(temperature=0, max_tokens=32))
    assert len(outs) == 5 and outs[0].prompt == "Hello world!"
    ids = [llm.tokenizer.encode(p) if isinstance(p, str) else p for p in prompts]
    assert [o.prompt_token_ids for o in outs] == ids
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(tiny_llama, ids)
    assert outs[0].outputs[0].text == llm.tokenizer.decode(outs[0].outputs[0].token_ids, skip_special_tokens=True)
    assert all(o.finish_reason in ("stop", "length") for o in outs)
    lp = llm.generate([[5, 6, 7]], SP(temperature=0, max_tokens=4, logprobs=3))[0]
    assert len(lp.outputs[0].logprobs) == 4 and len(lp.outputs[0].logprobs[0][1]) == 3
    assert llm.engine.get_stats().num_free_blocks == start


@pytest.mark.slow
async def test_async_engine_concurrent_generate_stream_and_cancel(tiny_llama):
    from pdcluster.engine import AsyncEngineArgs, AsyncLLMEngine

    with pytest.raises(ValueError, match="collective_timeout"):
        AsyncEngineArgs(model=tiny_llama, collective_timeout=0)
    engine = AsyncLLMEngine.from_engine_args(AsyncEngineArgs(model=tiny_llama, num_gpu_blocks_override=128))
    try:
        start = engine.engine.get_stats().num_free_blocks
        prompts = make_prompts([5, 40, 90, 12], seed=60)
        results = await asyncio.wait_for(asyncio.gather(*(engine.generate(p, GREEDY) for p in prompts)), 60)
        assert [r.outputs[0].token_ids for r in results] == hf_greedy(tiny_llama, prompts)
        streamed = []
        async for out in engine.generate_stream(prompts[1], GREEDY):
            streamed += out.new_token_ids
        assert streamed == results[1].outputs[0].token_ids

        streaming = asyncio.Event()

        async def consume_forever():
            forever = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
            async for _ in engine.generate_stream(prompts[2], forever):
                streaming.set()

        task = asyncio.create_task(consume_forever())
        await asyncio.wait_for(streaming.wait(), 30)   # cancelled mid-stream (400 tokens take ~0.2 s when idle)
        assert engine.engine.get_stats().num_free_blocks < start
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(100):
            if engine.engine.get_stats().num_free_blocks == start and not engine.engine.has_unfinished_requests():
                break
            await asyncio.sleep(0.05)
        assert engine.engine.get_stats().num_free_blocks == start
        with pytest.raises(ValueError, match="empty"):
            await engine.generate([], GREEDY)
    finally:
        engine.shutdown()


async def test_async_engine_fails_in_flight_requests_on_a_failed_step_and_keeps_serving(tiny_llama):
    from pdcluster.engine import AsyncEngineArgs, AsyncLLMEngine

    engine = AsyncLLMEngine.from_engine_args(AsyncEngineArgs(model=tiny_llama, num_gpu_blocks_override=64))
    try:
        start = engine.engine.get_stats().num_free_blocks
        run = engine.engine.runner.run
        calls = []

        def broken_once(*args, **kwargs):
            calls.append(1)
            if len(calls) == 3:
                raise RuntimeError("device lost")
            return run(*args, **kwargs)

        engine.engine.runner.run = broken_once
        long = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
        with pytest.raises(RuntimeError, match="device lost"):
            await asyncio.wait_for(asyncio.gather(engine.generate([5, 6, 7], long), engine.generate([8, 9], long)), 60)
        assert engine.engine.get_stats().num_free_blocks == start and not engine.engine.scheduler.requests
        out = await asyncio.wait_for(engine.generate([5, 6, 7], GREEDY), 60)
        assert out.outputs[0].token_ids == hf_greedy(tiny_llama, [[5, 6, 7]])[0]
    finally:
        engine.shutdown()


# ---- pool, allocator, device ------------------------------------------------------------------

def test_kv_pool_layout_views_and_external_tensor(tiny_llama, make_engine):
    engine = make_engine(tiny_llama, num_gpu_blocks_override=10, block_size=8)
    cfg = engine.model_config
    shape = KVCachePool.shape_for(cfg, 10, 8)
    assert tuple(engine.kv_pool.tensor.shape) == shape == (2, 2, 10, 8, 2, 16)   # layers, k|v, blocks, ...
    assert KVCachePool.bytes_per_block(cfg, 8, torch.float32) == engine.kv_pool.block_bytes == 2 * 2 * 8 * 2 * 16 * 4
    k, v = engine.kv_pool.layer_views(1)
    # one contiguous K and V cache per layer, the pool aligned for memory registration
    assert k.data_ptr() == engine.kv_pool.tensor[1, 0].data_ptr() and k.shape == (10, 8, 2, 16) and k.is_contiguous()
    assert v.data_ptr() == k.data_ptr() + k.numel() * 4 and engine.kv_pool.tensor.data_ptr() % 4096 == 0
    ext = torch.zeros(shape)
    other = make_engine(tiny_llama, kv_pool_tensor=ext, block_size=8)
    assert other.kv_pool.tensor is ext and other.get_stats().num_total_blocks == 10
    run_all(other, [make_prompts([20])[0]], SamplingParams(temperature=0, max_tokens=2))
    assert ext.abs().sum() > 0     # the engine wrote its KV into the caller's tensor
    made = []
    third = make_engine(tiny_llama, kv_cache_memory=5 * KVCachePool.bytes_per_block(cfg, 8, torch.float32),
                        block_size=8, num_gpu_blocks_override=None,
                        kv_pool_factory=lambda s, d: made.append(s) or torch.zeros(s, dtype=d))
    assert made == [KVCachePool.shape_for(cfg, 5, 8)] and third.get_stats().num_total_blocks == 5
    with pytest.raises(ValueError, match="kv_pool_tensor"):
        KVCachePool(10, 2, 8, 2, 16, torch.float32, tensor=torch.zeros(3, 3))


def test_rank_pools_map_a_shared_file_pool_and_a_torch_shared_pool_as_the_same_memory(tiny_llama):
    """What tensor-parallel CPU ranks get: a factory's /dev/shm-file tensor is found in /proc/self/maps and
    mapped again by path; a torch shared-memory tensor travels as itself. Both alias rank 0's pool."""
    from multiprocessing.reduction import ForkingPickler

    from pdcluster.engine.config import ModelConfig
    from pdcluster.engine.kv_cache import MappedFile, make_pool, mapped_file
    from pdcluster.kv_transfer.shm import SharedKVPool

    cfg = ModelConfig.from_pretrained(tiny_llama)
    cpu = torch.device("cpu")
    assert mapped_file(torch.zeros(16)) is None                        # private memory: no file
    shm = []
    try:
        def factory(shape, dtype):
            shm.append(SharedKVPool.create(shape, dtype))
            return shm[0].tensor

        pool, ranks = make_pool(cfg, 8, torch.float32, cpu, 2, lambda per_block: 4, factory=factory)
        assert pool.tensor is shm[0].tensor and ranks.num_blocks == 4 and ranks.kv_heads == 1
        assert isinstance(ranks.shared, MappedFile) and ranks.shared.path.endswith(shm[0].name)
        view = ForkingPickler.loads(ForkingPickler.dumps(ranks)).pool(cfg, cpu, 2)
        view.tensor[1, 3, 2].fill_(5.0)                                 # rank 1's V plane of layer 1, block 2
        assert pool.tensor[1, 3, 2].eq(5.0).all() and pool.tensor.sum() == 5.0 * pool.tensor[1, 3, 2].numel()
    finally:
        for p in shm:
            p.close()
    own, ranks = make_pool(cfg, 8, torch.float32, cpu, 2, lambda per_block: 3)
    assert own.tensor.is_shared() and ranks.shared is own.tensor and own.tensor.shape[1] == 4
    with pytest.raises(ValueError, match="worker ranks can map"):
        make_pool(cfg, 8, torch.float32, cpu, 2, lambda per_block: 3, factory=lambda s, d: torch.zeros(s, dtype=d))
    with pytest.raises(TypeError, match="kv_pool_factory: must return a torch.Tensor"):
        make_pool(cfg, 8, torch.float32, cpu, 1, lambda per_block: 3, factory=lambda s, d: object())
    single, none = make_pool(cfg, 8, torch.float32, cpu, 1, lambda per_block: 3)
    assert none is None and single.num_blocks == 3


@pytest.mark.slow
def test_device_layer_defaults_to_cpu_without_importing_torch_npu():
    code = ("import sys, pdcluster.engine.device as d; print(d.detect_device(), d.resolve_device('cpu'), "
            "'torch_npu' in sys.modules)")
    env = dict(os.environ, PDCLUSTER_SKIP_NPU="1")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120,
                         cwd=os.path.dirname(os.path.dirname(__file__)))
    assert out.stdout.split() == ["cpu", "cpu", "False"], out.stderr
    from pdcluster.engine.device import resolve_device

    with pytest.raises(ValueError, match="device"):
        resolve_device("tpu")


def test_block_size_unset_takes_the_devices_default(tiny_llama, make_engine):
    """Unset: 128 on CPU (vLLM-CPU's default), 16 on CUDA; a block size given is kept (NPU: 16 becomes 128,
    test_npu_backend)."""
    from pdcluster.engine.device import with_device_defaults

    assert make_engine(tiny_llama, device="cpu", num_gpu_blocks_override=8).block_size == 128
    assert make_engine(tiny_llama, device="cpu", num_gpu_blocks_override=8, block_size=16).block_size == 16
    unset = EngineArgs(model=tiny_llama)
    assert unset.block_size is None
    assert with_device_defaults(unset, torch.device("cuda", 0)).block_size == 16
    assert with_device_defaults(EngineArgs(model=tiny_llama, block_size=32), torch.device("cpu")).block_size == 32


def test_attention_backend_registry():
    from pdcluster.engine.attention import available_backends, get_backend_class

    assert {"torch", "cpu", "npu"} <= set(available_backends())
    assert get_backend_class(None, "cpu").name == "cpu"
    assert get_backend_class(None, "cuda").name in ("torch", "flashinfer")   # flashinfer where it imports
    with pytest.raises(ValueError, match="attention_backend"):
        get_backend_class("flash9000")


def _dense_attention(q, k, v, window=0):
    """fp32 causal (optionally sliding-window) attention of one sequence: [n, H, D] in, [n, Hq, D] out."""
    n = q.shape[0]
    pos = torch.arange(n)
    mask = pos[None, :] <= pos[:, None]
    if window:
        mask &= pos[None, :] > pos[:, None] - window
    return torch.nn.functional.scaled_dot_product_attention(
        q.float().transpose(0, 1), k.float().transpose(0, 1), v.float().transpose(0, 1), attn_mask=mask,
        enable_gqa=True).transpose(0, 1)


@pytest.mark.parametrize("backend_name,split_rows", [("torch", False), ("torch", True), ("cpu", False)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [0, 3])
def test_backend_paged_decode_and_chunked_prefill_match_dense_attention(dtype, backend_name, split_rows, window):
    """Paged attention through scattered block tables equals dense causal attention (grouped decode in
    fp32 and bf16, also split into one-row calls as big CPU batches are, a prefill chunk after cached
    context, a first chunk longer than the window), for the torch reference and the CPU backend (native
    decode kernel), with full and sliding-window attention."""
    from pdcluster.engine.attention import AttentionMetadata, PrefillChunk, get_backend_class

    torch.manual_seed(0)
    hq, hkv, d, bs = 4, 2, 16, 4
    backend = get_backend_class(backend_name)(hq, hkv, d)
    if split_rows:
        backend.cpu_decode_chunk_bytes = 1
    pool = torch.zeros(1, 2, 20, bs, hkv, d, dtype=dtype)
    k_cache, v_cache = pool[0, 0], pool[0, 1]
    lens = [5, 11, 1]
    tables = [[7, 2], [3, 19, 0], [12]]
    ks = [torch.randn(n, hkv, d, dtype=dtype) for n in lens]
    vs = [torch.randn(n, hkv, d, dtype=dtype) for n in lens]
    qs = [torch.randn(n, hq, d, dtype=dtype) for n in lens]
    for t, k, v in zip(tables, ks, vs, strict=True):      # fill all but the last token directly
        for p in range(k.shape[0] - 1):
            k_cache[t[p // bs], p % bs] = k[p]
            v_cache[t[p // bs], p % bs] = v[p]
    padded = torch.tensor([t + [0] * (3 - len(t)) for t in tables], dtype=torch.int32)
    pos = torch.tensor([n - 1 for n in lens])
    slots = (padded[torch.arange(3), pos // bs] * bs + pos % bs).to(torch.int32)
    meta = AttentionMetadata(slot_mapping=slots, num_decode_tokens=3,
                             decode_block_tables=padded, decode_context_lens=(pos + 1).to(torch.int32))
    out = backend.forward(torch.stack([q[-1] for q in qs]), torch.stack([k[-1] for k in ks]),
                          torch.stack([v[-1] for v in vs]), k_cache, v_cache, backend.prepare(meta), window)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    for i in range(3):
        assert (out[i].float() - _dense_attention(qs[i], ks[i], vs[i], window)[-1]).abs().max().item() < tol
    # Sequence 1 prefilled in two chunks: 5 tokens with an empty cache, then 6 after those 5 cached.
    pool.zero_()
    blocks = torch.tensor(tables[1], dtype=torch.int32)
    ref = _dense_attention(qs[1], ks[1], vs[1], window)
    for start, end in ((0, 5), (5, 11)):
        p = torch.arange(start, end)
        meta = AttentionMetadata(slot_mapping=(blocks[p // bs] * bs + p % bs).to(torch.int32),
                                 prefills=[PrefillChunk(0, end - start, start, blocks)])
        out = backend.forward(qs[1][start:end], ks[1][start:end], vs[1][start:end], k_cache, v_cache,
                              backend.prepare(meta), window)
        assert (out.float() - ref[start:end]).abs().max().item() < tol
