"""logit_bias (OpenAI semantics) in the batched sampler: the bias is added to the row's logits before
sampling, composing with greedy, temperature, top-k/p, penalties and seeds; logprobs stay the model's."""

from __future__ import annotations

import pytest
import torch

from pdcluster.control.sampling_params import SamplingParams
from pdcluster.engine.sampler import Sampler, SampleRequest

VOCAB = 300


def req(bias=None, output=(), **kw) -> SampleRequest:
    return SampleRequest(SamplingParams(logit_bias=bias, **kw), [1, 2, 3], list(output), [])


def logits(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_follows_the_bias():
    x = logits(8)
    top = x.argmax(-1).tolist()
    sampler = Sampler(seed=0)
    banned, _ = sampler(x, [req({top[i]: -100}, temperature=0.0) for i in range(8)])
    assert banned == x.scatter(1, torch.tensor(top).unsqueeze(1), -1e9).argmax(-1).tolist()
    forced, _ = sampler(x, [req({"7": 100}, temperature=0.0) for _ in range(8)])
    assert forced == [7] * 8


@pytest.mark.parametrize("kw", [dict(temperature=0.8), dict(temperature=1.2, top_k=20, top_p=0.9),
                                dict(temperature=0.7, min_p=0.05, repetition_penalty=1.3, frequency_penalty=0.5)])
def test_seeded_draw_equals_the_draw_on_pre_biased_logits(kw):
    """A seeded row with a bias draws exactly what the same row draws unbiased from logits + bias: the bias is
    one more additive term, applied in one batched op, whatever the other rows do."""
    x = logits(16, seed=1)
    g = torch.Generator().manual_seed(2)
    biases = [{int(t): float(b) for t, b in zip(torch.randint(0, VOCAB, (5,), generator=g),
                                                torch.empty(5).uniform_(-8, 8, generator=g), strict=True)}
              for _ in range(16)]
    out = (4, 5, 4)
    biased = [req(biases[i] if i % 2 == 0 else None, output=out, seed=100 + i, **kw) for i in range(16)]
    got, _ = Sampler(seed=0)(x, biased)
    shifted = x.clone()
    for i in range(0, 16, 2):
        for t, b in biases[i].items():
            shifted[i, t] += b
    want, _ = Sampler(seed=0)(shifted, [req(None, output=out, seed=100 + i, **kw) for i in range(16)])
    assert got == want
    # unbiased rows draw as without any bias in the batch; the biases moved some draws (else this could not fail)
    plain, _ = Sampler(seed=0)(x, [req(None, output=out, seed=100 + i, **kw) for i in range(16)])
    assert plain[1::2] == got[1::2] and plain[::2] != got[::2]


def test_bias_changes_sampling_distribution_and_logprobs_stay_raw():
    x = torch.zeros(400, VOCAB)
    tokens, lps = Sampler(seed=3)(x, [req({9: 5.0}, temperature=1.0, logprobs=0) for _ in range(400)])
    share = tokens.count(9) / 400   # e^5 / (e^5 + 299) ≈ 0.33 against 1/300 unbiased
    assert 0.2 < share < 0.5
    uniform = -torch.log(torch.tensor(float(VOCAB))).item()
    assert all(lp[0] == pytest.approx(uniform, abs=1e-5) for lp in lps)


def test_ids_outside_the_vocabulary_are_ignored_by_the_sampler():
    x = logits(2)
    tokens, _ = Sampler(seed=0)(x, [req({VOCAB + 5: 100}, temperature=0.0) for _ in range(2)])
    assert tokens == x.argmax(-1).tolist()


@pytest.mark.parametrize("bad", [{"a": 1}, {"1": 100.5}, {"1": float("nan")}, {-1: 1}, [1, 2],
                                 {str(i): 1 for i in range(1025)}])
def test_sampling_params_refuse_bad_logit_bias(bad):
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias=bad)


def test_logit_bias_round_trips_the_wire_form():
    p = SamplingParams(logit_bias={"5": 2, 7: -100.0}, prompt_logprobs=3)
    assert p.logit_bias == {5: 2.0, 7: -100.0}
    d = p.to_dict()
    assert d["logit_bias"] == {"5": 2.0, "7": -100.0} and SamplingParams.from_dict(d) == p
    assert SamplingParams(logit_bias={}).logit_bias is None
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)
