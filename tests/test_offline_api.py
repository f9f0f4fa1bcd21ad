"""Offline API parity with vLLM (engine/llm.py, engine/async_engine.py, engine/prompts.py): `LLM.generate`
takes vLLM's prompt forms; `LLM` / `AsyncLLMEngine` shut down (twice is harmless) and work as context
managers, releasing the tensor-parallel ranks, their shared memory and the torch.distributed group, so a
second TP = 2 engine in the same process gives the same greedy tokens."""

from __future__ import annotations

import asyncio
import os

import pytest
import torch

from pdcluster.control.sampling_params import SamplingParams
from pdcluster.engine.async_engine import AsyncLLMEngine
from pdcluster.engine.llm import LLM
from pdcluster.engine.testing import make_tiny_model

pytestmark = pytest.mark.timeout(300)

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
SMALL = dict(dtype="float32", device="cpu", num_gpu_blocks_override=64, block_size=8)


def _tokens(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def _shm_segments() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith("pdcluster-")}


def test_generate_takes_vllm_prompt_forms(tiny_llama):
    with LLM(tiny_llama, **SMALL) as llm:
        text = "hello world, the"
        ids = llm.tokenizer.encode(text)
        other = [5, 17, 9, 3, 22]
        ref = _tokens(llm.generate([text, other], GREEDY))
        assert ref[0] != ref[1]
        # every form, one at a time and mixed in one list
        assert _tokens(llm.generate({"prompt": text}, GREEDY)) == [ref[0]]
        assert _tokens(llm.generate({"prompt_token_ids": ids}, GREEDY)) == [ref[0]]
        assert _tokens(llm.generate(other, GREEDY)) == [ref[1]]
        mixed = llm.generate([{"prompt_token_ids": other}, text, {"prompt": text}, ids,
                              {"prompt_token_ids": ids, "prompt": "label"}], GREEDY)
        assert _tokens(mixed) == [ref[1], ref[0], ref[0], ref[0], ref[0]]
        assert [o.prompt for o in mixed] == [None, text, text, None, "label"]
        assert all(o.outputs[0].text == llm.tokenizer.decode(o.outputs[0].token_ids) for o in mixed)
        for bad, error in [({"prompt": text, "multi_modal_data": {}}, "multi_modal_data"),
                           ({}, "needs 'prompt' or 'prompt_token_ids'"),
                           ({"prompt_token_ids": "1 2 3"}, "list of ints"), (3.5, "expected a string")]:
            with pytest.raises((ValueError, TypeError), match=error):
                llm.generate([text, bad], GREEDY)
        assert not llm.engine.has_unfinished_requests()   # a bad prompt in a list starts none of them
    llm.shutdown()   # a second shutdown is harmless
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate(text, GREEDY)


def test_async_engine_prompt_forms_and_context_managers(tiny_llama):
    async def main() -> None:
        async with AsyncLLMEngine(model=tiny_llama, **SMALL) as engine:
            a = await engine.generate({"prompt_token_ids": [5, 17, 9]}, GREEDY)
            b = await engine.generate([5, 17, 9], GREEDY)
            c = await engine.generate({"prompt": "hi there"}, GREEDY)
            assert a.outputs[0].token_ids == b.outputs[0].token_ids and c.prompt == "hi there"
        engine.shutdown()
        with pytest.raises(RuntimeError, match="shut down"):
            await engine.generate([5, 17, 9], GREEDY)

    asyncio.run(main())
    with AsyncLLMEngine(model=tiny_llama, **SMALL) as engine:
        assert not engine._thread.stopped
    assert engine._thread.stopped


def test_second_tensor_parallel_engine_after_shutdown(tmp_path):
    model = make_tiny_model(str(tmp_path), "llama", num_attention_heads=8, num_key_value_heads=4,
                            hidden_size=64, intermediate_size=128)
    prompts = [[1, 2, 3, 4, 5], [9, 8, 7]]
    before = _shm_segments()
    with LLM(model, tensor_parallel_size=2, **SMALL) as first:
        ref = _tokens(first.generate(prompts, GREEDY))
        assert torch.distributed.is_initialized()
        # while it lives, another TP engine is refused before any rank starts, naming the way out
        with pytest.raises(RuntimeError, match=r"shut it down first with LLM.shutdown\(\)"):
            LLM(model, tensor_parallel_size=2, **SMALL)
    first.shutdown()
    assert not torch.distributed.is_initialized()
    assert all(not p.is_alive() for p in first.engine.runner.workers.procs)
    second = LLM(model, tensor_parallel_size=2, **SMALL)
    try:
        assert _tokens(second.generate(prompts, GREEDY)) == ref
    finally:
        second.shutdown()
    assert not torch.distributed.is_initialized()
    assert _shm_segments() - before == set()
