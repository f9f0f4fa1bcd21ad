"""The batched sampler keeps per-request semantics (property tests): penalties computed for the whole batch at once
equal the per-row definition bitwise, and a seeded row draws the same token whatever batch it is sampled in
(the whole-batch path, the greedy/random split, and alone)."""

from __future__ import annotations

from collections import Counter

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pdcluster.control.sampling_params import SamplingParams
from pdcluster.engine.sampler import Sampler, SampleRequest, apply_penalties, filter_probs


def penalties_reference(x: torch.Tensor, rows: list[int], requests: list[SampleRequest]) -> None:
    """The definition, one row and one token at a time (the sampler's earlier per-row code)."""
    vocab = x.shape[1]
    for row, r in zip(rows, requests, strict=True):
        p = r.params
        counts = Counter(r.output_ids)
        ids = set(r.prompt_ids).union(counts) if p.repetition_penalty != 1.0 else set(counts)
        for t in (t for t in ids if 0 <= t < vocab):
            v = x[row, t:t + 1]
            rep = torch.tensor([p.repetition_penalty])
            c = torch.tensor([float(counts.get(t, 0))])
            v = torch.where(v > 0, v / rep, v * rep)
            v = v - torch.tensor([p.frequency_penalty]) * c - torch.tensor([p.presence_penalty]) * (c > 0).float()
            x[row, t] = v[0]


ids = st.lists(st.integers(-2, 40), max_size=12)
penalty_params = st.builds(
    SamplingParams,
    repetition_penalty=st.sampled_from([1.0, 0.7, 1.3, 2.0]),
    frequency_penalty=st.sampled_from([0.0, 0.5, -0.4]),
    presence_penalty=st.sampled_from([0.0, 0.25, -1.0]),
)


@settings(max_examples=60, deadline=None)
@given(rows=st.lists(st.tuples(penalty_params, ids, ids), min_size=1, max_size=5), vocab=st.integers(3, 36),
       seed=st.integers(0, 1000))
def test_batched_penalties_equal_the_per_row_definition(rows, vocab, seed):
    x = torch.randn(len(rows) + 1, vocab, generator=torch.Generator().manual_seed(seed)) * 3
    requests = [SampleRequest(p, prompt, out) for p, prompt, out in rows]
    targets = list(range(1, len(rows) + 1))[::-1]   # rows of x need not be the requests' order
    got, want = x.clone(), x.clone()
    apply_penalties(got, targets, requests)
    penalties_reference(want, targets, requests)
    assert torch.equal(got, want)


sample_params = st.builds(
    SamplingParams,
    temperature=st.sampled_from([0.0, 0.5, 1.0, 1.7]),
    top_k=st.sampled_from([0, 1, 3, 20]),
    top_p=st.sampled_from([1.0, 0.9, 0.3]),
    min_p=st.sampled_from([0.0, 0.1]),
    repetition_penalty=st.sampled_from([1.0, 1.2]),
    frequency_penalty=st.sampled_from([0.0, 0.3]),
    min_tokens=st.sampled_from([0, 3]),
    seed=st.integers(0, 2**31),
)


@settings(max_examples=40, deadline=None)
@given(params=st.lists(sample_params, min_size=1, max_size=6), outputs=st.lists(ids, min_size=6, max_size=6),
       seed=st.integers(0, 1000), bf16=st.booleans())
def test_seeded_rows_draw_the_same_token_in_any_batch(params, outputs, seed, bf16):
    vocab = 41
    logits = torch.randn(len(params), vocab, generator=torch.Generator().manual_seed(seed)) * 2
    if bf16:
        logits = logits.bfloat16()
    requests = [SampleRequest(p, [1, 2, 3], outputs[i], eos_token_ids=[0]) for i, p in enumerate(params)]
    together, _ = Sampler(seed=1)(logits, requests)
    alone = [Sampler(seed=2)(logits[i:i + 1], [r])[0][0] for i, r in enumerate(requests)]
    reversed_batch, _ = Sampler(seed=3)(logits.flip(0), requests[::-1])
    assert together == alone == reversed_batch[::-1]


def test_candidate_draw_equals_the_full_row_draw():
    """A top-k / top-p row alone is drawn over its candidates only (filter_probs returns them); next to a row
    without a cut the whole batch takes the full-vocabulary cumsum. Same token for every seed."""
    vocab = 3000
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(7)) * 4
    free = SampleRequest(SamplingParams(temperature=1.0, seed=0), [1], [])
    probs = logits.softmax(-1)
    assert filter_probs(probs.clone(), [SamplingParams(top_k=40)]) is not None
    assert filter_probs(torch.cat([probs, probs]), [SamplingParams(top_k=40), free.params]) is None
    for kw in (dict(top_k=40), dict(top_p=0.8), dict(top_k=100, top_p=0.5, min_p=0.01)):
        for seed in range(100):
            r = SampleRequest(SamplingParams(temperature=0.9, seed=seed, **kw), [1], [2])
            alone = Sampler()(logits, [r])[0]
            in_batch = Sampler()(torch.cat([logits, logits]), [r, free])[0][:1]
            assert alone == in_batch, (kw, seed)
