"""Sender side: writes source blocks of a local KV pool into a receiver's reserved blocks.

`connect` opens the connections to a receiver (blocking; off the engine thread). Called from the thread
that runs engine steps: `start(..., connect=False)` and `send_layers` only enqueue work; per
receiver connection ("stream") a worker thread has the stream's channel send the writes and a reader
thread routes replies. `finish` blocks until the receiver acknowledged every byte (checksums matched)
or fails. The engine must not overwrite source blocks until `finish` returns. The channel class is
picked once per destination and connection (backends.choose); nothing here depends on which it is.
"""

from __future__ import annotations

import logging
import queue
import socket
import threading
import time
import uuid
from itertools import count
from typing import Any, Callable

import torch

from pdcluster.kv_transfer.backends import CHANNELS, choose
from pdcluster.kv_transfer.channel import Channel, PoolViews, bind_thread
from pdcluster.kv_transfer.checksum import combine
from pdcluster.kv_transfer.destination import Destination
from pdcluster.kv_transfer.errors import ChecksumError, StaleReservationError, TransferError
from pdcluster.kv_transfer.handshake import client_handshake
from pdcluster.kv_transfer.layout import KVLayout, runs
from pdcluster.kv_transfer.tcp import WIRE_VERSION, IdleTimeout, Wire, configure

log = logging.getLogger(__name__)

_xids = count(1)


class Transfer:
    """One request's KV going to one destination; create with KVSender.start."""

    def __init__(self, sender: "KVSender", peer: "_Peer", dst: Destination, src_ids: list[int], dst_ids: list[int]):
        self.request_id = dst.request_id
        self.xid = next(_xids)  # echoed in replies: tells apart two transfers of one request id
        self.backend = peer.channel_cls.name
        self.dst = dst
        self._sender, self._peer = sender, peer
        self._runs = runs(dst_ids, src_ids)  # (dst_start, src_start, n)
        self._lock = threading.Condition()
        self._writes = 0  # write frames planned
        self._pending = 0  # write frames not yet sent
        self._checksum = 0
        self._error: BaseException | None = None
        self._finished = threading.Event()
        self._finish_queued = False
        self._done_sent = False  # "done" went out with the last write
        self._done_checksum: int | None = None  # the total the done frame announced
        self.checksum: int | None = None

    def send_layers(self, l0: int, l1: int) -> None:
        """Queue layers [l0, l1) of every block; returns at once."""
        if not 0 <= l0 < l1 <= self._sender.layout.num_layers:
            raise ValueError(f"layers: expected 0 <= l0 < l1 <= {self._sender.layout.num_layers}, got [{l0}, {l1})")
        if self._finish_queued:
            raise TransferError(f"kv transfer {self.request_id!r}: send after finish")
        parts = _split(self._runs, len(self._peer.streams))
        with self._lock:
            self._writes += len(parts)
            self._pending += len(parts)
        for stream, part in zip(self._peer.streams, parts):
            stream.submit(self, lambda s, part=part: s.write(self, part, l0, l1))

    def send_all(self) -> None:
        self.send_layers(0, self._sender.layout.num_layers)

    def finish(self, timeout: float = 10.0) -> int:
        """Block until the receiver acknowledged the whole transfer; returns the end-to-end checksum."""
        if not self._finish_queued:
            self._finish_queued = True
            self._peer.streams[0].submit(self, lambda s: s.done(self, timeout))
        if not self._finished.wait(timeout):
            self._fail(TransferError(f"kv transfer {self.request_id!r}: no acknowledgement within {timeout} s"))
            self.abort("sender timed out waiting for the ack")
        self._peer.forget(self)
        if self._error is not None:
            raise self._error
        return self.checksum

    def abort(self, reason: str = "") -> None:
        """Tell the receiver to drop the reservation (its blocks go back to its owner)."""
        self._fail(TransferError(f"kv transfer {self.request_id!r} aborted: {reason}"))
        self._peer.streams[0].submit(self, lambda s: s.abort(self, reason), even_if_failed=True)

    @property
    def failed(self) -> bool:
        return self._error is not None

    def _fail(self, exc: BaseException) -> None:
        with self._lock:
            if self._error is None and not self._finished.is_set():
                self._error = exc
            self._lock.notify_all()
        self._finished.set()

    def _sent(self, checksum: int) -> None:
        with self._lock:
            self._checksum = combine(self._checksum, checksum)
            self._pending -= 1
            self._lock.notify_all()

    def _acked(self, checksum: int) -> None:
        with self._lock:
            if self._error is None and checksum != self._done_checksum:
                self._error = ChecksumError(
                    f"kv transfer {self.request_id!r}: ack checksum {checksum:#x} != sent {self._done_checksum!r}"
                )
            self.checksum = checksum
        self._finished.set()


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
                                f"{sender.connect_timeout} s: {exc}") from None
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
        self.remote_layout = KVLayout.from_dict(reply["layout"])
        self.remote_layout.check_compatible(sender.layout, mine="sender", theirs="receiver")
        self.channel: Channel = peer.channel_cls.connect(
            self.wire, sender.views, reply, session=peer.session, connect_timeout=sender.connect_timeout,
            io_timeout=sender.io_timeout,
        )  # fmt: skip
        sock.settimeout(sender.io_timeout)
        self.queue: queue.Queue = queue.Queue()
        self.dead: BaseException | None = None
        for target in (self._work_loop, self._read_loop):
            threading.Thread(target=target, name=f"kv-send-{index}", daemon=True).start()

    def submit(self, transfer: Transfer, fn: Callable[["_Stream"], None], even_if_failed: bool = False) -> None:
        if self.dead is not None:
            transfer._fail(TransferError(f"kv transfer {transfer.request_id!r}: connection lost: {self.dead}"))
            return
        self.queue.put((transfer, fn, even_if_failed))

    def run_now(self, transfer: Transfer, fn: Callable[["_Stream"], None]) -> None:
        """Run a short op (one small frame) on the caller's thread, sparing the hand-off to the worker."""
        if self.dead is not None:
            transfer._fail(TransferError(f"kv transfer {transfer.request_id!r}: connection lost: {self.dead}"))
            return
        self._run(transfer, fn)

    def close(self) -> None:
        self.queue.put(None)
        self.wire.shutdown()
        self.channel.close()

    # ---- ops (run on the worker thread) ---------------------------------------------------------

    def open(self, t: Transfer) -> None:
        blocks = [d + i for d, _, n in t._runs for i in range(n)]
        if max(blocks) >= self.remote_layout.num_blocks:
            raise TransferError(
                f"kv transfer {t.request_id!r}: destination block {max(blocks)} outside the receiver pool"
            )
        self.wire.send({"op": "open", "rid": t.request_id, "xid": t.xid, "token": t.dst.token, "blocks": blocks})

    def write(self, t: Transfer, part: list[tuple[int, int, int]], l0: int, l1: int) -> None:
        if time.monotonic() > t.dst.expires:
            raise TransferError(f"kv transfer {t.request_id!r}: destination deadline passed")
        base = {
            "op": "write", "rid": t.request_id, "xid": t.xid, "token": t.dst.token,
            "runs": [[d, n] for d, _, n in part], "l0": l0, "l1": l1,
        }  # fmt: skip
        try:
            checksum = self.channel.write_runs(t.dst.token, part, l0, l1, lambda c: {**base, **self._done_fields(t, c)})
        except StaleReservationError as exc:
            t._finished.wait(0.5)  # the receiver's error answer to our open, if it comes, says why
            raise t._error or TransferError(f"kv transfer {t.request_id!r}: {exc}") from None
        t._sent(checksum)

    def _done_fields(self, t: Transfer, checksum: int) -> dict[str, Any]:
        """When finish() was already called and this is the transfer's last unsent write, the write
        carries the "done" too: one frame and one receiver wake-up less per transfer."""
        with t._lock:
            if t._finish_queued and t._pending == 1 and not t._done_sent and t._error is None:
                t._done_sent = True
                t._done_checksum = combine(t._checksum, checksum)
                return {"done": {"writes": t._writes, "checksum": t._done_checksum}}
        return {}

    def done(self, t: Transfer, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        with t._lock:
            while t._pending > 0 and t._error is None:
                if not t._lock.wait(max(0.0, deadline - time.monotonic())):
                    raise TransferError(f"kv transfer {t.request_id!r}: writes not sent within {timeout} s")
            writes, checksum = t._writes, t._checksum
            if not t._done_sent:
                t._done_checksum = checksum
        if t._error is None and not t._done_sent:
            self.wire.send({
                "op": "done", "rid": t.request_id, "xid": t.xid, "token": t.dst.token, "writes": writes,
                "checksum": checksum,
            })  # fmt: skip

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
                transfer._fail(TransferError(f"kv transfer {transfer.request_id!r}: connection lost: {self.dead}"))
                continue
            if transfer.failed and not even_if_failed:
                continue
            self._run(transfer, fn)

    def _run(self, transfer: Transfer, fn: Callable[["_Stream"], None]) -> None:
        try:
            fn(self)
        except (OSError, ConnectionError) as exc:
            self._die(exc)
            transfer._fail(TransferError(f"kv transfer {transfer.request_id!r}: connection lost: {exc}"))
        except Exception as exc:
            if not isinstance(exc, TransferError):
                exc = TransferError(f"kv transfer {transfer.request_id!r}: {type(exc).__name__}: {exc}")
            transfer._fail(exc)

    def _read_loop(self) -> None:
        try:
            while True:
                try:
                    frame = self.wire.recv(idle_ok=True)
                except IdleTimeout:
                    continue
                t = self.peer.transfers.get(frame.get("xid"))
                if t is None:
                    continue
                op = frame["op"]
                if op == "ack":
                    t._acked(int(frame.get("checksum", -1)))
                elif op == "error":
                    err = str(frame.get("error"))
                    cls = ChecksumError if "checksum mismatch" in err else TransferError
                    t._fail(cls(f"kv transfer {t.request_id!r} rejected by the receiver: {err}"))
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
        self.streams += [_Stream(self, i) for i in range(1, nstreams)]

    def forget(self, t: Transfer) -> None:
        self.transfers.pop(t.xid, None)

    def broken(self, exc: BaseException) -> None:
        self.dead = exc
        self.close()
        for t in list(self.transfers.values()):
            t._fail(TransferError(f"kv transfer {t.request_id!r}: connection to {self.dst.address} lost: {exc}"))

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
    ):
        """`auth_key`: the cluster secret's KV key, proven to every receiver (and asked of it) in the handshake."""
        if backend != "auto" and backend not in CHANNELS:
            raise ValueError(f"backend: expected auto or one of {list(CHANNELS)}, got {backend!r}")
        if quant not in (None, "int8"):
            raise ValueError(f"quant: expected None or 'int8', got {quant!r}")
        if num_streams < 1:
            raise ValueError("num_streams: expected >= 1")
        self.pool = pool
        self.views = PoolViews(pool)
        self.layout = self.views.layout
        for cls in set(CHANNELS.values()):
            cls.prepare(self.views)
        self.backend = backend
        self.num_streams = num_streams
        self.quant = None if self.layout.scale_bytes else quant   # an int8 pool's blocks travel as they are
        self.connect_timeout = connect_timeout
        self.io_timeout = io_timeout
        self.auth_key = auth_key
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
                                f"{exc or type(exc).__name__}") from None

    def start(self, dst: Destination | dict, src_block_ids: list[int], skip_blocks: int = 0,
              connect: bool = True) -> Transfer:
        """Open a transfer of src_block_ids into dst.block_ids[skip_blocks:] (same count). With
        `connect=False` (the engine thread) nothing blocks: no connection is opened (TransferError when none is
        open; see `connect`) and the open frame is queued behind the stream's other work."""
        if isinstance(dst, dict):
            dst = Destination.from_dict(dst)
        dst_ids = dst.block_ids[skip_blocks:]
        if len(src_block_ids) != len(dst_ids):
            raise ValueError(f"src_block_ids: {len(src_block_ids)} blocks for {len(dst_ids)} destination blocks")
        bad = [b for b in src_block_ids if not 0 <= b < self.layout.num_blocks]
        if bad:
            raise ValueError(f"src_block_ids: {bad[:5]} outside 0..{self.layout.num_blocks - 1}")
        self.layout.check_compatible(KVLayout.from_dict(dst.layout), mine="sender", theirs="receiver")
        peer = self._peer(dst, choose(self.backend, self.quant, self.views, dst), connect=connect)
        t = Transfer(self, peer, dst, list(src_block_ids), dst_ids)
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

    def _peer(self, dst: Destination, channel_cls: type[Channel], connect: bool = True) -> _Peer:
        """The live peer for dst's receiver; opened here if `connect`. A connect holds only its receiver's
        gate, never the sender's lock: a receiver that does not answer delays nobody else."""
        key = (dst.address, channel_cls.name)
        with self._lock:
            peer = self._peers.get(key)
            if peer is not None and peer.dead is None:
                return peer
            if not connect:
                raise TransferError(f"kv transfer {dst.request_id!r}: no open connection to {dst.address}")
            gate = self._gates.setdefault(key, threading.Lock())
        with gate:   # one connect per receiver at a time; who waited reuses its result
            with self._lock:
                peer = self._peers.get(key)
                if peer is not None and peer.dead is None:
                    return peer
            peer = _Peer(self, dst, channel_cls)
            with self._lock:
                self._peers[key] = peer
            return peer
