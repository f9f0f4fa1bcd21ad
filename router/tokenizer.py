"""Tokenizer side of the router: prompts -> ids, ids -> streamed text, stop strings.

Reads the model directory's tokenizer files and config.json; imports neither transformers nor torch.
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


@dataclass
class ServedModel:
    """One model a router serves: its limits and tokenizer; nodes register with its name (`NodeInfo.model`)."""

    info: ModelInfo
    tokenizer: Tokenizer

    @property
    def name(self) -> str:
        return self.info.name

    @classmethod
    def load(cls, name: str, path: str, max_model_len: int | None = None) -> "ServedModel":
        return cls(read_model_info(path, name, max_model_len), Tokenizer(path))


class Tokenizer:
    """The model's tokenizer and chat template, read as transformers reads them: `tokenizer.json` through
    the `tokenizers` library, the template (tokenizer_config.json or chat_template.jinja) through jinja2.
    transformers itself is not imported: it imports torch, which the router never loads."""

    def __init__(self, path: str) -> None:
        from tokenizers import Tokenizer as RustTokenizer

        tokenizer_file = os.path.join(path, "tokenizer.json")
        if not os.path.exists(tokenizer_file):
            raise ValueError(f"model at {path}: no tokenizer.json (the router needs a fast tokenizer)")
        self.path = path
        self.tk = RustTokenizer.from_file(tokenizer_file)
        config = _read_json(os.path.join(path, "tokenizer_config.json"))
        special_map = _read_json(os.path.join(path, "special_tokens_map.json"))
        self.special_tokens = {name: text for name in _SPECIAL_TOKEN_NAMES
                               if (text := _token_content(config.get(name, special_map.get(name))))}
        eos = self.special_tokens.get("eos_token")
        self.eos_token_id = self.tk.token_to_id(eos) if eos else None
        self.vocab_size = self.tk.get_vocab_size(with_added_tokens=True)
        self.chat_template = _chat_template(path, config)
        self._template = None
        self._token_strings: dict[int, str] = {}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids; BOS/EOS come from tokenizer.json's post-processor, as in transformers 5."""
        return self.tk.encode(text, add_special_tokens=add_special_tokens).ids

    def apply_chat_template(self, messages: list[dict[str, Any]], **kwargs: Any) -> list[int]:
        if not self.chat_template:
            raise ValueError("this model's tokenizer has no chat template; use /v1/completions")
        if self._template is None:
            self._template = _compile_chat_template(self.chat_template)
        text = self._template.render(messages=messages, add_generation_prompt=True,
                                     **{**self.special_tokens, **kwargs})
        # The template already holds BOS etc.; do not add special tokens twice.
        return self.tk.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tk.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """One token shown on its own (logprobs): its text with its leading space, or the raw
        piece ("<0xE6>") for a byte that is not a character by itself."""
        text = self._token_strings.get(token_id)
        if text is None:
            piece = self.tk.id_to_token(token_id) or ""
            text = self.decode([token_id], skip_special_tokens=False)
            if "\ufffd" in text:
                text = piece
            elif piece.startswith("\u2581") and not text.startswith(" "):
                text = " " + text  # decoders strip the sentencepiece space of a sequence's first token
            self._token_strings[token_id] = text
        return text

    def token_bytes(self, token_id: int) -> list[int]:
        """UTF-8 bytes of one token; a byte-fallback token "<0xE6>" is that single byte."""
        m = _BYTE_TOKEN.match(self.tk.id_to_token(token_id) or "")
        if m:
            return [int(m.group(1), 16)]
        return list(self.token_text(token_id).encode("utf-8"))


_SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _read_json(path: str) -> dict[str, Any]:
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


def _token_content(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _chat_template(path: str, config: dict[str, Any]) -> str | None:
    """The default chat template: chat_template.jinja (transformers 5) or tokenizer_config.json's entry
    (a string, or a list of named templates of which "default" is used)."""
    jinja_file = os.path.join(path, "chat_template.jinja")
    if os.path.exists(jinja_file):
        with open(jinja_file) as f:
            return f.read()
    template = config.get("chat_template")
    if isinstance(template, list):
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    return template if isinstance(template, str) else None


def _compile_chat_template(source: str):
    """The template in a sandboxed environment set up as transformers sets it up (trim/lstrip blocks, loop
    controls, `tojson` without ASCII escaping, `raise_exception`, `strftime_now`, `{% generation %}` tags)."""
    from datetime import datetime

    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTags(Extension):
        tags = {"generation"}   # marks assistant spans for training masks; renders its body as is

        def parse(self, parser):
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    def raise_exception(message: str):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationTags, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as exc:
        raise ValueError(f"the model's chat template does not parse: {exc}") from None


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    A delta is only released once it decodes without a trailing U+FFFD, so a multi-byte character
    split across byte-fallback tokens comes out whole. The work is `tokenizers`' `DecodeStream`: its state
    (a short window from the last point where the text was complete) lives in Rust, so a step costs one
    call and no Python-side re-decoding; the prompt's tail seeds the window (leading-space markers).
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True) -> None:
        from tokenizers.decoders import DecodeStream

        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        context = list(prompt_ids[-_PROMPT_CONTEXT_TOKENS:])
        self._stream = DecodeStream(ids=context, skip_special_tokens=skip_special_tokens)
        self._released = context   # the window of ids whose text is out (the tail of it), for flush
        self._held: list[int] = []  # ids since the last released text

    def add(self, new_ids: list[int]) -> str:
        """Append tokens; return the newly completed text (maybe "")."""
        piece = self._stream.step(self.tokenizer.tk, new_ids if len(new_ids) != 1 else new_ids[0])
        if piece is None:
            self._held += new_ids
            return ""  # incomplete character (or nothing visible) so far: wait for more tokens
        self._released = (self._released + self._held + new_ids)[-_PROMPT_CONTEXT_TOKENS:]
        self._held = []
        return piece

    def flush(self) -> str:
        """At the end of a sequence: release whatever is held back (even an invalid byte run)."""
        if not self._held:
            return ""
        decode = self.tokenizer.decode
        prefix_text = decode(self._released, self.skip_special_tokens)
        full_text = decode(self._released + self._held, self.skip_special_tokens)
        self._released, self._held = (self._released + self._held)[-_PROMPT_CONTEXT_TOKENS:], []
        return full_text[len(prefix_text):]


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
