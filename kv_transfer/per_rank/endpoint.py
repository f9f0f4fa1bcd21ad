"""One tensor-parallel rank's KV endpoint: its slice of the engine's KV pool, moved over its own channel.

Runs in the rank's own process beside its model shard: an agent of the engine (engine/rank_agent.py), which a
node starts with `LLMEngine.start_rank_agents(RankEndpointSpec(...))`. It holds a `KVReceiver` on the slice (a
decode node: the reservations rank 0 asks for; on CPU the slice first moves into a `SharedKVPool`, so a sender on
the same host copies into it over shm) and a `KVSender` (made on first use: a prefill node's pushes),
both marked as this rank's slice (KVLayout.rank_slice), so the handshake maps its heads (regroup.py): plane for
plane with the same rank of an engine sliced the same way, regrouped with a pool holding some of its heads.
Rank 0 drives it:

- over the link (link.py), answered from the link's thread: `reserve` / `cancel` / `active` (receiver),
  `connect` (on a thread of its own: a destination that does not answer delays no other), `send` (blocks already
  computed, e.g. cached ones: start, every layer, finish), `abort`, `keep_peers` / `forget_peer`;
- in order with the engine's steps (`on_message`, the rank's main thread): `start` (a transfer whose layers go
  out as the next step computes them on this rank: `layer_hook`) and `send_all` (every layer now: the step that
  computed them ran).

Once every layer of a transfer is queued the endpoint finishes it itself (waits for the receiver's ack on a
thread, at most `finish_timeout`) and reports `sent` to rank 0; each reservation's result goes to rank 0 as
`landed` when it resolves. Rank 0 combines the ranks' reports into one (sender.py, receiver.py).
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from functools import partial
from typing import Any, Callable

import torch

from pdcluster.kv_transfer.destination import Destination
from pdcluster.kv_transfer.errors import TransferError
from pdcluster.kv_transfer.per_rank.link import LinkServer
from pdcluster.kv_transfer.receiver import KVReceiver
from pdcluster.kv_transfer.reservations import TransferResult
from pdcluster.kv_transfer.sender import KVSender, Transfer
from pdcluster.kv_transfer.shm import SharedKVPool

log = logging.getLogger(__name__)

EARLY_ABORT_S = 60.0   # an abort that overtook its transfer's start is remembered this long


@dataclass
class RankEndpointSpec:
    """What a rank needs to open its endpoint; pickled to the rank by the engine and called there with (its KV pool
    tensor, rank, size): an `engine.rank_agent.RankAgentFactory`."""

    receive: bool   # hold a KVReceiver on the slice (a decode node)
    shared_memory: bool = False   # with receive: the slice moves into /dev/shm, so a same-host sender copies into it
    host: str = "127.0.0.1"   # where the receiver listens (and is reached)
    kv_port: int = 0   # rank 0's KV port: rank r listens on kv_port + r (0: a free port)
    backend: str = "auto"
    connect_timeout: float = 5.0
    auth_key: bytes | None = None
    finish_timeout: float = 30.0   # the longest a transfer waits for the receiver's ack
    model_kv_heads: int = 0   # the model's KV heads (KVLayout.sliced: needed when fewer than ranks, each a copy of one)

    def __call__(self, pool: torch.Tensor, rank: int, size: int) -> "RankEndpoint":
        return RankEndpoint(self, pool, rank, size)


class RankEndpoint:
    def __init__(self, spec: RankEndpointSpec, pool: torch.Tensor, rank: int, size: int) -> None:
        self.shm = SharedKVPool.create(tuple(pool.shape), pool.dtype) if spec.receive and spec.shared_memory else None
        self.kv_pool = self.shm.tensor if self.shm is not None else None   # the engine moves the rank's pool here
        self.pool = self.kv_pool if self.kv_pool is not None else pool
        self.spec, self.rank, self.size = spec, rank, size
        self.rank_slice = (rank, size, spec.model_kv_heads)
        self.num_layers = pool.shape[0]
        self.receiver = KVReceiver(self.pool, host=spec.host, port=spec.kv_port + rank if spec.kv_port else 0,
                                   shm_name=self.shm.name if self.shm is not None else None, auth_key=spec.auth_key,
                                   rank_slice=self.rank_slice) if spec.receive else None
        self._sender: KVSender | None = None
        self._lock = threading.Lock()
        self._transfers: dict[int, Transfer] = {}   # by rank 0's transfer id, until finished and reported
        self._streaming: list[tuple[int, Transfer]] = []   # their layers go out during the next step
        self._early_aborts: dict[int, float] = {}   # transfer id -> monotonic time its abort came before its start
        self._threads = ThreadPoolExecutor(16, thread_name_prefix=f"kv-rank{rank}")   # connects, acks, sends
        self.link = LinkServer(self._handle)
        self.info = {"link": self.link.address, "kv_addr": self.receiver.address if self.receiver else ""}

    @property
    def sender(self) -> KVSender:
        with self._lock:
            if self._sender is None:
                s = self.spec
                self._sender = KVSender(self.pool, backend=s.backend, connect_timeout=s.connect_timeout,
                                        auth_key=s.auth_key, rank_slice=self.rank_slice)
            return self._sender

    # ---- the engine's calls (the rank's main thread) -----------------------------------------------

    def on_message(self, message: dict[str, Any]) -> None:
        try:
            if message["op"] == "start":
                self._start(message["tid"], message["dst"], message["src"], stream=True)
            elif message["op"] == "send_all":
                self._send_all(message["tid"])
        except Exception:   # never out of here: the rank must go on stepping
            log.exception("tensor-parallel rank %d: KV message %r failed", self.rank, message.get("op"))

    def layer_hook(self) -> Callable[[int], None] | None:
        return self._layer_done if self._streaming else None

    def _layer_done(self, layer: int) -> None:
        for tid, t in self._streaming:
            self._guard(tid, t, partial(t.send_layers, layer, layer + 1))
        if layer == self.num_layers - 1:
            done, self._streaming = self._streaming, []
            for tid, t in done:
                self._finish_later(tid, t)

    def close(self) -> None:
        self.link.close()
        self._threads.shutdown(wait=False, cancel_futures=True)
        if self.receiver is not None:
            self.receiver.close()
        if self._sender is not None:
            self._sender.close()
        if self.shm is not None:
            self.shm.close()

    # ---- transfers -----------------------------------------------------------------------------------

    def _start(self, tid: int, dst: dict[str, Any], src: list[int], stream: bool) -> Transfer | None:
        """A transfer of blocks `src` into `dst` (no connect: rank 0 had this rank connect first, or for `send`
        the caller's thread may); it streams during the next step when `stream`."""
        with self._lock:
            aborted = self._early_aborts.pop(tid, None) is not None
        if aborted:
            self._report(tid, None, TransferError("aborted before it started", "aborted"))
            return None
        try:
            t = self.sender.start(Destination.from_dict(dst), src, connect=not stream)
        except Exception as exc:
            self._report(tid, None, exc)
            return None
        with self._lock:
            self._transfers[tid] = t
            if stream:
                self._streaming.append((tid, t))
        return t

    def _send_all(self, tid: int) -> None:
        with self._lock:
            t = self._transfers.get(tid)
            self._streaming = [(i, s) for i, s in self._streaming if i != tid]
        if t is not None and self._guard(tid, t, t.send_all):
            self._finish_later(tid, t)

    def _send_now(self, tid: int, dst: dict[str, Any], src: list[int]) -> None:
        """`send`, on a thread of the pool: blocks computed long ago (start connects if need be)."""
        t = self._start(tid, dst, src, stream=False)
        if t is not None and self._guard(tid, t, t.send_all):
            self._finish(tid, t)

    def _guard(self, tid: int, t: Transfer, fn: Callable[[], None]) -> bool:
        """Run `fn` on transfer `t`; a failure is reported (and the transfer dropped), never raised."""
        try:
            fn()
            return True
        except Exception as exc:
            t.abort(str(exc))
            self._report(tid, t, exc)
            return False

    def _finish_later(self, tid: int, t: Transfer) -> None:
        self._threads.submit(self._finish, tid, t)

    def _finish(self, tid: int, t: Transfer) -> None:
        try:
            t.finish(self.spec.finish_timeout)
        except Exception as exc:
            self._report(tid, t, exc)
            return
        self._report(tid, t, None)

    def _report(self, tid: int, t: Transfer | None, error: BaseException | None) -> None:
        with self._lock:
            if t is not None and self._transfers.get(tid) is not t:
                return   # reported already
            self._transfers.pop(tid, None)
        if error is None:
            assert t is not None
            self.link.event("sent", tid=tid, ok=True, checksum=t.checksum, nbytes=t.sent_bytes, backend=t.backend)
        else:
            code = error.code if isinstance(error, TransferError) else "failed"
            self.link.event("sent", tid=tid, ok=False, code=code, error=str(error))

    def _abort(self, tid: int, reason: str) -> None:
        now = time.monotonic()
        with self._lock:
            t = self._transfers.get(tid)
            if t is None:
                self._early_aborts = {i: at for i, at in self._early_aborts.items() if now - at < EARLY_ABORT_S}
                self._early_aborts[tid] = now
        if t is not None:
            t.abort(reason)   # its finish (or the next write) reports it

    # ---- rank 0's requests (the link's thread) -------------------------------------------------------

    def _handle(self, op: str, frame: dict[str, Any]) -> Any:
        if op == "reserve":
            return self._reserve(frame["rid"], frame["blocks"], frame["timeout_s"], frame.get("sender_slices", 1))
        if op == "cancel":
            self._need_receiver().cancel(frame["rid"])
        elif op == "extend":
            self._need_receiver().extend(frame["rid"], frame["timeout_s"])
        elif op == "active":
            return self._need_receiver().num_active_reservations
        elif op == "connect":
            return self._threads.submit(self.sender.connect, frame["dst"])
        elif op == "send":
            self._threads.submit(self._send_now, frame["tid"], frame["dst"], frame["src"])
        elif op == "abort":
            self._abort(frame["tid"], frame.get("reason", ""))
        elif op == "keep_peers":
            self._threads.submit(self.sender.keep_peers, frame["addresses"])
        elif op == "forget_peer":
            self._threads.submit(self.sender.forget_peer, frame["address"])
        else:
            raise TransferError(f"tensor-parallel rank {self.rank}: unknown KV op {op!r}", "failed")
        return None

    def _need_receiver(self) -> KVReceiver:
        if self.receiver is None:
            raise TransferError(f"tensor-parallel rank {self.rank} holds no KV receiver", "refused")
        return self.receiver

    def _reserve(self, rid: str, blocks: list[int], timeout_s: float, sender_slices: int) -> dict[str, Any]:
        receiver = self._need_receiver()
        dst = receiver.reserve(rid, blocks, timeout_s, sender_slices)
        receiver.on_result(rid, self._landed)
        return dst.to_dict()

    def _landed(self, result: TransferResult) -> None:
        self.link.event("landed", **asdict(result))
