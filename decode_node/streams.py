"""The decode node's token messages to routers: one engine step's outputs -> one `TokenBatch` per router.

A request whose router could not take its last tokens (reconnecting) keeps them as a backlog; the next
step's tokens are merged into it, so the router always gets a request's tokens in order, `pos` intact.
"""

from __future__ import annotations

from typing import Any, Protocol

from pdcluster.control.protocol import Tokens


class _Request(Protocol):   # the fields of node.DecodeRequest used here
    rid: str
    router: bytes
    prompt_ids: list[int]
    prefill_path: str
    num_cached_tokens: int
    first_sent: bool
    sent: int
    backlog: Tokens | None


def step_tokens(req: _Request, out: Any) -> Tokens:
    """The Tokens of one engine output (`RequestOutput`) for `req`, merged after its backlog if it has one."""
    msg = Tokens(rid=req.rid, ids=list(out.new_token_ids),
                 logprobs=[wire_logprob(lp) for lp in out.logprobs] if out.logprobs is not None else None,
                 finish=out.finish_reason if out.finished else None, pos=req.sent)
    req.sent += len(msg.ids)
    if not req.first_sent:
        req.first_sent = True
        msg.num_prompt_tokens = len(req.prompt_ids)
        msg.num_cached_tokens = req.num_cached_tokens or out.num_cached_tokens
        msg.prefill_path = req.prefill_path
    if req.backlog is not None:   # still held for a reconnecting router: send in order, as one message
        req.backlog.append(msg)
        msg, req.backlog = req.backlog, None
    return msg


def wire_logprob(lp: Any) -> Any:
    """Engine (logprob, [(id, logprob), ...]) -> msgpack-friendly lists."""
    if lp is None:
        return None
    return [float(lp[0]), [[int(t), float(v)] for t, v in lp[1]]]
