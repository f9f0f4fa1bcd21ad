"""Request results (vLLM-shaped).

The engine's `step()` returns one `RequestOutput` per request that got a token, carrying that step's delta
(`new_token_ids`, `logprobs`, O(1) in the output length); the whole completion (`outputs[0]`: every token id,
logprob and the cumulative logprob) is built once, on the output that finishes the request. `LLM.generate`
and `AsyncLLMEngine.generate` return those finished outputs."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list | None            # per token: (sampled logprob, [(token id, logprob), ...top-N]) or None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | None = None    # the stop token id when a stop_token_ids entry ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]   # the whole completion, on the finished output only ([] before)
    finished: bool
    new_token_ids: list[int] = field(default_factory=list)
    logprobs: list | None = None      # entries for new_token_ids only
    finish_reason: str | None = None  # "stop" | "length" once finished
    num_cached_tokens: int = 0
    block_ids: list[int] | None = None   # set when the request was added with hold_blocks=True
    # params.prompt_logprobs: per prompt token (logprob, [(token id, logprob), ...top-N]), the first None;
    # on the request's first output and its finished one
    prompt_logprobs: list | None = None
    error: str | None = None          # set when it finished "abort" on its own (a structured output's grammar failed)
    # hold_blocks under a hidden-state head (EAGLE, EAGLE-3, MTP), on the finished output: (first position, dtype
    # name, raw rows) of the target's features of the prompt's last positions, for a decode node's head
    prompt_features: tuple[int, str, bytes] | None = None

    @property
    def text(self) -> str:
        return self.outputs[0].text if self.outputs else ""
