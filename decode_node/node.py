"""The decode node: admission, KV block reservation, remote (or local) prefill, the decode loop,
token streaming to routers.

A request's path (docs/design.md §3): `Generate` from a router → reserve blocks (leading blocks already in
this node's prefix cache are shared, not re-sent) → `Prefill` to the chosen prefill node, which
writes the prompt's KV straight into the reserved blocks of this node's shared-memory pool → on
`PrefillDone` + the receiver's checksum ack the sequence joins the running batch → one message per engine
step per router: a `TokenBatch` of the new tokens of each of its requests (`Tokens` when only one has any).
Any failure of the remote part (timeout, checksum, prefill node gone or erroring) frees the reservation and
prefills locally (§5).

While a request sends no token (queued, waiting on its prefill or its KV) the router hears `Progress` for
it on admission and every `heartbeat_interval`, so its stall timer measures silence, not time to first
token. Tokens that cannot reach the router (it is reconnecting) are held, merged, and sent when it is
back; a router gone for `router_reconnect_timeout` gets its requests aborted.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from pdcluster.control.protocol import (
    Abort,
    Generate,
    Load,
    Message,
    Prefill,
    PrefillDone,
    Progress,
    Reject,
    TokenBatch,
    Tokens,
)
from pdcluster.control.records import NodeInfo
from pdcluster.control.sampling_params import SamplingParams
from pdcluster.control.transport import PeerDealers
from pdcluster.decode_node.metrics import DecodeMetrics
from pdcluster.decode_node.streams import step_tokens
from pdcluster.engine.llm_engine import LLMEngine
from pdcluster.engine.outputs import RequestOutput
from pdcluster.kv_transfer import KVReceiver, SharedKVPool, sweep_dead_pools
from pdcluster.kv_transfer.errors import ChecksumError
from pdcluster.node.config import NodeConfig, engine_args_from_config
from pdcluster.node.service import NodeService

log = logging.getLogger(__name__)

RELEASE_TIMEOUT = 10.0  # wait for the receiver to give a cancelled reservation's blocks back


class RemotePrefillFailed(Exception):
    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


@dataclass
class DecodeRequest:
    rid: str
    router: bytes  # zmq identity of the router's DEALER: where Tokens go
    prompt_ids: list[int]  # Generate.prompt_ids + resume_ids
    params: SamplingParams
    deadline: float  # time.monotonic() seconds (0: none); from the message's timeout_s at receipt
    prefill_node: str | None
    phase: str = "new"  # remote (prefill elsewhere) | engine (the engine owns it)
    blocks: list[int] = field(default_factory=list)  # held in the engine while the remote KV lands
    prefill_done: asyncio.Future | None = None
    prefill_path: str = "local"
    num_cached_tokens: int = 0
    first_sent: bool = False
    aborted: bool = False
    progress: str = "queued"  # Progress state while silent: queued | prefilling | waiting_kv
    sent: int = 0  # token ids sent so far (the next Tokens.pos)
    last_sent: float = 0.0  # monotonic time of the last message that reached the router
    backlog: Tokens | None = None  # tokens the router could not take yet (merged), sent when it is back
    outcome: str = ""  # set once the engine finished it while its backlog still waits for the router


class DecodeNode(NodeService):
    role = "decode"

    def __init__(self, config: NodeConfig, prefill_timeout: float | None = None, max_queue: int | None = None,
                 drain_timeout: float | None = None) -> None:
        super().__init__(config, drain_timeout=config.drain_timeout if drain_timeout is None else drain_timeout)
        self.prefill_timeout = config.prefill_timeout if prefill_timeout is None else prefill_timeout
        self.heartbeat_interval = config.heartbeat_interval
        self.router_reconnect_timeout = config.router_reconnect_timeout
        self._unreachable: dict[bytes, float] = {}  # router identity -> monotonic time its sends began failing
        self.max_in_flight = config.max_num_seqs + (config.max_num_seqs if max_queue is None else max_queue)
        self.metrics = DecodeMetrics(self.registry)
        self.shm: SharedKVPool | None = None
        args = engine_args_from_config(config, kv_pool_factory=self._make_shared_pool)
        self.engine = LLMEngine(args)  # loads the model: seconds
        pool = self.engine.kv_pool.tensor
        if pool.device.type == "cpu":
            self.receiver = KVReceiver(pool, host=config.host, port=config.kv_port,
                                       shm_name=self.shm.name if self.shm else None, auth_key=self.kv_key)
        else:  # device pool: the collective backend (hccl/nccl) writes into it, no shm
            self.receiver = KVReceiver(pool, host=config.host, port=config.kv_port, auth_key=self.kv_key)
        self.block_size = self.engine.block_size
        self.max_model_len = self.engine.model_config.max_model_len
        self.vocab_size = self.engine.model_config.vocab_size
        self.requests: dict[str, DecodeRequest] = {}
        self.peers: PeerDealers | None = None

    def _make_shared_pool(self, shape: tuple[int, ...], dtype) -> Any:
        """KV pool in POSIX shm (CPU), so a same-host prefill node copies straight into it (and the engine's
        tensor-parallel ranks map it too)."""
        if self.config.device not in ("auto", "cpu"):
            return None
        from pdcluster.engine.device import resolve_device

        if resolve_device(None if self.config.device == "auto" else self.config.device).type != "cpu":
            return None
        for name in sweep_dead_pools():   # pools of nodes that died here before (SIGKILL, OOM kill)
            log.warning("removed the shared-memory KV pool /dev/shm/%s of a node process that is gone", name)
        self.shm = SharedKVPool.create(shape, dtype)
        return self.shm

    # ---- lifecycle -------------------------------------------------------------------------------

    async def on_start(self) -> None:
        self.start_engine_thread(self._on_outputs)
        self.peers = PeerDealers(self._on_peer_message, keys=self.keys)
        self._tasks_extra = [self.supervised(self._deadline_loop(), "deadlines"),
                             self.supervised(self._heartbeat_loop(), "heartbeats")]

    async def on_stop(self) -> None:
        for task in self._tasks_extra:
            task.cancel()
        await asyncio.gather(*self._tasks_extra, return_exceptions=True)
        if self.peers is not None:
            self.peers.close()
        self.receiver.close()
        if self.shm is not None:
            self.shm.close()

    def dropped_frames(self) -> dict[str, object]:
        peers = getattr(self, "peers", None)   # None until on_start (the registry asks at construction too)
        peers = {"peers": peers.dropped} if peers is not None else {}
        receiver = getattr(self, "receiver", None)   # refused KV connections and malformed KV frames
        kv = {"kv": receiver.dropped} if receiver is not None else {}
        return {**super().dropped_frames(), **peers, **kv}

    def node_info(self) -> NodeInfo:
        info = super().node_info()
        info.kv_addr = self.receiver.address
        info.kv_backends = list(self.receiver.backends)
        return info

    def num_in_flight(self) -> int:
        return len(self.requests)

    def load(self) -> Load:
        s = self.engine_stats()
        remote = sum(1 for r in self.requests.values() if r.phase == "remote")
        return Load(node_id=self.node_id, role=self.role, running=s.num_running, waiting=s.num_waiting + remote,
                    free_blocks=s.num_free_blocks, total_blocks=s.num_total_blocks, block_size=self.block_size,
                    tokens_per_s=self.rate("tokens", s.num_decode_tokens), transfer_gbps=self.transfer_gbps(),
                    cached_block_hashes=self.cached_block_hashes())

    # ---- messages --------------------------------------------------------------------------------

    def handle(self, identity: bytes, msg: Message) -> None:
        if isinstance(msg, Generate):
            self._on_generate(identity, msg)
        elif isinstance(msg, Abort):
            req = self.requests.get(msg.rid)
            if req is not None and req.router != identity:   # only the router that sent the Generate may abort
                self.control.dropped.drop(f"Abort of request {msg.rid} from a peer that did not send it")
                return
            self._abort(msg.rid, "aborted by the router")
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
            sampling["max_tokens"] = int(sampling.get("max_tokens", 16)) - resumed
            sampling["min_tokens"] = max(0, int(sampling.get("min_tokens", 0)) - resumed)
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
        req = DecodeRequest(rid=msg.rid, router=identity, prompt_ids=prompt, params=params,
                            deadline=time.monotonic() + msg.timeout_s if msg.timeout_s else 0.0,
                            prefill_node=msg.prefill_node)
        self.requests[req.rid] = req
        self._to_router(req, Progress(rids=[req.rid], states=[req.progress]))   # the acknowledgement
        log.info("request %s admitted from router %s: %d prompt tokens (%d resumed), prefill on %s", req.rid,
                 msg.router, len(prompt), resumed, msg.prefill_node or "this node", extra={"request_id": req.rid})
        peer = self.view.nodes.get(msg.prefill_node) if msg.prefill_node else None
        if peer is not None and peer.role == "prefill":
            req.phase = "remote"
            asyncio.create_task(self._remote_prefill(req, peer), name=f"remote-prefill:{req.rid}")
        else:
            if msg.prefill_node:
                self.metrics.remote_failures.labels("unknown_node").inc()
            self._prefill_locally(req)

    def _prefill_locally(self, req: DecodeRequest) -> None:
        req.phase, req.prefill_path = "engine", "local"
        self.metrics.prefills.labels("local").inc()
        rid, prompt, params = req.rid, req.prompt_ids, req.params
        fut = self.engine_thread.call(lambda e: e.add_request(rid, prompt, params))
        fut.add_done_callback(
            lambda f: f.exception() and self._fail(req, f"engine rejected the request: {f.exception()}"))

    async def _remote_prefill(self, req: DecodeRequest, peer: NodeInfo) -> None:
        rid, prompt, params = req.rid, req.prompt_ids, req.params
        started = time.monotonic()
        backend = "unknown"
        try:
            got = await self.engine_thread.call(lambda e: e.reserve_remote(rid, prompt, params))
            if got is None:
                raise RemotePrefillFailed("no_blocks", "not enough free KV blocks to reserve")
            req.blocks, cached_tokens = got
            if req.aborted:
                raise RemotePrefillFailed("aborted")
            skip = cached_tokens // self.block_size
            dst = self.receiver.reserve(rid, req.blocks[skip:], timeout_s=self.prefill_timeout)
            req.prefill_done = self.loop.create_future()
            sent = self.peers.send(peer.node_id, peer.control_addr, Prefill(
                rid=rid, prompt_ids=prompt, sampling=req.params.to_dict(), dst=dst.to_dict(),
                decode_node=self.node_id, timeout_s=dst.timeout_s, skip_blocks=skip))
            if not sent:
                raise RemotePrefillFailed("send_failed", f"could not queue Prefill to {peer.node_id}")
            req.progress = "prefilling"
            log.info("request %s: prefill sent to %s (%d blocks reserved, %d cached here)", rid, peer.node_id,
                     len(req.blocks) - skip, skip, extra={"request_id": rid})
            try:
                done: PrefillDone = await asyncio.wait_for(req.prefill_done, self.prefill_timeout)
            except asyncio.TimeoutError:
                raise RemotePrefillFailed(
                    "timeout", f"no PrefillDone from {peer.node_id} in {self.prefill_timeout} s") from None
            backend = done.kv_backend or backend
            req.progress = "waiting_kv"
            if done.error:
                raise RemotePrefillFailed("prefill_error", done.error)
            if not 0 <= done.first_token < self.vocab_size:
                raise RemotePrefillFailed("prefill_error", f"first_token {done.first_token} is not in the vocabulary")
            try:
                first_lp = _logprob_entry(done.logprobs[0]) if done.logprobs else None
            except (TypeError, ValueError, IndexError) as exc:
                raise RemotePrefillFailed("prefill_error", f"malformed logprobs: {exc}") from None
            try:
                result = await self.receiver.wait(rid, timeout=5.0)
            except ChecksumError as exc:
                raise RemotePrefillFailed("checksum", str(exc)) from None
            except Exception as exc:
                raise RemotePrefillFailed("transfer", str(exc)) from None
            if done.checksum and result.checksum != done.checksum:
                raise RemotePrefillFailed("checksum", f"sender {done.checksum:#x} != landed {result.checksum:#x}")
            self.metrics.received_bytes.labels(backend).inc(result.nbytes)
            self.kv_bytes_moved += result.nbytes
        except Exception as exc:
            reason = "aborted" if req.aborted else exc.reason if isinstance(exc, RemotePrefillFailed) else "internal"
            if reason == "internal":
                log.exception("request %s: remote prefill failed", rid)
            if reason != "aborted":
                (log.warning if reason != "no_blocks" else log.info)(
                    "request %s: remote prefill on %s failed (%s); prefilling locally", rid, peer.node_id, exc)
                self.metrics.remote_failures.labels(reason).inc()
                if reason in ("checksum", "transfer"):
                    self.metrics.transfer_failures.labels(backend).inc()
            await self._release_reservation(req, notify=peer.node_id if reason != "no_blocks" else None)
            if req.aborted:
                self._forget(req, "abort")
            else:
                req.progress = "queued"
                self._prefill_locally(req)
            return
        self.metrics.remote_prefill_seconds.observe(time.monotonic() - started)
        self.metrics.prefills.labels("remote").inc()
        log.info("request %s: prefill done on %s (%d KV bytes via %s)", rid, peer.node_id, result.nbytes, backend,
                 extra={"request_id": rid})
        req.blocks = []
        req.phase, req.prefill_path = "engine", f"remote:{peer.node_id}"
        req.num_cached_tokens = max(cached_tokens, done.num_cached_tokens)

        def add(engine: LLMEngine) -> None:
            out = engine.add_prefilled(rid, done.first_token, first_lp)
            # From the engine thread, so the first token reaches the loop before the next step's tokens.
            self.loop.call_soon_threadsafe(self._on_outputs, [out])

        try:
            await self.engine_thread.call(add)
        except Exception as exc:
            self._fail(req, f"engine refused the prefilled request: {exc}")   # its abort frees the blocks
            return
        if req.aborted:  # aborted while the KV was landing
            self.engine_thread.post(lambda e: e.abort(rid))
            self._forget(req, "abort")

    async def _release_reservation(self, req: DecodeRequest, notify: str | None) -> None:
        """Cancel the receiver's reservation, wait until no write can land, then drop the engine's request
        (and its blocks)."""
        if notify is not None:
            self.peers.send_existing(notify, Abort(rid=req.rid))
        self.receiver.cancel(req.rid)
        try:
            await self.receiver.wait(req.rid, timeout=RELEASE_TIMEOUT)
        except TimeoutError:
            log.error("request %s: receiver kept the reservation past %s s; freeing its blocks anyway",
                      req.rid, RELEASE_TIMEOUT)
        except Exception:
            pass  # resolved (as failed or unknown): no write can land any more
        if req.blocks:
            req.blocks = []
            await self.engine_thread.call(lambda e: e.abort(req.rid))

    def _on_peer_message(self, node_id: str, msg: Message) -> None:
        if not isinstance(msg, PrefillDone):
            log.warning("decode node: dropped unexpected %s from prefill node %s", msg.TYPE, node_id)
            return
        req = self.requests.get(msg.rid)
        if req is None or req.prefill_node != node_id or req.prefill_done is None or req.prefill_done.done():
            return  # late reply for a request that moved on
        req.prefill_done.set_result(msg)

    def on_peer_change(self, event: str, node_id: str) -> None:
        if event != "node_removed":
            return
        if self.peers is not None:
            self.peers.drop(node_id)
        for req in self.requests.values():
            if req.prefill_node == node_id and req.prefill_done is not None and not req.prefill_done.done():
                req.prefill_done.set_result(PrefillDone(rid=req.rid, error=f"prefill node {node_id} left the cluster"))

    # ---- aborts, deadlines, outputs ----------------------------------------------------------------

    def _abort(self, rid: str, reason: str, notify_router: bool = False) -> None:
        req = self.requests.get(rid)
        if req is None:
            return
        req.aborted = True
        if notify_router:
            self.control.send(req.router, Tokens(rid=rid, ids=[], finish="abort", error=reason))
        if req.phase == "remote":
            if req.prefill_done is not None and not req.prefill_done.done():
                req.prefill_done.set_result(PrefillDone(rid=rid, error=reason))
            # _remote_prefill frees the reservation and forgets the request
        else:
            self.engine_thread.post(lambda e: e.abort(rid))
            self._forget(req, "abort")

    def _fail(self, req: DecodeRequest, error: str) -> None:
        if self.requests.get(req.rid) is not req:
            return
        log.warning("request %s failed: %s", req.rid, error)
        self.control.send(req.router, Tokens(rid=req.rid, ids=[], finish="error", error=error))
        self.engine_thread.post(lambda e: e.abort(req.rid))
        self._forget(req, "error")

    def _forget(self, req: DecodeRequest, outcome: str) -> None:
        if self.requests.get(req.rid) is req:
            del self.requests[req.rid]
            self.metrics.requests.labels(outcome).inc()
            log.info("request %s finished: %s (prefill %s)", req.rid, outcome, req.prefill_path,
                     extra={"request_id": req.rid})

    async def _deadline_loop(self) -> None:
        while True:
            await asyncio.sleep(0.25)
            now = time.monotonic()
            for req in [r for r in self.requests.values() if r.deadline and now > r.deadline]:
                log.info("request %s: deadline passed; aborting", req.rid)
                self._abort(req.rid, "deadline exceeded", notify_router=True)

    def _on_outputs(self, outputs: list[RequestOutput] | BaseException) -> None:
        if isinstance(outputs, BaseException):  # the engine thread died: fail everything, leave
            for req in list(self.requests.values()):
                self.control.send(req.router, Tokens(rid=req.rid, ids=[], finish="error", error="engine failure"))
                self._forget(req, "error")
            self.exit_code = 1   # a failed engine: exit non-zero, so systemd restarts the node
            self.begin_drain("engine failure")
            return
        batches: dict[bytes, list[tuple[DecodeRequest, Tokens]]] = {}
        for out in outputs:
            req = self.requests.get(out.request_id)
            if req is None or req.phase != "engine":
                continue
            batches.setdefault(req.router, []).append((req, step_tokens(req, out)))
            if out.finished:
                req.outcome = out.finish_reason or "stop"
        for router, items in batches.items():
            frame = items[0][1] if len(items) == 1 else TokenBatch(items=[msg for _, msg in items])
            if self._send_to(router, frame):
                now = time.monotonic()
                for req, _ in items:
                    req.last_sent = now
                    if req.outcome:
                        self._forget(req, req.outcome)
            else:
                for req, msg in items:
                    req.backlog = msg

    # ---- the router link: acknowledgements, heartbeats, held tokens ---------------------------------

    def _to_router(self, req: DecodeRequest, msg: Message) -> bool:
        """Send to the request's router; False when it cannot take it now (disconnected or far behind)."""
        if not self._send_to(req.router, msg):
            return False
        req.last_sent = time.monotonic()
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
        silent: dict[bytes, list[DecodeRequest]] = {}
        for req in list(self.requests.values()):
            if req.backlog is not None:
                if self._to_router(req, req.backlog):
                    req.backlog = None
                    if req.outcome:
                        self._forget(req, req.outcome)
            elif not req.outcome and now - req.last_sent >= self.heartbeat_interval / 2:
                silent.setdefault(req.router, []).append(req)
        for router, reqs in silent.items():
            if self.control.send(router, Progress(rids=[r.rid for r in reqs], states=[r.progress for r in reqs])):
                self._unreachable.pop(router, None)
                for r in reqs:
                    r.last_sent = now
            else:
                self._unreachable.setdefault(router, now)
        gone = {r for r, since in self._unreachable.items() if now - since > self.router_reconnect_timeout}
        for req in [r for r in self.requests.values() if r.router in gone]:
            log.warning("request %s: router %r unreachable for %s s; aborting", req.rid, req.router,
                        self.router_reconnect_timeout, extra={"request_id": req.rid})
            self._abort(req.rid, "router unreachable")
        for router in gone:
            del self._unreachable[router]


def _logprob_entry(lp: Any) -> Any:
    """Wire list -> the engine's (logprob, [(id, logprob), ...]) tuple."""
    if lp is None:
        return None
    return (float(lp[0]), [(int(t), float(v)) for t, v in lp[1]])


def main(config: NodeConfig) -> int:
    from pdcluster.node.service import run_service

    return run_service(lambda: DecodeNode(config))
