"""Batched token sampler: penalties, logit_bias, min_tokens masking, temperature, top-k / top-p / min-p, logprobs.

A row is sampled by inverse-CDF: one uniform number u per row picks the token whose cumulative
probability interval (in token-id order) contains u. For a seeded request u is a pure function of
(seed, position), so the token drawn at a position is the same whatever the batch, the device or
the node that samples it (docs/design.md §3); unseeded rows draw u from the sampler's own generator.
One number per row instead of V noise values keeps the sampler cheap on CPUs (B=256, V=32000).
The batch is handled in tensor ops, not per row: penalties through flat (row, token) keys, and on CPU
top-k / top-p rows take their cumulative sums over their surviving candidates only (the same sums, so
the same token; docs/benchmarks.md, "Engine speed (#13)").
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from itertools import chain
from typing import Any

import torch

from pdcluster.control.sampling_params import SamplingParams

# Below this temperature a row is sampled greedily, as in vLLM: logits / T would overflow.
MIN_TEMPERATURE = 1e-5
# top-p rows first look for their nucleus among this many most likely tokens; a full sort of the
# row happens only when the nucleus is larger.
TOP_P_CANDIDATES = 256
_MASK64 = (1 << 64) - 1
_LARGEST_FLOAT32_BELOW_ONE = 1.0 - 2.0 ** -24

Logprobs = tuple[float, list[tuple[int, float]]]


@dataclass(slots=True)
class SampleRequest:
    params: SamplingParams
    prompt_ids: list[int]
    output_ids: list[int]
    eos_token_ids: list[int] = field(default_factory=list)
    grammar: Any = None   # structured output (engine/structured_output.Grammar): masks the row's next tokens
    drafts: list[int] = field(default_factory=list)   # the tail of output_ids that are drafts the grammar has not seen

    @property
    def position(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def masked_ids(self) -> list[int]:
        """Token ids that may not be sampled yet because min_tokens is not reached."""
        if len(self.output_ids) >= self.params.min_tokens:
            return []
        if self.grammar is not None:   # the grammar decides where EOS may come: masking it could leave no token
            return [t for t in self.params.stop_token_ids if t not in self.eos_token_ids]
        return list(self.eos_token_ids) + list(self.params.stop_token_ids)


def seeded_uniform(seed: int, position: int) -> float:
    """A number in [0, 1) that is a pure function of (request seed, token position) (splitmix64)."""
    z = (seed * 0x9E3779B97F4A7C15 + position * 0xD1B54A32D192ED03 + 0x94D049BB133111EB) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    z ^= z >> 31
    return (z >> 11) / float(1 << 53)


def _is_greedy(p: SamplingParams) -> bool:
    return p.temperature < MIN_TEMPERATURE or p.top_k == 1


class Sampler:
    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)   # for unseeded requests
        self.bitmask: Any = None   # engine/structured_output.BitmaskBuffer, set by the engine with its first grammar

    def __call__(self, logits: torch.Tensor,
                 requests: list[SampleRequest]) -> tuple[list[int], list[Logprobs | None]]:
        if logits.dim() != 2 or logits.shape[0] != len(requests):
            raise ValueError(f"logits shape {tuple(logits.shape)} does not match {len(requests)} requests")
        if self.bitmask is not None and any(r.grammar is not None for r in requests):
            # Structured output first, as vLLM: what follows (logprobs included) sees the masked distribution.
            logits = logits.float()
            self.bitmask.apply(logits, [r.grammar for r in requests], [r.drafts for r in requests])
        plain_greedy = all(_is_greedy(r.params) and not r.params.has_penalties and r.params.logprobs is None
                           and not r.params.logit_bias
                           and len(r.output_ids) >= r.params.min_tokens for r in requests)
        if plain_greedy:  # max().indices: same first-maximum index as argmax, faster on CPU bf16 (docs/benchmarks.md)
            return logits.max(dim=-1).indices.tolist(), [None] * len(requests)
        return self._sample(logits, requests)

    def _sample(self, logits: torch.Tensor,
                requests: list[SampleRequest]) -> tuple[list[int], list[Logprobs | None]]:
        device = logits.device
        x = logits.to(torch.float32, copy=True)
        lp_tops = {i: r.params.logprobs for i, r in enumerate(requests) if r.params.logprobs is not None}
        lp_rows = list(lp_tops)
        raw_logprobs = torch.log_softmax(x[lp_rows], dim=-1) if lp_rows else None

        pen_rows = [i for i, r in enumerate(requests) if r.params.has_penalties]
        if pen_rows:
            apply_penalties(x, pen_rows, [requests[i] for i in pen_rows])
        _add_logit_bias(x, requests)
        _mask_min_tokens(x, requests)

        greedy_rows = [i for i, r in enumerate(requests) if _is_greedy(r.params)]
        random_rows = [i for i, r in enumerate(requests) if not _is_greedy(r.params)]
        if not random_rows:
            tokens = x.argmax(dim=-1)
        elif not greedy_rows:   # the whole batch samples: no row gathers, x itself is the work buffer
            tokens = self._sample_random(x, requests)
        else:
            tokens = torch.empty(len(requests), dtype=torch.long, device=device)
            idx = torch.tensor(greedy_rows, device=device)
            tokens[idx] = x[idx].argmax(dim=-1)
            idx = torch.tensor(random_rows, device=device)
            tokens[idx] = self._sample_random(x[idx], [requests[i] for i in random_rows])
        token_list = tokens.tolist()

        logprobs: list[Logprobs | None] = [None] * len(requests)
        if raw_logprobs is not None:   # some rows asked for logprobs
            entries = gather_logprobs(raw_logprobs, [token_list[i] for i in lp_rows], list(lp_tops.values()))
            for i, entry in zip(lp_rows, entries, strict=True):
                logprobs[i] = entry
        return token_list, logprobs

    def _sample_random(self, x: torch.Tensor, requests: list[SampleRequest]) -> torch.Tensor:
        """x: fp32 logits, one row per request; overwritten."""
        device = x.device
        params = [r.params for r in requests]
        temps = torch.tensor([p.temperature for p in params], device=device).unsqueeze(1)
        probs = x.div_(temps).softmax(dim=-1)
        candidates = filter_probs(probs, params)

        us = [seeded_uniform(r.params.seed, r.position) if r.params.seed is not None else self._rng.random()
              for r in requests]
        u = torch.tensor([min(v, _LARGEST_FLOAT32_BELOW_ONE) for v in us], device=device).unsqueeze(1)
        vocab = x.shape[1]
        if candidates is not None and device.type != "cpu":
            candidates = None   # a device cumsum is a parallel scan: its sums depend on the columns it covers
        if candidates is not None:
            # Only the candidates can be picked: their cumulative sums in id order are the full row's at
            # their ids (the zeros between them add nothing; CPU cumsum accumulates in order, in double), so
            # the draw is the same token as over the whole row, for a cumsum over `width` columns, not the vocab.
            probs = probs.gather(1, candidates.clamp(max=vocab - 1)).masked_fill_(candidates == vocab, 0.0)
        cdf = probs.cumsum(dim=-1)
        # First token whose cumulative probability reaches u * total. The target is kept > 0 and
        # <= total, so a token with zero probability can never be picked.
        target = (u * cdf[:, -1:]).clamp_(min=torch.finfo(torch.float32).tiny)
        picked = torch.searchsorted(cdf, target).clamp_(max=cdf.shape[1] - 1)
        if candidates is not None:
            picked = candidates.gather(1, picked)
        return picked.squeeze(1).clamp_(max=vocab - 1)


def apply_penalties(x: torch.Tensor, rows: list[int], requests: list[SampleRequest]) -> None:
    """In place, vLLM semantics: repetition penalty over prompt+output tokens (divide positive logits,
    multiply negative ones), then frequency (per occurrence) and presence (once) over output tokens.
    Only the (row, token) entries that were seen are touched: every request's ids go into one flat tensor
    of keys row * vocab + id, and `unique` / `bincount` find the entries and their output counts for the
    whole batch at once (no per-token Python)."""
    vocab = x.shape[1]
    device = x.device
    params = [r.params for r in requests]
    out_ids = torch.tensor(list(chain.from_iterable(r.output_ids for r in requests)), dtype=torch.long)
    out_rows = torch.repeat_interleave(torch.arange(len(requests)),
                                       torch.tensor([len(r.output_ids) for r in requests], dtype=torch.long))
    rep_rows = [j for j, p in enumerate(params) if p.repetition_penalty != 1.0]   # these count prompt ids too
    prompt_ids = torch.tensor(list(chain.from_iterable(requests[j].prompt_ids for j in rep_rows)), dtype=torch.long)
    prompt_rows = torch.repeat_interleave(torch.tensor(rep_rows, dtype=torch.long),
                                          torch.tensor([len(requests[j].prompt_ids) for j in rep_rows],
                                                       dtype=torch.long))
    out_keys = (out_rows * vocab + out_ids)[(out_ids >= 0) & (out_ids < vocab)]
    prompt_keys = (prompt_rows * vocab + prompt_ids)[(prompt_ids >= 0) & (prompt_ids < vocab)]
    keys = torch.unique(torch.cat((out_keys, prompt_keys)))
    if keys.numel() == 0:
        return
    counts = torch.bincount(torch.searchsorted(keys, out_keys), minlength=keys.numel()).to(torch.float32)
    row = keys // vocab
    index = (torch.tensor(rows, dtype=torch.long)[row].to(device), (keys % vocab).to(device))
    rep = torch.tensor([p.repetition_penalty for p in params])[row].to(device)
    freq = torch.tensor([p.frequency_penalty for p in params])[row].to(device)
    pres = torch.tensor([p.presence_penalty for p in params])[row].to(device)
    count = counts.to(device)
    values = x[index]
    values = torch.where(values > 0, values / rep, values * rep)
    values = values - freq * count - pres * (count > 0).float()
    x[index] = values


def _add_logit_bias(x: torch.Tensor, requests: list[SampleRequest]) -> None:
    """In place: every request's logit_bias added to its row, for the whole batch in one index_put_ (ids
    outside the vocabulary are ignored; the engine refuses them at admission)."""
    rows: list[int] = []
    cols: list[int] = []
    values: list[float] = []
    vocab = x.shape[1]
    for i, r in enumerate(requests):
        bias = r.params.logit_bias
        if bias:
            for t, b in bias.items():
                if t < vocab:
                    rows.append(i)
                    cols.append(t)
                    values.append(b)
    if rows:
        device = x.device
        x.index_put_((torch.tensor(rows, device=device), torch.tensor(cols, device=device)),
                     torch.tensor(values, dtype=x.dtype, device=device), accumulate=True)


def _mask_min_tokens(x: torch.Tensor, requests: list[SampleRequest]) -> None:
    rows: list[int] = []
    cols: list[int] = []
    vocab = x.shape[1]
    for i, r in enumerate(requests):
        for t in r.masked_ids():
            if 0 <= t < vocab:
                rows.append(i)
                cols.append(t)
    if rows:
        x[torch.tensor(rows, device=x.device), torch.tensor(cols, device=x.device)] = -math.inf


def filter_probs(probs: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor | None:
    """In place: zero the probabilities outside top-k, then top-p (on the top-k renormalised
    distribution), then min-p. probs need not be renormalised afterwards (sampling scales u).
    Each filter is a per-row probability cutoff, so tokens tied with the cutoff survive (as in
    transformers' top-k warper); only rows with top-k or top-p pay for a (partial) sort.
    Returns, when every row's survivors are among its top candidates (every row has top-k or a top-p
    nucleus found among them, and no tie at the cutoff reaches past them), the surviving candidates' token
    ids, ascending per row, padded with `vocab` ([n, width]); else None."""
    device = probs.device
    vocab = probs.shape[1]
    threshold = torch.zeros(len(params), 1, device=device)

    cut_rows = [j for j, p in enumerate(params) if p.top_k > 0 or p.top_p < 1.0]
    every_row = len(cut_rows) == len(params)
    unresolved: list[int] = []
    if cut_rows:
        sub = probs if every_row else probs[cut_rows]   # no copy when every row cuts
        ks = [min(params[j].top_k, vocab) if params[j].top_k > 0 else 0 for j in cut_rows]
        top_ps = [params[j].top_p for j in cut_rows]
        # One column past the widest top-k: below the cutoff, unless tied with it (see the return value).
        width = min(vocab, max(k if k > 0 else TOP_P_CANDIDATES for k in ks) + 1)
        values, candidates = torch.topk(sub, width, dim=-1)
        cut, resolved = _nucleus_cutoff(values, ks, top_ps)
        unresolved = [n for n, ok in enumerate(resolved.tolist()) if not ok]
        if unresolved and width < vocab:   # nucleus wider than the candidates: sort those rows in full
            full = torch.sort(sub[unresolved], dim=-1, descending=True).values
            cut[unresolved] = _nucleus_cutoff(full, [ks[n] for n in unresolved], [top_ps[n] for n in unresolved])[0]
        threshold[cut_rows] = cut

    minp_rows = [j for j, p in enumerate(params) if p.min_p > 0.0]
    if minp_rows:
        min_p = torch.tensor([params[j].min_p for j in minp_rows], device=device).unsqueeze(1)
        cut = probs[minp_rows].max(dim=-1, keepdim=True).values * min_p
        threshold[minp_rows] = torch.maximum(threshold[minp_rows], cut)

    if not (cut_rows or minp_rows):
        return None
    probs.masked_fill_(probs < threshold, 0.0)
    # The tokens outside the candidates are at most as likely as the last candidate: all dropped if it is.
    if not every_row or unresolved or not bool((values[:, -1:] < threshold).all()):
        return None
    return candidates.masked_fill_(values < threshold, vocab).sort(dim=-1).values


def _nucleus_cutoff(values: torch.Tensor, ks: list[int],
                    top_ps: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """values: each row's most likely probabilities, sorted descending. Returns the smallest
    probability a token may have to survive top-k then top-p, [n, 1], and whether the candidate
    columns sufficed to decide it."""
    device = values.device
    n, width = values.shape
    has_k = torch.tensor([k > 0 for k in ks], device=device).unsqueeze(1)
    k = torch.tensor([k if k > 0 else width for k in ks], device=device).unsqueeze(1)
    top_p = torch.tensor([p if p < 1.0 else math.inf for p in top_ps], device=device).unsqueeze(1)
    ranks = torch.arange(width, device=device).unsqueeze(0)
    in_k = ranks < k
    v = values.masked_fill(~in_k, 0.0)
    csum = v.cumsum(dim=-1)
    # Rows with top-k renormalise over their k tokens; others keep the full distribution (sums to 1).
    norm = torch.where(has_k, csum.gather(1, k - 1), torch.ones_like(top_p))
    mass_before = (csum - v) / norm
    keep = (mass_before <= top_p) & in_k
    last = keep.sum(dim=-1, keepdim=True) - 1
    cutoff = values.gather(1, last)
    # Without top-k the cut is decided only if some candidate fell outside the nucleus.
    resolved = has_k.squeeze(1) | (last.squeeze(1) < width - 1)
    return cutoff, resolved


def gather_logprobs(raw: torch.Tensor, tokens: list[int], tops: list[int]) -> list[Logprobs]:
    device = raw.device
    sampled = raw.gather(1, torch.tensor(tokens, device=device).unsqueeze(1)).squeeze(1).tolist()
    max_top = max(tops)
    top_values: list[list[float]] = []
    top_ids: list[list[int]] = []
    if max_top > 0:
        values, ids = torch.topk(raw, max_top, dim=-1)
        top_values, top_ids = values.tolist(), ids.tolist()
    out: list[Logprobs] = []
    for j, n in enumerate(tops):
        top = list(zip(top_ids[j][:n], top_values[j][:n], strict=True)) if n > 0 else []
        out.append((sampled[j], top))
    return out
