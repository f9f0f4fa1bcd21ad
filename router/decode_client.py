"""Per-request token streams from decode nodes over zmq, with retries and migration.

One DEALER per decode node (`PeerDealers`); replies (`Tokens`, the items of a `TokenBatch`, `Reject`,
`Progress`) are demultiplexed by rid into per-request queues. Each attempt of a request gets its own rid
(`<request id>.<attempt>`), so late messages from a node the request has left are simply dropped.

A `RequestStream`:
  * no decode node of its model at all when it starts -> it waits up to `queue_timeout` for one.
  * `Reject` (before any token) -> the next decode node, up to `max_retries`; none left -> NoCapacity.
  * no message for `stall_timeout` (a node sends `Progress` for a request that is queued or waiting on
    its prefill, so this is silence, not time to first token), the node left the cluster view, it ended
    the request with "abort"/"error", or tokens went missing (a `Tokens.pos` gap after a reconnect) ->
    migration: `Generate` again on another node with `resume_ids` = the tokens already received, up to
    `max_migrations`.
  * `abort()` (client gone, stop string hit) -> `Abort{rid}` to the node.
  * `move()` (rebalancing, or the node asked: `MoveAway`, it drains or its pool is short) -> live migration: the
    stream's KV is pre-copied to a target node (`PreCopy` / `PreCopied`) while it decodes on, then its node hands
    it back at a block boundary (`Handback`, `Tokens` finish "migrate") and the next attempt goes to the target,
    which fetches only the blocks filled since and recomputes nothing. Not counted against `max_migrations`.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import deque
from dataclasses import dataclass
from typing import Any, Collection

from pdcluster.control.protocol import (
    Abort,
    Generate,
    Handback,
    LoraDone,
    Message,
    MoveAway,
    PreCopied,
    PreCopy,
    Progress,
    Reject,
    TokenBatch,
    Tokens,
)
from pdcluster.control.sampling_params import SamplingParams
from pdcluster.control.transport import PeerDealers
from pdcluster.router.cluster import NodeState, RouterCluster
from pdcluster.router.lora import Adapter, lora_nodes
from pdcluster.router.metrics import RouterMetrics
from pdcluster.router.policies import (
    PrefillWork,
    Prompt,
    RoutingPolicy,
    best_cover,
    choose_prefill,
    decode_load,
    note_assignment,
    prefill_locally_pays,
    prefix_holder,
)
from pdcluster.router.settings import RouterSettings

log = logging.getLogger(__name__)

POLL_INTERVAL = 0.25  # how often a waiting stream re-checks node liveness and deadlines
REBALANCE_INTERVAL_S = 1.0   # at most one stream moved per interval (the Load reports catch up meanwhile)
MIN_REBALANCE_TOKENS = 16    # a stream with fewer tokens left to generate is not worth moving
DEFAULT_MAX_TOKENS: int = SamplingParams.max_tokens   # a sampling dict without max_tokens gets the engines' default
PRECOPY_TIMEOUT_S = 10.0     # a pre-copy not answered within this is given up
PRECOPY_HOLD_S = 20.0        # how long the target holds pre-copied blocks for the attempt that follows


class NoCapacity(Exception):
    """No decode node took the request (none alive, all rejected or overloaded)."""

    def __init__(self, reason: str, retry_after: float, overloaded: bool = False) -> None:
        super().__init__(reason)
        self.retry_after = retry_after
        self.overloaded = overloaded  # nodes exist but rejected it (429) vs none available (503)


class StreamFailed(Exception):
    """The request could not be completed (deadline, migrations exhausted)."""


class InvalidRequest(Exception):
    """The decode node found the request itself invalid (finish "invalid": a grammar its engine's compiler
    refused): a client error, answered with a 400 and tried nowhere else."""


class Mailbox:
    """One attempt's incoming messages: a deque and at most one waiting reader. Cheaper than an
    `asyncio.Queue` read under `wait_for` (a task per read), which the per-token path cannot afford; a
    wait has no timer of its own either: the client's ticker wakes every waiting reader each
    POLL_INTERVAL, so that it can check its node, deadline and stall timer."""

    __slots__ = ("_items", "_waiter")

    def __init__(self) -> None:
        self._items: deque = deque()
        self._waiter: asyncio.Future | None = None

    def put_nowait(self, msg: Any) -> None:
        self._items.append(msg)
        self.wake()

    def wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def empty(self) -> bool:
        return not self._items

    def peek(self) -> Any:
        return self._items[0]

    def get_nowait(self) -> Any:
        return self._items.popleft()

    async def get(self) -> Any:
        """The next message; TimeoutError when woken (by the ticker) without one."""
        if not self._items:
            self._waiter = waiter = asyncio.get_running_loop().create_future()
            try:
                await waiter
            finally:
                self._waiter = None
            if not self._items:
                raise asyncio.TimeoutError
        return self._items.popleft()


class DecodeClient:
    def __init__(self, cluster: RouterCluster, policy: RoutingPolicy, settings: RouterSettings,
                 metrics: RouterMetrics) -> None:
        self.cluster = cluster
        self.policy = policy
        self.settings = settings
        self.metrics = metrics
        self.queues: dict[str, Mailbox] = {}   # per attempt rid: late replies to a left node are dropped
        self.replies: dict[str, asyncio.Future] = {}   # LoraAdapter ops in flight, by rid
        self.streams: dict[str, RequestStream] = {}    # the attempt on a decode node of each open stream, by rid
        self.precopies: dict[str, RequestStream] = {}  # streams whose KV is being pre-copied, by their next rid
        self._rebalanced_at = 0.0
        self.tokens_received = 0   # generated token ids accepted from decode nodes (all streams, since start)
        self.dealers = PeerDealers(self._on_message, keys=cluster.keys, owner=settings.node_id)
        cluster.on_removed.append(self.dealers.drop)
        cluster.on_removed.append(metrics.forget_node)
        self._ticker: asyncio.Task | None = None

    def stream(self, prompt_ids: list[int], sampling: dict[str, Any], deadline: float,
               model: str | None = None, adapter: Adapter | None = None) -> RequestStream:
        """A stream for one engine request (one choice) on nodes serving `model` (under LoRA `adapter`), to be
        finished by `deadline` (`time.monotonic()` seconds); call `start()` then `next()`."""
        return RequestStream(self, prompt_ids, sampling, deadline, model, adapter)

    def _on_message(self, node_id: str, msg: Message) -> None:
        if isinstance(msg, TokenBatch):   # one engine step of a node: fan the items out to their streams
            queues = self.queues
            for item in msg.items:
                queue = queues.get(item.rid)
                if queue is not None:
                    queue.put_nowait(item)
            return
        if isinstance(msg, Progress):
            for rid in msg.rids:
                queue = self.queues.get(rid)
                if queue is not None:
                    queue.put_nowait(msg)
            return
        if isinstance(msg, MoveAway):   # the node wants the request elsewhere (draining, pool pressure)
            stream = self.streams.get(msg.rid)
            if stream is not None and stream._node_id == node_id:
                stream.move(msg.reason or "its node asks", fallback=msg.reason == "drain")
            return
        if isinstance(msg, PreCopied):
            stream = self.precopies.get(msg.rid)
            if stream is not None and stream._move is not None and stream._move.target == node_id:
                stream.precopied(msg)
            return
        if isinstance(msg, LoraDone):   # a node's answer to an adapter load / unload (router/lora.py)
            reply = self.replies.pop(msg.rid, None)
            if reply is not None and not reply.done():
                reply.set_result(msg)
            return
        msg_rid = getattr(msg, "rid", None)
        queue = self.queues.get(msg_rid) if isinstance(msg_rid, str) else None
        if queue is not None:
            queue.put_nowait(msg)

    def close(self) -> None:
        if self._ticker is not None and not self._ticker.get_loop().is_closed():
            self._ticker.cancel()
        self.dealers.close()
        self.queues.clear()

    def start_ticker(self) -> None:
        """Wake every waiting stream each POLL_INTERVAL (started with the first request, on the loop)."""
        loop = asyncio.get_running_loop()
        if self._ticker is None or self._ticker.done() or self._ticker.get_loop() is not loop:
            self._ticker = loop.create_task(self._tick())

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(POLL_INTERVAL)
            for queue in self.queues.values():   # wake() only schedules: the dict cannot change under us
                queue.wake()
            if self.settings.rebalance_threshold and time.monotonic() - self._rebalanced_at >= REBALANCE_INTERVAL_S:
                self._rebalanced_at = time.monotonic()
                self.rebalance()

    def rebalance(self) -> None:
        """When the busiest decode node (of a model) has more than `rebalance_threshold` requests over the least
        busy, move this router's stream there with the most tokens still to generate to another node with its KV
        (`RequestStream.move`). One move per REBALANCE_INTERVAL_S."""
        stream = rebalance_pick(self.cluster.candidates("decode"), list(self.streams.values()),
                                self.settings.rebalance_threshold)
        if stream is not None and stream._node_id is not None:
            log.info("request %s: rebalancing away from %s", stream.request_id, stream._node_id,
                     extra={"request_id": stream._rid})
            stream.move("rebalance", fallback=False)

    async def wait_for_node(self, model: str | None, deadline: float, request_id: str = "",
                            exclude: Collection[str] = frozenset()) -> None:
        """Return once some decode node of `model` (None: any; not in `exclude`) takes new work, or after
        `queue_timeout` (at most until `deadline`): a request that arrives before the first decode node registered,
        or while every one restarts, or one handed back by a draining node, waits for one instead of failing. Nodes
        that exist but are full answer Reject: no wait."""
        timeout = self.settings.queue_timeout
        if timeout <= 0 or self.cluster.candidates("decode", exclude, model):
            return
        self.metrics.queued.inc()
        log.info("request %s: no decode node serves %s yet; waiting up to %g s", request_id,
                 repr(model) if model else "any model", timeout, extra={"request_id": request_id})
        until = min(time.monotonic() + timeout, deadline)
        # Polled: a node shows up through the view's sync or its Load reports, and neither says so.
        while not self.cluster.candidates("decode", exclude, model) and (left := until - time.monotonic()) > 0:
            await asyncio.sleep(min(POLL_INTERVAL, left))

    def place(self, token_ids: list[int], max_tokens: int, exclude: set[str], model: str | None = None,
              remote_prefill: bool = True, adapter: Adapter | None = None, kv_holder: str | None = None,
              prefer: str | None = None) -> tuple[NodeState, NodeState | None, PrefillWork, tuple[str, int] | None]:
        """(decode node, prefill node or None, the prefill work counted on it, (node, blocks) the decode node
        fetches the prompt's prefix from or None) of `model` (None: any) for a request, or NoCapacity.
        `remote_prefill` False: the decode node prefills it (prompt logprobs are computed where the prompt runs).
        `adapter`: only nodes holding that LoRA adapter (or, if none does, able to load it); its KV hashes are its
        own, so no prefix fetch or local-tail choice is made from the index (base-model hashes) for it.
        `kv_holder`: a node that holds the KV of all of `token_ids` (it handed the request back): the decode node
        (`prefer` if it is a candidate: the one the KV was pre-copied to) fetches it from there and computes only
        the last partial block."""
        decode_nodes = self.cluster.candidates("decode", exclude, model, len(token_ids) + max_tokens)
        prefill_nodes = self.cluster.candidates("prefill", model=model, num_tokens=len(token_ids) + 1)
        if adapter is not None:
            decode_nodes, prefill_nodes = lora_nodes(decode_nodes, adapter), lora_nodes(prefill_nodes, adapter)
        if not decode_nodes:
            raise NoCapacity(f"no decode node available{f' for model {model!r}' if model else ''}"
                             f"{f' with LoRA adapter {adapter.name!r}' if adapter else ''}", self.settings.retry_after)
        prompt = Prompt(token_ids)
        holding = self.cluster.get(kv_holder) if kv_holder is not None else None
        if holding is not None:
            decode = next((n for n in decode_nodes if n.id == prefer), None) \
                or self.policy.pick_decode(decode_nodes, len(token_ids) + max_tokens, prompt)
            assert decode is not None   # there are candidates
            work = note_assignment(decode, None, 0)
            return decode, None, work, (holding.id, (len(token_ids) - 1) // decode.block_size)
        prefill = choose_prefill(self.policy, prefill_nodes, prompt, self.settings.disagg_min_tokens) \
            if remote_prefill else None
        prefix_aware = self.policy.name == "prefix_aware" and adapter is None
        # nodes a decode node may fetch the prompt's prefix from (the prefix-aware policy: the others do not look)
        holders = [n for n in self.cluster.holders(model) if n.id not in exclude] \
            if prefix_aware and self.settings.prefix_fetch else []
        disagg = self.settings.disagg_min_tokens
        maybe_local = prefix_aware and prefill is not None and prefill_locally_pays(
            prompt, prefill, best_cover(prompt, decode_nodes, holders), prefill.block_size, disagg)
        local = prefill is None or maybe_local
        # a decode node that prefills the prompt itself is picked with its cached prefix in mind
        decode = self.policy.pick_decode(decode_nodes, len(token_ids) + max_tokens, prompt if local else None)
        assert decode is not None   # there are candidates
        holder = prefix_holder(prompt, holders, decode, exclude=decode.id) if local and remote_prefill else None
        if maybe_local:
            assert prefill is not None
            covered = max(len(prompt.cached_tiers(decode)), holder[1] if holder else 0)
            if prefill_locally_pays(prompt, prefill, covered, decode.block_size, disagg):
                prefill = None
            else:   # the node picked holds less than the best one: the prefill node computes it after all
                holder = None
        work = note_assignment(decode, prefill, round(prompt.work_tokens(prefill)) if prefill else 0)
        return decode, prefill, work, (holder[0].id, holder[1]) if holder is not None else None


def rebalance_pick(nodes: list[NodeState], streams: list[RequestStream], threshold: int) -> RequestStream | None:
    """Of `streams`, the one to move for `rebalance`: on the busiest of `nodes` (of its model) when that has more
    than `threshold` requests over the least busy, the one with the most tokens left (at least
    MIN_REBALANCE_TOKENS), not asked before. None when nothing should move."""
    best: tuple[int, RequestStream] | None = None
    for stream in streams:
        node = next((n for n in nodes if n.id == stream._node_id), None)
        peers = [n for n in nodes if stream.model is None or n.serves(stream.model)]
        if node is None or stream.handed_back or stream.adapter is not None or len(peers) < 2 \
                or not stream.output_ids:   # not prefilled yet: nothing to take along
            continue
        if decode_load(node) - min(decode_load(n) for n in peers) <= threshold \
                or decode_load(node) < max(decode_load(n) for n in peers):
            continue
        left = stream.tokens_left
        if left >= MIN_REBALANCE_TOKENS and (best is None or left > best[0]):
            best = (left, stream)
    return best[1] if best else None


@dataclass
class Move:
    """A live migration of a stream (`RequestStream.move`)."""
    target: str                   # the decode node its KV is pre-copied to
    rid: str                      # the next attempt's rid: the target holds the blocks under it
    fallback: bool                # its node must let it go (drains): handed back even without a pre-copy
    timer: asyncio.TimerHandle    # gives the pre-copy up after PRECOPY_TIMEOUT_S
    ready: bool = False           # pre-copied; Handback sent: the next attempt goes to `target`


class RequestStream:
    def __init__(self, client: DecodeClient, prompt_ids: list[int], sampling: dict[str, Any],
                 deadline: float, model: str | None = None, adapter: Adapter | None = None) -> None:
        self.client = client
        self.model = model  # served name: only nodes of this model run it
        self.adapter = adapter  # a LoRA adapter of that model: only nodes holding it (or able to load it) run it
        self.prompt_ids = prompt_ids
        self.sampling = sampling
        self.deadline = deadline  # time.monotonic() seconds: a wall-clock step moves no deadline
        self.request_id = uuid.uuid4().hex
        self.output_ids: list[int] = []
        self.finished = False
        self.prefill_path = ""
        self.prompt_logprobs: list[Any] | None = None   # wire entries, from the first attempt that sent them
        self._attempt = 0
        self._rejected: set[str] = set()
        self._failed: set[str] = set()
        self._moved_from: set[str] = set()   # nodes that handed the request back (draining with migration)
        self._kv_holder: str | None = None   # the last of them: the next attempt fetches the KV from it
        self.handed_back = False   # a move to another node was started (rebalancing picks a stream once)
        self._move: Move | None = None   # a live migration under way
        self._checked_at = 0.0           # when _wait last checked the deadline and the move
        self._retries = 0
        self._migrations = 0
        self._retry_after = 0.0
        self._node_id: str | None = None   # decode node of the current attempt
        self._rid = ""
        self._queue: Mailbox | None = None
        self._last_message = 0.0
        self._attempt_ids = 0  # token ids received from the current attempt (what its next Tokens.pos must be)
        self._first: Tokens | None = None
        self._sent_at = 0.0  # monotonic time of the current attempt's Generate, until its first reply
        self._resumed = False   # the current attempt resumes after tokens already streamed (a migration)
        self._prefill_work = PrefillWork(None, 0)   # the current attempt's, taken back at its first token

    async def start(self) -> None:
        """Submit (once a decode node of the model is there: `DecodeClient.wait_for_node`) and wait for the
        first tokens: NoCapacity here means nothing was sent to the client."""
        await self.client.wait_for_node(self.model, self.deadline, self.request_id)
        self._first = await self.next()

    async def next(self) -> Tokens:
        """The Tokens received since the last call, as one message (its `finish` is set on the last one):
        a reader that fell behind gets everything queued at once, not one message per engine step."""
        if self._first is not None:
            first, self._first = self._first, None
            return self._take_queued(first)
        while True:
            if self.finished:
                raise StreamFailed("stream already finished")
            if self._node_id is None and self._moved_from:   # handed back: the others may still be joining
                await self.client.wait_for_node(self.model, self.deadline, self.request_id, self._moved_from)
            node_id = self._node_id or self._submit()
            msg = await self._wait()
            if isinstance(msg, Reject):
                self._count(node_id, "rejected")
                log.info("request %s: rejected by decode node %s: %s", self.request_id, node_id,
                         msg.reason, extra={"request_id": self._rid})
                self._rejected.add(node_id)
                self._retry_after = max(self._retry_after, msg.retry_after)
                self._detach(send_abort=False)
                self._retries += 1
                self.client.metrics.retries.inc()
                if self._retries > self.client.settings.max_retries:
                    raise NoCapacity(f"rejected by {len(self._rejected)} decode node(s): {msg.reason}",
                                     self._retry_after or self.client.settings.retry_after, overloaded=True)
                continue
            if msg is not None and msg.finish == "invalid":
                self._count(node_id, "ok")   # the node is fine; the request is not
                self.finished = True
                self._detach(send_abort=False)
                raise InvalidRequest(msg.error or "invalid request")
            if msg is not None and msg.finish == "migrate":   # the node drains: resume elsewhere with its KV
                self._move_away(node_id, msg.error or "")
                continue
            if msg is None or msg.finish in ("abort", "error"):
                reason = "stalled or left the cluster" if msg is None else f"ended it with {msg.finish}: {msg.error}"
                self._migrate(reason)
                continue
            if 0 <= msg.pos != self._attempt_ids:
                self._migrate(f"lost tokens {self._attempt_ids}..{msg.pos - 1} of its stream (reconnect?)")
                continue
            if self._sent_at:
                self._prefill_work.done()   # the prompt is prefilled: no longer work queued on its prefill node
                if self._resumed:   # all but its last token were computed before: what the new node did again
                    self.client.metrics.resumed_recomputed_tokens.inc(
                        max(0, msg.num_prompt_tokens - msg.num_cached_tokens - 1))
                if self.client.cluster.is_alive(node_id):   # see _count
                    self.client.metrics.backend_first_token.labels(node_id).observe(time.monotonic() - self._sent_at)
                self._sent_at = 0.0
            if msg.prefill_path:
                self.prefill_path = msg.prefill_path
            self._accept(msg)
            return self._take_queued(msg)

    def _accept(self, msg: Tokens) -> None:
        """`msg` (in order, of the current attempt) is received."""
        self._attempt_ids += len(msg.ids)
        self.client.tokens_received += len(msg.ids)
        self.output_ids.extend(msg.ids)
        if msg.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = msg.prompt_logprobs[:len(self.prompt_ids)]
        self._last_message = time.monotonic()
        if msg.finish is not None:
            self._count(self._node_id, "ok")
            log.info("request %s: finished on %s (%s, %d tokens, prefill %s)", self.request_id,
                     self._node_id, msg.finish, len(self.output_ids), self.prefill_path or "?",
                     extra={"request_id": self._rid})
            self.finished = True
            self._detach(send_abort=False)

    def _take_queued(self, msg: Tokens) -> Tokens:
        """`msg` with the in-order Tokens queued behind it appended; stops before anything that ends the
        attempt otherwise (a Reject, an abort/error finish, a gap), which the next `next()` handles."""
        queue = self._queue
        while msg.finish is None and queue is not None and not queue.empty():
            more = queue.peek()
            if isinstance(more, Progress):
                queue.get_nowait()
                continue
            if not isinstance(more, Tokens) or more.finish in ("abort", "error", "invalid", "migrate") \
                    or 0 <= more.pos != self._attempt_ids:
                break
            queue.get_nowait()
            self._accept(more)
            msg.append(more)
        return msg

    def abort(self, reason: str = "client") -> None:
        """Stop the request on its decode node (idempotent; no-op once finished)."""
        if self._node_id is not None and not self.finished:
            self.client.metrics.aborts.labels(reason).inc()
        self.finished = True
        self._detach(send_abort=True)

    def _submit(self) -> str:
        """Send the request (resuming from the tokens received) to a decode node; the node's id."""
        if time.monotonic() > self.deadline:
            raise StreamFailed("request deadline exceeded")
        exclude = self._rejected | self._failed | self._moved_from
        max_tokens = self.sampling.get("max_tokens", DEFAULT_MAX_TOKENS)
        try:
            decode, prefill, self._prefill_work, source = self.client.place(
                self.prompt_ids + self.output_ids, max_tokens - len(self.output_ids), exclude, self.model,
                self.sampling.get("prompt_logprobs") is None, self.adapter, self._kv_holder,
                self._move.target if self._move is not None and self._move.ready and self._kv_holder else None)
            # the hand-back is one move: later attempts may go anywhere (back there too), the index decides
            self._kv_holder = None
            self._drop_move()
            self._moved_from.clear()
        except NoCapacity as exc:
            if self._rejected:
                raise NoCapacity(f"all decode nodes rejected the request ({len(self._rejected)} tried)",
                                 self._retry_after or exc.retry_after, overloaded=True) from None
            raise
        self._attempt += 1
        self._rid = f"{self.request_id}.{self._attempt}"
        self._node_id = decode.id
        self.client.streams[self._rid] = self
        self._queue = self.client.queues[self._rid] = Mailbox()
        self.client.start_ticker()   # what wakes this attempt's waits to check node, deadline and stall
        self._last_message = self._sent_at = time.monotonic()
        self._resumed = bool(self.output_ids)
        self._attempt_ids = 0
        log.info("request %s: attempt %d to decode node %s, prefill %s (%d prompt + %d resumed tokens)",
                 self.request_id, self._attempt, decode.id, prefill.id if prefill else "local",
                 len(self.prompt_ids), len(self.output_ids), extra={"request_id": self._rid})
        sent = self.client.dealers.send(decode.id, decode.info.control_addr, Generate(
            rid=self._rid, prompt_ids=self.prompt_ids, sampling=self.sampling,
            prefill_node=prefill.id if prefill else None, timeout_s=self.deadline - time.monotonic(),
            router=self.client.settings.node_id, resume_ids=list(self.output_ids),
            kv_source=source[0] if source else None, kv_source_blocks=source[1] if source else 0,
            lora_name=self.adapter.name if self.adapter else "", lora_path=self.adapter.path if self.adapter else ""))
        if not sent:
            self._queue.put_nowait(None)  # treated like a dead node: try the next one
        return decode.id

    async def _wait(self) -> Tokens | Reject | None:
        """The node's next message, or None when it stalled / left the view / the deadline passed.
        `Progress` only restarts the stall timer."""
        assert self._queue is not None and self._node_id is not None
        stall = self.client.settings.stall_timeout
        queue = self._queue
        while True:
            try:
                msg = await queue.get()
                if not isinstance(msg, Progress):
                    # a node whose messages never let the mailbox run dry must not keep its stream from the checks
                    if time.monotonic() - self._checked_at >= POLL_INTERVAL:
                        self._check_deadline_and_move()
                    return msg
                self._last_message = time.monotonic()
            except asyncio.TimeoutError:
                pass
            self._check_deadline_and_move()
            if self._queue is not queue:
                raise StreamFailed("stream aborted")
            if not self.client.cluster.is_alive(self._node_id):
                return None
            if time.monotonic() - self._last_message > stall:
                return None

    def _check_deadline_and_move(self) -> None:
        """Each POLL_INTERVAL, whether or not the node's messages keep coming: the deadline, and whether the target
        of a pre-copy under way left the cluster (which gives the pre-copy up at once)."""
        self._checked_at = now = time.monotonic()
        if now > self.deadline:
            self.abort("deadline")
            raise StreamFailed("request deadline exceeded")
        move = self._move
        if move is not None and not move.ready and not self.client.cluster.is_alive(move.target):
            self.precopied(PreCopied(rid=move.rid, error=f"{move.target} left the cluster"))

    @property
    def tokens_left(self) -> int:
        return int(self.sampling.get("max_tokens", DEFAULT_MAX_TOKENS)) - len(self.output_ids)

    def _move_away(self, node_id: str, why: str) -> None:
        """The node handed the request back to run elsewhere (it drains with migration): not a failure and not
        counted against max_migrations; the next attempt's node fetches the KV of the prompt and the tokens so far
        from it (`place(kv_holder=...)`)."""
        self._moved_from.add(node_id)
        self._kv_holder = node_id
        self._count(node_id, "ok")
        self._detach(send_abort=False)
        self.client.metrics.migrations.inc()
        log.info("request %s: decode node %s hands it over (%s); resuming elsewhere after %d tokens with its KV",
                 self.request_id, node_id, why, len(self.output_ids), extra={"request_id": self._rid})

    def move(self, why: str, fallback: bool) -> None:
        """Move this stream to another decode node with its KV and no pause (live migration): pre-copy the full
        blocks of its tokens so far to a target (`PreCopy`) while it decodes on, then have its node hand it back at a
        block boundary (`Handback`); the next attempt goes to the target, which copies only the blocks filled
        since. `fallback` (its node drains): if the pre-copy fails it is handed back all the same; without a target
        nothing happens (its node asks again, and in the end hands it back itself)."""
        node_id = self._node_id
        if node_id is None or self.finished or self._move is not None or self.adapter is not None:
            return
        self.handed_back = True   # rebalancing tries a stream once
        if not self.client.settings.migration_precopy:
            self._hand_back()
            return
        tokens = self.prompt_ids + self.output_ids
        need = len(tokens) + self.tokens_left
        nodes = self.client.cluster.candidates("decode", self._rejected | self._failed | {node_id}, self.model, need)
        target = self.client.policy.pick_decode(nodes, need) if nodes else None
        blocks = (len(tokens) - 1) // target.block_size if target is not None else 0
        if target is None or blocks == 0:   # its node asks again (or gives up and hands it back itself)
            log.info("request %s: no node to pre-copy its KV to (%s)", self.request_id, why,
                     extra={"request_id": self._rid})
            if fallback and target is not None:
                self._hand_back()
            return
        rid = f"{self.request_id}.{self._attempt + 1}"   # what the target's attempt will be called
        timer = asyncio.get_running_loop().call_later(
            PRECOPY_TIMEOUT_S, lambda: self.precopied(PreCopied(rid=rid, error=f"no answer in {PRECOPY_TIMEOUT_S} s")))
        self._move = Move(target.id, rid, fallback, timer)
        self.client.precopies[rid] = self
        log.info("request %s: moving from %s to %s (%s): pre-copying %d blocks", self.request_id, node_id, target.id,
                 why, blocks, extra={"request_id": self._rid})
        if not self.client.dealers.send(target.id, target.info.control_addr, PreCopy(
                rid=rid, token_ids=tokens, kv_source=node_id, num_blocks=blocks, timeout_s=PRECOPY_HOLD_S)):
            self.precopied(PreCopied(rid=rid, error=f"could not send PreCopy to {target.id}"))

    def precopied(self, msg: PreCopied) -> None:
        """The target's answer to the pre-copy (or its timeout): hand the stream back from its node now."""
        move = self._move
        if move is None or move.rid != msg.rid or move.ready:
            return
        if self.finished or self._node_id is None:
            self._drop_move()
            return
        self.client.precopies.pop(msg.rid, None)
        move.timer.cancel()
        ok = bool(msg.num_blocks) and not msg.error
        self.client.metrics.pre_copies.labels("ok" if ok else "failed").inc()
        if ok:
            move.ready = True
            self._hand_back()
            return
        self._move = None
        log.info("request %s: pre-copy to %s failed (%s)%s", self.request_id, move.target, msg.error,
                 "; handing it back without one" if move.fallback else "; it stays", extra={"request_id": self._rid})
        if move.fallback:
            self._hand_back()

    def _drop_move(self) -> None:
        if self._move is not None:
            self._move.timer.cancel()
            self.client.precopies.pop(self._move.rid, None)
            self._move = None

    def _hand_back(self) -> None:
        assert self._node_id is not None
        self.client.dealers.send_existing(self._node_id, Handback(rid=self._rid))

    def _migrate(self, reason: str) -> None:
        node_id = self._node_id or "?"
        self._failed.add(node_id)
        self._count(node_id, "failed")
        self._detach(send_abort=True)
        self._migrations += 1
        if self._migrations > self.client.settings.max_migrations:
            raise StreamFailed(f"decode node {node_id} {reason}; migrations exhausted")
        log.warning("request %s: decode node %s %s; migrating with %d tokens", self.request_id, node_id,
                    reason, len(self.output_ids))
        self.client.metrics.migrations.inc()

    def _count(self, node_id: str | None, outcome: str) -> None:
        """One attempt's outcome on its node, unless the node already left the view: its label children are
        gone then (RouterMetrics.forget_node), and one made again now would stay forever."""
        if node_id is not None and self.client.cluster.is_alive(node_id):
            self.client.metrics.backend_requests.labels(node_id, outcome).inc()

    def _detach(self, send_abort: bool) -> None:
        if self._node_id is None:
            return
        queue = self.client.queues.pop(self._rid, None)
        self.client.streams.pop(self._rid, None)
        if queue is not None:
            queue.wake()   # a reader waiting on it returns (and sees the stream finished)
        if send_abort:
            self.client.dealers.send_existing(self._node_id, Abort(rid=self._rid))
        if self.finished:
            self._drop_move()
        self._node_id = None
        self._queue = None
