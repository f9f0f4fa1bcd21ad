import math
from itertools import pairwise

import pytest
import torch

from pdcluster.control.sampling_params import SamplingParams
from pdcluster.engine.sampler import Sampler, SampleRequest, apply_penalties, filter_probs, seeded_uniform


def req(prompt=(1, 2, 3), output=(), eos=(), **kw) -> SampleRequest:
    return SampleRequest(SamplingParams(**kw), list(prompt), list(output), list(eos))


def rows(logits_row: torch.Tensor, n: int) -> torch.Tensor:
    return logits_row.unsqueeze(0).expand(n, -1).contiguous()


def test_greedy_is_argmax_fp32_and_bf16():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(16, 500, generator=g)
    expected = logits.argmax(-1).tolist()
    sampler = Sampler(seed=0)
    tokens, logprobs = sampler(logits, [req(temperature=0.0) for _ in range(16)])
    assert tokens == expected and logprobs == [None] * 16
    tokens, _ = sampler(logits.bfloat16(), [req(temperature=0.0) for _ in range(16)])
    assert tokens == logits.bfloat16().argmax(-1).tolist()
    # the general path (logprobs requested) agrees with the fast path
    tokens, logprobs = sampler(logits, [req(temperature=0.0, logprobs=0) for _ in range(16)])
    assert tokens == expected and all(lp is not None for lp in logprobs)


def test_top_k_1_and_tiny_temperature_are_greedy():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(64, 300, generator=g)
    expected = logits.argmax(-1).tolist()
    sampler = Sampler(seed=1)
    assert sampler(logits, [req(top_k=1, temperature=5.0) for _ in range(64)])[0] == expected
    assert sampler(logits, [req(temperature=1e-6) for _ in range(64)])[0] == expected


@pytest.mark.slow
def test_temperature_to_zero_limit():
    logits = torch.tensor([1.0, 3.0, 2.5, -1.0, 2.9])
    sampler = Sampler(seed=2)
    tokens, _ = sampler(rows(logits, 2000), [req(temperature=1e-3) for _ in range(2000)])
    assert set(tokens) == {1}
    tokens, _ = sampler(rows(logits, 2000), [req(temperature=1.0) for _ in range(2000)])
    assert len(set(tokens)) == 5     # at T=1 the same logits spread over every token


def allowed_reference(logits: torch.Tensor, p: SamplingParams) -> set[int]:
    """Full-sort reference for top-k, then top-p on the renormalised top-k set, then min-p."""
    probs = (logits.double() / p.temperature).softmax(-1)
    order = torch.argsort(probs, descending=True).tolist()
    if p.top_k > 0:
        order = order[:p.top_k]
    total = sum(probs[t].item() for t in order)
    keep, before = [], 0.0
    for t in order:
        if before / total > p.top_p + 1e-9 and keep:
            break
        keep.append(t)
        before += probs[t].item()
    pmax = probs[order[0]].item()
    return {t for t in keep if probs[t].item() >= p.min_p * pmax - 1e-12}


@pytest.mark.parametrize("kw", [
    dict(top_k=5), dict(top_k=40, temperature=0.7), dict(top_p=0.5), dict(top_p=0.9, temperature=1.5),
    dict(top_p=0.3, top_k=20), dict(min_p=0.2), dict(min_p=0.05, top_p=0.8), dict(top_k=7, min_p=0.3),
])
def test_filters_match_full_sort_reference(kw):
    # 1000 tokens with a spread-out distribution: top_p=0.9 needs a nucleus wider than the
    # 256 candidates, so the full-sort fallback is exercised too.
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 1000, generator=g) * torch.tensor([0.5, 1.0, 2.0, 3.0, 5.0, 8.0]).unsqueeze(1)
    p = SamplingParams(**kw)
    probs = (logits / p.temperature).softmax(-1)
    filter_probs(probs, [p] * 6)
    for row in range(6):
        assert set(probs[row].nonzero().flatten().tolist()) == allowed_reference(logits[row], p), row


@pytest.mark.parametrize("kw", [dict(top_k=3), dict(top_p=0.6), dict(min_p=0.25), dict(top_k=4, top_p=0.7)])
def test_draws_stay_inside_the_allowed_set(kw):
    probs = torch.tensor([0.30, 0.25, 0.20, 0.10, 0.06, 0.05, 0.03, 0.01])
    logits = probs.log()
    p = SamplingParams(**kw)
    allowed = allowed_reference(logits, p)
    assert 1 < len(allowed) < 8
    tokens, _ = Sampler(seed=4)(rows(logits, 3000), [req(**kw) for _ in range(3000)])
    assert set(tokens) == allowed


def test_extreme_uniform_values_never_pick_masked_tokens():
    class Fixed:
        def __init__(self, value):
            self.value = value

        def random(self):
            return self.value

    logits = torch.tensor([5.0, 1.0, 2.0, 3.0, 4.0, 0.0])   # top_k=3 keeps tokens 0, 3, 4
    sampler = Sampler()
    sampler._rng = Fixed(0.0)
    assert sampler(rows(logits, 1), [req(top_k=3)])[0] == [0]
    sampler._rng = Fixed(1.0 - 2.0 ** -53)
    assert sampler(rows(logits, 1), [req(top_k=3)])[0] == [4]


def test_seeded_row_is_independent_of_batch_and_sampler_instance():
    g = torch.Generator().manual_seed(5)
    vocab = 2000
    target = torch.randn(vocab, generator=g) * 2
    others = torch.randn(7, vocab, generator=g)
    kw = dict(seed=42, temperature=0.8, top_p=0.95)
    alone, together, fresh = [], [], []
    for step in range(20):
        r = req(prompt=range(10), output=range(step), **kw)
        alone.append(Sampler(seed=1)(rows(target, 1), [r])[0][0])
        batch = [req(temperature=0.0), req(top_k=5), r, req(seed=7, min_p=0.1), req(),
                 req(top_p=0.5, logprobs=3), req(repetition_penalty=1.3, output=[1, 2]), req(seed=42)]
        logits = torch.cat([others[:2], target.unsqueeze(0), others[2:]])
        together.append(Sampler(seed=2)(logits, batch)[0][2])
        fresh.append(Sampler()(rows(target, 1), [r])[0][0])
    assert alone == together == fresh
    assert len(set(alone)) > 10          # different positions draw differently


def test_seed_and_position_change_the_draw():
    logits = torch.zeros(1000)   # uniform over 1000 tokens
    sampler = Sampler()
    by_position = [sampler(rows(logits, 1), [req(prompt=range(p), seed=3)])[0][0] for p in range(1, 51)]
    by_seed = [sampler(rows(logits, 1), [req(seed=s)])[0][0] for s in range(50)]
    assert len(set(by_position)) > 40 and len(set(by_seed)) > 40
    assert seeded_uniform(3, 10) == seeded_uniform(3, 10) != seeded_uniform(3, 11)


def test_unseeded_rows_vary_between_calls():
    logits = torch.zeros(1, 1000)
    sampler = Sampler()
    assert len({sampler(logits, [req()])[0][0] for _ in range(30)}) > 20


def chi_square(tokens: list[int], probs: torch.Tensor) -> float:
    n = len(tokens)
    counts = torch.bincount(torch.tensor(tokens), minlength=probs.numel()).double()
    expected = probs.double() * n
    mask = expected > 0
    assert counts[~mask].sum() == 0
    return float(((counts[mask] - expected[mask]) ** 2 / expected[mask]).sum())


@pytest.mark.parametrize("temperature", [1.0, 0.6])
@pytest.mark.slow
def test_empirical_distribution_matches_softmax(temperature):
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.2])
    n = 20000
    # seeded requests (one seed per draw) make the test deterministic
    tokens, _ = Sampler()(rows(logits, n), [req(seed=s, temperature=temperature) for s in range(n)])
    stat = chi_square(tokens, (logits / temperature).softmax(-1))
    assert stat < 40, stat          # 7 degrees of freedom: p(stat > 24.3) = 0.001


@pytest.mark.slow
def test_empirical_distribution_with_top_k_renormalises():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.2])
    n = 20000
    tokens, _ = Sampler()(rows(logits, n), [req(seed=s + 10**6, top_k=3) for s in range(n)])
    expected = torch.zeros(8)
    expected[[0, 6, 1]] = logits[[0, 6, 1]].softmax(-1)
    assert chi_square(tokens, expected) < 30


def test_penalties_exact_values():
    x = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0],
                      [2.0, -1.0, 0.5, 3.0, -2.0]])
    r = req(prompt=[0, 1], output=[3, 3, 1], repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    only_freq = req(prompt=[0, 1], output=[3, 3, 1], frequency_penalty=1.0)
    apply_penalties(x, [0, 1], [r, only_freq])
    # token 0: prompt only -> 2/2; token 1: prompt+output once -> -1*2 - 0.5 - 0.25;
    # token 2 unseen; token 3: output twice -> 3/2 - 2*0.5 - 0.25; token 4 unseen
    assert torch.allclose(x[0], torch.tensor([1.0, -2.75, 0.5, 0.25, -2.0]))
    # frequency/presence ignore prompt tokens
    assert torch.allclose(x[1], torch.tensor([2.0, -2.0, 0.5, 1.0, -2.0]))


def test_penalties_change_the_greedy_choice_and_logprobs_stay_raw():
    logits = torch.tensor([[0.0, 1.0, 5.0, 4.5]])
    plain = Sampler()(logits, [req(prompt=[0], output=[2], temperature=0.0)])[0]
    penalised = req(prompt=[0], output=[2], temperature=0.0, repetition_penalty=1.5, logprobs=1)
    tokens, logprobs = Sampler()(logits, [penalised])
    assert plain == [2] and tokens == [3]
    raw = torch.log_softmax(logits[0], -1)
    assert logprobs[0][0] == pytest.approx(raw[3].item(), abs=1e-6)
    assert logprobs[0][1] == [(2, pytest.approx(raw[2].item(), abs=1e-6))]


def test_min_tokens_masks_eos_and_stop_ids():
    logits = torch.tensor([[0.0, 1.0, 9.0, 8.0, 3.0]])   # 2 = eos, 3 = stop id
    kw = dict(min_tokens=2, stop_token_ids=[3])
    s = Sampler()
    assert s(logits, [req(output=[], eos=[2], temperature=0.0, **kw)])[0] == [4]
    assert s(logits, [req(output=[1], eos=[2], temperature=0.0, **kw)])[0] == [4]
    assert s(logits, [req(output=[1, 1], eos=[2], temperature=0.0, **kw)])[0] == [2]
    # sampled rows too: eos/stop never drawn while masked
    tokens, _ = s(rows(logits[0], 500), [req(output=[], eos=[2], **kw) for _ in range(500)])
    assert not {2, 3} & set(tokens)


def test_logprobs_match_log_softmax_and_are_sorted():
    g = torch.Generator().manual_seed(6)
    logits = torch.randn(4, 100, generator=g) * 3
    reqs = [req(logprobs=5, temperature=0.7, top_k=10), req(logprobs=0), req(), req(logprobs=20, seed=1)]
    tokens, logprobs = Sampler()(logits, reqs)
    raw = torch.log_softmax(logits, -1)
    assert logprobs[2] is None
    assert logprobs[1][1] == []
    for i in (0, 1, 3):
        sampled, top = logprobs[i]
        assert sampled == pytest.approx(raw[i, tokens[i]].item(), abs=1e-5)
        n = reqs[i].params.logprobs
        assert len(top) == n
        assert [t for t, _ in top] == raw[i].topk(n).indices.tolist() if n else True
        assert all(a[1] >= b[1] for a, b in pairwise(top))
        for t, lp in top:
            assert lp == pytest.approx(raw[i, t].item(), abs=1e-5)


def test_bf16_logits_with_logprobs():
    logits = torch.tensor([[0.5, 2.0, -1.0, 1.0]]).bfloat16()
    tokens, logprobs = Sampler()(logits, [req(temperature=0.0, logprobs=2)])
    assert tokens == [1]
    raw = torch.log_softmax(logits.float(), -1)[0]
    assert logprobs[0][0] == pytest.approx(raw[1].item(), abs=1e-5)
    assert [t for t, _ in logprobs[0][1]] == [1, 3]


def test_shape_mismatch_is_an_error():
    with pytest.raises(ValueError):
        Sampler()(torch.zeros(2, 10), [req()])
    assert math.isfinite(seeded_uniform(2**70, 0)) and 0 <= seeded_uniform(-5, 3) < 1
