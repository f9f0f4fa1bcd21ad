"""The decode node: admission, remote (or local) prefill, the decode loop, token streaming to routers.

A request's path (docs/design.md §3; the states are decode_node/request.py's): `Generate` from a router → (once the
pool has room for its prompt beside the requests held here, each with `kv_reserve_tokens` to grow: `_kv_room_for`;
until then it waits in `kv_queue`) `Prefill` to the chosen prefill node, which starts on the prompt, and
`add_request(remote_kv=True)`: the engine reserves blocks for the whole prompt (leading blocks already in this
node's prefix cache are shared, not re-sent) and reports them through the connector's `on_remote_reserved` →
`PrefillDestination` to the prefill node, which writes the prompt's KV straight into the reserved blocks of this
node's pool (layer by layer as it computes them) → on `PrefillDone` + the receiver's checksum ack,
`remote_kv_landed`: the sequence joins the running batch → one message per engine step per router: a `TokenBatch`
of the new tokens of each of its requests (`Tokens` when only one has any). Any failure of the remote part
(timeout, checksum, prefill node gone or erroring) cancels the reservation, waits until no write can land, and
hands the prompt back with `remote_kv_failed`: the engine prefills it locally (§5).

While a request sends no token (queued, waiting on its prefill or its KV) the router hears `Progress` for
it on admission and every `heartbeat_interval`, so its stall timer measures silence, not time to first
token. Tokens that cannot reach the router (it is reconnecting) are held, merged, and sent when it is
back; a router gone for `router_reconnect_timeout` gets its requests aborted.

Live migration: this node asks a request's router to move it (`MoveAway`: draining, or the pool about to preempt),
the router has a target pre-copy its KV from here (`PreCopy` there; this node lends the blocks, `KVLender`), then asks
for it back (`Handback`): it is handed over at its next block boundary. As a target, `PreCopies` holds the copied
blocks for the attempt that follows (decode_node/pre_copy.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from typing import Callable, Mapping

from pdcluster.control.protocol import (
    Abort,
    Generate,
    Handback,
    KVFetched,
    Load,
    Message,
    MoveAway,
    PreCopied,
    PreCopy,
    Prefill,
    PrefillDestination,
    PrefillDone,
    Progress,
    Reject,
    TokenBatch,
    Tokens,
    logprob_from_wire,
)
from pdcluster.control.records import NodeInfo
from pdcluster.control.sampling_params import SamplingParams
from pdcluster.control.transport import PeerDealers
from pdcluster.decode_node.metrics import DecodeMetrics
from pdcluster.decode_node.pre_copy import PreCopies
from pdcluster.decode_node.prefix_fetch import PrefixFetches
from pdcluster.decode_node.request import DecodeRequest, RemoteFailure, State
from pdcluster.engine.kv_connector import KVConnector
from pdcluster.engine.llm_engine import LLMEngine
from pdcluster.engine.outputs import RequestOutput
from pdcluster.kv_transfer import KVReceiver, KVSender, SharedKVPool, sweep_dead_pools
from pdcluster.kv_transfer.errors import ChecksumError
from pdcluster.kv_transfer.per_rank import RankedReceiver, RankedSender
from pdcluster.node.config import NodeConfig, engine_args_from_config
from pdcluster.node.rank_kv import RankKV
from pdcluster.node.service import NodeService

log = logging.getLogger(__name__)

MOVE_ASK_TIMEOUT_S = 15.0   # a draining node hands a request back itself when its router did not within this
MOVE_REASK_S = 1.0          # meanwhile it asks again this often (the router may not see a target node yet)
MAX_MOVES = 4               # requests a draining node has on the move at once (each pre-copy takes a lending slot)


class RemoteKVConnector(KVConnector):
    """The engine's decode-side hooks, on the engine thread: a `remote_kv=True` request's reserved blocks go to
    `on_reserved`, the blocks to fetch from another node to `fetch` (both hop to the event loop)."""

    fetches = True

    def __init__(self, on_reserved: Callable[[str, list[int], int], None],
                 fetch: Callable[[str, list[int], list[int]], None]) -> None:
        self.on_reserved = on_reserved
        self.fetch = fetch

    def on_remote_reserved(self, request_id: str, block_ids: list[int], num_cached_tokens: int) -> None:
        self.on_reserved(request_id, list(block_ids), num_cached_tokens)

    def on_fetch(self, request_id: str, block_ids: list[int], block_hashes: list[int]) -> None:
        self.fetch(request_id, list(block_ids), list(block_hashes))


class DecodeNode(NodeService):
    role = "decode"
    upstream = "router"

    def __init__(self, config: NodeConfig, prefill_timeout: float | None = None,
                 max_queue: int | None = None) -> None:
        self.shm: SharedKVPool | None = None
        args = engine_args_from_config(config, kv_pool_factory=lambda shape, dtype: self._make_shared_pool(
            config.device, shape, dtype))
        connector = RemoteKVConnector(self._remote_reserved, self._fetch_asked)
        engine = LLMEngine(args, kv_connector=connector)   # loads the model
        super().__init__(config, engine)
        self.prefill_timeout = config.prefill_timeout if prefill_timeout is None else prefill_timeout
        self.kv_landing_timeout = config.kv_landing_timeout
        self.kv_release_timeout = config.kv_release_timeout
        self.heartbeat_interval = config.heartbeat_interval
        self.router_reconnect_timeout = config.router_reconnect_timeout
        self._unreachable: dict[bytes, float] = {}  # router identity -> monotonic time its sends began failing
        self.max_in_flight = config.max_num_seqs + (config.max_num_seqs if max_queue is None else max_queue)
        self.metrics = DecodeMetrics(self.registry)
        pool = engine.kv_pool.tensor
        shm_name = self.shm.name if self.shm is not None and pool.device.type == "cpu" else None
        # A pool sliced per rank: every rank receives its own slice (pdcluster/node/rank_kv.py), on kv_port + rank
        self.rank_kv = RankKV.start(engine, config, self.kv_key, receive=True) if engine.rank_sliced_pool else None
        self._rank_lend_sender: RankedSender | None = None   # lends every rank's slice (`kv_sender`)
        # A device pool: the collective backend (hccl/nccl) writes into it, no shm.
        local = KVReceiver(pool, host=config.host, port=config.kv_port, shm_name=shm_name, auth_key=self.kv_key,
                           total_kv_heads=engine.kv_pool.model_kv_heads,
                           rank_slice=self.rank_kv.rank_slice if self.rank_kv else None)
        self.receiver: KVReceiver | RankedReceiver = self.rank_kv.receiver(local) if self.rank_kv else local
        self.peers = PeerDealers(self._on_peer_message, keys=self.keys)
        self.frame_sources["peers"] = self.peers.dropped
        self.frame_sources["kv"] = self.receiver.dropped   # refused KV connections and malformed KV frames
        self.block_size = engine.block_size
        self.max_model_len = engine.model_config.max_model_len
        self.vocab_size = engine.model_config.vocab_size
        self.requests: dict[str, DecodeRequest] = {}
        self._remote_tasks: set[asyncio.Task] = set()
        self.fetches = PrefixFetches(self.node_id, self.receiver, self.peers, self.view, self.engine_thread,
                                     self.kv_landing_timeout, self.kv_release_timeout, self.registry, self._spawn)
        self.precopies = PreCopies(self.node_id, self.view, self.engine_thread, self._send_to, self.registry)
        self.fetches.on_end = self.precopies.fetched
        self.preempt_migrate = config.preempt_migrate
        self.kv_reserve_tokens = config.kv_reserve_tokens
        # prompts not started for want of KV room (`_kv_room_for`), oldest first: (request, fetch blocks, resumed ids)
        self.kv_queue: deque[tuple[DecodeRequest, int, list[int]]] = deque()
        self._relieving: str | None = None   # the request this node asked to move for pool pressure
        self._heartbeats: asyncio.Task | None = None

    def _make_shared_pool(self, device: str | None, shape: tuple[int, ...], dtype):
        """KV pool in POSIX shm (CPU), so a same-host prefill node copies straight into it (and the engine's
        tensor-parallel ranks map it too)."""
        if device not in ("auto", "cpu"):
            return None
        from pdcluster.engine.device import resolve_device

        if resolve_device(None if device == "auto" else device).type != "cpu":
            return None
        for name in sweep_dead_pools():   # pools of nodes that died here before (SIGKILL, OOM kill)
            log.warning("removed the shared-memory KV pool /dev/shm/%s of a node process that is gone", name)
        self.shm = SharedKVPool.create(shape, dtype)
        return self.shm.tensor

    # ---- lifecycle -------------------------------------------------------------------------------

    async def on_start(self) -> None:
        self.start_engine_thread()
        self._heartbeats = self.supervised(self._heartbeat_loop(), "heartbeats")

    async def on_stop(self) -> None:
        tasks = [t for t in (self._heartbeats, *self._remote_tasks) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.peers.close()
        self.receiver.close()
        if self._rank_lend_sender is not None:
            self._rank_lend_sender.close()
        if self.rank_kv is not None:
            self.rank_kv.close()
        if self.shm is not None:
            self.shm.close()

    def kv_sender(self) -> KVSender | RankedSender:
        """A pool sliced per rank lends every rank's slice, each over its own channel (pdcluster/node/rank_kv.py);
        made on first use."""
        if self.rank_kv is None:
            return super().kv_sender()
        if self._rank_lend_sender is None:
            cfg = self.config
            local = KVSender(self.engine.kv_pool.tensor, backend=cfg.kv_backend,
                             connect_timeout=cfg.kv_connect_timeout, auth_key=self.kv_key,
                             total_kv_heads=self.engine.kv_pool.model_kv_heads, rank_slice=self.rank_kv.rank_slice)
            self._rank_lend_sender = self.rank_kv.sender(local)
        return self._rank_lend_sender

    def node_info(self) -> NodeInfo:
        info = super().node_info()
        info.kv_addr = self.receiver.address
        info.kv_backends = list(self.receiver.backends)
        info.kv_rank_addrs = list(self.rank_kv.kv_addresses) if self.rank_kv else []
        return info

    def in_flight(self) -> Mapping[str, DecodeRequest]:
        return self.requests

    def load(self) -> Load:
        s = self.engine_stats()
        remote = sum(1 for r in self.requests.values() if r.remote) + len(self.kv_queue)
        return Load(node_id=self.node_id, role=self.role, running=s.num_running, waiting=s.num_waiting + remote,
                    free_blocks=s.num_free_blocks, total_blocks=s.num_total_blocks, block_size=self.block_size,
                    tokens_per_s=s.tokens_per_s, transfer_gbps=self.transfer_gbps(), **self.kv_report())

    # ---- admission -------------------------------------------------------------------------------

    def handle(self, identity: bytes, msg: Message) -> None:
        if isinstance(msg, Generate):
            self._on_generate(identity, msg)
        elif isinstance(msg, Handback):
            req = self.requests.get(msg.rid)
            if req is not None and req.owner == identity and req.state is State.ENGINE and req.handback_from < 0:
                req.handback_from = req.sent
                self._hand_back_at_boundary(req)
        elif isinstance(msg, PreCopy):
            if self.state == "serving":
                self.precopies.handle(identity, msg)
            else:
                self._send_to(identity, PreCopied(rid=msg.rid, error=f"node {self.node_id} is {self.state}"))
        else:
            log.warning("decode node: dropped unexpected %s message", msg.TYPE)

    def _reject(self, identity: bytes, rid: str, reason: str, retry_after: float = 1.0) -> None:
        self.metrics.requests.labels("rejected").inc()
        self.control.send(identity, Reject(rid=rid, reason=reason, retry_after=retry_after))

    def _on_generate(self, identity: bytes, msg: Generate) -> None:
        if self.state != "serving" or (self.engine_thread and self.engine_thread.error):
            self._reject(identity, msg.rid, f"node {self.node_id} is {self.state}")
            return
        if msg.rid in self.requests:
            log.warning("decode node: duplicate request id %s dropped", msg.rid)
            return
        if len(self.requests) >= self.max_in_flight:
            self._reject(identity, msg.rid, f"queue full ({len(self.requests)} requests)")
            return
        prompt = list(msg.prompt_ids) + list(msg.resume_ids)
        sampling = dict(msg.sampling)
        resumed = len(msg.resume_ids)
        if resumed:  # migration: what was already streamed counts against the limits
            sampling["max_tokens"] = int(sampling.get("max_tokens", SamplingParams.max_tokens)) - resumed
            sampling["min_tokens"] = max(0, int(sampling.get("min_tokens", 0)) - resumed)
            sampling.pop("prompt_logprobs", None)   # the router has them from the first attempt
            if sampling["max_tokens"] < 1:
                self.control.send(identity, Tokens(rid=msg.rid, ids=[], finish="length",
                                                   num_prompt_tokens=len(prompt)))
                return
        try:
            params = SamplingParams.from_dict(sampling)
            if not prompt:
                raise ValueError("prompt_ids: the prompt is empty")
            if len(prompt) >= self.max_model_len:
                raise ValueError(f"prompt_ids: {len(prompt)} tokens leave no room in max_model_len "
                                 f"{self.max_model_len}")
        except (ValueError, TypeError) as exc:
            self.metrics.requests.labels("error").inc()
            self.control.send(identity, Tokens(rid=msg.rid, ids=[], finish="error", error=str(exc)))
            return
        req = DecodeRequest(rid=msg.rid, owner=identity, prompt_ids=prompt, params=params,
                            deadline=time.monotonic() + msg.timeout_s if msg.timeout_s else 0.0,
                            prefill_node=msg.prefill_node or "",
                            kv_source=msg.kv_source if msg.kv_source and msg.kv_source != self.node_id else "")
        fetch = msg.kv_source_blocks if req.kv_source else 0
        self.requests[req.rid] = req
        self._to_router(req, Progress(rids=[req.rid], states=[req.progress]))   # the acknowledgement
        log.info("request %s admitted from router %s: %d prompt tokens (%d resumed), prefill on %s", req.rid,
                 msg.router, len(prompt), resumed, msg.prefill_node or "this node", extra={"request_id": req.rid})
        if msg.lora_name:   # the adapter first (loaded now if this node does not hold it yet)
            req.lora = self.loras.request(msg.lora_name, msg.lora_path)
            self._spawn(self._load_lora(req, msg, fetch), f"lora:{req.rid}")
        else:
            self._dispatch(req, msg, fetch)

    async def _load_lora(self, req: DecodeRequest, msg: Generate, fetch: int) -> None:
        try:
            req.lora_hash = await self.loras.load(msg.lora_name, msg.lora_path)
        except Exception as exc:
            self._fail(req, f"LoRA adapter {msg.lora_name!r}: {exc}")
            return
        if self.requests.get(req.rid) is req and req.state is State.NEW:   # not aborted meanwhile
            self._dispatch(req, msg, fetch)

    def _dispatch(self, req: DecodeRequest, msg: Generate, fetch: int) -> None:
        """Where the prompt is computed: here, or on the prefill node the router chose; a prompt bound for a prefill
        node without KV room here, and any prompt while such prompts wait, joins the wait (`kv_queue`, first come
        first served: a stream of local prompts cannot starve a waiting remote one)."""
        # A resumed structured output rebuilds its grammar's matcher from the tokens so far: prefilled here.
        resumed_ids = list(msg.resume_ids) if req.params.structured_outputs is not None else []
        remote = not self._prefilled_here(req, resumed_ids) and self._prefill_peer(req) is not None
        if self.kv_queue or (remote and not self._kv_room_for(req)):
            self.kv_queue.append((req, fetch, resumed_ids))
            log.info("request %s: waits for KV room before its prefill (%d waiting)", req.rid, len(self.kv_queue),
                     extra={"request_id": req.rid})
            return
        self._start_prefill(req, fetch, resumed_ids)

    @staticmethod
    def _prefilled_here(req: DecodeRequest, resumed_ids: list[int]) -> bool:
        """No prefill node named, or the prompt must run here (prompt logprobs need its logits here)."""
        return req.params.prompt_logprobs is not None or bool(resumed_ids) or not req.prefill_node

    def _prefill_peer(self, req: DecodeRequest) -> NodeInfo | None:
        peer = self.view.nodes.get(req.prefill_node)
        return peer if peer is not None and peer.role == "prefill" else None

    def _start_prefill(self, req: DecodeRequest, fetch: int, resumed_ids: list[int]) -> None:
        here = self._prefilled_here(req, resumed_ids)
        peer = None if here else self._prefill_peer(req)
        if peer is not None:
            self._prefill_remotely(req, peer, fetch)
            return
        if not here:   # the prefill node named left the cluster view
            self.metrics.remote_failures.labels(RemoteFailure.UNKNOWN_NODE.value).inc()
        self._prefill_locally(req, resumed_ids, fetch)

    def _kv_room_for(self, req: DecodeRequest) -> bool:
        """Whether `req`'s prompt fits in the pool beside every request holding KV here, each counted with room to
        grow by `kv_reserve_tokens` (up to its max_tokens; blocks it shares from the prefix cache not counted).
        A decode node that started every prompt as it came would fill its pool with prompts and then preempt
        running requests, recomputing their prompts on its own cores (what disaggregation is there to avoid);
        this holds the prompt back instead, as SGLang's decode-side pre-allocation does. Always True with nothing
        running (a prompt too big for the pool is the engine's to refuse)."""
        total = self.engine_stats().num_total_blocks
        if not self.kv_reserve_tokens or not total:
            return True
        holding = [r for r in self.requests.values() if r.state not in (State.NEW, State.FINISHED, State.GONE)]
        need = sum(self._kv_blocks_reserved(r) for r in holding) + self._kv_blocks_reserved(req)
        return not holding or need <= total

    def _kv_blocks_reserved(self, req: DecodeRequest) -> int:
        prompt = len(req.prompt_ids)
        tokens = min(prompt + req.params.max_tokens, prompt + req.sent + self.kv_reserve_tokens, self.max_model_len)
        return -(-tokens // self.block_size) - req.num_cached_tokens // self.block_size

    def _start_waiting_prefills(self) -> None:
        """The prompts waiting for KV room start, oldest first, while there is room (a request left). A draining node
        sends them back instead (`Reject`: nothing computed yet, their routers place them on another decode node)
        when another decode node takes work; with none, they wait and run here."""
        if self.kv_queue and self.state == "draining" and self._other_decode_nodes():
            for req, _, _ in list(self.kv_queue):
                self._send_to(req.owner, Reject(rid=req.rid, reason=f"node {self.node_id} is draining",
                                                retry_after=1.0))
                self._forget(req, "rejected")
            return
        while self.kv_queue:
            req, fetch, resumed_ids = self.kv_queue[0]
            if not self._kv_room_for(req):
                return
            self.kv_queue.popleft()
            self._start_prefill(req, fetch, resumed_ids)

    def _prefill_locally(self, req: DecodeRequest, resumed_ids: list[int] | None = None, fetch_blocks: int = 0
                         ) -> None:
        req.move(State.ENGINE)
        req.prefill_path = "local"
        self.metrics.prefills.labels("local").inc()
        rid, prompt, params, resumed, lora = req.rid, req.prompt_ids, req.params, resumed_ids or [], req.lora
        self._engine_call(req, lambda e: e.add_request(rid, prompt, params, resumed_output_ids=resumed,
                                                       fetch_blocks=fetch_blocks, lora=lora),
                          "engine rejected the request")

    def _fetch_asked(self, rid: str, block_ids: list[int], block_hashes: list[int]) -> None:
        """The connector's hook, on the engine thread: the engine wants these blocks from the request's holder."""
        self.loop.call_soon_threadsafe(self._start_fetch, rid, block_ids, block_hashes)

    def _start_fetch(self, rid: str, block_ids: list[int], block_hashes: list[int]) -> None:
        req = self.requests.get(rid)
        source = req.kv_source if req is not None else self.precopies.source_of(rid)
        if not source:   # aborted meanwhile: the fetch ends empty (its blocks unpinned)
            self.engine_thread.post(lambda e: e.kv_fetch_done(rid, block_ids, 0))
            return
        self.fetches.start(rid, block_ids, block_hashes, source)

    def _engine_call(self, req: DecodeRequest, fn: Callable[[LLMEngine], object], error: str) -> None:
        """`fn` on the engine thread; if it raises, the request fails with `error` (its abort frees the blocks)."""
        def done(fut: asyncio.Future) -> None:
            if fut.exception() is not None:
                self._fail(req, f"{error}: {fut.exception()}")

        self.engine_thread.call(fn).add_done_callback(done)

    # ---- remote prefill: message handling --------------------------------------------------------

    def _prefill_remotely(self, req: DecodeRequest, peer: NodeInfo, fetch_blocks: int = 0) -> None:
        """The prompt goes to the prefill node at once and its KV destination once the engine has reserved the
        blocks (at its next step boundary, up to a decode step away): the prefill overlaps the reservation."""
        sent = self.peers.send(req.prefill_node, peer.control_addr, Prefill(
            rid=req.rid, prompt_ids=req.prompt_ids, sampling=req.params.to_dict(), dst={},
            decode_node=self.node_id, timeout_s=self.prefill_timeout,
            lora_name=req.lora.lora_name if req.lora else "", lora_path=req.lora.lora_path if req.lora else "",
            lora_hash=req.lora_hash))
        if not sent:
            log.info("request %s: could not queue Prefill to %s; prefilling locally", req.rid, req.prefill_node,
                     extra={"request_id": req.rid})
            self.metrics.remote_failures.labels(RemoteFailure.SEND_FAILED.value).inc()
            self._prefill_locally(req, fetch_blocks=fetch_blocks)
            return
        req.move(State.RESERVING)
        req.prefill_addr = peer.control_addr
        req.prefill_slices = peer.capacity.kv_rank_slices
        req.remote_started = time.monotonic()
        rid, prompt, params, lora = req.rid, req.prompt_ids, req.params, req.lora
        fut = self.engine_thread.call(lambda e: e.add_request(rid, prompt, params, remote_kv=True,
                                                              fetch_blocks=fetch_blocks, lora=lora))
        fut.add_done_callback(lambda f: self._reserve_answered(req, f))

    def _remote_reserved(self, rid: str, block_ids: list[int], num_cached_tokens: int) -> None:
        """The connector's hook, on the engine thread (inside `add_request`): hop to the loop. The hop runs
        before the add's own future resolves (both are queued in order on the loop)."""
        self.loop.call_soon_threadsafe(self._on_reserved, rid, block_ids, num_cached_tokens)

    def _on_reserved(self, rid: str, block_ids: list[int], num_cached_tokens: int) -> None:
        req = self.requests.get(rid)
        if req is None or req.state is not State.RESERVING:
            return   # aborted meanwhile: its engine abort, queued behind the add, frees the blocks
        skip = num_cached_tokens // self.block_size
        req.num_cached_tokens = num_cached_tokens
        if req.early_failure is not None:   # the peer gave up before it had the destination
            self._remote_failed(req, *req.early_failure)
            return
        try:
            # a prefill engine sliced per rank: each of its ranks holding some of a pool's heads writes them
            dst = self.receiver.reserve(rid, block_ids[skip:], timeout_s=self.prefill_timeout,
                                        sender_slices=req.prefill_slices)
        except Exception as exc:
            log.exception("request %s: the receiver refused the reservation", rid)
            self._remote_failed(req, RemoteFailure.INTERNAL, str(exc))
            return
        sent = self.peers.send(req.prefill_node, req.prefill_addr,
                               PrefillDestination(rid=rid, dst=dst.to_dict(), skip_blocks=skip))
        if not sent:
            self._remote_failed(req, RemoteFailure.SEND_FAILED,
                                f"could not queue PrefillDestination to {req.prefill_node}")
            return
        req.move(State.PREFILLING)
        req.timer = self.loop.call_later(self.prefill_timeout, self._prefill_timed_out, req)
        log.info("request %s: prefill sent to %s, then its KV destination (%d blocks reserved, %d cached here)", rid,
                 req.prefill_node, len(block_ids) - skip, skip, extra={"request_id": rid})

    def _reserve_answered(self, req: DecodeRequest, fut: asyncio.Future) -> None:
        if fut.exception() is not None:
            self._fail(req, f"engine rejected the request: {fut.exception()}")
        elif fut.result() is False and req.state is State.RESERVING:   # nothing was added
            log.info("request %s: not enough free KV blocks to reserve for a remote prefill; prefilling locally",
                     req.rid, extra={"request_id": req.rid})
            self.metrics.remote_failures.labels(RemoteFailure.NO_BLOCKS.value).inc()
            self.peers.send_existing(req.prefill_node, Abort(rid=req.rid))
            self._prefill_locally(req)

    def _prefill_timed_out(self, req: DecodeRequest) -> None:
        if req.state is State.PREFILLING:
            self._remote_failed(req, RemoteFailure.TIMEOUT,
                                f"no PrefillDone from {req.prefill_node} in {self.prefill_timeout} s")

    def _on_peer_message(self, node_id: str, msg: Message) -> None:
        if isinstance(msg, KVFetched):
            self.fetches.answered(node_id, msg)
            return
        if isinstance(msg, Progress):
            self._prefill_progressed(node_id, msg.rids)
            return
        if not isinstance(msg, PrefillDone):
            log.warning("decode node: dropped unexpected %s from prefill node %s", msg.TYPE, node_id)
            return
        req = self.requests.get(msg.rid)
        if req is None or req.prefill_node != node_id:
            return  # late reply for a request that moved on
        if req.state is State.RESERVING and req.early_failure is None:   # acted on once the blocks are reserved
            req.early_failure = (RemoteFailure.PREFILL_ERROR, msg.error or "PrefillDone before its destination")
        elif req.state is State.PREFILLING:
            self._prefill_answered(req, msg)

    def _prefill_progressed(self, node_id: str, rids: list[str]) -> None:
        """The prefill node still works through these prompts (queued behind others, or computing): their wait
        and their KV reservations start afresh. `prefill_timeout` so bounds the prefill node's silence, not its
        queue: a busy prefill node keeps its prompts, a stuck or stopped one sends nothing and loses them."""
        for rid in rids:
            req = self.requests.get(rid)
            if req is None or req.prefill_node != node_id or req.state is not State.PREFILLING:
                continue
            if self.receiver.extend(rid, self.prefill_timeout):
                req.timer.cancel()
                req.timer = self.loop.call_later(self.prefill_timeout, self._prefill_timed_out, req)

    def on_peer_change(self, event: str, node_id: str) -> None:
        if event != "node_removed":
            return
        self.fetches.holder_left(node_id)
        self.peers.drop(node_id)
        for req in [r for r in self.requests.values() if r.prefill_node == node_id and r.remote]:
            self._on_peer_message(node_id, PrefillDone(rid=req.rid, error=f"prefill node {node_id} left the cluster"))

    def _prefill_answered(self, req: DecodeRequest, done: PrefillDone) -> None:
        req.timer.cancel()
        backend = done.kv_backend or "unknown"
        if done.error:
            self._remote_failed(req, RemoteFailure.PREFILL_ERROR, done.error, backend)
            return
        if not 0 <= done.first_token < self.vocab_size:
            self._remote_failed(req, RemoteFailure.PREFILL_ERROR,
                                f"first_token {done.first_token} is not in the vocabulary", backend)
            return
        try:
            first_lp = logprob_from_wire(done.logprobs[0]) if done.logprobs else None
        except (TypeError, ValueError) as exc:
            self._remote_failed(req, RemoteFailure.PREFILL_ERROR, f"malformed logprobs: {exc}", backend)
            return
        req.move(State.WAITING_KV)
        self._spawn(self._land(req, done, first_lp, backend), f"kv-landing:{req.rid}")

    async def _land(self, req: DecodeRequest, done: PrefillDone, first_lp, backend: str) -> None:
        """Wait for the receiver's checksum ack of the KV, then hand the request to the engine."""
        rid = req.rid
        try:
            result = await self.receiver.wait(rid, timeout=self.kv_landing_timeout)
            if done.checksum and result.checksum != done.checksum:
                raise ChecksumError(f"sender {done.checksum:#x} != landed {result.checksum:#x}")
        except Exception as exc:   # TimeoutError, TransferError (ChecksumError among them)
            if req.state is State.WAITING_KV:
                reason = RemoteFailure.CHECKSUM if isinstance(exc, ChecksumError) else RemoteFailure.TRANSFER
                self._remote_failed(req, reason, str(exc), backend)
            return
        if req.state is not State.WAITING_KV:
            return   # aborted while the KV landed: its release frees the blocks
        self.metrics.received_bytes.labels(backend).inc(result.nbytes)
        self.kv_bytes_moved += result.nbytes
        self.metrics.remote_prefill_seconds.observe(time.monotonic() - req.remote_started)
        self.metrics.prefills.labels("remote").inc()
        log.info("request %s: prefill done on %s (%d KV bytes via %s, %d feature bytes)", rid, req.prefill_node,
                 result.nbytes, backend, len(done.features), extra={"request_id": rid})
        req.move(State.ENGINE)
        req.prefill_path = f"remote:{req.prefill_node}"
        req.num_cached_tokens = max(req.num_cached_tokens, done.num_cached_tokens)

        def landed(engine: LLMEngine) -> None:
            features = (done.features_start, done.features_dtype, done.features) if done.features else None
            out = engine.remote_kv_landed(rid, done.first_token, first_lp, features)
            # From the engine thread, so its output reaches the loop before the next step's tokens.
            self.loop.call_soon_threadsafe(self.engine_outputs, [out])

        self._engine_call(req, landed, "engine refused the prefilled request")
        # The first token is the prefill node's: to the router now rather than at the engine's next step
        # boundary (up to a decode step later); the engine's output for it then only says if it finished.
        msg = req.first_token_ahead(done.first_token, first_lp)
        if not self._to_router(req, msg):
            req.hold(msg)

    def _remote_failed(self, req: DecodeRequest, reason: RemoteFailure, detail: str, backend: str = "unknown"
                       ) -> None:
        log.warning("request %s: remote prefill on %s failed (%s: %s); prefilling locally", req.rid,
                    req.prefill_node, reason.value, detail, extra={"request_id": req.rid})
        self.metrics.remote_failures.labels(reason.value).inc()
        if reason.counts_as_transfer_failure:
            self.metrics.transfer_failures.labels(backend).inc()
        req.move(State.RELEASING)
        self._spawn(self._release(req), f"kv-release:{req.rid}")

    async def _release(self, req: DecodeRequest) -> None:
        """RELEASING / ABORTING: tell the prefill node, cancel the reservation, wait until no write can land;
        then the engine prefills the prompt itself (`remote_kv_failed`) or, aborted, drops it."""
        rid = req.rid
        if req.timer is not None:
            req.timer.cancel()
        self.peers.send_existing(req.prefill_node, Abort(rid=rid))
        if not await self.receiver.settle(rid, self.kv_release_timeout):
            log.error("request %s: receiver kept the reservation past %s s; freeing its blocks anyway",
                      rid, self.kv_release_timeout)
        if req.state is State.ABORTING:
            self.engine_thread.post(lambda e: e.abort(rid))
            self._forget(req, "abort")
        elif req.state is State.RELEASING:
            req.move(State.ENGINE)
            req.prefill_path = "local"
            self.metrics.prefills.labels("local").inc()
            self._engine_call(req, lambda e: e.remote_kv_failed(rid), "engine refused the local prefill")

    def _spawn(self, coro, name: str) -> None:
        task = asyncio.create_task(coro, name=name)
        self._remote_tasks.add(task)
        task.add_done_callback(self._remote_tasks.discard)

    # ---- aborts, failures, outputs ---------------------------------------------------------------

    def abort(self, rid: str, reason: str, expired: bool = False) -> None:
        req = self.requests.get(rid)
        if req is None:
            return
        self.fetches.fail(rid, "the request was aborted")
        if expired:
            log.info("request %s: deadline passed; aborting", rid, extra={"request_id": rid})
            self.control.send(req.owner, Tokens(rid=rid, ids=[], finish="abort", error=reason))
        if req.state in (State.PREFILLING, State.WAITING_KV):
            req.move(State.ABORTING)
            self._spawn(self._release(req), f"kv-release:{rid}")
        elif req.state is State.RELEASING:
            req.move(State.ABORTING)   # its release is running; it drops the request when done
        elif req.state is not State.ABORTING:
            if req.state is State.RESERVING:   # the prefill node has the prompt already
                self.peers.send_existing(req.prefill_node, Abort(rid=rid))
            self.engine_thread.post(lambda e: e.abort(rid))   # queued behind any add: it frees what that took
            self._forget(req, "abort")

    def begin_drain(self, reason: str = "", migrate: bool = False) -> None:
        super().begin_drain(reason, migrate)
        self._start_waiting_prefills()   # the prompts waiting for KV room go to another node now

    def migrate_away(self) -> None:
        """Draining with migration: ask the router of each request the engine runs to move it (MoveAway: it
        pre-copies the KV to another node, then sends Handback), MAX_MOVES at a time; one whose router stays silent
        for MOVE_ASK_TIMEOUT_S is handed back anyway."""
        now = time.monotonic()
        moving = sum(1 for r in self.requests.values() if r.move_reason == "drain")
        for req in list(self.requests.values()) if self._other_decode_nodes() else []:
            if req.state is not State.ENGINE or req.lora is not None or req.handback_from >= 0:
                continue
            if req.move_reason != "drain" and moving < MAX_MOVES:
                self._ask_move(req, "drain")
                moving += req.move_reason == "drain"
        self._overdue_moves(now)

    def _ask_move(self, req: DecodeRequest, reason: str) -> None:
        if self._send_to(req.owner, MoveAway(rid=req.rid, reason=reason)):
            req.move_reason, req.move_asked = reason, time.monotonic()
            req.move_nagged = req.move_asked
            log.info("request %s: asked its router to move it (%s)", req.rid, reason, extra={"request_id": req.rid})

    def _overdue_moves(self, now: float) -> None:
        """Asks the router has not acted on: repeated every MOVE_REASK_S (the router may not see a target node
        yet); after MOVE_ASK_TIMEOUT_S a draining node hands the request back without a pre-copy, and a node under
        pool pressure lets the engine preempt as usual and may ask for another request."""
        for req in list(self.requests.values()):
            if not req.move_reason or req.handback_from >= 0:
                continue
            if now - req.move_asked <= MOVE_ASK_TIMEOUT_S:
                if now - req.move_nagged >= MOVE_REASK_S and (req.move_reason == "drain" or req.rid == self._relieving):
                    req.move_nagged = now
                    self._send_to(req.owner, MoveAway(rid=req.rid, reason=req.move_reason))
                continue
            if req.move_reason == "drain":
                req.handback_from = req.sent
                self._hand_back_at_boundary(req)
            elif req.rid == self._relieving:
                self._relieving = None

    def _relieve_pressure(self) -> None:
        """preempt_migrate: when the pool is about to preempt (fewer free blocks than two per running request:
        each may need one at its next block boundary, and the move hands its request back only at the one after),
        ask the router to move the newest running request to another node with its KV, one at a time."""
        stats = self.engine_stats()
        if self._relieving is not None:
            self._overdue_moves(time.monotonic())
        if self._relieving is not None or self.state != "serving" or stats.num_free_blocks >= 2 * stats.num_running:
            return
        victim = next((r for r in reversed(self.requests.values()) if r.state is State.ENGINE and r.lora is None
                       and not r.move_reason and r.handback_from < 0 and r.backlog is None), None)
        if victim is not None:
            self._ask_move(victim, "pressure")
            if victim.move_reason:
                self._relieving = victim.rid

    def _hand_back_at_boundary(self, req: DecodeRequest) -> None:
        """Hand `req` back (its router asked) once its KV lies in full blocks only: all its tokens but the last
        fill whole blocks, so the next node fetches every one and recomputes nothing. After a block's worth of
        tokens without such a step (speculative steps may jump over it), at once."""
        if (len(req.prompt_ids) + req.sent - 1) % self.block_size and req.sent - req.handback_from < self.block_size:
            return
        reason = req.move_reason or "rebalance"
        if self._hand_back(req, f"its router moves it ({reason})"):
            self.metrics.handbacks.labels(reason).inc()
            self.handed_back_at = time.monotonic()
        else:   # nowhere to go, or the router is away: it goes on here (a drain asks again later)
            req.handback_from, req.move_reason = -1, ""

    def _hand_back(self, req: DecodeRequest, why: str) -> bool:
        """End `req` (the engine runs it, its tokens all delivered) with finish "migrate": its router resumes it on
        another decode node after the tokens it has, naming this node as the holder of its KV (kept in the prefix
        cache by the abort), which that node fetches (FetchKV). Only when another decode node of this model takes
        work, not for a LoRA request (whether another node serves the adapter is the routers' knowledge), and
        not while its router is away; whether it went."""
        if req.state is not State.ENGINE or req.backlog is not None or req.lora is not None \
                or not self._other_decode_nodes():
            return False
        if not self._send_to(req.owner, Tokens(rid=req.rid, ids=[], finish="migrate", error=why, pos=req.sent)):
            return False
        self._forget(req, "migrated")
        rid = req.rid
        self.engine_thread.post(lambda e: e.abort(rid))
        return True

    def _other_decode_nodes(self) -> bool:
        """Whether another decode node of this model takes work (a request handed back has somewhere to go)."""
        model = self.served_model_name()
        return any(n.node_id != self.node_id and n.model == model and self.view.admin_state(n.node_id) == "active"
                   for n in self.view.nodes_by_role("decode"))

    def _fail(self, req: DecodeRequest, error: str, finish: str = "error") -> None:
        """finish "error": this node failed it (the router tries another); "invalid": the request itself is
        (a grammar only the engine's compiler refuses), which the router answers with a 400."""
        if self.requests.get(req.rid) is not req:
            return
        log.warning("request %s failed: %s", req.rid, error)
        if req.state is State.RESERVING:   # the prefill node has the prompt already
            self.peers.send_existing(req.prefill_node, Abort(rid=req.rid))
        self.control.send(req.owner, Tokens(rid=req.rid, ids=[], finish=finish, error=error))
        self.engine_thread.post(lambda e: e.abort(req.rid))
        self._forget(req, "error")

    def _forget(self, req: DecodeRequest, outcome: str) -> None:
        if self.requests.get(req.rid) is req:
            del self.requests[req.rid]
            self.precopies.release(req.rid)
            if req.rid == self._relieving:
                self._relieving = None
            req.move(State.GONE)
            req.outcome = outcome
            if self.kv_queue:   # out of the wait if it was in it; its KV room may let a waiting prompt start
                self.kv_queue = deque(entry for entry in self.kv_queue if entry[0] is not req)
                self.loop.call_soon(self._start_waiting_prefills)   # after the caller's loop
            self.metrics.requests.labels(outcome).inc()
            log.info("request %s finished: %s (prefill %s)", req.rid, outcome, req.prefill_path,
                     extra={"request_id": req.rid})

    def on_engine_failure(self) -> None:
        for req in list(self.requests.values()):
            self.control.send(req.owner, Tokens(rid=req.rid, ids=[], finish="error", error="engine failure"))
            self._forget(req, "error")

    def on_outputs(self, outputs: list[RequestOutput]) -> None:
        batches: dict[bytes, list[tuple[DecodeRequest, Tokens]]] = {}
        if self.precopies.holds:   # a migrated request runs: its prefix hits hold the pre-copied blocks now
            for out in outputs:
                self.precopies.release(out.request_id)
        for out in outputs:
            req = self.requests.get(out.request_id)
            if req is None or req.state is not State.ENGINE:
                continue
            if out.error is not None:   # the engine gave up on it (a structured output's grammar failed)
                self._fail(req, out.error, "invalid")
                continue
            msg = req.tokens(out)
            if msg.ids or msg.finish:   # else the output was only of the token sent ahead: nothing new
                batches.setdefault(req.owner, []).append((req, msg))
        for router, items in batches.items():
            frame = items[0][1] if len(items) == 1 else TokenBatch(items=[msg for _, msg in items])
            if self._send_to(router, frame):
                now = time.monotonic()
                for req, _ in items:
                    req.delivered(now)
                    if req.state is State.FINISHED:
                        self._forget(req, req.outcome)
                    elif req.handback_from >= 0:
                        self._hand_back_at_boundary(req)
            else:
                for req, msg in items:
                    req.hold(msg)
        if self.preempt_migrate:
            self._relieve_pressure()

    # ---- the router link: acknowledgements, heartbeats, held tokens ---------------------------------

    def _to_router(self, req: DecodeRequest, msg: Message) -> bool:
        """Send to the request's router; False when it cannot take it now (disconnected or far behind)."""
        if not self._send_to(req.owner, msg):
            return False
        req.delivered(time.monotonic())
        return True

    def _send_to(self, router: bytes, msg: Message) -> bool:
        if not self.control.send(router, msg):
            self._unreachable.setdefault(router, time.monotonic())
            return False
        self._unreachable.pop(router, None)
        return True

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_interval)
            self._heartbeat()

    def _heartbeat(self) -> None:
        """Flush held tokens; one Progress per router listing its silent requests; abort the requests of a
        router that stayed unreachable past `router_reconnect_timeout`."""
        now = time.monotonic()
        self._overdue_moves(now)
        self._start_waiting_prefills()
        silent: dict[bytes, list[DecodeRequest]] = {}
        for req in list(self.requests.values()):
            if req.backlog is not None:
                if self._send_to(req.owner, req.backlog):
                    req.backlog_delivered(now)
                    if req.state is State.FINISHED:
                        self._forget(req, req.outcome)
            elif req.state is not State.FINISHED and now - req.last_sent >= self.heartbeat_interval / 2:
                silent.setdefault(req.owner, []).append(req)
        for router, reqs in silent.items():
            if self.control.send(router, Progress(rids=[r.rid for r in reqs], states=[r.progress for r in reqs])):
                self._unreachable.pop(router, None)
                for r in reqs:
                    r.delivered(now)
            else:
                self._unreachable.setdefault(router, now)
        gone = {r for r, since in self._unreachable.items() if now - since > self.router_reconnect_timeout}
        for req in [r for r in self.requests.values() if r.owner in gone]:
            log.warning("request %s: router %r unreachable for %s s; aborting", req.rid, req.owner,
                        self.router_reconnect_timeout, extra={"request_id": req.rid})
            self.abort(req.rid, "router unreachable")
        for router in gone:
            del self._unreachable[router]


def main(config: NodeConfig) -> int:
    from pdcluster.node.service import run_service

    return run_service(lambda: DecodeNode(config))
