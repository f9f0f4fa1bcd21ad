"""A prompt on the prefill node: one typed lifecycle (a pure transition table, no I/O) and the engine-thread
side of its KV transfer.

    CONNECTING ──connected, in the engine──► QUEUED ──prompt done, KV handed over──► SENDING ──ack──► DONE
    CONNECTING ──unreachable / aborted / expired──► DONE
    QUEUED ──aborted / expired / engine refused──► DONE (the engine's abort frees its blocks)
    SENDING ──aborted / expired──► ABANDONED ──ack waiter returned──► DONE
    CONNECTING / QUEUED / SENDING ──the engine failed (the node leaves)──► DONE

A job is answered (`PrefillDone`) exactly once, on leaving CONNECTING / QUEUED / SENDING; ABANDONED is an
answered job whose transfer may still read its blocks, so they are freed only once the ack waiter returns.

Owners: every field of a `PrefillJob` belongs to the event loop. An `Outgoing` (the transfer) belongs to the
engine thread while its prompt is in the engine (`TransferConnector` owns the table of them and starts and
feeds the transfer from the engine's hooks); once the prompt is done the connector hands it to the event loop
(`PrefillJob.outgoing`), and from then on only the loop and the ack waiter it starts read it. One exception: a
prompt sent before its destination (`Prefill` with no `dst`, then `PrefillDestination`) enters the engine with
`Outgoing.dst` None; the loop sets `first_block` and then `dst`, once, and the engine thread starts the transfer
at its next hook that sees `dst` (a later layer of the step, or the prompt's end). If the prompt is done first,
the loop starts it (`PrefillJob.routed` is set once the transfer started or cannot).
"""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass, field
from typing import Any

from pdcluster.control.lifecycle import check_move
from pdcluster.kv_transfer import Destination, Transfer
from pdcluster.kv_transfer.per_rank import RankedTransfer


class JobState(enum.Enum):
    CONNECTING = "connecting"  # opening the connection to the KV receiver (off the engine thread)
    QUEUED = "queued"  # in the engine: prefilling, its KV leaving layer by layer
    SENDING = "sending"  # prompt done; the receiver's checksum ack awaited
    ABANDONED = "abandoned"  # answered (aborted) while sending: its blocks wait for the ack waiter
    DONE = "done"  # answered, nothing of it left on this node (terminal)


_NEXT: dict[JobState, set[JobState]] = {
    JobState.CONNECTING: {JobState.QUEUED, JobState.DONE},
    JobState.QUEUED: {JobState.SENDING, JobState.DONE},
    JobState.SENDING: {JobState.DONE, JobState.ABANDONED},
    JobState.ABANDONED: {JobState.DONE},
    JobState.DONE: set(),
}
ANSWER_PENDING = frozenset({JobState.CONNECTING, JobState.QUEUED, JobState.SENDING})


@dataclass
class Outgoing:
    """A prompt's KV on its way to the decode node: the engine thread's until the prompt is done."""
    rid: str
    dst: Destination | None  # None until the destination comes (set once, by the loop, after first_block)
    first_block: int  # the prompt's leading blocks the decode node already holds (not sent)
    num_blocks: int  # the prompt's blocks
    transfer: Transfer | RankedTransfer | None = None
    error: str | None = None  # why the transfer could not start
    nbytes: int = 0
    first_write: float = 0.0  # monotonic time the first write was queued
    src_blocks: list[int] | None = None  # the prompt's blocks here, kept when it was done before its destination


@dataclass
class PrefillJob:
    rid: str
    owner: bytes  # zmq identity of the decode node's DEALER: where PrefillDone goes, the only one that may abort
    prompt_ids: list[int]
    dst: Destination | None  # None until PrefillDestination comes
    skip_blocks: int
    deadline: float  # time.monotonic() seconds, from the Prefill message's timeout_s at receipt, renewed while queued
    timeout_s: float = 0.0  # the Prefill message's: how far each renewal moves the deadline (node.renew)
    state: JobState = JobState.CONNECTING
    outgoing: Outgoing | None = None  # handed over by the connector once the prompt is done
    unrouted: Outgoing | None = None  # the engine's Outgoing while the destination is awaited (the loop sets it)
    routed: asyncio.Event = field(default_factory=asyncio.Event)  # the transfer started, or never will
    starting: bool = False  # the loop has the engine thread start the transfer of a prompt done before it
    outcome: str = ""  # ok | error | aborted: set when answered
    lora: Any = None  # the engine's LoRARequest of Prefill.lora_name (None: the base model)
    lora_hash: str = ""  # the decode node's content hash of that adapter: ours must equal it

    def move(self, state: JobState) -> None:
        self.state = check_move(_NEXT, self.state, state, f"prefill job {self.rid!r}")

    @property
    def answered(self) -> bool:
        return self.state not in ANSWER_PENDING

    @property
    def aborted(self) -> bool:
        return self.outcome == "aborted"

    @property
    def queued(self) -> bool:
        """Its prompt is not computed yet (what `Load.queued_prefill_tokens` counts)."""
        return self.state in (JobState.CONNECTING, JobState.QUEUED)
