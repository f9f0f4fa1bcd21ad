"""Helpers shared by the engine tests: prompts, transformers references, a step driver."""

from __future__ import annotations

import random

import torch

from pdcluster.control.sampling_params import SamplingParams

PROMPT_LENGTHS = [1, 3, 17, 40, 100, 300, 33, 64, 129]
GREEDY = SamplingParams(temperature=0.0, max_tokens=32)


def make_prompts(lengths=PROMPT_LENGTHS, seed: int = 0, vocab: int = 400) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


_REF_CACHE: dict[tuple, list[int]] = {}


def hf_greedy(model_dir: str, prompts: list[list[int]], max_new_tokens: int = 32) -> list[list[int]]:
    """transformers `generate` per prompt (fp32, greedy, no padding), stopping at EOS like the engine."""
    from pdcluster.engine.testing import load_hf_model

    missing = [p for p in prompts if (model_dir, tuple(p), max_new_tokens) not in _REF_CACHE]
    if missing:
        hf = load_hf_model(model_dir)
        with torch.no_grad():
            for p in missing:
                out = hf.generate(torch.tensor([p]), max_new_tokens=max_new_tokens, do_sample=False)
                _REF_CACHE[(model_dir, tuple(p), max_new_tokens)] = out[0, len(p):].tolist()
    return [_REF_CACHE[(model_dir, tuple(p), max_new_tokens)] for p in prompts]


def run_staggered(engine, prompts: list[list[int]], params=GREEDY, first: int = 4, later_every: int = 2,
                  max_steps: int = 5000) -> dict[str, list[int]]:
    """Submit `first` prompts together, then one more every `later_every` steps while others decode."""
    results: dict[str, list[int]] = {}
    pending = list(enumerate(prompts))
    for _ in range(min(first, len(pending))):
        i, p = pending.pop(0)
        engine.add_request(str(i), p, params)
    steps = 0
    while engine.has_unfinished_requests() or pending:
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out.outputs[0].token_ids
        steps += 1
        assert steps < max_steps, "engine did not finish"
        if pending and steps % later_every == 0:
            i, p = pending.pop(0)
            engine.add_request(str(i), p, params)
    return results


def run_all(engine, prompts, params=GREEDY, prefix: str = "r") -> list[list[int]]:
    params_list = params if isinstance(params, list) else [params] * len(prompts)
    for i, (p, sp) in enumerate(zip(prompts, params_list, strict=True)):
        engine.add_request(f"{prefix}{i}", p, sp)
    results: dict[str, list[int]] = {}
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out.outputs[0].token_ids
        steps += 1
        assert steps < 5000, "engine did not finish"
    return [results[f"{prefix}{i}"] for i in range(len(prompts))]


def run_outputs(engine, prompts, params_list, **add_kw) -> list:
    """Each request's final RequestOutput (ids r0, r1, ...), one SamplingParams per prompt."""
    for i, (p, sp) in enumerate(zip(prompts, params_list, strict=True)):
        engine.add_request(f"r{i}", p, sp, **add_kw)
    outs = {}
    for _ in range(5000):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out
    else:
        raise AssertionError("engine did not finish")
    return [outs[f"r{i}"] for i in range(len(prompts))]
