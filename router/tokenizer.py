"""The model's tokenizer in the router: prompts and chat templates -> ids, one token's text and bytes.

Reads the model directory's tokenizer files and config.json; imports neither transformers nor torch.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pdcluster.router.detokenizer import BYTE_TOKEN, ByteTable, build_byte_table

if TYPE_CHECKING:   # jinja2 loads with the first chat template
    import jinja2


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
    """One model a router serves: its limits and tokenizer; nodes register with its name (`NodeInfo.model`). A
    LoRA adapter is served as a view of its base model (`adapter` set, `name` the adapter's: router/lora.py)."""

    info: ModelInfo
    tokenizer: Tokenizer
    adapter: Any = None   # router.lora.Adapter

    @property
    def name(self) -> str:
        return self.info.name

    @property
    def node_model(self) -> str:
        """The name nodes serving it registered with: the base model's for an adapter."""
        return self.adapter.parent if self.adapter is not None else self.info.name

    @classmethod
    def load(cls, name: str, path: str, max_model_len: int | None = None) -> "ServedModel":
        tokenizer = Tokenizer(path)
        _ = tokenizer.byte_table   # built now (tens of ms), not on the event loop by the first request
        return cls(read_model_info(path, name, max_model_len), tokenizer)


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
        self._template: jinja2.Template | None = None
        self._token_strings: dict[int, str] = {}
        self._byte_table: ByteTable | None = None
        self._byte_table_built = False

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids; BOS/EOS come from tokenizer.json's post-processor, as in transformers 5."""
        return self.tk.encode(text, add_special_tokens=add_special_tokens).ids

    def apply_chat_template(self, messages: list[dict[str, Any]], **kwargs: Any) -> list[int]:
        if not self.chat_template:
            raise ValueError("this model's tokenizer has no chat template; use /v1/completions")
        if self._template is None:
            self._template = _compile_chat_template(self.chat_template)
        text = self._template.render(messages=messages,
                                     **{"add_generation_prompt": True, **self.special_tokens, **kwargs})
        # The template already holds BOS etc.; do not add special tokens twice.
        return self.tk.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tk.decode(ids, skip_special_tokens=skip_special_tokens)

    @property
    def byte_table(self) -> ByteTable | None:
        """Every token id's bytes, built on first use (tens of ms for a 50k vocabulary); None where
        tokenizer.json's decoder is not one `build_byte_table` models exactly."""
        if not self._byte_table_built:
            self._byte_table = build_byte_table(self.tk)
            self._byte_table_built = True
        return self._byte_table

    def token_text(self, token_id: int) -> str:
        """One token shown on its own (logprobs): its text with its leading space, or the raw
        piece ("<0xE6>") for bytes that are not characters by themselves."""
        text = self._token_strings.get(token_id)
        if text is None:
            piece = self.tk.id_to_token(token_id) or ""
            table = self.byte_table
            if table is not None:
                try:
                    text = table.piece(token_id).decode("utf-8")
                except UnicodeDecodeError:
                    text = piece
            else:
                text = self.decode([token_id], skip_special_tokens=False)
                if "\ufffd" in text:
                    text = piece
                elif piece.startswith("\u2581") and not text.startswith(" "):
                    text = " " + text  # decoders strip the sentencepiece space of a sequence's first token
            self._token_strings[token_id] = text
        return text

    def token_bytes(self, token_id: int) -> list[int]:
        """The bytes of one token (a byte-fallback token "<0xE6>" is that single byte)."""
        table = self.byte_table
        if table is not None:
            return list(table.piece(token_id))
        m = BYTE_TOKEN.fullmatch(self.tk.id_to_token(token_id) or "")
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


def _compile_chat_template(source: str) -> jinja2.Template:
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
