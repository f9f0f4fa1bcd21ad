"""A live migration's pre-copy, on the target decode node.

The router moves a running request from node S to this node in two steps. First `PreCopy`: while the request keeps
decoding on S, this node copies the full blocks of its tokens so far from S (the prefix fetch: FetchKV, the KV
channel, the end-to-end checksum: decode_node/prefix_fetch.py) into its prefix cache and holds them under the
request id the router will use next (`LLMEngine.prefetch`), then answers `PreCopied`. Then the router has S hand
the request back at its next block boundary and sends `Generate` here with that id: the engine finds the held
blocks as prefix hits and fetches only the blocks S filled since (the stop-and-copy), so nothing is recomputed.
Nodes whose KV pool is sliced per tensor-parallel rank move it the same way, every rank its slice over its own
channel (S's RankedSender into this node's per-rank reservations).

A hold has an owner (the router that asked) and a deadline (`PreCopy.timeout_s`): it ends when the request's first
output comes, when the request ends, or at the deadline, whichever is first. A failed copy holds nothing and says
so: the router leaves the request where it is (or, for a draining node, moves it without a pre-copy).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Callable

from prometheus_client import CollectorRegistry, Counter

from pdcluster.control.cluster_view import ClusterView
from pdcluster.control.metrics import get_or_create
from pdcluster.control.protocol import Message, PreCopied, PreCopy
from pdcluster.engine.engine_thread import EngineThread

log = logging.getLogger(__name__)

SUFFIX = "#pre"   # the engine's id of a held prefix: the request's own id comes with its Generate
MAX_HOLDS = 16    # pre-copies held at once (each pins up to a whole request's KV)


@dataclass
class Hold:
    rid: str          # the request id the router sends next
    owner: bytes      # the router that asked (the only one its PreCopied goes to)
    source: str       # the node the blocks are copied from
    timer: asyncio.TimerHandle | None = None
    hits: int = 0     # blocks this pool had already
    answered: bool = False

    @property
    def key(self) -> str:
        return self.rid + SUFFIX


class PreCopies:
    def __init__(self, node_id: str, view: ClusterView, engine_thread: EngineThread,
                 send: Callable[[bytes, Message], bool], registry: CollectorRegistry) -> None:
        self.node_id = node_id
        self.view = view
        self.engine_thread = engine_thread
        self.send = send
        self.holds: dict[str, Hold] = {}   # by the request id the router sends next
        self.outcomes = get_or_create(registry, Counter, "pdcluster_node_pre_copies_total",
                                      "live-migration pre-copies into this node by outcome (ok, failed)",
                                      ("outcome",))

    def handle(self, identity: bytes, msg: PreCopy) -> None:
        if msg.rid in self.holds:
            log.warning("pre-copy %s: already held; duplicate dropped", msg.rid)
            return
        peer = self.view.nodes.get(msg.kv_source)
        error = (f"holder {msg.kv_source!r} is not a decode node of this cluster"
                 if peer is None or peer.role != "decode" or msg.kv_source == self.node_id
                 else f"{len(self.holds)} pre-copies held already" if len(self.holds) >= MAX_HOLDS else "")
        if error:
            self.outcomes.labels("failed").inc()
            self.send(identity, PreCopied(rid=msg.rid, error=error))
            return
        hold = self.holds[msg.rid] = Hold(msg.rid, identity, msg.kv_source)
        hold.timer = asyncio.get_running_loop().call_later(msg.timeout_s, self.release, msg.rid)
        key, ids, n = hold.key, list(msg.token_ids), msg.num_blocks
        fut = self.engine_thread.call(lambda e: e.prefetch(key, ids, n))
        fut.add_done_callback(lambda f: self._started(hold, f))

    def _started(self, hold: Hold, fut: asyncio.Future) -> None:
        if fut.exception() is not None:
            self._answer(hold, 0, f"the engine refused it: {fut.exception()}")
            self.release(hold.rid)
            return
        hold.hits, fetching = fut.result()
        if not fetching:
            self._answer(hold, hold.hits)

    def source_of(self, key: str) -> str | None:
        """The holder to fetch from when the engine asks for the blocks of held prefix `key`; None if not one."""
        hold = self.holds.get(key.removesuffix(SUFFIX)) if key.endswith(SUFFIX) else None
        return hold.source if hold is not None else None

    def fetched(self, key: str, done: int, reason: str) -> None:
        """The fetch of held prefix `key` ended with `done` blocks landed."""
        hold = self.holds.get(key.removesuffix(SUFFIX))
        if hold is not None:
            self._answer(hold, hold.hits + done, reason)

    def _answer(self, hold: Hold, blocks: int, reason: str = "") -> None:
        if hold.answered:
            return
        hold.answered = True
        self.outcomes.labels("ok" if blocks else "failed").inc()
        self.send(hold.owner, PreCopied(rid=hold.rid, num_blocks=blocks,
                                        error=None if blocks else (reason or "no block could be copied")))
        log.info("pre-copy %s: %d blocks held from %s%s", hold.rid, blocks, hold.source,
                 f" ({reason})" if reason and not blocks else "", extra={"request_id": hold.rid})

    def release(self, rid: str) -> None:
        """Let the blocks held for `rid` go (its request runs, ended, or never came)."""
        hold = self.holds.pop(rid, None)
        if hold is None:
            return
        if hold.timer is not None:
            hold.timer.cancel()
        if not hold.answered:
            self._answer(hold, 0, "released before the copy ended")
        key = hold.key
        self.engine_thread.post(lambda e: e.abort(key))   # a fetch in flight keeps its blocks pinned until it ends
