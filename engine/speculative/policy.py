"""How many drafts each decoding sequence gets in a step: the counts that maximise the step's expected output
tokens per second (SmartSpec's "goodput", Liu et al. 2024, arXiv 2406.14066), from each sequence's measured
acceptance and the measured cost of a decode step by its rows.

A sequence with acceptance rate a that gets k drafts yields 1 + a + a^2 + ... + a^k tokens on average (its j-th
draft counts only if the ones before it passed), and costs k more rows. Every draft j of every sequence is a
candidate worth a^j tokens; taking candidates best first, the step's rate (tokens) / (cost of its rows) is
evaluated for every count, and the best count wins, none at all when no draft pays for its rows. On a device that
is idle at small batches rows are nearly free and every draft with some chance is taken; on a CPU, where each row
costs compute, a large batch keeps only the drafts likely to pass.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdcluster.engine.sequence import Sequence

DECAY = 0.8          # weight of a sequence's past verified steps per new one (the last few steps count most)
IDLE_DECAY = 0.9     # per step a sequence goes without drafts it could have had: back towards the batch's rate
PRIOR_WEIGHT = 2.0   # drafts' worth of the batch's rate a sequence's own estimate starts from
FIRST_RATE = 0.5     # the batch's rate before any draft was verified
COST_SAMPLES = 64    # recent step times the cost line is fitted to
FIT_EVERY = 8        # steps between refits of the cost line


@dataclass
class Acceptance:
    """A sequence's verified drafts, discounted by age: drafts accepted, and steps that rejected one (a step
    stops at its first rejection, so accepted / (accepted + rejected) estimates the chance that a draft passes
    given the ones before it did)."""
    accepted: float = 0.0
    rejected: float = 0.0

    def record(self, drafted: int, accepted: int) -> None:
        self.accepted = self.accepted * DECAY + accepted
        self.rejected = self.rejected * DECAY + (accepted < drafted)

    def forget(self, factor: float) -> None:
        self.accepted *= factor
        self.rejected *= factor

    def rate(self, prior: float) -> float:
        return (self.accepted + PRIOR_WEIGHT * prior) / (self.accepted + self.rejected + PRIOR_WEIGHT)


class StepCost:
    """Seconds of a decode step as a line in its rows, a + b * rows, fitted to the recent steps by Theil-Sen (the
    median of the slopes between every two steps of different rows, then the median intercept): a step that
    another process slowed moves a median little, and recent steps share the machine's current load. Until
    two row counts were seen, rows are taken as free (b = 0)."""

    def __init__(self) -> None:
        self.samples: deque[tuple[int, float]] = deque(maxlen=COST_SAMPLES)
        self.line = (0.0, 0.0)
        self._since_fit = 0

    def add(self, rows: int, seconds: float) -> None:
        self.samples.append((rows, seconds))
        self._since_fit += 1
        if self._since_fit >= FIT_EVERY or len(self.samples) < FIT_EVERY:
            self._fit()

    def seconds(self, rows: int) -> float:
        a, b = self.line
        return a + b * rows

    def _fit(self) -> None:
        self._since_fit = 0
        pts = list(self.samples)
        slopes = [(t2 - t1) / (r2 - r1) for i, (r1, t1) in enumerate(pts) for r2, t2 in pts[i + 1:] if r1 != r2]
        b = max(0.0, median(slopes)) if slopes else self.line[1]
        self.line = (max(0.0, median([t - b * r for r, t in pts])), b)


def median(values: list[float]) -> float:
    values = sorted(values)
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2


class DraftPolicy:
    """The engine's one decision of draft counts (`choose`, once per step, before the proposer drafts). It times
    the steps itself: from its call to the end of that step's forward pass and sampling (the drafting, scheduling
    and verification included), kept when the step only decoded (or verified drafts). `fixed`: every sequence
    gets all its caps, whatever they cost (speculative_config.draft_policy "fixed", vLLM's behaviour)."""

    def __init__(self, clock=time.perf_counter, fixed: bool = False) -> None:
        self.cost = StepCost()
        self.clock = clock
        self.fixed = fixed
        self._last: float | None = None

    def choose(self, seqs: list[Sequence], caps: list[int], last_step: tuple[int, float] | None = None,
               other_rows: int = 0) -> list[int]:
        """Drafts for each of `seqs` (the sequences that decode next step), at most `caps[i]`. `last_step`: the
        rows of the last step and the clock at its end, if it only decoded, else None; `other_rows`: rows of the
        next step that are not these sequences' (a running sequence that does not decode)."""
        if self._last is not None and last_step is not None and last_step[1] > self._last:
            self.cost.add(last_step[0], last_step[1] - self._last)
        self._last = self.clock()
        if self.fixed:
            return list(caps)
        counts = [0] * len(seqs)
        if not any(caps):
            return counts
        prior = batch_rate(seqs)
        gains: list[tuple[float, int]] = []   # (expected tokens of the candidate draft, its sequence)
        for i, (seq, cap) in enumerate(zip(seqs, caps, strict=True)):
            rate, worth = seq.spec_acceptance.rate(prior), 1.0
            for _ in range(cap):
                worth *= rate
                gains.append((worth, i))
        gains.sort(key=lambda g: -g[0])
        base = len(seqs) + other_rows
        tokens, best, take = float(base), base / max(self.cost.seconds(base), 1e-9), 0
        for m, (worth, _) in enumerate(gains, start=1):
            tokens += worth
            rate = tokens / max(self.cost.seconds(base + m), 1e-9)
            if rate > best:
                best, take = rate, m
        for _, i in gains[:take]:
            counts[i] += 1
        for seq, cap, k in zip(seqs, caps, counts, strict=True):
            if cap and not k:   # unmeasured while it goes without: drift back to the batch's rate, to be retried
                seq.spec_acceptance.forget(IDLE_DECAY)
        return counts


def batch_rate(seqs: list[Sequence]) -> float:
    """What a sequence without history of its own is expected to accept: the pooled rate of `seqs`."""
    accepted = sum(s.spec_acceptance.accepted for s in seqs)
    seen = accepted + sum(s.spec_acceptance.rejected for s in seqs)
    return (accepted + PRIOR_WEIGHT * FIRST_RATE) / (seen + PRIOR_WEIGHT)
