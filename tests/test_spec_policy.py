"""The draft policy (engine/speculative/policy.py) on its own: acceptance records, the step-cost line, and the draft
counts it chooses for given histories and costs (against a brute-force search of every choice)."""

from __future__ import annotations

import itertools
import random
from types import SimpleNamespace

import pytest

from pdcluster.engine.speculative.policy import FIRST_RATE, PRIOR_WEIGHT, Acceptance, DraftPolicy, StepCost, batch_rate


def seq(accepted: float = 0.0, rejected: float = 0.0) -> SimpleNamespace:
    return SimpleNamespace(spec_acceptance=Acceptance(accepted, rejected))


def policy(a: float, b: float) -> DraftPolicy:
    """A policy whose steps cost a + b * rows seconds (its own timing not used)."""
    p = DraftPolicy()
    p.cost.line = (a, b)
    return p


def test_acceptance_counts_drafts_passed_and_steps_stopped_by_a_rejection_recent_ones_most():
    acc = Acceptance()
    acc.record(3, 3)                      # every draft passed: no rejection seen
    assert (acc.accepted, acc.rejected) == (3, 0)
    acc.record(3, 1)                      # the second draft failed (the third was never judged)
    assert acc.accepted == pytest.approx(3 * 0.8 + 1) and acc.rejected == 1
    assert acc.rate(0.5) == pytest.approx((3.4 + PRIOR_WEIGHT * 0.5) / (4.4 + PRIOR_WEIGHT))
    assert Acceptance().rate(0.3) == pytest.approx(0.3)   # no history: the prior
    for _ in range(30):
        acc.record(3, 0)                  # a run of rejections outweighs the old passes
    assert acc.rate(0.5) < 0.15


def test_batch_rate_pools_the_sequences_records():
    assert batch_rate([]) == FIRST_RATE
    got = batch_rate([seq(9, 1), seq(0, 10)])
    assert got == pytest.approx((9 + PRIOR_WEIGHT * FIRST_RATE) / (20 + PRIOR_WEIGHT))


def test_step_cost_fits_a_line_that_an_outlier_hardly_moves():
    cost = StepCost()
    cost.add(8, 0.050)
    cost.add(8, 0.052)
    assert cost.line == pytest.approx((0.051, 0.0))          # one row count: rows are free
    for rows, seconds in [(32, 0.086), (8, 0.048), (32, 0.084), (20, 0.068), (32, 0.9), (8, 0.050), (32, 0.085)]:
        cost.add(rows, seconds)                              # 0.9: a step another process slowed
    a, b = cost.line
    assert b == pytest.approx(0.035 / 24, rel=0.05) and cost.seconds(8) == pytest.approx(0.050, rel=0.02)
    cost = StepCost()
    for _ in range(3):
        cost.add(4, 0.05)
        cost.add(1, 0.06)                                    # fewer rows slower (noise): never a negative slope
    assert cost.line[1] == 0.0


def test_with_free_rows_every_draft_with_a_chance_is_taken_and_caps_hold():
    seqs = [seq(5, 1), seq(0, 4), seq()]
    assert DraftPolicy().choose(seqs, [3, 2, 0]) == [3, 2, 0]   # no step timed yet: rows free
    assert policy(0.05, 0.0).choose(seqs, [1, 5, 2]) == [1, 5, 2]
    assert policy(0.05, 0.0).choose([seq(0, 50)], [3]) == [3]   # acceptance ~0 still > 0; free rows


def test_costly_rows_keep_only_the_drafts_likely_to_pass_and_none_when_nothing_pays():
    # rows cost 1.2 ms on a 45 ms step (SmolLM2 on 2 CPU cores at batch 8)
    p = policy(0.045, 0.0012)
    good, poor = seq(40, 2), seq(1, 10)
    counts = p.choose([good] * 4 + [poor] * 4, [3] * 8)
    assert counts[:4] == [3] * 4 and counts[4:] == [0] * 4
    # nothing pays: not one draft in the step
    assert p.choose([seq(0, 30) for _ in range(8)], [3] * 8) == [0] * 8


def test_one_sequence_left_drafts_what_a_full_batch_would_not():
    p = policy(0.045, 0.004)        # rows dear at batch 8, cheap next to a lone sequence's step
    assert p.choose([seq(3, 6) for _ in range(8)], [3] * 8) == [0] * 8
    assert p.choose([seq(3, 6)], [3]) == [2]   # (a rate ~0.34: a third draft no longer pays for its row)


def test_rows_of_sequences_that_do_not_decode_count_in_the_cost():
    p = policy(0.010, 0.002)
    s = seq(2, 4)
    assert p.choose([s], [3]) == [1]
    assert p.choose([s], [3], other_rows=40) == [0]   # the same gain, on a step whose rows already cost


def expected_rate(rates: list[float], counts: tuple[int, ...], a: float, b: float, other: int) -> float:
    tokens = len(rates) + other + sum(sum(r ** j for j in range(1, k + 1)) for r, k in zip(rates, counts, strict=True))
    return tokens / (a + b * (len(rates) + other + sum(counts)))


@pytest.mark.parametrize("trial", range(40))
def test_the_choice_maximises_expected_tokens_per_second(trial):
    """Against a brute-force search over every count within the caps, on random histories and costs."""
    rng = random.Random(trial)
    n = rng.randint(1, 4)
    seqs = [seq(rng.uniform(0, 20), rng.uniform(0, 8)) for _ in range(n)]
    caps = [rng.randint(0, 4) for _ in range(n)]
    a, b, other = rng.uniform(0.005, 0.1), rng.choice([0.0, rng.uniform(0, 0.01)]), rng.randint(0, 3)
    prior = batch_rate(seqs)
    rates = [s.spec_acceptance.rate(prior) for s in seqs]
    got = policy(a, b).choose(seqs, caps, other_rows=other)
    best = max(expected_rate(rates, c, a, b, other) for c in itertools.product(*(range(k + 1) for k in caps)))
    assert expected_rate(rates, tuple(got), a, b, other) == pytest.approx(best, rel=1e-9)


def test_a_sequence_left_without_drafts_drifts_back_to_the_batch_rate_and_is_tried_again():
    p = policy(0.045, 0.0012)
    others = [seq(30, 3) for _ in range(7)]
    poor = seq(0, 6)
    rounds = 0
    while p.choose(others + [poor], [3] * 8)[-1] == 0:
        rounds += 1
        assert rounds < 60
    assert rounds >= 5           # not at once: it stays out while its record is fresh


def test_the_policy_times_each_step_from_its_call_to_the_end_of_the_forward_pass_if_it_only_decoded():
    now = [10.0]
    p = DraftPolicy(clock=lambda: now[0])
    s = [seq(5, 1)]
    p.choose(s, [3], last_step=(4, 9.5))     # a step that ended before the first call: not timed
    # (rows, seconds of the step, whether it only decoded, seconds the engine then waited for work)
    for rows, seconds, decoded, idle in [(4, 0.040, True, 0.0), (7, 0.5, False, 0.0), (1, 0.036, True, 3.0),
                                         (4, 0.042, True, 0.0)]:
        now[0] += seconds
        end = now[0]
        now[0] += idle
        p.choose(s, [3], last_step=(rows, end) if decoded else None)
    p.choose(s, [3], last_step=(4, end))     # no step ran since the last call (its record is an older step's)
    # not the step that ran a prompt's chunk (None), and the wait after the lone-row step is not its cost
    assert list(p.cost.samples) == [(4, pytest.approx(0.040)), (1, pytest.approx(0.036)), (4, pytest.approx(0.042))]


def test_the_fixed_policy_gives_every_sequence_its_caps_whatever_rows_cost():
    p = DraftPolicy(fixed=True)
    p.cost.line = (0.01, 1.0)                     # rows so dear that goodput drafts nothing
    seqs = [seq(0, 50), seq(50, 0), seq()]
    assert p.choose(seqs, [3, 0, 2]) == [3, 0, 2]
    assert policy(0.01, 1.0).choose(seqs, [3, 0, 2]) == [0, 0, 0]
