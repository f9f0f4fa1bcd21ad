"""The last layer runs its MLP (and the final norm) only on the rows whose logits a step computes."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import make_prompts

from pdcluster.control.sampling_params import SamplingParams
from pdcluster.engine.scheduler import ScheduledBatch
from pdcluster.engine.sequence import Sequence
from pdcluster.engine.step_inputs import decode, encode
from pdcluster.engine.testing import make_tiny_model


def _rows_into(module: torch.nn.Module, seen: list[int]):
    return module.register_forward_pre_hook(lambda _m, args: seen.append(args[0].shape[0]))


def _step(engine, prompts: list[list[int]], counts: list[int], logit_rows_only: bool):
    """Logits of one step over fresh sequences (their first `counts` tokens), and the rows the last two layers'
    MLPs saw."""
    bm = engine.scheduler.block_manager
    seqs = [Sequence(f"s{i}", p, SamplingParams(max_tokens=1), [], len(p) + 1, 0) for i, p in enumerate(prompts)]
    for s in seqs:
        assert bm.allocate(s, len(s.token_ids))
    layers = engine.runner.model.model.layers
    seen: dict[int, list[int]] = {-1: [], -2: []}
    hooks = [_rows_into(layers[i].mlp, seen[i]) for i in seen]
    try:
        inputs, _ = engine.runner.prepare(ScheduledBatch(seqs, counts))
        assert inputs.logit_rows_only   # no LoRA, no hidden-state head
        inputs.logit_rows_only = logit_rows_only
        logits = engine.runner.execute(inputs)
        return logits, inputs.sample_rows, seen
    finally:
        for h in hooks:
            h.remove()
        for s in seqs:
            bm.free(s)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_last_layer_computes_only_the_sampled_rows_and_the_logits_stay(tiny_llama, make_engine, dtype):
    engine = make_engine(tiny_llama, dtype=dtype, block_size=16)
    prompts = make_prompts([37, 20], seed=5)
    full, rows, seen_full = _step(engine, prompts, [37, 20], logit_rows_only=False)
    cut, rows_cut, seen_cut = _step(engine, prompts, [37, 20], logit_rows_only=True)
    assert rows == rows_cut and len(rows) == 2
    assert seen_full == {-1: [57], -2: [57]}
    assert seen_cut == {-1: [2], -2: [57]}   # every row still goes through the layers before the last
    assert full.shape == cut.shape == (2, full.shape[1])
    tol = 1e-4 if dtype == "float32" else 3e-2
    torch.testing.assert_close(cut.float(), full.float(), rtol=tol, atol=tol)
    # A chunk that ends no prompt: no logits, and the last layer's MLP has nothing to do.
    none, rows_none, seen_none = _step(engine, prompts[:1], [30], logit_rows_only=True)
    assert none is None and rows_none == [] and seen_none == {-1: [], -2: [30]}


def test_prompt_logprob_rows_go_through_the_last_layer(tiny_llama, make_engine):
    """A request asking for prompt logprobs keeps every prompt row (they are logit rows): the same prompt
    logprobs as a run that computes every row."""
    engine = make_engine(tiny_llama, block_size=16)
    prompt = make_prompts([25], seed=7)[0]
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)

    def prompt_logprobs(logit_rows_only: bool) -> list:
        seq = Sequence("p", prompt, params, [], len(prompt) + 1, 0)
        assert engine.scheduler.block_manager.allocate(seq, len(prompt))
        layers = engine.runner.model.model.layers
        seen: list[int] = []
        hook = _rows_into(layers[-1].mlp, seen)
        try:
            inputs, sampled = engine.runner.prepare(ScheduledBatch([seq], [len(prompt)]))
            inputs.logit_rows_only = logit_rows_only
            engine.runner._run(inputs, sampled, None)
        finally:
            hook.remove()
            engine.scheduler.block_manager.free(seq)
        assert seen == [len(prompt)]   # the sampled row and the 24 scored prompt rows
        return [lp for lp, _ in seq.prompt_logprobs[1:]]

    cut, full = prompt_logprobs(True), prompt_logprobs(False)
    assert len(cut) == len(prompt) - 1
    assert cut == pytest.approx(full, abs=1e-4)


def test_the_flag_reaches_the_other_tensor_parallel_ranks(tiny_llama, make_engine):
    engine = make_engine(tiny_llama, block_size=16)
    seq = Sequence("w", make_prompts([20], seed=3)[0], SamplingParams(max_tokens=1), [], 21, 0)
    assert engine.scheduler.block_manager.allocate(seq, 20)
    try:
        inputs, _ = engine.runner.prepare(ScheduledBatch([seq], [20]))
        for flag in (True, False):
            inputs.logit_rows_only = flag
            assert decode(encode(inputs)).logit_rows_only is flag
        # A hidden-state head wants every row's state: no cut.
        engine.runner.feature_sink = lambda *a: None
        assert not engine.runner.prepare(ScheduledBatch([seq], [20]))[0].logit_rows_only
    finally:
        engine.runner.feature_sink = None
        engine.scheduler.block_manager.free(seq)


def test_a_last_layer_of_experts_sees_every_row(tmp_path, make_engine):
    """Expert load counts every token the router routes (engine/expert_load.py): no cut there."""
    engine = make_engine(make_tiny_model(str(tmp_path), "qwen3_moe", num_hidden_layers=2), block_size=16)
    assert not engine.runner.cut_last_layer
    seq = Sequence("m", make_prompts([20], seed=4)[0], SamplingParams(max_tokens=1), [], 21, 0)
    assert engine.scheduler.block_manager.allocate(seq, 20)
    try:
        assert not engine.runner.prepare(ScheduledBatch([seq], [20]))[0].logit_rows_only
    finally:
        engine.scheduler.block_manager.free(seq)
