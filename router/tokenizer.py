"""Tokenizer side of the router: prompts -> ids, ids -> streamed text, stop strings.

Only `transformers.AutoTokenizer` and the model's config.json are needed: no torch device.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from typing import Any

_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")
# Tokens of the prompt tail decoded together with the first output tokens, so a leading-space
# marker ("▁Hello" -> " Hello") comes out as it will in the full text.
_PROMPT_CONTEXT_TOKENS = 5


@dataclass
class ModelInfo:
    name: str
    path: str
    max_model_len: int
    eos_token_ids: list[int]


def read_model_info(path: str, name: str | None = None, max_model_len: int | None = None) -> ModelInfo:
    """Context length and EOS ids from config.json (+ generation_config.json when present)."""
    config: dict[str, Any] = {}
    config_file = os.path.join(path, "config.json")
    if os.path.exists(config_file):
        with open(config_file) as f:
            config = json.load(f)
    text_config = config.get("text_config", config)
    limit = max_model_len or text_config.get("max_position_embeddings") or config.get("max_position_embeddings")
    if not limit:
        raise ValueError(f"model at {path}: no max_position_embeddings in config.json; set max_model_len")
    eos: Any = config.get("eos_token_id")
    gen_file = os.path.join(path, "generation_config.json")
    if os.path.exists(gen_file):
        with open(gen_file) as f:
            eos = json.load(f).get("eos_token_id", eos)
    eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
    return ModelInfo(name=name or os.path.basename(os.path.normpath(path)), path=path,
                     max_model_len=int(limit), eos_token_ids=eos_ids)


class Tokenizer:
    """The model's HF tokenizer plus the few operations the router needs."""

    def __init__(self, path: str) -> None:
        from transformers import AutoTokenizer  # heavy import: only when a router starts

        self.hf = AutoTokenizer.from_pretrained(path)
        self.vocab_size = len(self.hf)
        self.eos_token_id = self.hf.eos_token_id
        self._token_strings: dict[int, str] = {}

    def encode(self, text: str) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=True))

    def apply_chat_template(self, messages: list[dict[str, Any]], **kwargs: Any) -> list[int]:
        if not getattr(self.hf, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template; use /v1/completions")
        text = self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
        # The template already holds BOS etc.; do not add special tokens twice.
        return list(self.hf.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens,
                              clean_up_tokenization_spaces=False)

    def token_text(self, token_id: int) -> str:
        """One token shown on its own (logprobs): its text with its leading space, or the raw
        piece ("<0xE6>") for a byte that is not a character by itself."""
        text = self._token_strings.get(token_id)
        if text is None:
            piece = self.hf.convert_ids_to_tokens(token_id)
            piece = piece if isinstance(piece, str) else ""
            text = self.decode([token_id], skip_special_tokens=False)
            if "\ufffd" in text:
                text = piece
            elif piece.startswith("\u2581") and not text.startswith(" "):
                text = " " + text  # decoders strip the sentencepiece space of a sequence's first token
            self._token_strings[token_id] = text
        return text

    def token_bytes(self, token_id: int) -> list[int]:
        """UTF-8 bytes of one token; a byte-fallback token "<0xE6>" is that single byte."""
        piece = self.hf.convert_ids_to_tokens(token_id)
        if isinstance(piece, str):
            m = _BYTE_TOKEN.match(piece)
            if m:
                return [int(m.group(1), 16)]
        return list(self.token_text(token_id).encode("utf-8"))


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    A delta is only released once it decodes without a trailing U+FFFD, so a multi-byte character
    split across byte-fallback tokens comes out whole. Decoding a short window (from the last point
    where the text was complete) instead of the whole output keeps each step O(window).
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = list(prompt_ids[-_PROMPT_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""

    def add(self, new_ids: list[int]) -> str:
        """Append tokens; return the newly completed text (maybe "")."""
        self.ids.extend(new_ids)
        decode = self.tokenizer.decode
        prefix_text = decode(self.ids[self.prefix_offset:self.read_offset], self.skip_special_tokens)
        full_text = decode(self.ids[self.prefix_offset:], self.skip_special_tokens)
        if len(full_text) <= len(prefix_text) or full_text.endswith("\ufffd"):
            return ""  # incomplete character (or nothing visible) so far: wait for more tokens
        delta = full_text[len(prefix_text):]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """At the end of a sequence: release whatever is held back (even an invalid byte run)."""
        if self.read_offset >= len(self.ids):
            return ""
        prefix_text = self.tokenizer.decode(self.ids[self.prefix_offset:self.read_offset], self.skip_special_tokens)
        full_text = self.tokenizer.decode(self.ids[self.prefix_offset:], self.skip_special_tokens)
        delta = full_text[len(prefix_text):]
        self.prefix_offset = self.read_offset = len(self.ids)
        self.text += delta
        return delta


class StopMatcher:
    """Finds stop strings in streamed text, holding back any tail that could start one."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self._held = ""

    def feed(self, delta: str) -> tuple[str, bool]:
        """Returns (text safe to emit, stopped). After a stop, the stop string itself is dropped."""
        if not self.stops:
            return delta, False
        buf = self._held + delta
        cut = min((i for i in (buf.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self._held = ""
            return buf[:cut], True
        hold = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(buf)), hold, -1):
                if buf.endswith(s[:k]):
                    hold = k
                    break
        self._held = buf[len(buf) - hold:] if hold else ""
        return buf[:len(buf) - hold], False

    def flush(self) -> str:
        held, self._held = self._held, ""
        return held
