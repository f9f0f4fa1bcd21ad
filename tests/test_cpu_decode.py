"""The decode plan (engine/cpu_decode.py): a decode step run as flat kernel calls gives bitwise the eager forward's
logits, in both float dtypes and on every dense architecture it takes (a QKV bias, tied embeddings, one KV head, a
sliding window, per-head q/k norms); it runs only on steps where every row decodes, and models it does not cover keep
the eager forward."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import make_prompts, run_all

from pdcluster.control.sampling_params import SamplingParams
from pdcluster.engine.attention import native
from pdcluster.engine.testing import make_tiny_model

SIZE = dict(hidden_size=96, intermediate_size=160, num_hidden_layers=3)   # (n % 16 != 0: the strips' remainders)
ARCHS = {"llama": {}, "qwen2": {}, "mistral": dict(sliding_window=7), "qwen3": {}, "qwen3_moe": {}}
COVERED = {"llama", "qwen2", "mistral", "qwen3"}   # not qwen3_moe: routed experts


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("plan")
    return {arch: make_tiny_model(str(root / arch), arch, **SIZE, **extra) for arch, extra in ARCHS.items()}


def plan_expected() -> bool:
    """The plan needs the native library's vectorized fused ops (AVX2 or AVX-512 builds)."""
    return native.load() is not None and native._fused_vectorized()


def decode_inputs(engine, prompts: list[list[int]]):
    """Prefill `prompts` and decode twice, then the inputs of the next step (every row decoding)."""
    for i, p in enumerate(prompts):
        engine.add_request(f"p{i}", p, SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True))
    for _ in range(len(prompts) + 3):
        engine.step()
    batch = engine.scheduler.schedule()
    assert all(n == 1 for n in batch.num_new_tokens)
    inputs, _ = engine.runner.prepare(batch)
    return inputs


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float32-onednn"])
@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_a_decode_step_equals_the_eager_forward_bitwise(arch, dtype, models, make_engine, monkeypatch):
    """float32-onednn: fp32 weights in oneDNN's packed layout, not the strips (the plan calls `packed_matmul`),
    as on CPUs with AVX-512."""
    if dtype == "float32-onednn":
        monkeypatch.setenv("PDCLUSTER_NATIVE_MATMUL", "0")
    engine = make_engine(models[arch], dtype=dtype.split("-")[0], block_size=16)
    runner = engine.runner
    if arch not in COVERED or not plan_expected():
        assert runner.decode_plan is None
        return
    assert runner.decode_plan is not None
    strips = {m.strips for layer in runner.decode_plan.layers for m in (layer.qkv, layer.o, layer.gate, layer.down)}
    if dtype == "float32-onednn":
        assert strips == {False}
    inputs = decode_inputs(engine, make_prompts([3, 17, 40, 9], seed=5))
    assert runner.decode_plan.covers(runner.attn_backend.prepare(inputs.meta), inputs.ids.shape[0])
    planned = runner.execute(inputs)
    plan, runner.decode_plan = runner.decode_plan, None
    eager = runner.execute(inputs)   # (writes the same K/V into the same slots again)
    runner.decode_plan = plan
    assert planned is not None and eager is not None
    assert torch.equal(planned, eager)
    engine.abort_all()


@pytest.mark.parametrize("arch", sorted(COVERED))
def test_generation_with_the_plan_equals_generation_without(arch, models, make_engine, monkeypatch):
    """Whole runs, prefill chunks and decodes mixed (the plan takes only the all-decode steps): same tokens, and
    the plan ran."""
    if not plan_expected():
        pytest.skip("no vectorized native fused ops on this machine")
    prompts = make_prompts([5, 33, 70, 2, 18], seed=9)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    engine = make_engine(models[arch], max_num_batched_tokens=32, block_size=16)
    plan = engine.runner.decode_plan
    calls = []
    forward = plan.forward
    monkeypatch.setattr(plan, "forward", lambda *a: calls.append(1) or forward(*a))
    got = run_all(engine, prompts, params)
    monkeypatch.setenv("PDCLUSTER_DECODE_PLAN", "0")
    eager = make_engine(models[arch], max_num_batched_tokens=32, block_size=16)
    assert eager.runner.decode_plan is None
    assert got == run_all(eager, prompts, params)
    assert len(calls) >= 15   # the steps after the last prompt's chunks


def test_steps_with_a_prefill_chunk_and_int8_caches_take_the_eager_forward(models, make_engine):
    if not plan_expected():
        pytest.skip("no vectorized native fused ops on this machine")
    engine = make_engine(models["llama"], block_size=16)
    runner = engine.runner
    engine.add_request("a", make_prompts([20], seed=1)[0], SamplingParams(temperature=0.0, max_tokens=5))
    batch = engine.scheduler.schedule()
    inputs, _ = runner.prepare(batch)
    assert not runner.decode_plan.covers(runner.attn_backend.prepare(inputs.meta), inputs.ids.shape[0])
    engine.abort_all()
    int8 = make_engine(models["llama"], block_size=16, kv_cache_dtype="int8")
    inputs = decode_inputs(int8, make_prompts([4, 12], seed=2))
    assert not int8.runner.decode_plan.covers(int8.runner.attn_backend.prepare(inputs.meta), inputs.ids.shape[0])
    int8.abort_all()
