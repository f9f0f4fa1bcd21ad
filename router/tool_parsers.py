"""Tool-call parsers (vLLM's `tool_call_parser`): the tool calls a model writes in the format it was trained
on, found in its free output (`tool_choice: "auto"`), whole or as it streams.

- `hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks (Qwen2.5, Qwen3, Hermes).
- `llama3_json`: the output is `{"name": ..., "parameters": {...}}` (several joined by `;`), optionally after
  `<|python_tag|>` (Llama 3.1-3.3).
- `mistral`: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`, or the newer `[TOOL_CALLS]name[ARGS]{...}`.

Text before the tool calls is `content`. Output that opens a tool call but does not parse is returned as
content, with no tool calls (as vLLM does).
"""

from __future__ import annotations

import json
import re
import secrets
import string
from dataclasses import dataclass
from typing import Any

from pdcluster.router.reasoning import partial_suffix

TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral")


@dataclass
class ToolCall:
    name: str
    arguments: str   # a JSON object, as text (OpenAI's shape)
    id: str

    def openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def new_call_id(parser: str = "") -> str:
    if parser == "mistral":   # Mistral's chat template wants 9 alphanumerics when the call comes back
        return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))
    return f"call_{secrets.token_hex(12)}"


def make_call(parser: str, name: Any, arguments: Any) -> ToolCall:
    """A call from a parsed name and arguments (a dict, or JSON text of one); ValueError when malformed."""
    if not isinstance(name, str) or not name:
        raise ValueError("a tool call without a name")
    if isinstance(arguments, str):
        arguments = json.loads(arguments or "{}")
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        raise ValueError("tool call arguments are not a JSON object")
    return ToolCall(name, json.dumps(arguments, ensure_ascii=False), new_call_id(parser))


class ToolParser:
    """One format. `markers`: what opens the tool-call part (`at_start`: only as the output's first
    non-blank text); `calls(part, final)`: the calls in that part, complete ones only unless `final`."""

    name = ""
    markers: tuple[str, ...] = ()
    at_start = False

    def calls(self, part: str, final: bool) -> list[ToolCall]:
        raise NotImplementedError

    def split(self, text: str) -> tuple[str, str] | None:
        """(content, tool-call part) where a marker opens one, else None."""
        if self.at_start:
            head = text.lstrip()
            return ("", head) if head.startswith(self.markers) else None
        found = [i for i in (text.find(m) for m in self.markers) if i >= 0]
        return (text[:min(found)], text[min(found):]) if found else None


class HermesParser(ToolParser):
    name = "hermes"
    markers = ("<tool_call>",)
    _block = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)

    def calls(self, part: str, final: bool) -> list[ToolCall]:
        out = []
        for m in self._block.finditer(part):
            if not m.group(0).endswith("</tool_call>") and not final:
                break
            body = json.loads(m.group(1))
            if not isinstance(body, dict):
                raise ValueError("a <tool_call> that is not a JSON object")
            out.append(make_call(self.name, body.get("name"), body.get("arguments", body.get("parameters"))))
        return out


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    markers = ("<|python_tag|>", "{")
    at_start = True

    def calls(self, part: str, final: bool) -> list[ToolCall]:
        if not final:
            return []
        text = part.removeprefix("<|python_tag|>")
        decoder, pos, out = json.JSONDecoder(), 0, list[ToolCall]()
        while True:
            while pos < len(text) and text[pos] in " \t\r\n;":
                pos += 1
            if pos == len(text):
                return out
            body, pos = decoder.raw_decode(text, pos)
            if not isinstance(body, dict):
                raise ValueError("a tool call that is not a JSON object")
            out.append(make_call(self.name, body.get("name"), body.get("parameters", body.get("arguments"))))


class MistralParser(ToolParser):
    name = "mistral"
    markers = ("[TOOL_CALLS]",)

    def calls(self, part: str, final: bool) -> list[ToolCall]:
        if not final:
            return []
        out = []
        for chunk in part.split("[TOOL_CALLS]")[1:]:
            chunk = chunk.strip()
            if chunk.startswith("["):
                bodies = json.loads(chunk)
                if not isinstance(bodies, list) or not all(isinstance(b, dict) for b in bodies):
                    raise ValueError("[TOOL_CALLS] is not a list of objects")
                out += [make_call(self.name, b.get("name"), b.get("arguments")) for b in bodies]
            elif chunk:
                name, sep, args = chunk.partition("[ARGS]")
                if not sep:
                    raise ValueError("[TOOL_CALLS] without [ARGS]")
                out.append(make_call(self.name, name.strip(), args))
        return out


_PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser)}


def get_parser(name: str) -> ToolParser:
    if name not in _PARSERS:
        raise ValueError(f"tool_call_parser: unknown parser {name!r} (one of {', '.join(TOOL_CALL_PARSERS)})")
    return _PARSERS[name]()


class ToolCallStream:
    """One choice's streamed content -> (content delta, new tool calls). Content streams until a marker
    opens the tool-call part (a possible marker split across deltas is held back); from there the text is
    kept and its calls are sent as each completes (hermes: per closed block; the others at the end)."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.pending = ""          # content not sent yet: it may be the start of a marker
        self.part: str | None = None   # the tool-call part, once opened
        self.sent = 0              # calls sent so far
        self.started = False       # any non-blank text seen (at_start parsers decide on it)

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        if self.part is not None:
            self.part += text
            return "", self._new_calls(final=False)
        self.pending += text
        parts = self.parser.split(self.pending)
        if parts is not None:
            content, self.part, self.pending = parts[0], parts[1], ""
            return content, self._new_calls(final=False)
        if self.parser.at_start:
            head = self.pending.lstrip()
            if not head or any(m.startswith(head) for m in self.parser.markers):
                return "", []   # undecided yet
            self.parser = _NEVER   # the output did not open with a tool call: all content
            return self._take(len(self.pending))
        keep = max((partial_suffix(self.pending, m) for m in self.parser.markers), default=0)
        return self._take(len(self.pending) - keep)

    def finish(self) -> tuple[str, list[ToolCall]]:
        """The rest at the end of the output; a tool-call part with no call that parses goes out as content."""
        if self.part is None:
            return self._take(len(self.pending))
        try:
            calls = self._new_calls(final=True)
        except ValueError:
            calls = []
        if self.sent == 0:
            return self.part, []
        return "", calls

    def _take(self, n: int) -> tuple[str, list[ToolCall]]:
        out, self.pending = self.pending[:n], self.pending[n:]
        return out, []

    def _new_calls(self, final: bool) -> list[ToolCall]:
        assert self.part is not None
        try:
            calls = self.parser.calls(self.part, final)
        except ValueError:
            if final:
                raise
            return []
        new = calls[self.sent:]
        self.sent = len(calls)
        return new


class _NoParser(ToolParser):
    def split(self, text: str) -> None:
        return None


_NEVER = _NoParser()
