"""Structured output (vLLM's `structured_outputs`): grammars compiled with xgrammar off the engine thread, one
matcher per request, and the token bitmask the sampler applies to the whole batch.

A request with `params.structured_outputs` gets a `Grammar` at admission: its compile runs on a small thread
pool (the engine thread never waits for it; the scheduler parks the request WAITING_FOR_GRAMMAR until it is
ready). Compiled grammars are cached by xgrammar's compiler, one per engine, so by (tokenizer, grammar), within
CACHE_LIMIT_BYTES. Once compiled, the matcher accepts every output token so far (a migrated request's resumed
tokens, a remote prefill's first token) and then each sampled one; EOS is allowed only where the grammar may
end, and the request finishes when the matcher terminates.

JSON is generated compact (no free whitespace between tokens, `any_whitespace=False`): a small model sampling
at a high temperature would otherwise spend its tokens on whitespace.
"""

from __future__ import annotations

import json
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

import torch
import xgrammar as xgr

COMPILE_THREADS = 2
CACHE_LIMIT_BYTES = 256 << 20    # compiled grammars kept per engine (xgrammar's cache, least recently used out)
GRAMMAR_WAIT_S = 60.0            # the longest a remote prefill's landing waits for a grammar still compiling


def grammar_source(spec: dict[str, Any]) -> tuple[str, str]:
    """(kind, text) of a validated `structured_outputs` dict: what the compiler gets and the cache key."""
    (kind, value), = ((k, v) for k, v in spec.items() if k != "after")
    if kind == "json":
        return kind, value if isinstance(value, str) else json.dumps(value, sort_keys=True)
    if kind == "json_object":
        return kind, ""
    if kind == "choice":   # EBNF string literals are JSON-escaped strings
        return "grammar", "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in value)
    return kind, value


class GrammarCompiler:
    """One per engine: the tokenizer's vocabulary as xgrammar sees it (padded to the model's logits width, the
    padding never allowed) and a pool of compile threads."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: list[int]) -> None:
        self.vocab_size = vocab_size
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=eos_token_ids)
        self._compiler = xgr.GrammarCompiler(info, max_threads=COMPILE_THREADS, cache_limit_bytes=CACHE_LIMIT_BYTES)
        self._pool = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="grammar")

    def submit(self, spec: dict[str, Any]) -> Future:
        """Compile on the pool; the future's result is an xgrammar CompiledGrammar, its exception a ValueError
        naming the field."""
        return self._pool.submit(self.compile, spec)

    def compile(self, spec: dict[str, Any]) -> xgr.CompiledGrammar:
        kind, text = grammar_source(spec)
        try:
            if kind == "json":
                return self._compiler.compile_json_schema(text, any_whitespace=False)
            if kind == "json_object":   # any JSON object (xgrammar's builtin JSON grammar also allows arrays etc.)
                return self._compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
            if kind == "regex":
                return self._compiler.compile_regex(text)
            return self._compiler.compile_grammar(text)
        except Exception as exc:   # xgrammar raises RuntimeError / ValueError / InvalidJSONError for bad input
            field = next(k for k in spec if k != "after")
            raise ValueError(f"structured_outputs.{field}: cannot compile: {str(exc).strip()[:500]}") from exc

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class Grammar:
    """A request's grammar: its compile future, then its matcher. Owned by the request's Sequence (engine
    thread), which feeds it every output token. With `after` (a reasoning model's end-of-thinking token ids),
    the grammar is open: no mask, no matching, until the output has contained `after`; it holds from the next
    token on, so only the answer follows it."""

    def __init__(self, future: Future, after: list[int] | None = None) -> None:
        self._future = future
        self.matcher: xgr.GrammarMatcher | None = None
        self._pending: list[int] = []   # tokens accepted before the compile finished
        self._after = list(after or [])
        self._recent: list[int] = []    # the last len(after) tokens while the grammar is open

    @property
    def open(self) -> bool:
        """Still before `after`: the output is free (the sampler masks nothing)."""
        return bool(self._after)

    @property
    def ready(self) -> bool:
        return self._future.done()

    def wait(self, timeout: float) -> None:
        """Block up to `timeout` for the compile (an engine with nothing else to do, instead of spinning)."""
        wait([self._future], timeout)

    def error(self) -> str | None:
        """The compile error, once the compile is done (None if it worked or is still running)."""
        if not self._future.done():
            return None
        exc = self._future.exception()
        return None if exc is None else str(exc)

    def matcher_now(self, timeout: float = GRAMMAR_WAIT_S) -> xgr.GrammarMatcher:
        """The matcher, waiting up to `timeout` for the compile (raises its ValueError, or TimeoutError)."""
        if self.matcher is None:
            self.matcher = xgr.GrammarMatcher(self._future.result(timeout))
            for token in self._pending:
                self._accept(token)
            self._pending.clear()
        return self.matcher

    def accept(self, token: int) -> None:
        self._advance(token)

    def _advance(self, token: int) -> int:
        """Accept `token`; how many tokens the matcher took (0 while open, pending or terminated, else 1)."""
        if self._after:
            self._recent = (self._recent + [token])[-len(self._after):]
            if self._recent == self._after:
                self._after = []
            return 0
        if self.matcher is None and not self._future.done():
            self._pending.append(token)
            return 0
        return self._accept_with(self.matcher_now(), token)

    def _accept(self, token: int) -> None:
        assert self.matcher is not None
        self._accept_with(self.matcher, token)

    @staticmethod
    def _accept_with(matcher: xgr.GrammarMatcher, token: int) -> int:
        if matcher.is_terminated():
            return 0
        if not matcher.accept_token(token):
            # only after a sampler bug, or resumed tokens that never obeyed this grammar
            raise ValueError(f"structured_outputs: token {token} does not follow the grammar")
        return 1

    # ---- speculative decoding: drafts are tried on the matcher and rolled back ----------------------------

    def valid_drafts(self, drafts: list[int]) -> int:
        """How many leading `drafts` the grammar allows (none past its end). The matcher is left as it was."""
        saved, taken, valid = (self._after, self._recent), 0, 0
        try:
            for token in drafts:
                if not self._after:
                    matcher = self.matcher_now()
                    if matcher.is_terminated() or not matcher.accept_token(token):
                        break
                    taken += 1
                else:
                    self._advance(token)
                valid += 1
            return valid
        finally:
            self._restore(saved, taken)

    def fill_after(self, mask: torch.Tensor, row: int, drafts: list[int]) -> bool:
        """Fill `mask[row]` with the tokens allowed after the (valid) `drafts`; False, filling nothing, when the
        grammar is still open after them. The matcher is left as it was."""
        saved, taken = (self._after, self._recent), 0
        try:
            for token in drafts:
                taken += self._advance(token)
            if self._after:
                return False
            self.matcher_now().fill_next_token_bitmask(mask, row)
            return True
        finally:
            self._restore(saved, taken)

    def _restore(self, saved: tuple[list[int], list[int]], taken: int) -> None:
        if taken:
            assert self.matcher is not None
            self.matcher.rollback(taken)
        self._after, self._recent = saved

    @property
    def terminated(self) -> bool:
        return self.matcher is not None and self.matcher.is_terminated()


class BitmaskBuffer:
    """One reusable [rows, vocab/32] int32 bitmask for the sampler (grown as batches grow)."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._mask = xgr.allocate_token_bitmask(1, vocab_size)

    def apply(self, logits: torch.Tensor, grammars: list[Grammar | None],
              drafts: list[list[int]] | None = None) -> None:
        """Mask, in place and in one op over the batch, every token the row's grammar does not allow next (after
        the row's `drafts`, when given: speculative decoding scores a sequence's drafts in consecutive rows).
        `logits` [rows, V'] (V' may be smaller or larger than the tokenizer's vocabulary)."""
        if all(g is None for g in grammars):
            return
        if self._mask.shape[0] < len(grammars):
            self._mask = xgr.allocate_token_bitmask(len(grammars), self.vocab_size)
        mask = self._mask[:len(grammars)]
        rows: list[int] = []
        for i, g in enumerate(grammars):
            if g is None:
                continue
            if drafts and drafts[i]:
                if g.fill_after(mask, i, drafts[i]):
                    rows.append(i)
            elif not g.open:
                g.matcher_now().fill_next_token_bitmask(mask, i)
                rows.append(i)
        if not rows:
            return
        width = min(logits.shape[1], self.vocab_size)
        if logits.device.type != "cpu":
            mask = mask.to(logits.device, non_blocking=True)
        xgr.apply_token_bitmask_inplace(logits, mask, vocab_size=width, indices=rows)
        if logits.shape[1] > width:   # model logits wider than the grammar's vocabulary: the padding is never allowed
            logits[rows, width:] = -torch.inf
