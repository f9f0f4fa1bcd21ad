"""`speculative_config` (vLLM's shape): which proposer drafts tokens on the decode side and how many per step.
Torch-free: `EngineArgs` holds one, and the router imports the root package."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

METHODS = ("ngram", "draft_model", "eagle", "eagle3", "mtp")
ALIASES = {"deepseek_mtp": "mtp"}   # vLLM's earlier name (vLLM-Ascend's docs use it)
MAX_SPECULATIVE_TOKENS = 16
DEFAULT_LOOKUP = 5   # vLLM: prompt_lookup_min = prompt_lookup_max = 5 when neither is given
# goodput: the draft counts that maximise the step's expected tokens per second (engine/speculative/policy.py);
# fixed: every sequence gets num_speculative_tokens drafts in every step (vLLM's behaviour)
DRAFT_POLICIES = ("goodput", "fixed")


def as_text(value: Any) -> Any:
    """A config file's object value as JSON text (the knob's type is a string; flags and env give text)."""
    return json.dumps(value) if isinstance(value, dict) else value


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 0      # ngram: shortest suffix matched earlier in the sequence
    prompt_lookup_max: int = 0      # ngram: longest suffix tried first
    model: str = ""                 # draft_model / eagle / eagle3: the drafter's or head's checkpoint directory
    disable_by_batch_size: int = 0  # no drafts in a step once this many sequences run (0: always draft)
    draft_policy: str = "goodput"   # how many drafts a sequence gets per step (DRAFT_POLICIES)

    @classmethod
    def parse(cls, value: Any) -> SpeculativeConfig | None:
        """A SpeculativeConfig from a dict, a JSON object text, or one already made; None / "" / {} is off.
        ValueError names the key at fault."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            if not value.strip() or value.strip().lower() in ("none", "null"):
                return None
            try:
                value = json.loads(value)
            except ValueError as exc:
                raise ValueError(f"speculative_config: not a JSON object ({exc})") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config: expected an object, got {type(value).__name__}")
        if not value:
            return None
        d = dict(value)
        known = {"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "model",
                 "draft_tensor_parallel_size", "disable_by_batch_size", "draft_policy"}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"speculative_config.{unknown[0]}: unknown key (known: {', '.join(sorted(known))})")
        method = d.get("method") or ("draft_model" if d.get("model") else "")
        method = ALIASES.get(method, method) if isinstance(method, str) else method
        if method not in METHODS:
            raise ValueError(f"speculative_config.method: expected one of {', '.join(METHODS)}, got {method!r}")
        k = d.get("num_speculative_tokens")
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"speculative_config.num_speculative_tokens: an integer in [1, "
                             f"{MAX_SPECULATIVE_TOKENS}] is required, got {k!r}")
        off = d.get("disable_by_batch_size") or 0
        if not isinstance(off, int) or isinstance(off, bool) or off < 0:
            raise ValueError(f"speculative_config.disable_by_batch_size: an integer >= 0 is required, got {off!r}")
        policy = d.get("draft_policy", "goodput")
        if policy not in DRAFT_POLICIES:
            raise ValueError(f"speculative_config.draft_policy: expected one of {', '.join(DRAFT_POLICIES)}, "
                             f"got {policy!r}")
        if d.get("draft_tensor_parallel_size", 1) != 1:
            raise ValueError("speculative_config.draft_tensor_parallel_size: only 1 (the drafter runs on rank 0)")
        if method == "ngram":
            if d.get("model"):
                raise ValueError("speculative_config.model: ngram uses no model")
            lo, hi = d.get("prompt_lookup_min"), d.get("prompt_lookup_max")
            lo, hi = (lo if lo is not None else hi or DEFAULT_LOOKUP), (hi if hi is not None else lo or DEFAULT_LOOKUP)
            for name, n in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
                if not isinstance(n, int) or isinstance(n, bool) or n < 1:
                    raise ValueError(f"speculative_config.{name}: an integer >= 1 is required, got {n!r}")
            if lo > hi:
                raise ValueError(f"speculative_config.prompt_lookup_min ({lo}) exceeds prompt_lookup_max ({hi})")
            return cls(method, k, prompt_lookup_min=lo, prompt_lookup_max=hi, disable_by_batch_size=off,
                       draft_policy=policy)
        for key in ("prompt_lookup_min", "prompt_lookup_max"):
            if key in d:
                raise ValueError(f"speculative_config.{key}: only for method ngram")
        model = d.get("model")
        if method == "mtp":   # the layers come with the target's own checkpoint
            if model:
                raise ValueError("speculative_config.model: mtp reads the target model's own layers (leave it out)")
            return cls(method, k, disable_by_batch_size=off, draft_policy=policy)
        if not isinstance(model, str) or not model:
            what = "draft model" if method == "draft_model" else f"{method} head"
            raise ValueError(f"speculative_config.model: the {what}'s checkpoint directory is required")
        return cls(method, k, model=model, disable_by_batch_size=off, draft_policy=policy)

    def to_json(self) -> str:
        """The canonical text of this config (keys sorted, unused fields and the default policy dropped): what
        nodes compare."""
        return json.dumps({k: v for k, v in asdict(self).items() if v not in (0, "", "goodput")}, sort_keys=True)
