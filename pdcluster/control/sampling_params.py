"""Per-request sampling parameters: vLLM-compatible names, defaults and validation.

Light module (no torch): the router imports it to validate requests and put them on the wire.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any

MAX_LOGPROBS = 20
# Hard limits every engine enforces; a router may set lower ones (router/settings.py).
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1   # every integer goes on the wire as a msgpack int
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 4096
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS = 1024              # entries of a logit_bias map
LOGIT_BIAS_LIMIT = 100.0            # |bias| (OpenAI's range)


def _float(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    try:
        value = float(value)
    except OverflowError:  # an int too large for a float
        raise ValueError(f"{name} must be finite, got an integer of {value.bit_length()} bits") from None
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value!r}")
    return value


def _int(name: str, value: Any) -> int:
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if not INT64_MIN <= value <= INT64_MAX:
        raise ValueError(f"{name} must fit in a signed 64-bit integer, got {value}")
    return value


def _bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a boolean, got {value!r}")
    return value


def _int_list(name: str, value: Any) -> list[int]:
    if value is None:
        return []
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"{name} must be a list of integers, got {value!r}")
    if len(value) > MAX_STOP_TOKEN_IDS:
        raise ValueError(f"{name} may hold at most {MAX_STOP_TOKEN_IDS} ids, got {len(value)}")
    out = [_int(name, v) for v in value]
    if any(v < 0 for v in out):
        raise ValueError(f"{name} must hold non-negative token ids, got {value!r}")
    return out


def _str_list(name: str, value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{name} must be a string or a list of strings, got {value!r}")
    if any(v == "" for v in value):
        raise ValueError(f"{name} must not contain empty strings")
    if len(value) > MAX_STOP_STRINGS:
        raise ValueError(f"{name} may hold at most {MAX_STOP_STRINGS} strings, got {len(value)}")
    if any(len(v) > MAX_STOP_STRING_CHARS for v in value):
        raise ValueError(f"{name} strings may be at most {MAX_STOP_STRING_CHARS} characters long")
    return list(value)


@dataclass(init=False)
class SamplingParams:
    n: int = 1
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                      # 0 or -1: off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)   # applied by the detokenizing side, not the sampler
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None         # top-N alternatives; 0 = only the sampled token's logprob
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None   # token id -> added to its logit before sampling (OpenAI)
    prompt_logprobs: int | None = None  # per prompt token: its logprob and the top-N (vLLM); the prompt is computed
    # vLLM's structured output: exactly one of json (schema dict or str), json_object (True), regex, choice,
    # grammar (EBNF); compiled and enforced by the engine (engine/structured_output.py)
    structured_outputs: dict[str, Any] | None = None

    def __init__(self, **kwargs: Any) -> None:
        names = _field_names()
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise ValueError(f"unknown sampling parameter(s): {', '.join(map(repr, unknown))}")
        for f in fields(self):
            default = f.default_factory() if callable(f.default_factory) else f.default
            setattr(self, f.name, kwargs.get(f.name, default))
        self._validate()

    def _validate(self) -> None:
        self.n = _int("n", self.n)
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        self.max_tokens = _int("max_tokens", self.max_tokens)
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        self.temperature = _float("temperature", self.temperature)
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        self.top_p = _float("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        self.top_k = _int("top_k", self.top_k)
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 or 0 (off) or >= 1, got {self.top_k}")
        if self.top_k == -1:
            self.top_k = 0
        self.min_p = _float("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        self.repetition_penalty = _float("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0.0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = _float(name, getattr(self, name))
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
            setattr(self, name, value)
        if self.seed is not None:
            self.seed = _int("seed", self.seed)
        self.stop = _str_list("stop", self.stop)
        self.stop_token_ids = _int_list("stop_token_ids", self.stop_token_ids)
        self.ignore_eos = _bool("ignore_eos", self.ignore_eos)
        self.min_tokens = _int("min_tokens", self.min_tokens)
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}")
        if self.logprobs is not None:
            self.logprobs = _int("logprobs", self.logprobs)
            if not 0 <= self.logprobs <= MAX_LOGPROBS:
                raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        self.skip_special_tokens = _bool("skip_special_tokens", self.skip_special_tokens)
        self.logit_bias = _logit_bias(self.logit_bias)
        if self.prompt_logprobs is not None:
            self.prompt_logprobs = _int("prompt_logprobs", self.prompt_logprobs)
            if not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
                raise ValueError(f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs}")
        self.structured_outputs = _structured_outputs(self.structured_outputs)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["stop"] = list(self.stop)
        d["stop_token_ids"] = list(self.stop_token_ids)
        if self.logit_bias is not None:   # string keys, as OpenAI's JSON has them (msgpack maps want them too)
            d["logit_bias"] = {str(t): b for t, b in self.logit_bias.items()}
        return d

    @classmethod
    def from_dict(cls, d: Any) -> SamplingParams:
        if not isinstance(d, dict):
            raise ValueError(f"sampling params must be a dict, got {type(d).__name__}")
        bad_keys = [k for k in d if not isinstance(k, str)]
        if bad_keys:
            raise ValueError(f"sampling parameter names must be strings, got {bad_keys!r}")
        return cls(**d)


def _logit_bias(value: Any) -> dict[int, float] | None:
    """OpenAI's map of token id (a decimal string, or an int) -> bias in [-100, 100]; None or {} = none."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError(f"logit_bias must be a map of token id -> bias, got {type(value).__name__}")
    if len(value) > MAX_LOGIT_BIAS:
        raise ValueError(f"logit_bias may hold at most {MAX_LOGIT_BIAS} entries, got {len(value)}")
    out: dict[int, float] = {}
    for key, bias in value.items():
        token = int(key) if isinstance(key, str) and key.strip().isdecimal() else key
        if isinstance(token, bool) or not isinstance(token, int) or token < 0 or token > INT64_MAX:
            raise ValueError(f"logit_bias keys must be non-negative token ids, got {key!r:.40}")
        b = _float("logit_bias", bias)
        if not -LOGIT_BIAS_LIMIT <= b <= LOGIT_BIAS_LIMIT:
            raise ValueError(f"logit_bias values must be in [-100, 100], got {b} for token {token}")
        out[token] = b
    return out or None


STRUCTURED_OUTPUT_KINDS = ("json", "json_object", "regex", "choice", "grammar")
# Beside the kind, optionally "after": token ids (a reasoning model's end-of-thinking marker, set by the router's
# reasoning parser) that the output must contain before the grammar applies, so that only the answer is held to it.
MAX_AFTER_TOKENS = 16
MAX_STRUCTURED_OUTPUT_CHARS = 65536    # a schema / regex / grammar / all choices, as text
MAX_CHOICES = 1024


def _structured_outputs(value: Any) -> dict[str, Any] | None:
    """Shape check only (cheap, torch-free): one of STRUCTURED_OUTPUT_KINDS with a value of the right type
    and size. Whether the schema / regex / grammar compiles is the engine's to find out."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError(f"structured_outputs must be an object, got {type(value).__name__}")
    given = {k: v for k, v in value.items() if v is not None and v is not False}
    after = given.pop("after", None)
    if after is not None:
        after = _int_list("structured_outputs.after", after)
        if not 1 <= len(after) <= MAX_AFTER_TOKENS:
            raise ValueError(f"structured_outputs.after must hold 1 to {MAX_AFTER_TOKENS} token ids")
    unknown = sorted(str(k) for k in given if k not in STRUCTURED_OUTPUT_KINDS)
    if unknown:
        raise ValueError(f"structured_outputs: unknown key(s) {unknown}; "
                         f"expected one of {list(STRUCTURED_OUTPUT_KINDS)}")
    if len(given) != 1:
        raise ValueError(f"structured_outputs must set exactly one of {list(STRUCTURED_OUTPUT_KINDS)}, "
                         f"got {sorted(given)}")
    (kind, spec), = given.items()
    if kind == "json":
        if not isinstance(spec, (dict, str)) or isinstance(spec, str) and not spec.strip():
            raise ValueError("structured_outputs.json must be a JSON schema (an object or its JSON text)")
        size = len(spec) if isinstance(spec, str) else len(repr(spec))
    elif kind == "json_object":
        if spec is not True:
            raise ValueError(f"structured_outputs.json_object must be true, got {spec!r:.40}")
        size = 0
    elif kind == "choice":
        if (not isinstance(spec, (list, tuple)) or not spec or len(spec) > MAX_CHOICES
                or not all(isinstance(c, str) and c for c in spec)):
            raise ValueError(f"structured_outputs.choice must be a list of 1 to {MAX_CHOICES} non-empty strings")
        spec = list(spec)
        size = sum(len(c) for c in spec)
    else:   # regex, grammar
        if not isinstance(spec, str) or not spec:
            raise ValueError(f"structured_outputs.{kind} must be a non-empty string")
        size = len(spec)
    if size > MAX_STRUCTURED_OUTPUT_CHARS:
        raise ValueError(f"structured_outputs.{kind} is too long ({size} > {MAX_STRUCTURED_OUTPUT_CHARS} characters)")
    return {kind: spec} if after is None else {kind: spec, "after": after}


def _field_names() -> set[str]:
    return {f.name for f in fields(SamplingParams)}
