"""`pdcluster demo`: offline generation on a model directory (default: SmolLM2, `cli.default_model`)."""

from __future__ import annotations

import time
from typing import Any

from pdcluster.control.sampling_params import SamplingParams
from pdcluster.engine.llm import LLM

_PROMPTS = [
    "Hello world! How are you today?",
    "The quick brown fox",
    "A paged KV cache stores keys and values in",
    "Prefill is compute bound and decode is",
    "Once upon a time there was a cluster",
    "I am a tiny language model",
    "0123456789 + 1 =",
    "user: what is disaggregated serving? assistant:",
]


def run_demo(model: str | None = None, num_prompts: int = 8, max_tokens: int = 32) -> None:
    if num_prompts < 1 or max_tokens < 1:
        raise ValueError("num_prompts and max_tokens must be positive")
    engine_config: dict[str, Any] = {}
    if model is None:
        from pdcluster.cli.default_model import default_model

        model = default_model(engine_config, {})   # and its dtype
        print(f"no model given: {model}")
    llm = LLM(model=model, kv_cache_memory=64 << 20, dtype=engine_config.get("dtype", "auto"))
    prompts = [_PROMPTS[i % len(_PROMPTS)] for i in range(num_prompts)]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    for out in outputs:
        completion = out.outputs[0]
        print(f"{out.prompt!r} -> {completion.text!r} ({len(completion.token_ids)} tokens, {out.finish_reason})")
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    print(f"throughput: {generated} tokens in {elapsed:.2f} s = {generated / elapsed:.1f} tokens/s "
          f"({len(outputs)} prompts, device {llm.engine.device}, dtype {llm.engine.dtype})")
