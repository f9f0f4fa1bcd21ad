"""Sender side: writes source blocks of a local KV pool into a receiver's reserved blocks.

`connect` opens the connections to a receiver (blocking; off the engine thread). Called from the thread
that runs engine steps: `start(..., connect=False)` and `send_layers` only enqueue work; per
receiver connection ("stream") a worker thread has the stream's channel send the writes and a reader
thread routes replies. `finish` blocks until the receiver acknowledged every byte (checksums matched)
or fails. The engine must not overwrite source blocks until `finish` returns. The channel class is
picked once per destination and connection (backends.choose); nothing here depends on which it is.
A transfer's state is `Transfer.state` (a TransferState); a failure is a TransferError whose `code` the
receiver sent (errors.CODES), never read out of its message.
"""

from __future__ import annotations

import enum
import logging
import queue
import socket
import threading
import time
import uuid
from functools import partial
from itertools import count
from typing import Any, Callable, Iterable

import torch

from pdcluster.control.lifecycle import check_move
from pdcluster.device import bind_thread
from pdcluster.kv_transfer.backends import CHANNELS, choose
from pdcluster.kv_transfer.channel import Channel, PoolViews
from pdcluster.kv_transfer.checksum import combine
from pdcluster.kv_transfer.destination import Destination
from pdcluster.kv_transfer.errors import ChecksumError, StaleReservationError, TransferError, from_code
from pdcluster.kv_transfer.handshake import client_handshake
from pdcluster.kv_transfer.layout import KVLayout, RankSlice, runs
from pdcluster.kv_transfer.regroup import regroup_for
from pdcluster.kv_transfer.tcp import WIRE_VERSION, IdleTimeout, Wire, configure

log = logging.getLogger(__name__)

_xids = count(1)

STALE_ANSWER_WAIT_S = 0.5  # an shm write that found its tags withdrawn waits this long for the receiver's why


class TransferState(enum.Enum):
    SENDING = "sending"  # writes may be queued (send_layers)
    FINISHING = "finishing"  # finish() called: no more writes; the done goes out once every write is sent
    AWAITING_ACK = "awaiting_ack"  # the done went out (in its own frame or with the last write)
    COMPLETE = "complete"  # the receiver acknowledged the total that was sent (terminal)
    FAILED = "failed"  # terminal; `error` says why (its `code`)


_NEXT = {
    TransferState.SENDING: {TransferState.FINISHING, TransferState.FAILED},
    TransferState.FINISHING: {TransferState.AWAITING_ACK, TransferState.FAILED},
    TransferState.AWAITING_ACK: {TransferState.COMPLETE, TransferState.FAILED},
    TransferState.COMPLETE: set(),
    TransferState.FAILED: set(),
}
_TERMINAL = (TransferState.COMPLETE, TransferState.FAILED)


class ByteCount:
    """A running total that several threads add to (the streams' reply readers) and anyone reads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._total = 0

    def add(self, n: int) -> None:
        with self._lock:
            self._total += n

    @property
    def total(self) -> int:
        return self._total


class Transfer:
    """One request's KV going to one destination; create with KVSender.start.

        SENDING ──finish()──► FINISHING ──every write sent, done out──► AWAITING_ACK ──ack──► COMPLETE
           └──────────────────────┴── fail / abort / lost / refused / timeout ──┴──────────► FAILED

    Three kinds of thread change it, each only through a method here and under its one condition variable:
    the caller (send_layers, finish, abort), each stream's worker (write_header, take_done) and reply reader
    (acked, fail). The first outcome wins: a terminal state never changes again.
    """

    def __init__(self, peer: "_Peer", dst: Destination, src_ids: list[int], dst_ids: list[int], *,
                 num_layers: int, delivered: ByteCount):
        self.request_id = dst.request_id
        self.xid = next(_xids)  # echoed in replies: tells apart two transfers of one request id
        self.backend = peer.channel_cls.name
        self.dst = dst
        self.runs = runs(dst_ids, src_ids)  # (dst_start, src_start, n)
        self._peer = peer
        self._num_layers = num_layers
        self._delivered = delivered  # the sender's total of acknowledged bytes
        self._cond = threading.Condition()
        self._state = TransferState.SENDING
        self._writes = 0  # write frames queued
        self._unsent = 0  # of those, the ones whose header has not gone out yet
        self._sent_checksum = 0  # combined over the writes sent
        self._sent_bytes = 0  # their wire bytes
        self._done_checksum: int | None = None  # the total the done announced
        self._checksum: int | None = None  # the receiver's ack
        self._error: TransferError | None = None

    @property
    def state(self) -> TransferState:
        return self._state

    @property
    def failed(self) -> bool:
        return self._state is TransferState.FAILED

    @property
    def error(self) -> TransferError | None:
        """Why it failed (its `code` is machine-readable); None unless FAILED."""
        return self._error

    @property
    def checksum(self) -> int | None:
        """The checksum the receiver acknowledged; None before the ack."""
        return self._checksum

    @property
    def sent_bytes(self) -> int:
        """Wire bytes of the writes sent so far."""
        return self._sent_bytes

    # ---- the caller's thread -----------------------------------------------------------------------

    def send_layers(self, l0: int, l1: int) -> None:
        """Queue layers [l0, l1) of every block; returns at once. Ignored once the transfer failed."""
        if not 0 <= l0 < l1 <= self._num_layers:
            raise ValueError(f"layers: expected 0 <= l0 < l1 <= {self._num_layers}, got [{l0}, {l1})")
        streams = self._peer.streams
        parts = _split(self.runs, len(streams))
        with self._cond:
            if self._state is TransferState.FAILED:
                return
            if self._state is not TransferState.SENDING:
                raise TransferError(f"kv transfer {self.request_id!r}: send after finish")
            self._writes += len(parts)
            self._unsent += len(parts)
        for stream, part in zip(streams, parts, strict=False):   # parts may be fewer
            stream.submit(self, partial(_Stream.write, t=self, part=part, l0=l0, l1=l1))

    def send_all(self) -> None:
        self.send_layers(0, self._num_layers)

    def finish(self, timeout: float = 10.0) -> int:
        """Block until the receiver acknowledged the whole transfer; returns the end-to-end checksum.
        Raises the failure's TransferError (code "timeout" when no ack came within `timeout`)."""
        with self._cond:
            queue_done = self._state is TransferState.SENDING
            if queue_done:
                self._move(TransferState.FINISHING)
        if queue_done:
            self._peer.streams[0].submit(self, lambda s: s.done(self, timeout))
        if not self.settle(timeout):
            self.fail(TransferError(f"kv transfer {self.request_id!r}: no acknowledgement within {timeout} s",
                                    "timeout"))
            self.abort("sender timed out waiting for the ack")
        if self._error is not None:
            raise self._error
        assert self._checksum is not None  # terminal and no error: COMPLETE, so acked
        return self._checksum

    def abort(self, reason: str = "") -> None:
        """Tell the receiver to drop the reservation (its blocks go back to its owner); no-op once acknowledged."""
        self.fail(TransferError(f"kv transfer {self.request_id!r} aborted: {reason}", "aborted"))
        if self._state is not TransferState.COMPLETE:
            self._peer.streams[0].submit(self, lambda s: s.abort(self, reason), even_if_failed=True)

    def settle(self, timeout: float) -> bool:
        """Wait up to `timeout` for COMPLETE or FAILED; whether it got there."""
        with self._cond:
            return self._cond.wait_for(lambda: self._state in _TERMINAL, timeout)

    # ---- the streams' threads ----------------------------------------------------------------------

    def write_header(self, checksum: int, nbytes: int) -> dict[str, int] | None:
        """A write's header is going out (a worker): it counts as sent. When finish() was already called and
        this is the last unsent write, returns the done it carries ({writes, checksum}; one frame and one
        receiver wake-up less) and the transfer awaits the ack."""
        with self._cond:
            self._unsent -= 1
            self._sent_checksum = combine(self._sent_checksum, checksum)
            self._sent_bytes += nbytes
            self._cond.notify_all()
            if self._state is TransferState.FINISHING and self._unsent == 0:
                return self._announce_done()
        return None

    def take_done(self, timeout: float) -> dict[str, int] | None:
        """After finish() (stream 0's worker): wait until every write is sent; returns the done frame's
        {writes, checksum}, or None when the last write carried it or the transfer failed meanwhile."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._unsent > 0 and self._state is TransferState.FINISHING:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TransferError(f"kv transfer {self.request_id!r}: writes not sent within {timeout} s",
                                        "timeout")
                self._cond.wait(left)
            if self._state is not TransferState.FINISHING:
                return None
            return self._announce_done()

    def acked(self, checksum: int) -> None:
        """The receiver's ack (a reply reader): COMPLETE when it is the total the done announced, else FAILED
        with ChecksumError. Ignored once FAILED (e.g. timed out); an ack before the done went out, or a
        second one, is refused (RuntimeError: the reader drops the connection)."""
        with self._cond:
            if self._state is TransferState.FAILED:
                return
            if self._state is not TransferState.AWAITING_ACK:
                raise RuntimeError(f"kv transfer {self.request_id!r}: an ack in state {self._state.value}")
            self._checksum = checksum
            if checksum == self._done_checksum:
                self._move(TransferState.COMPLETE)
            else:
                self._error = ChecksumError(
                    f"kv transfer {self.request_id!r}: ack checksum {checksum:#x} != sent {self._done_checksum!r}"
                )
                self._move(TransferState.FAILED)
            self._cond.notify_all()
            delivered = self._sent_bytes if self._state is TransferState.COMPLETE else 0
        if delivered:
            self._delivered.add(delivered)

    def fail(self, exc: TransferError) -> None:
        """FAILED with `exc` (its code says why), from any state that is not terminal."""
        with self._cond:
            if self._state in _TERMINAL:
                return
            self._error = exc
            self._move(TransferState.FAILED)
            self._cond.notify_all()

    def _announce_done(self) -> dict[str, int]:
        self._move(TransferState.AWAITING_ACK)
        self._done_checksum = self._sent_checksum
        return {"writes": self._writes, "checksum": self._done_checksum}

    def _move(self, state: TransferState) -> None:
        self._state = check_move(_NEXT, self._state, state, f"kv transfer {self.request_id!r}")
        if state in _TERMINAL:   # no reply can change it any more: it leaves its peer's table (finished or not)
            self._peer.forget(self)


def _split(run_list: list[tuple[int, int, int]], parts: int) -> list[list[tuple[int, int, int]]]:
    """Split runs into `parts` groups of about equal block counts (for parallel streams)."""
    if parts == 1:
        return [run_list]
    total = sum(n for _, _, n in run_list)
    per = -(-total // parts)
    out: list[list[tuple[int, int, int]]] = [[]]
    room = per
    for d, s, n in run_list:
        while n:
            if room == 0:
                out.append([])
                room = per
            k = min(n, room)
            out[-1].append((d, s, k))
            d, s, n, room = d + k, s + k, n - k, room - k
    return [p for p in out if p]


class _Stream:
    """One connection to the receiver, its channel, and its worker and reply-reader threads."""

    def __init__(self, peer: "_Peer", index: int):
        self.peer = peer
        sender = peer.sender
        bind_thread(sender.pool.device)   # the connecting thread builds the channel (a collective group)
        try:
            sock = socket.create_connection(peer.dst.host_port, timeout=sender.connect_timeout)
        except OSError as exc:
            raise TransferError(f"kv receiver {peer.dst.address}: no connection within "
                                f"{sender.connect_timeout} s: {exc}", "unreachable") from None
        configure(sock, sender.connect_timeout)  # a receiver that accepts but never answers fails as fast
        self.wire = Wire(sock)
        try:
            reply = client_handshake(self.wire, sender.auth_key, {
                "op": "hello", "version": WIRE_VERSION, "backend": peer.channel_cls.name, "session": peer.session,
                "layout": sender.layout.to_dict(), "stream": index,
            }, peer.dst.address)  # fmt: skip
        except BaseException:
            self.wire.close()
            raise
        try:
            self.remote_layout = KVLayout.from_dict(reply["layout"])
            self.remote_layout.check_compatible(sender.layout, mine="sender", theirs="receiver")
            regroup = regroup_for(peer.channel_cls, sender.layout, self.remote_layout)
            self.channel: Channel = peer.channel_cls.connect(
                self.wire, sender.views, reply, session=peer.session, connect_timeout=sender.connect_timeout,
                io_timeout=sender.io_timeout,
            )  # fmt: skip
        except BaseException:
            self.wire.close()
            raise
        self.channel.regroup = regroup
        sock.settimeout(sender.io_timeout)
        self.queue: queue.Queue = queue.Queue()
        self.dead: BaseException | None = None
        for target in (self._work_loop, self._read_loop):
            threading.Thread(target=target, name=f"kv-send-{index}", daemon=True).start()

    def submit(self, transfer: Transfer, fn: Callable[["_Stream"], None], even_if_failed: bool = False) -> None:
        if self.dead is not None:
            transfer.fail(self._lost(transfer))
            return
        self.queue.put((transfer, fn, even_if_failed))

    def run_now(self, transfer: Transfer, fn: Callable[["_Stream"], None]) -> None:
        """Run a short op (one small frame) on the caller's thread, sparing the hand-off to the worker."""
        if self.dead is not None:
            transfer.fail(self._lost(transfer))
            return
        self._run(transfer, fn)

    def _lost(self, transfer: Transfer) -> TransferError:
        return TransferError(f"kv transfer {transfer.request_id!r}: connection lost: {self.dead}", "lost")

    def close(self) -> None:
        self.queue.put(None)
        self.wire.shutdown()
        self.channel.close()

    # ---- ops (run on the worker thread) ---------------------------------------------------------

    def open(self, t: Transfer) -> None:
        blocks = [d + i for d, _, n in t.runs for i in range(n)]
        if max(blocks) >= self.remote_layout.num_blocks:
            raise TransferError(
                f"kv transfer {t.request_id!r}: destination block {max(blocks)} outside the receiver pool", "refused"
            )
        self.wire.send({"op": "open", "rid": t.request_id, "xid": t.xid, "token": t.dst.token, "blocks": blocks})

    def write(self, t: Transfer, part: list[tuple[int, int, int]], l0: int, l1: int) -> None:
        if time.monotonic() > t.dst.expires:
            raise TransferError(f"kv transfer {t.request_id!r}: destination deadline passed", "expired")
        base = {
            "op": "write", "rid": t.request_id, "xid": t.xid, "token": t.dst.token,
            "runs": [[d, n] for d, _, n in part], "l0": l0, "l1": l1,
        }  # fmt: skip

        def header(checksum: int, nbytes: int) -> dict[str, Any]:
            done = t.write_header(checksum, nbytes)   # the last write after finish() carries the done
            return base if done is None else {**base, "done": done}

        try:
            self.channel.write_runs(t.dst.token, part, l0, l1, header)
        except StaleReservationError as exc:
            t.settle(STALE_ANSWER_WAIT_S)  # the receiver's error answer to our open, if it comes, says why
            raise t.error or StaleReservationError(f"kv transfer {t.request_id!r}: {exc}") from None

    def done(self, t: Transfer, timeout: float) -> None:
        done = t.take_done(timeout)
        if done is not None:
            self.wire.send({"op": "done", "rid": t.request_id, "xid": t.xid, "token": t.dst.token, **done})

    def abort(self, t: Transfer, reason: str) -> None:
        self.wire.send({"op": "abort", "rid": t.request_id, "xid": t.xid, "token": t.dst.token, "reason": reason})

    # ---- threads ---------------------------------------------------------------------------------

    def _work_loop(self) -> None:
        bind_thread(self.peer.sender.pool.device)
        while True:
            item = self.queue.get()
            if item is None:
                return
            transfer, fn, even_if_failed = item
            if self.dead is not None:
                transfer.fail(self._lost(transfer))
                continue
            if transfer.failed and not even_if_failed:
                continue
            self._run(transfer, fn)

    def _run(self, transfer: Transfer, fn: Callable[["_Stream"], None]) -> None:
        try:
            fn(self)
        except OSError as exc:   # ConnectionError, socket.timeout included
            self._die(exc)
            transfer.fail(TransferError(f"kv transfer {transfer.request_id!r}: connection lost: {exc}", "lost"))
        except TransferError as exc:
            transfer.fail(exc)
        except Exception as exc:
            transfer.fail(TransferError(f"kv transfer {transfer.request_id!r}: {type(exc).__name__}: {exc}"))

    def _read_loop(self) -> None:
        try:
            while True:
                try:
                    frame = self.wire.recv(idle_ok=True)
                except IdleTimeout:
                    continue
                t = self.peer.transfers.get(frame.get("xid", 0))  # 0: no transfer's (xids start at 1)
                if t is None:
                    continue
                op = frame["op"]
                if op == "ack":
                    t.acked(int(frame.get("checksum", -1)))
                elif op == "error":
                    why = f"kv transfer {t.request_id!r} rejected by the receiver: {frame.get('error')}"
                    t.fail(from_code(frame.get("code"), why))
        except Exception as exc:
            self._die(exc)

    def _die(self, exc: BaseException) -> None:
        if self.dead is None:
            self.dead = exc
            self.peer.broken(exc)


class _Peer:
    """All streams to one receiver over one channel class; one session id on the receiver side."""

    def __init__(self, sender: "KVSender", dst: Destination, channel_cls: type[Channel]):
        self.sender, self.dst, self.channel_cls = sender, dst, channel_cls
        self.session = uuid.uuid4().hex
        self.transfers: dict[int, Transfer] = {}
        self.dead: BaseException | None = None
        nstreams = sender.num_streams if channel_cls.parallel_streams else 1
        self.streams = [_Stream(self, 0)]
        try:
            for i in range(1, nstreams):
                self.streams.append(_Stream(self, i))
        except BaseException:   # the streams already open must not stay open, unseen
            self.close()
            raise

    def forget(self, t: Transfer) -> None:
        self.transfers.pop(t.xid, None)

    def broken(self, exc: BaseException) -> None:
        self.dead = exc
        self.sender.drop(self)
        self.close()
        for t in list(self.transfers.values()):
            t.fail(TransferError(f"kv transfer {t.request_id!r}: connection to {self.dst.address} lost: {exc}", "lost"))

    def close(self) -> None:
        for s in self.streams:
            s.close()


class KVSender:
    def __init__(
        self,
        pool: torch.Tensor,
        *,
        backend: str = "auto",
        num_streams: int = 1,
        quant: str | None = None,
        connect_timeout: float = 5.0,
        io_timeout: float = 10.0,
        auth_key: bytes | None = None,
        total_kv_heads: int | None = None,
        rank_slice: RankSlice | None = None,
    ):
        """`auth_key`: the cluster secret's KV key, proven to every receiver (and asked of it) in the handshake.
        `total_kv_heads`: the model's KV heads, when fewer than the pool's tensor-parallel ranks (KVLayout.of).
        `rank_slice`: (rank, ranks[, model KV heads]) when the pool is one rank's slice of an engine sliced per rank
        (per_rank/; the model's heads when fewer than ranks: KVLayout.sliced)."""
        if backend != "auto" and backend not in CHANNELS:
            raise ValueError(f"backend: expected auto or one of {list(CHANNELS)}, got {backend!r}")
        if quant not in (None, "int8"):
            raise ValueError(f"quant: expected None or 'int8', got {quant!r}")
        if num_streams < 1:
            raise ValueError("num_streams: expected >= 1")
        self.pool = pool
        self.views = PoolViews(pool, total_kv_heads, rank_slice)
        self.layout = self.views.layout
        for cls in set(CHANNELS.values()):
            cls.prepare(self.views)
        self.backend = backend
        self.num_streams = num_streams
        self.quant = None if self.layout.scale_bytes else quant   # an int8 pool's blocks travel as they are
        self.connect_timeout = connect_timeout
        self.io_timeout = io_timeout
        self.auth_key = auth_key
        self._delivered = ByteCount()  # wire bytes of acknowledged transfers (the reply readers add)
        self._peers: dict[tuple[str, str], _Peer] = {}
        self._gates: dict[tuple[str, str], threading.Lock] = {}   # per receiver: serializes its connects
        self._lock = threading.Lock()

    def connect(self, dst: Destination | dict) -> None:
        """Open (or find open) the connections to dst's receiver: blocks for up to `connect_timeout` per
        connection (TCP connect, then the handshake), so call it off the engine thread, before the prompt is
        admitted; `start(..., connect=False)` then only queues work. TransferError naming the receiver if it
        does not answer in time."""
        if isinstance(dst, dict):
            dst = Destination.from_dict(dst)
        try:
            self._peer(dst, choose(self.backend, self.quant, self.views, dst))
        except OSError as exc:   # socket.timeout in the handshake, resets
            raise TransferError(f"kv receiver {dst.address}: handshake not done within {self.connect_timeout} s: "
                                f"{exc or type(exc).__name__}", "unreachable") from None

    @property
    def bytes_sent(self) -> int:
        """Wire bytes of every transfer the receiver acknowledged so far (read-only; counted here)."""
        return self._delivered.total

    def start(self, dst: Destination | dict, src_block_ids: list[int], connect: bool = True) -> Transfer:
        """Open a transfer of src_block_ids into dst.block_ids (same count). With `connect=False` (the engine
        thread) nothing blocks: no connection is opened (TransferError when none is open; see `connect`) and
        the open frame is queued behind the stream's other work."""
        if isinstance(dst, dict):
            dst = Destination.from_dict(dst)
        dst_ids = dst.block_ids
        if len(src_block_ids) != len(dst_ids):
            raise ValueError(f"src_block_ids: {len(src_block_ids)} blocks for {len(dst_ids)} destination blocks")
        bad = [b for b in src_block_ids if not 0 <= b < self.layout.num_blocks]
        if bad:
            raise ValueError(f"src_block_ids: {bad[:5]} outside 0..{self.layout.num_blocks - 1}")
        self.layout.check_compatible(KVLayout.from_dict(dst.layout), mine="sender", theirs="receiver")
        peer = self._peer(dst, choose(self.backend, self.quant, self.views, dst), connect=connect)
        t = Transfer(peer, dst, list(src_block_ids), dst_ids, num_layers=self.layout.num_layers,
                     delivered=self._delivered)
        peer.transfers[t.xid] = t
        if connect or len(peer.streams) > 1:   # other streams' writes must not overtake the open
            peer.streams[0].run_now(t, lambda s: s.open(t))
        else:
            peer.streams[0].submit(t, lambda s: s.open(t))
        return t

    def send(self, dst: Destination | dict, src_block_ids: list[int], timeout: float = 10.0) -> int:
        """Convenience: all layers, wait for the ack."""
        t = self.start(dst, src_block_ids)
        t.send_all()
        return t.finish(timeout)

    def close(self) -> None:
        with self._lock:
            peers, self._peers = list(self._peers.values()), {}
        for p in peers:
            p.close()

    def forget_peer(self, address: str) -> None:
        """Close the connections to the receiver at `address` (e.g. its node left the cluster view) and forget
        it; its transfers still in flight fail ("lost"). A later transfer to it connects again."""
        with self._lock:
            peers = [p for key, p in self._peers.items() if key[0] == address]
        for p in peers:
            self.drop(p)
            p.close()

    def keep_peers(self, addresses: Iterable[str]) -> None:
        """forget_peer every receiver whose address is not in `addresses` (e.g. the decode nodes in the view)."""
        keep = set(addresses)
        with self._lock:
            gone = {key[0] for key in self._peers if key[0] not in keep}
        for address in gone:
            self.forget_peer(address)

    def drop(self, peer: _Peer) -> None:
        """Take `peer` out of the table (its connection broke or it was forgotten)."""
        key = (peer.dst.address, peer.channel_cls.name)
        with self._lock:
            if self._peers.get(key) is peer:
                del self._peers[key]

    def _peer(self, dst: Destination, channel_cls: type[Channel], connect: bool = True) -> _Peer:
        """The live peer for dst's receiver; opened here if `connect`. A connect holds only its receiver's
        gate, never the sender's lock: a receiver that does not answer delays nobody else."""
        key = (dst.address, channel_cls.name)
        with self._lock:
            peer = self._peers.get(key)
            if peer is not None and peer.dead is None:
                return peer
            if not connect:
                raise TransferError(f"kv transfer {dst.request_id!r}: no open connection to {dst.address}",
                                    "unreachable")
            gate = self._gates.setdefault(key, threading.Lock())
        try:
            with gate:   # one connect per receiver at a time; who waited reuses its result
                with self._lock:
                    peer = self._peers.get(key)
                    if peer is not None and peer.dead is None:
                        return peer
                peer = _Peer(self, dst, channel_cls)
                with self._lock:
                    current = self._peers.get(key)
                    if current is None or current.dead is not None:
                        if peer.dead is None:   # one that broke already stays out (broken() dropped it before)
                            self._peers[key] = peer
                        return peer
                # a connect through a newer gate (see below) won meanwhile: use its peer, not a second one
                peer.close()
                return current
        finally:
            with self._lock:   # gates only live while connects wait on them (a receiver never reached leaves none)
                if self._gates.get(key) is gate and not gate.locked():
                    del self._gates[key]
