"""Streamed text: token ids -> text deltas (a per-token byte table, or `tokenizers`' DecodeStream for
decoders it does not model), and stop strings found in that text."""

from __future__ import annotations

import codecs
import json
import logging
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from pdcluster.router.tokenizer import Tokenizer

log = logging.getLogger(__name__)

# A byte-fallback token as the `ByteFallback` decoder reads it: 6 bytes, "<0x", two digits for Rust's
# u8::from_str_radix (which takes a leading "+"), ">".
BYTE_TOKEN = re.compile(r"<0x([+0-9A-Fa-f][0-9A-Fa-f])>")
# Tokens of the prompt tail decoded together with the first output tokens, so a leading-space
# marker ("▁Hello" -> " Hello") comes out as it will in the full text.
_PROMPT_CONTEXT_TOKENS = 5


@dataclass(frozen=True)
class ByteTable:
    """What each token id contributes to the decoded text, as bytes, for the decoders whose output is the
    (lossy UTF-8) decoding of per-token bytes: the text of a whole sequence is `pieces` joined, decoded,
    with one exception at the very start of the text (`strip`)."""

    pieces: list[bytes]       # by id; special tokens give their text (skip_special_tokens=False)
    skipped: list[bytes]      # the same with special tokens giving b"" (skip_special_tokens=True)
    # At the start of the text (the first token the decoder sees): "space" = one leading b" " of the text
    # goes (Strip(" ", 1, 0) after Fuse); "token" = that token is `first[id]` (Metaspace drops every "▁"
    # of the first token); "" = nothing.
    strip: str
    first: list[bytes] | None

    def piece(self, token_id: int) -> bytes:
        return self.pieces[token_id] if 0 <= token_id < len(self.pieces) else b""


def build_byte_table(tk: Any) -> ByteTable | None:
    """The byte table of a `tokenizers.Tokenizer`, or None for decoders it does not model: kinds are read
    from tokenizer.json's decoder, and the table is checked once against the tokenizer's own decoding of
    every id on its own (a token on its own is the start of the text, so `strip` applies)."""
    kind = _decoder_kind(tk)
    if kind is None:
        return None
    to_bytes, strip, to_first = kind
    added = tk.get_added_tokens_decoder()
    n = max(tk.get_vocab_size(with_added_tokens=True), max(added, default=-1) + 1)
    strings = [tk.id_to_token(i) for i in range(n)]
    # The decoder sees every token the same way, added ones included (Tokenizer::decode in tokenizers).
    pieces = [b"" if s is None else to_bytes(s) for s in strings]
    first = [b"" if s is None else to_first(s) for s in strings] if to_first else None
    if first is not None:
        alone = first
    elif strip == "space":
        alone = [p[1:] if p[:1] == b" " else p for p in pieces]
    else:
        alone = pieces
    got = tk.decode_batch([[i] for i in range(n)], skip_special_tokens=False)
    for i, (text, data) in enumerate(zip(got, alone, strict=True)):
        if text != data.decode("utf-8", "replace"):
            log.warning("tokenizer decoder %s: token %d (%r) decodes to %r, not %r as modelled; "
                        "detokenizing through tokenizers' DecodeStream instead", strip or "table", i,
                        strings[i], text, data.decode("utf-8", "replace"))
            return None
    skipped = list(pieces)
    for i, token in added.items():
        if token.special and i < n:
            skipped[i] = b""
    return ByteTable(pieces, skipped, strip, first)


def _decoder_kind(tk: Any) -> tuple[Callable[[str], bytes], str, Callable[[str], bytes] | None] | None:
    """(token string -> bytes, strip, token string -> bytes as the text's first token) for the decoders
    modelled: ByteLevel; SentencePiece's Sequence[Replace("▁", " "), ByteFallback, Fuse, (Strip(" ", 1, 0))];
    Metaspace."""
    try:
        spec = json.loads(tk.decoder.__getstate__()) if tk.decoder is not None else None
    except Exception:  # a custom (Python) decoder has no JSON form
        return None
    if spec and spec.get("type") == "Sequence" and len(spec.get("decoders", [])) == 1:
        spec = spec["decoders"][0]
    if not spec:
        return None
    if spec["type"] == "ByteLevel":
        return _byte_level_bytes, "", None
    if spec["type"] == "Metaspace":
        replacement = spec.get("replacement", "\u2581")
        if spec.get("prepend_scheme", "always") == "never":
            return lambda s: s.replace(replacement, " ").encode(), "", None
        return (lambda s: s.replace(replacement, " ").encode(), "token",
                lambda s: s.replace(replacement, "").encode())
    if spec["type"] == "Sequence":
        steps = spec["decoders"]
        sentencepiece = [{"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
                         {"type": "ByteFallback"}, {"type": "Fuse"}]
        if steps == sentencepiece:
            return _sentencepiece_bytes, "", None
        if steps == sentencepiece + [{"type": "Strip", "content": " ", "start": 1, "stop": 0}]:
            return _sentencepiece_bytes, "space", None
    return None


def _sentencepiece_bytes(s: str) -> bytes:
    if len(s) == 6 and (m := BYTE_TOKEN.fullmatch(s)):
        return bytes([int(m.group(1), 16)])
    return s.replace("\u2581", " ").encode()


def _gpt2_bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map, which ByteLevel tokens are written in."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + k) for k, b in enumerate(others)}}


# character -> the byte as a latin-1 character; characters below 256 outside the map go to one that
# latin-1 cannot encode, like characters above it, so a token with any of them fails the encode below.
_BYTE_LEVEL_CHARS = {ord(c): chr(b) for b, c in _gpt2_bytes_to_unicode().items()}
_BYTE_LEVEL_CHARS.update({c: "\uffff" for c in range(256) if c not in _BYTE_LEVEL_CHARS})


def _byte_level_bytes(s: str) -> bytes:
    """ByteLevel's decoding of one token: its characters' bytes, or its own UTF-8 when a character is
    outside the map (an added token written as text)."""
    try:
        return s.translate(_BYTE_LEVEL_CHARS).encode("latin-1")
    except UnicodeEncodeError:
        return s.encode()


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    With the tokenizer's `ByteTable`, a token costs a list lookup and a step of Python's incremental UTF-8
    decoder: a character split across tokens is held back (in the decoder) until it is complete, never
    released half-way. The text after the prompt, `"".join(add(...) ...) + flush()`, is:
    - `tokenizer.decode(prompt + out)[len(tokenizer.decode(prompt)):]` whenever the prompt's and the
      output's bytes are valid UTF-8 (the leading space at the start of the text is dropped as the
      decoder drops it, when the prompt shows no text before it);
    - otherwise the output's bytes decoded with errors="replace": each maximal invalid subpart becomes one
      U+FFFD, as Python and Rust's from_utf8_lossy (ByteLevel decoders) do; `tokenizers`' ByteFallback
      decoder writes one U+FFFD per byte of an invalid run of byte tokens instead.
    Nothing raises, whatever the ids (ids outside the vocabulary give no text, as in `decode`).

    Decoders without a table go through `tokenizers`' DecodeStream (`_StreamDetokenizer`).
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True) -> None:
        self._table = table = tokenizer.byte_table
        self._stream = None if table else _StreamDetokenizer(tokenizer, prompt_ids, skip_special_tokens)
        self._pieces = (table.skipped if skip_special_tokens else table.pieces) if table else []
        self._n = len(self._pieces)
        self._decode = codecs.getincrementaldecoder("utf-8")("replace").decode
        # The decoder's start-of-text rule applies to the output when the prompt shows no token before it
        # (scanning back from its end, so this stops at once for almost every prompt).
        self._pending = bool(table and table.strip) and not any(self._visible(i) for i in reversed(prompt_ids))

    def _visible(self, token_id: int) -> bool:
        """Whether the decoder sees the token (not skipped, not outside the vocabulary): the first one it
        sees is the start of the text."""
        return 0 <= token_id < self._n and bool(self._pieces[token_id])

    def add(self, new_ids: list[int]) -> str:
        """Append tokens; return the newly completed text (maybe "")."""
        if self._stream is not None:
            return self._stream.add(new_ids)
        if self._pending:
            return self._decode(self._start_of_text(new_ids))
        pieces, n = self._pieces, self._n
        if len(new_ids) == 1:
            i = new_ids[0]
            return self._decode(pieces[i] if 0 <= i < n else b"")
        return self._decode(b"".join([pieces[i] if 0 <= i < n else b"" for i in new_ids]))

    def _start_of_text(self, new_ids: list[int]) -> bytes:
        assert self._table is not None
        pieces, n = self._pieces, self._n
        for k, i in enumerate(new_ids):
            if self._visible(i):  # the ids before it give b""
                self._pending = False
                rest = b"".join([pieces[j] if 0 <= j < n else b"" for j in new_ids[k + 1:]])
                if self._table.first is not None:
                    return self._table.first[i] + rest
                data = pieces[i] + rest
                return data[1:] if data[:1] == b" " else data
        return b""

    def flush(self) -> str:
        """At the end of a sequence: release whatever is held back (an incomplete character as U+FFFD)."""
        if self._stream is not None:
            return self._stream.flush()
        return self._decode(b"", True)


class _StreamDetokenizer:
    """The detokenizer for decoders without a `ByteTable`: `tokenizers`' `DecodeStream`, seeded with the
    prompt's tail (leading-space markers). A delta is released once it decodes without a trailing U+FFFD."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], skip_special_tokens: bool) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._reset(list(prompt_ids[-_PROMPT_CONTEXT_TOKENS:]))

    def _reset(self, context: list[int]) -> None:
        from tokenizers.decoders import DecodeStream

        self._stream = DecodeStream(ids=context, skip_special_tokens=self.skip_special_tokens)
        self._released = context   # the window of ids whose text is out (the tail of it), for flush
        self._held: list[int] = []  # ids since the last released text

    def add(self, new_ids: list[int]) -> str:
        tk = self.tokenizer.tk
        try:
            piece = self._stream.step(tk, new_ids if len(new_ids) != 1 else new_ids[0])
        except Exception as exc:
            # "Invalid prefix encountered while decoding stream" (vllm-project/vllm#17448): byte tokens whose
            # text was out join an invalid run, and the text no longer starts with what was released. Start
            # a stream with no context on the ids not yet out, as vLLM does; its prefix is "", so it cannot
            # fail that way again.
            _warn_stream_reset(exc)
            new_ids = self._held + list(new_ids)
            self._reset([])
            try:
                piece = self._stream.step(tk, new_ids)
            except Exception as again:  # ids the tokenizer cannot decode at all
                _warn_stream_reset(again)
                self._reset([])
                return ""
        if piece is None:
            self._held += new_ids
            return ""  # incomplete character (or nothing visible) so far: wait for more tokens
        self._released = (self._released + self._held + list(new_ids))[-_PROMPT_CONTEXT_TOKENS:]
        self._held = []
        return piece

    def flush(self) -> str:
        if not self._held:
            return ""
        decode = self.tokenizer.decode
        released, held = self._released, self._held
        self._released, self._held = (released + held)[-_PROMPT_CONTEXT_TOKENS:], []
        try:
            prefix_text = decode(released, self.skip_special_tokens)
            full_text = decode(released + held, self.skip_special_tokens)
            if full_text.startswith(prefix_text):
                return full_text[len(prefix_text):]
            return decode(held, self.skip_special_tokens)
        except Exception as exc:
            _warn_stream_reset(exc)
            return ""


_stream_reset_warned = False


def _warn_stream_reset(exc: Exception) -> None:
    global _stream_reset_warned
    if not _stream_reset_warned:
        _stream_reset_warned = True
        log.warning("DecodeStream failed (%s); restarted the stream (further ones not logged)", exc)


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
