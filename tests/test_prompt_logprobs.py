"""Prompt logprobs (vLLM's `prompt_logprobs`): the engine scores every prompt token with the model's own
logits, equal to transformers' log-softmax, whole or chunked, batched with other requests, never read from
the prefix cache, and the offline `LLM` returns them."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import make_prompts

from pdcluster.control.sampling_params import SamplingParams
from pdcluster.engine.testing import load_hf_model

pytestmark = pytest.mark.slow  # transformers reference runs, tensor-parallel worker processes

TOP = 3


def _reference(model: str, ids: list[int]) -> torch.Tensor:
    """transformers' log-softmax: row j scores token j + 1."""
    with torch.no_grad():
        logits = load_hf_model(model)(torch.tensor([ids])).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


def _run(engine, requests: dict[str, tuple[list[int], SamplingParams]], max_steps: int = 2000) -> dict:
    for rid, (ids, params) in requests.items():
        engine.add_request(rid, ids, params)
    done = {}
    for _ in range(max_steps):
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        if not engine.has_unfinished_requests():
            return done
    raise AssertionError("engine did not finish")


def _check(entries: list, ids: list[int], ref: torch.Tensor, top: int) -> None:
    assert len(entries) == len(ids) and entries[0] is None
    for j in range(1, len(ids)):
        logprob, alternatives = entries[j]
        assert logprob == pytest.approx(ref[j - 1, ids[j]].item(), abs=1e-3), f"prompt token {j}"
        # the N most likely tokens (ties may list either id), each with its own logprob
        assert [v for _, v in alternatives] == pytest.approx(torch.topk(ref[j - 1], top).values.tolist(), abs=1e-3)
        assert [v for _, v in alternatives] == pytest.approx([ref[j - 1, t].item() for t, _ in alternatives], abs=1e-3)


@pytest.mark.parametrize("budget", [4096, 16], ids=["whole", "chunked"])
def test_prompt_logprobs_equal_transformers(budget, tiny_llama, make_engine):
    """Two prompts scored in one batch beside a request that asks for none; chunked, the long prompt spans
    many steps (and a chunk boundary inside a block)."""
    engine = make_engine(tiny_llama, max_num_batched_tokens=budget, enable_chunked_prefill=True, max_num_seqs=8)
    long, short, plain = make_prompts([70, 9, 30], seed=11)
    asked = SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=TOP)
    done = _run(engine, {"long": (long, asked), "short": (short, SamplingParams(max_tokens=2, prompt_logprobs=0)),
                         "plain": (plain, SamplingParams(temperature=0.0, max_tokens=3))})
    _check(done["long"].prompt_logprobs, long, _reference(tiny_llama, long), TOP)
    short_entries = done["short"].prompt_logprobs
    ref = _reference(tiny_llama, short)
    assert len(short_entries) == len(short) and all(top == [] for _, top in short_entries[1:])
    assert [lp for lp, _ in short_entries[1:]] == pytest.approx([ref[j - 1, short[j]].item()
                                                                 for j in range(1, len(short))], abs=1e-3)
    assert done["plain"].prompt_logprobs is None
    if budget == 16:
        assert engine.get_stats().num_steps > len(long) // 16


def test_prompt_logprobs_skip_the_prefix_cache(tiny_llama, make_engine):
    """A prompt already in the prefix cache is computed again when its logprobs are asked (and the same
    tokens without prompt_logprobs do hit the cache)."""
    engine = make_engine(tiny_llama, block_size=16)
    ids = make_prompts([64], seed=4)[0]
    greedy = SamplingParams(temperature=0.0, max_tokens=2)
    _run(engine, {"warm": (ids, greedy)})
    done = _run(engine, {"asked": (ids, SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=1)),
                         "hit": (ids, greedy)})
    assert done["asked"].num_cached_tokens == 0 and done["hit"].num_cached_tokens == 48
    _check(done["asked"].prompt_logprobs, ids, _reference(tiny_llama, ids), 1)
    assert done["asked"].outputs[0].token_ids == done["hit"].outputs[0].token_ids


def test_first_output_carries_prompt_logprobs_and_later_deltas_do_not(tiny_llama, make_engine):
    engine = make_engine(tiny_llama)
    ids = make_prompts([20], seed=2)[0]
    engine.add_request("r", ids, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, prompt_logprobs=0))
    outs = []
    while engine.has_unfinished_requests():
        outs.extend(engine.step())
    assert len(outs) == 4 and len(outs[0].prompt_logprobs) == len(ids)
    assert all(o.prompt_logprobs is None for o in outs[1:-1]) and outs[-1].prompt_logprobs == outs[0].prompt_logprobs


def test_engine_refuses_what_it_cannot_score(tiny_llama, make_engine):
    engine = make_engine(tiny_llama)
    vocab = engine.model_config.vocab_size
    with pytest.raises(ValueError, match="logit_bias"):
        engine.add_request("b", [5, 6], SamplingParams(logit_bias={vocab: 1.0}))
    with pytest.raises(ValueError, match="prompt_logprobs"):
        engine.add_request("r", [5, 6], SamplingParams(prompt_logprobs=1), remote_kv=True)
    assert not engine.has_unfinished_requests()


def test_offline_llm_returns_prompt_logprobs(tiny_llama):
    from pdcluster import LLM

    llm = LLM(tiny_llama, dtype="float32", num_gpu_blocks_override=64)
    ids = make_prompts([12], seed=8)[0]
    out = llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=2))[0]
    _check(out.prompt_logprobs, ids, _reference(tiny_llama, ids), 2)


def test_wire_carries_prompt_logprobs_on_the_first_tokens_only_bounded_by_the_prompt():
    from pdcluster.control import protocol
    from pdcluster.control.protocol import ProtocolError, Tokens

    entries = [None, [-1.5, [[3, -0.5]]], [-2.0, []]]
    msg = protocol.decode(protocol.encode(Tokens(rid="r", ids=[7], num_prompt_tokens=3, prompt_logprobs=entries)))
    assert msg.prompt_logprobs == entries
    later = Tokens(rid="r", ids=[8], num_prompt_tokens=0)
    msg.append(later)
    assert msg.prompt_logprobs == entries and msg.ids == [7, 8]
    with pytest.raises(ProtocolError, match="prompt_logprobs"):
        protocol.decode(protocol.encode(Tokens(rid="r", ids=[7], num_prompt_tokens=2, prompt_logprobs=entries)))


def test_prompt_logprobs_under_tensor_parallelism(tiny_llama, make_engine):
    """The prompt rows go to every rank with the step's inputs (the vocab-parallel LM head needs them all)."""
    engine = make_engine(tiny_llama, tensor_parallel_size=2, device="cpu", max_num_batched_tokens=16,
                         enable_chunked_prefill=True)
    ids = make_prompts([40], seed=6)[0]
    done = _run(engine, {"tp": (ids, SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=2))})
    _check(done["tp"].prompt_logprobs, ids, _reference(tiny_llama, ids), 2)
