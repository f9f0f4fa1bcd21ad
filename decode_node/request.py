"""A request on the decode node: one typed lifecycle (a pure transition table, no I/O) and its token stream
to the router.

    NEW ──remote──► RESERVING ──reserved, destination sent─────► PREFILLING ──PrefillDone──► WAITING_KV
     │                 │                                            │                          │
     │                 └──too few blocks──► ENGINE ◄──KV landed─────┼──────────────────────────┘
     │                                        ▲                     │ error / timeout / peer gone / bad KV
     └──local─────────────────────────────────┤                     ▼
                                              └──remote_kv_failed── RELEASING (no write can land yet)
    ENGINE ──the engine finished it, tokens held for the router──► FINISHED ──sent──► GONE
    ENGINE / FINISHED ──sent, aborted or failed──► GONE
    PREFILLING / WAITING_KV / RELEASING ──abort──► ABORTING (the reservation drains) ──► GONE
    RESERVING ──abort──► GONE (the engine's abort, queued behind its add, frees the reservation; Abort to the peer)
    RESERVING: the Prefill went to the peer on entering it (the prefill starts while the blocks are reserved);
    a PrefillDone (an error: the peer has no destination yet) is kept until the blocks are reserved,
    then the request goes to RELEASING as from PREFILLING
    any state ──the engine failed (the node leaves)──► GONE

Every field of a `DecodeRequest` belongs to the event loop: only the loop reads or writes it (the decode
node's handlers, `stream`). The engine thread never touches one; its side of the request is the engine's
own (the `Sequence`, reached through `engine_thread.call` / `post`, and the connector's
`on_remote_reserved`, which only hops to the loop).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from pdcluster.control.lifecycle import check_move
from pdcluster.control.protocol import Tokens, logprob_to_wire
from pdcluster.control.sampling_params import SamplingParams


class State(enum.Enum):
    NEW = "new"  # admitted, not yet handed to the engine (a remote prefill may wait here for KV room)
    RESERVING = "reserving"  # remote: Prefill sent; the engine reserves blocks for the whole prompt
    PREFILLING = "prefilling"  # remote: Prefill sent; PrefillDone awaited
    WAITING_KV = "waiting_kv"  # remote: PrefillDone came; the receiver's checksum ack awaited
    RELEASING = "releasing"  # remote failed: reservation cancelled; waiting until no write can land
    ABORTING = "aborting"  # aborted while remote: the reservation drains, then the request is gone
    ENGINE = "engine"  # the engine owns it (local prefill or decode); its outputs stream to the router
    FINISHED = "finished"  # the engine finished it; its last tokens wait for the router (reconnecting)
    GONE = "gone"  # out of the node (terminal)


_NEXT: dict[State, set[State]] = {
    State.NEW: {State.RESERVING, State.ENGINE, State.GONE},
    State.RESERVING: {State.PREFILLING, State.ENGINE, State.RELEASING, State.GONE},
    State.PREFILLING: {State.WAITING_KV, State.RELEASING, State.ABORTING, State.GONE},
    State.WAITING_KV: {State.ENGINE, State.RELEASING, State.ABORTING, State.GONE},
    State.RELEASING: {State.ENGINE, State.ABORTING, State.GONE},
    State.ABORTING: {State.GONE},
    State.ENGINE: {State.FINISHED, State.GONE},
    State.FINISHED: {State.GONE},
    State.GONE: set(),
}

# The router's `Progress` word for a silent request in each state (the wire keeps these three).
_PROGRESS = {State.PREFILLING: "prefilling", State.WAITING_KV: "waiting_kv"}
REMOTE = frozenset({State.RESERVING, State.PREFILLING, State.WAITING_KV, State.RELEASING, State.ABORTING})


class RemoteFailure(enum.Enum):
    """Why a remote prefill fell back to a local one; the values are the `remote_failures{reason}` labels."""
    UNKNOWN_NODE = "unknown_node"  # the router named a node that is not a prefill node in the view
    NO_BLOCKS = "no_blocks"  # too few free blocks to reserve the whole prompt
    SEND_FAILED = "send_failed"  # the Prefill could not be queued to the peer
    TIMEOUT = "timeout"  # no PrefillDone within prefill_timeout
    PREFILL_ERROR = "prefill_error"  # the peer answered an error, a bad first token, or left the cluster
    CHECKSUM = "checksum"  # the KV that landed is not what the peer sent
    TRANSFER = "transfer"  # the receiver reported the transfer failed or did not resolve in time
    INTERNAL = "internal"  # a bug on this node (logged with its traceback)

    @property
    def counts_as_transfer_failure(self) -> bool:
        return self in (RemoteFailure.CHECKSUM, RemoteFailure.TRANSFER)


@dataclass
class DecodeRequest:
    rid: str
    owner: bytes  # zmq identity of the router's DEALER that sent it: where Tokens go, the only one that may abort
    prompt_ids: list[int]  # Generate.prompt_ids + resume_ids
    params: SamplingParams
    deadline: float  # time.monotonic() seconds (0: none); from the message's timeout_s at receipt
    prefill_node: str  # the prefill node the router chose ("": prefill here)
    prefill_addr: str = ""  # its control address, from the cluster view at admission
    prefill_slices: int = 0  # its KV pool's rank slices (Capacity.kv_rank_slices; 0: one pool), each a KV writer
    kv_source: str = ""  # the node holding more of the prompt's prefix (Generate.kv_source): fetched from it
    lora: Any = None  # the engine's LoRARequest of the request's adapter (Generate.lora_name); None: the base model
    lora_hash: str = ""  # that adapter's content hash on this node (Prefill.lora_hash)
    state: State = State.NEW
    prefill_path: str = "local"  # "local" | "remote:<node id>", reported on the first Tokens
    num_cached_tokens: int = 0
    remote_started: float = 0.0  # monotonic time the remote prefill began (for its latency histogram)
    timer: Any = None  # the loop's prefill_timeout handle while PREFILLING
    early_failure: tuple[RemoteFailure, str] | None = None  # the prefill peer failed it while RESERVING
    sent: int = 0  # token ids sent so far (the next Tokens.pos)
    ahead: int = 0  # of those, sent before the engine reported them (a remote prefill's first token)
    last_sent: float = 0.0  # monotonic time of the last message that reached the router
    backlog: Tokens | None = None  # tokens the router could not take yet (merged), sent when it is back
    outcome: str = ""  # stop | length (the engine's finish) | abort | error: set on FINISHED / GONE
    handback_from: int = -1  # `sent` when the router asked for it back (Handback); -1: not asked
    move_reason: str = ""  # why this node asked its router to move it (MoveAway: drain, pressure); "": not asked
    move_asked: float = 0.0  # monotonic time of that ask
    move_nagged: float = 0.0  # ... and of the last time it asked again (a draining node repeats it)

    def move(self, state: State) -> None:
        self.state = check_move(_NEXT, self.state, state, f"request {self.rid!r}")

    @property
    def progress(self) -> str:
        """What a `Progress` heartbeat says of this request while it is silent."""
        return _PROGRESS.get(self.state, "queued")

    @property
    def remote(self) -> bool:
        """The engine has not got the prompt to run yet: a prefill node computes it (or it is being given up)."""
        return self.state in REMOTE

    @property
    def aborted(self) -> bool:
        return self.state is State.ABORTING or self.outcome == "abort"

    # ---- the token stream to the router ------------------------------------------------------------

    def tokens(self, out: Any) -> Tokens:
        """The Tokens of one engine output (`RequestOutput`), merged after the backlog if there is one; a
        finished output moves the request to FINISHED (its tokens may still wait for the router). Ids sent
        ahead (`first_token_ahead`) are left out: that output then only says whether the request finished."""
        if self.state is not State.ENGINE:
            raise RuntimeError(f"request {self.rid!r}: tokens while {self.state.value}: the engine does not own it")
        ids, lps = list(out.new_token_ids)[self.ahead:], out.logprobs
        lps = lps[self.ahead:] if lps is not None else None
        self.ahead = 0
        msg = Tokens(rid=self.rid, ids=ids, logprobs=[logprob_to_wire(lp) for lp in lps] if lps is not None else None,
                     finish=out.finish_reason if out.finished else None, pos=self.sent)
        if self.sent == 0:   # the request's first message
            self._first_message(msg, out.num_cached_tokens)
            if out.prompt_logprobs is not None:
                msg.prompt_logprobs = [logprob_to_wire(lp) for lp in out.prompt_logprobs]
        self.sent += len(msg.ids)
        if out.finished:
            self.move(State.FINISHED)
            self.outcome = out.finish_reason or "stop"
        if self.backlog is not None:   # still held for a reconnecting router: send in order, as one message
            self.backlog.append(msg)
            msg, self.backlog = self.backlog, None
        return msg

    def first_token_ahead(self, token: int, logprob: Any) -> Tokens:
        """The Tokens of a remote prefill's first token, sent as its KV lands, before the engine (at its next
        step boundary) reports it; the engine's output for it is then trimmed by `tokens`."""
        if self.state is not State.ENGINE or self.sent:
            raise RuntimeError(f"request {self.rid!r}: a first token ahead while {self.state.value}, {self.sent} sent")
        msg = Tokens(rid=self.rid, ids=[token], logprobs=[logprob_to_wire(logprob)] if logprob is not None else None,
                     pos=0)
        self._first_message(msg, 0)
        self.sent = self.ahead = 1
        return msg

    def _first_message(self, msg: Tokens, engine_cached_tokens: int) -> None:
        msg.num_prompt_tokens = len(self.prompt_ids)
        msg.num_cached_tokens = self.num_cached_tokens or engine_cached_tokens
        msg.prefill_path = self.prefill_path

    def delivered(self, now: float) -> None:
        """The last message reached the router."""
        self.last_sent = now

    def hold(self, msg: Tokens) -> None:
        """The router could not take `msg`: keep it; the next tokens are merged after it."""
        self.backlog = msg

    def backlog_delivered(self, now: float) -> None:
        """The held tokens reached the router."""
        self.backlog = None
        self.last_sent = now
