"""The compiled model body (EngineArgs.enforce_eager=False, engine/compiled.py): the opaque attention op gives the
eager layer's result, and compiled engines produce the eager engine's greedy tokens (fp32) through batch-size
changes, with one dynamic graph instead of a compilation per token count."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import make_prompts, run_all, run_staggered

from pdcluster.control.sampling_params import SamplingParams
from pdcluster.engine.compiled import step_context
from pdcluster.engine.scheduler import ScheduledBatch
from pdcluster.engine.sequence import Sequence


def _batch(engine, prompts: list[list[int]]) -> tuple[ScheduledBatch, list[Sequence]]:
    seqs = []
    for i, p in enumerate(prompts):
        seq = Sequence(f"s{i}", p, SamplingParams(max_tokens=1), [], len(p) + 1, 0)
        assert engine.scheduler.block_manager.allocate(seq, len(p))
        seqs.append(seq)
    return ScheduledBatch(seqs, [len(p) for p in prompts]), seqs


def test_attention_op_equals_the_eager_layer_call(tiny_llama, make_engine):
    """The model body with meta=None (every layer's attention through `pdcluster::paged_attention`, metadata from
    the step context) gives bitwise the eager body's hidden states, prefill and decode rows in one step."""
    engine = make_engine(tiny_llama)
    runner = engine.runner
    batch, seqs = _batch(engine, make_prompts([5, 17, 40], seed=1))
    try:
        inputs, _ = runner.prepare(batch)
        with torch.inference_mode():
            meta = runner.attn_backend.prepare(inputs.meta)
            want = runner.model.model(inputs.ids, inputs.positions, meta)
            with step_context(runner.model.attention_layers(), runner.attn_backend.prepare(inputs.meta)):
                got = runner.model.model(inputs.ids, inputs.positions, None)
        assert torch.equal(got, want)
    finally:
        for seq in seqs:
            engine.scheduler.block_manager.free(seq)


def test_compiled_body_is_off_by_default(tiny_llama, make_engine):
    assert make_engine(tiny_llama).runner.compiled is None


def test_a_body_that_does_not_compile_runs_eagerly(tiny_llama, make_engine):
    eager = make_engine(tiny_llama, dtype="float32")
    engine = make_engine(tiny_llama, dtype="float32", enforce_eager=False)

    def fails(ids, positions):
        raise torch._dynamo.exc.TorchDynamoException("unsupported here")

    engine.runner.compiled._fn = fails
    prompts = make_prompts([7, 12], seed=4)
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    assert run_all(engine, prompts, params) == run_all(eager, prompts, params)
    assert engine.runner.compiled is None


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen2"])   # qwen2: QKV bias through the packed GEMM op, tied head
def test_compiled_greedy_tokens_equal_eager_through_batch_changes(arch, tiny_models, make_engine):
    """Staggered arrivals (mixed prefill + decode steps of many token counts, down to one decoding row), then a
    second wave of another size: same tokens as eager, and at most two compilations (T == 1 is specialised,
    every other token count shares one dynamic graph)."""
    model = tiny_models[arch]
    prompts = make_prompts([3, 9, 30, 64, 17, 5], seed=2)
    staggered = SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True)
    wave = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (4, 12, 20)]
    eager = make_engine(model, dtype="float32")
    compiled = make_engine(model, dtype="float32", enforce_eager=False)
    assert compiled.runner.compiled is not None
    want = run_staggered(eager, prompts, staggered, first=2, later_every=3)
    got = run_staggered(compiled, prompts, staggered, first=2, later_every=3)
    assert got == want
    assert compiled.runner.compiled.compiles <= 2
    second = make_prompts([11, 2, 50], seed=3)
    assert run_all(compiled, second, wave, prefix="b") == run_all(eager, second, wave, prefix="b")
    assert compiled.runner.compiled.compiles == 2   # the second wave ends with one row alone: T == 1 was run
