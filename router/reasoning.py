"""Reasoning parsers (vLLM's `reasoning_parser`): a reasoning model's `<think>...</think>` part of the output
goes to `reasoning_content`, the rest to `content`, whole or as a stream of deltas.

Styles:
- `deepseek_r1`: the output is reasoning up to `</think>` (the chat template opens `<think>` in the prompt;
  a `<think>` the model writes itself is dropped). No `</think>` by the end: all of it is reasoning.
- `qwen3`: the output is reasoning when it starts with `<think>` or the prompt ends with `<think>` (Qwen3's
  template with thinking on); then up to `</think>`. Otherwise (thinking off) all of it is content.
"""

from __future__ import annotations

START, END = "<think>", "</think>"
REASONING_PARSERS = ("deepseek_r1", "qwen3")


class ReasoningSplitter:
    """One choice's output text -> ("reasoning" | "content", text) pieces, fed as it streams. A possible
    tag split across deltas is held back until the next delta (or `finish`) decides it."""

    def __init__(self, style: str, prompt_text: str = "") -> None:
        if style not in REASONING_PARSERS:
            raise ValueError(f"reasoning_parser: unknown style {style!r} (one of {', '.join(REASONING_PARSERS)})")
        self.in_reasoning = style == "deepseek_r1" or prompt_text.rstrip().endswith(START)
        self.at_start = True   # a leading `<think>` (after blanks) may still come
        self.buffer = ""

    def feed(self, text: str) -> list[tuple[str, str]]:
        self.buffer += text
        out: list[tuple[str, str]] = []
        if self.at_start:
            head = self.buffer.lstrip()
            if head.startswith(START):
                self.buffer = head[len(START):]
                self.in_reasoning = True
                self.at_start = False
            elif START.startswith(head):   # blanks or a partial `<think>`: wait for more
                return out
            else:
                self.at_start = False
        if self.in_reasoning:
            cut = self.buffer.find(END)
            if cut >= 0:
                reasoning, self.buffer = self.buffer[:cut], self.buffer[cut + len(END):]
                self.in_reasoning = False
                _add(out, "reasoning", reasoning)
            else:
                keep = partial_suffix(self.buffer, END)
                _add(out, "reasoning", self.buffer[:len(self.buffer) - keep])
                self.buffer = self.buffer[len(self.buffer) - keep:]
                return out
        _add(out, "content", self.buffer)
        self.buffer = ""
        return out

    def finish(self) -> list[tuple[str, str]]:
        """The held-back rest, at the end of the output."""
        rest, self.buffer = self.buffer, ""   # at the start: blanks or a `<think>` never completed
        out: list[tuple[str, str]] = []
        _add(out, "reasoning" if self.in_reasoning else "content", rest)
        return out


def split_reasoning(style: str, text: str, prompt_text: str = "") -> tuple[str | None, str]:
    """A whole output as (reasoning_content or None, content)."""
    splitter = ReasoningSplitter(style, prompt_text)
    pieces = splitter.feed(text) + splitter.finish()
    reasoning = "".join(t for kind, t in pieces if kind == "reasoning")
    content = "".join(t for kind, t in pieces if kind == "content")
    return (reasoning if reasoning or splitter.in_reasoning or END in text else None), content


def _add(out: list[tuple[str, str]], kind: str, text: str) -> None:
    if text:
        out.append((kind, text))


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper start of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
