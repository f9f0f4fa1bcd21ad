"""What the engine asks of a proposer, and the one that `speculative_config` names."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

    from pdcluster.engine.args import EngineArgs
    from pdcluster.engine.config import ModelConfig
    from pdcluster.engine.model_runner import ModelRunner
    from pdcluster.engine.sequence import Sequence


@dataclass
class StepView:
    """What `prepare_step` (engine/model_runner.py) reads of a sequence, for one forward pass of a drafter:
    tokens `num_computed_tokens..num_tokens` are run. `features`: a head's input features of those rows."""
    token_ids: list[int]
    num_computed_tokens: int
    block_table: list[int]
    features: Any = None
    spec_token_ids: list[int] = field(default_factory=list)
    needs_prompt_logprobs: bool = False

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


class Proposer(Protocol):
    # True: it writes its own KV at the draft positions, so the scheduler reserves their blocks first
    writes_kv: bool
    # True: it reads the target's hidden states of every computed token, so every running sequence is handed
    # to `propose` each step (limit 0 where it may not draft)
    follows_target: bool
    # True: drafting costs next to nothing, so it drafts the most it may and the draft policy picks from the drafts
    # made (it knows which sequences have any); False: the policy's counts are its limits
    drafts_cheaply: bool

    def kv_bytes_per_block(self, block_size: int) -> int:
        """Bytes of its own KV per block of the target's pool (the engine sizes the pool for both)."""
        ...

    def bind(self, num_blocks: int, block_size: int) -> None:
        """The target pool is made: its KV (if any) gets the same block count, indexed by the same block ids."""
        ...

    def propose(self, seqs: list[Sequence], limits: list[int]) -> list[list[int]]:
        """Up to `limits[i]` drafts for the positions after `seqs[i].token_ids` (greedy: one token each)."""
        ...


def make_proposer(args: EngineArgs, target: ModelConfig, tokenizer: Any, runner: ModelRunner, dtype: torch.dtype,
                  kv_dtype: torch.dtype, device: torch.device) -> Proposer | None:
    spec = args.speculative
    if spec is None:
        return None
    if spec.method == "ngram":
        from pdcluster.engine.speculative.ngram import NgramProposer

        return NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
    if spec.method in ("eagle", "eagle3", "mtp"):
        from pdcluster.engine.speculative.head_proposer import HeadProposer

        return HeadProposer(spec, args.model, target, runner, dtype, kv_dtype, device, args.attention_backend)
    from pdcluster.engine.speculative.draft_model import DraftModelProposer

    return DraftModelProposer(spec.model, target, tokenizer, dtype, kv_dtype, device, args.attention_backend,
                              args.seed)
