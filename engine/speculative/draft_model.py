"""Draft-model proposer: a smaller model with the target's tokenizer drafts k tokens greedily, one forward pass
per draft over every drafting sequence.

Its KV sits in a pool of its own with the target pool's block count and block size, addressed by the target
sequence's block table: the scheduler's allocation (and prefix sharing, and freeing) covers both, and the
engine sizes the two pools from one budget. What the draft KV of a sequence holds is kept on the sequence
(`proposer_state`: the first position not valid); a preempted sequence loses it (the scheduler resets it) and
is caught up from its first token, as is a new one, so a decode node rebuilds the draft KV of a prompt that a
prefill node computed. Draft KV only steers proposals: verification keeps the output the target's whatever the
draft attended to (a prefix block another sequence computed, rewritten by the same tokens)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pdcluster.engine.config import ModelConfig
from pdcluster.engine.kv_cache import KVCachePool, make_pool
from pdcluster.engine.loader import load_tokenizer
from pdcluster.engine.model_runner import ModelRunner
from pdcluster.engine.scheduler import ScheduledBatch
from pdcluster.engine.sequence import Sequence
from pdcluster.engine.speculative.proposer import StepView


@dataclass
class DraftState:
    """The draft KV of a sequence: valid below `valid`, and at `valid + j` for `drafts[j]` if those became its
    tokens (the drafts written in the last round)."""
    valid: int = 0
    drafts: list[int] = field(default_factory=list)

    def valid_for(self, token_ids: list[int]) -> int:
        n = self.valid
        for token in self.drafts:
            if n >= len(token_ids) or token_ids[n] != token:
                break
            n += 1
        return n


class DraftModelProposer:
    writes_kv = True
    follows_target = False
    drafts_cheaply = False

    def __init__(self, model_dir: str, target: ModelConfig, tokenizer, dtype: torch.dtype, kv_dtype: torch.dtype,
                 device: torch.device, attention_backend: str | None = None, seed: int = 0) -> None:
        self.config = ModelConfig.from_pretrained(model_dir)
        if load_tokenizer(model_dir).get_vocab() != tokenizer.get_vocab():
            raise ValueError(f"speculative_config.model: {model_dir} has another tokenizer than the target model "
                             "(a draft model must share its vocabulary)")
        self.target_vocab = target.vocab_size
        self.kv_dtype = kv_dtype
        self.device = device
        self.runner = ModelRunner(model_dir, self.config, dtype, device, attention_backend, seed)
        self.pool: KVCachePool | None = None

    def kv_bytes_per_block(self, block_size: int) -> int:
        return KVCachePool.bytes_per_block(self.config, block_size, self.kv_dtype)

    def bind(self, num_blocks: int, block_size: int) -> None:
        self.pool, _ = make_pool(self.config, block_size, self.kv_dtype, self.device, 1, lambda _: num_blocks)
        self.runner.bind_kv_pool(self.pool)

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], limits: list[int]) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in seqs]
        active = [i for i, k in enumerate(limits) if k > 0 and seqs[i].num_tokens < self.config.max_model_len]
        bs = self.runner.block_size
        # First pass: each sequence's tokens the draft KV lacks (its last one at least), then one draft per pass.
        views, counts = [], []
        for i in active:
            seq = seqs[i]
            state = seq.proposer_state if isinstance(seq.proposer_state, DraftState) else DraftState()
            start = min(max(state.valid_for(seq.token_ids), seq.num_freed_blocks * bs), seq.num_tokens - 1)
            views.append(StepView(seq.token_ids, start, seq.block_table))
            counts.append(seq.num_tokens - start)
        step = 0
        while active:
            tokens = self._greedy(views, counts)
            for i, token in zip(active, tokens, strict=True):
                drafts[i].append(token)
            step += 1
            keep = [n for n, i in enumerate(active)
                    if step < limits[i] and seqs[i].num_tokens + step < self.config.max_model_len]
            active = [active[n] for n in keep]
            views = [StepView(seqs[i].token_ids + drafts[i], seqs[i].num_tokens + step - 1, seqs[i].block_table)
                     for i in active]
            counts = [1] * len(active)
        for seq, d in zip(seqs, drafts, strict=True):
            if d:   # KV written below num_tokens, and for all drafts but the last
                seq.proposer_state = DraftState(seq.num_tokens, d[:-1])
        return drafts

    def _greedy(self, views: list[StepView], counts: list[int]) -> list[int]:
        inputs, sampled = self.runner.prepare(ScheduledBatch(views, counts))   # type: ignore[arg-type]
        logits = self.runner.execute(inputs)
        assert logits is not None and len(sampled) == len(views)
        order = {id(v): n for n, v in enumerate(sampled)}   # prepare reorders rows (decodes first)
        best = logits[:, :self.target_vocab].argmax(dim=-1).tolist()
        return [best[order[id(v)]] for v in views]
