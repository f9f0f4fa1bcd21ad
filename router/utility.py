"""vLLM's utility endpoints: /tokenize and /detokenize (the router holds each served model's tokenizer), and
/version. Request and response shapes are vLLM's."""

from __future__ import annotations

import importlib.metadata
from typing import Any

from pdcluster.router.errors import bad_request
from pdcluster.router.openai_protocol import DetokenizeRequest, TokenizeRequest
from pdcluster.router.tokenizer import ServedModel
from pdcluster.router.validation import check_ids


def tokenize(model: ServedModel, req: TokenizeRequest, max_model_len: int) -> dict[str, Any]:
    """{"count", "max_model_len", "tokens", "token_strs"} (runs on the tokenizer pool)."""
    if (req.prompt is None) == (req.messages is None):
        raise bad_request("give exactly one of prompt and messages", param="prompt")
    tok = model.tokenizer
    if req.messages is not None:
        try:
            ids = tok.apply_chat_template([m.template_dict() for m in req.messages],
                                          add_generation_prompt=req.add_generation_prompt)
        except Exception as exc:  # template errors (bad roles, missing fields) are the client's
            raise bad_request(f"messages: the chat template failed: {exc}", param="messages") from None
    else:
        assert req.prompt is not None
        ids = tok.encode(req.prompt, add_special_tokens=req.add_special_tokens)
    return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids,
            "token_strs": [tok.token_text(t) for t in ids] if req.return_token_strs else None}


def detokenize(model: ServedModel, req: DetokenizeRequest) -> dict[str, Any]:
    """{"prompt": text} (special tokens kept, as vLLM does)."""
    ids = check_ids(model, req.tokens, "tokens")
    return {"prompt": model.tokenizer.decode(ids, skip_special_tokens=False)}


def version() -> dict[str, str]:
    return {"version": importlib.metadata.version("pdcluster")}
