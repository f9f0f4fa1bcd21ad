"""vLLM's prompt forms for the offline API: a string, a list of token ids, `{"prompt": str}` or
`{"prompt_token_ids": [...]}` (TextPrompt / TokensPrompt)."""

from __future__ import annotations

from typing import Any, Sequence

PromptType = str | list[int] | dict[str, Any]
PROMPT_KEYS = {"prompt", "prompt_token_ids"}


def is_single_prompt(prompts: Any) -> bool:
    """One prompt rather than a list of them (a list of ints is one tokenized prompt)."""
    if isinstance(prompts, (str, dict)):
        return True
    return isinstance(prompts, (list, tuple)) and bool(prompts) and isinstance(prompts[0], int)


def resolve_prompt(prompt: Any, tokenizer) -> tuple[list[int], str | None]:
    """(token ids, prompt text or None) of one prompt in any of the forms; ValueError / TypeError when it is none."""
    if isinstance(prompt, str):
        return tokenizer.encode(prompt), prompt
    if isinstance(prompt, dict):
        unknown = sorted(set(prompt) - PROMPT_KEYS)
        if unknown:
            raise ValueError(f"prompt: unsupported key(s) {unknown} (supported: {sorted(PROMPT_KEYS)})")
        text = prompt.get("prompt")
        if text is not None and not isinstance(text, str):
            raise TypeError(f"prompt: 'prompt' must be a string, got {type(text).__name__}")
        if "prompt_token_ids" in prompt:   # the ids are the prompt; a 'prompt' beside them is only reported back
            return _token_ids(prompt["prompt_token_ids"]), text
        if text is None:
            raise ValueError("prompt: a dict prompt needs 'prompt' or 'prompt_token_ids'")
        return tokenizer.encode(text), text
    if isinstance(prompt, Sequence):
        return _token_ids(prompt), None
    raise TypeError(f"prompt: expected a string, a list of token ids or a dict, got {type(prompt).__name__}")


def _token_ids(ids: Any) -> list[int]:
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence) or \
            not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise TypeError("prompt: prompt_token_ids must be a list of ints")
    return list(ids)
