"""Receiver side: owns a KV pool, issues reservations, accepts writes into reserved blocks only.

Threads: the gate (handshake.py: accepts and authenticates connections, all on one selector thread), one
thread per authenticated sender connection (its channel reads straight into the pool; at most
`max_connections`), and a reaper that expires reservations past their deadline. Results reach the owner
through one call, `await wait(request_id, timeout)`. Who may write what is the reservation table's call
(reservations.py); how bytes land is the connection's channel's (channel.py). A refusal goes back to the
sender as an `error` frame with a machine `code` (errors.CODES) and the message beside it.

Wire ops on a connection (see tcp.py for framing, docs/kv_transfer.md for the fields): challenge (from the
receiver) → hello → hello_ok | error; open → (error); write (+ the channel's bytes); done → ack | error;
abort. Any frame that is not well-formed drops the connection.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time
from typing import Any, Callable, cast

import torch

from pdcluster.control.transport import DroppedFrames
from pdcluster.device import bind_thread
from pdcluster.kv_transfer.backends import CHANNELS, offered
from pdcluster.kv_transfer.channel import Channel, PoolViews
from pdcluster.kv_transfer.checksum import MASK64
from pdcluster.kv_transfer.cuda_ipc_channel import device_uuid
from pdcluster.kv_transfer.destination import Destination, host_id
from pdcluster.kv_transfer.errors import LayoutMismatchError, TransferError
from pdcluster.kv_transfer.handshake import Gate, hello_ok_mac
from pdcluster.kv_transfer.layout import KVLayout, RankSlice
from pdcluster.kv_transfer.regroup import regroup_for, writer_count
from pdcluster.kv_transfer.reservations import Reservation, ReservationTable, State, TransferResult
from pdcluster.kv_transfer.shm import block_tags, token_tag
from pdcluster.kv_transfer.tcp import FrameError, IdleTimeout, Wire, configure

log = logging.getLogger(__name__)

__all__ = ["KVReceiver", "TransferResult"]

REAP_INTERVAL_S = 0.05  # how often reservations past their deadline are failed and quiet ones handed back
CLOSE_JOIN_S = 2.0  # close() waits this long for each of the gate and reaper threads
# A result nobody came for is dropped this long after it resolved: its owner stopped waiting (its wait timed
# out, its engine failed) and attempt ids are never reused, so it would otherwise stay for the node's life.
RESULT_TTL_S = 60.0


class _Conn:
    def __init__(self, sock: socket.socket):
        self.wire = Wire(sock)
        self.session: str | None = None
        self.channel: Channel | None = None

    def reply(self, body: dict[str, Any]) -> None:
        try:
            self.wire.send(body)
        except OSError as exc:
            log.info("kv receiver: reply to a closed connection dropped: %s", exc)


def result_future() -> tuple[asyncio.Future[TransferResult], Callable[[TransferResult], None]]:
    """A future on the running loop and the function that resolves it from any thread (a waiter's pair)."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[TransferResult] = loop.create_future()

    def deliver(r: TransferResult) -> None:
        def resolve() -> None:
            if not fut.done():
                fut.set_result(r)

        loop.call_soon_threadsafe(resolve)

    return fut, deliver


class KVReceiver:
    def __init__(
        self,
        pool: torch.Tensor,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        advertise_host: str | None = None,
        shm_name: str | None = None,
        io_timeout: float = 5.0,
        shm_grace_s: float = 0.5,
        auth_key: bytes | None = None,
        max_connections: int = 64,
        max_pending: int = 64,
        auth_timeout: float = 2.0,
        total_kv_heads: int | None = None,
        rank_slice: RankSlice | None = None,
    ):
        """`auth_key` (the cluster secret's KV key): a connection must prove it holds it before anything is
        done for it; None accepts any sender (no cluster secret configured). `io_timeout`: a sender
        connection's socket timeout (keepalive notices a silent peer sooner); `shm_grace_s`: how long a failed
        reservation a same-host copy may still touch holds its blocks; `auth_timeout`: how long an
        unauthenticated connection may take to send its hello; `total_kv_heads`: the model's KV heads, when fewer
        than the pool's tensor-parallel ranks (KVLayout.of); `rank_slice`: (rank, ranks[, model KV heads]) when the pool
        is one rank's slice of an engine sliced per rank (per_rank/; the model's heads when fewer than ranks:
        KVLayout.sliced)."""
        self.pool = pool
        self.views = PoolViews(pool, total_kv_heads, rank_slice)
        self.layout = self.views.layout
        self.io_timeout = io_timeout
        self.shm_name = shm_name
        self.backends = offered(self.views, shm_name)
        # shm senders check these per-block tags instead of asking (shm.py); None without a shm pool
        self._tags = block_tags(shm_name, self.layout.num_blocks) if shm_name else None

        self._lock = threading.Lock()
        self._table = ReservationTable(
            self.layout.num_blocks, grace_s=shm_grace_s if shm_name else 0.0, on_fail=self._failed_locked
        )
        # resolved, nobody waiting yet: (result, monotonic time it is dropped); in order of that time
        self._results: dict[str, tuple[TransferResult, float]] = {}
        self._waiters: dict[str, list[Callable[[TransferResult], None]]] = {}
        self._bytes_received = 0  # wire bytes of completed reservations (under _lock)
        self._conns: set[_Conn] = set()
        self._closed = threading.Event()

        self._listener = socket.create_server((host, port), backlog=64)
        self.port = self._listener.getsockname()[1]
        self.address = f"{advertise_host or host}:{self.port}"
        self.auth_key = auth_key
        self.dropped = DroppedFrames(f"kv receiver {self.address}")  # refused connections, malformed frames
        self._gate = Gate(self._listener, auth_key, self._on_hello, lambda: len(self._conns),
                          max_pending=max_pending, max_connections=max_connections, timeout=auth_timeout,
                          dropped=self.dropped)
        self._threads = [
            threading.Thread(target=self._gate.run, args=(self._closed,), name="kv-recv-gate", daemon=True),
            threading.Thread(target=self._reaper_loop, name="kv-recv-reaper", daemon=True),
        ]
        for t in self._threads:
            t.start()

    # ---- owner API -------------------------------------------------------------------------------

    @property
    def bytes_received(self) -> int:
        """Wire bytes of every reservation completed so far (read-only; the receiver counts them)."""
        with self._lock:
            return self._bytes_received

    @property
    def num_active_reservations(self) -> int:
        """Reservations whose blocks the receiver still holds (not yet resolved to the owner)."""
        with self._lock:
            return len(self._table)

    def reserve(self, request_id: str, block_ids: list[int], timeout_s: float = 30.0,
                sender_slices: int = 1) -> Destination:
        """Hold the blocks for the sending engine: `sender_slices` is the number of rank slices its KV pool is cut
        into (its `kv_rank_slices`; 0 or 1: one pool), whose ranks holding this pool's heads each write their part
        (regroup.writer_count), the reservation completing once every one of them did."""
        writers = writer_count(self.layout, sender_slices)
        with self._lock:
            res = self._table.reserve(request_id, block_ids, timeout_s, writers)
            if self._tags is not None:  # open to same-host senders holding the token
                self._tags[res.block_ids] = token_tag(res.token)
            self._results.pop(request_id, None)
        return Destination(
            request_id=request_id,
            address=self.address,
            block_ids=list(block_ids),
            token=res.token,
            deadline=res.deadline,
            backends=list(self.backends),
            layout=self.layout.to_dict(),
            host_id=host_id(),
            device_uuid=device_uuid(self.pool.device),
            shm_name=self.shm_name,
            timeout_s=timeout_s,
        )

    def extend(self, request_id: str, timeout_s: float) -> bool:
        """Keep the reservation `timeout_s` more from now (its sender is still working on it); False when it is
        gone or failed."""
        with self._lock:
            return self._table.extend(request_id, timeout_s)

    def cancel(self, request_id: str) -> None:
        """Stop accepting writes; `wait` answers (failed, code "cancelled") once no write is in flight."""
        with self._lock:
            self._table.cancel(request_id)
        self._release_ready()

    def on_result(self, request_id: str, fn: Callable[[TransferResult], None]) -> None:
        """Call `fn` (on whichever thread resolves it, or now) with the reservation's result, as `wait` would
        return it; the result is then taken (no `wait` gets it)."""
        self._add_waiter(request_id, fn)

    async def wait(self, request_id: str, timeout: float) -> TransferResult:
        """The reservation's result once it resolved: complete (its blocks hold the sender's bytes), or
        failed and no write can land any more. Raises the failure's TransferError subclass (its `code` says
        why; "missing": no such reservation, or its result was already taken) and TimeoutError (builtin)
        when `timeout` passes first. Each result is handed to one waiter."""
        fut, deliver = result_future()
        self._add_waiter(request_id, deliver)
        try:
            result = await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError:
            self._drop_waiter(request_id, deliver)
            raise TimeoutError(f"kv transfer {request_id!r}: no result within {timeout} s") from None
        return result.raise_if_failed()

    async def settle(self, request_id: str, timeout: float) -> bool:
        """Cancel the reservation and wait until no write into its blocks can land any more; False when the
        receiver still held it after `timeout` (its blocks are to be reused anyway)."""
        self.cancel(request_id)
        try:
            await self.wait(request_id, timeout=timeout)
        except TimeoutError:
            return False
        except Exception:
            pass   # resolved as failed (or already taken): no write can land any more
        return True

    def close(self) -> None:
        """Stop serving; whoever still waits gets a failed result (code "closed")."""
        self._closed.set()
        for t in self._threads:
            t.join(timeout=CLOSE_JOIN_S)
        self._listener.close()
        with self._lock:
            conns = list(self._conns)
            waiters, self._waiters = self._waiters, {}
        for c in conns:
            c.wire.close()
        for rid, fns in waiters.items():
            result = TransferResult(rid, False, "the receiver closed", code="closed")
            for fn in fns:
                try:
                    fn(result)
                except RuntimeError:  # the waiter's event loop is already closed
                    pass

    # ---- resolution --------------------------------------------------------------------------------

    def _add_waiter(self, request_id: str, fn: Callable[[TransferResult], None]) -> None:
        with self._lock:
            stored = self._results.pop(request_id, None)
            result = stored[0] if stored is not None else None
            if result is None:
                if request_id not in self._table:
                    result = TransferResult(request_id, False, "no such reservation", code="missing")
                else:
                    self._waiters.setdefault(request_id, []).append(fn)
                    return
        fn(result)

    def _drop_waiter(self, request_id: str, fn: Callable[[TransferResult], None]) -> None:
        with self._lock:
            fns = self._waiters.get(request_id, [])
            if fn in fns:
                fns.remove(fn)
            if not fns:
                self._waiters.pop(request_id, None)

    def _failed_locked(self, res: Reservation) -> None:
        """The table's on_fail: close the blocks to shm writers at once and answer every pending done."""
        self._clear_tags(res)
        log.warning("kv receiver: reservation %s failed: %s", res.request_id, res.error)
        for w in res.writers.values():
            if w.notify is not None:
                conn, xid = w.notify
                conn.reply(_error_frame(res.request_id, xid, res.code, res.error))
                w.notify = None

    def _clear_tags(self, res: Reservation) -> None:
        if self._tags is not None:
            self._tags[res.block_ids] = 0

    def _release_ready(self) -> None:
        """Hand back failed reservations that no write can touch any more."""
        with self._lock:
            calls = [self._resolved_locked(r) for r in self._table.release()]
        for call in calls:
            call()

    def _complete_locked(self, res: Reservation) -> Callable[[], None]:
        self._bytes_received += res.nbytes
        for w in res.writers.values():   # each writer's ack: what landed of its own writes
            if w.notify is None:
                continue
            conn, xid = w.notify
            conn.reply({"op": "ack", "rid": res.request_id, "xid": xid, "checksum": w.landed_checksum})
        return self._resolved_locked(res)

    def _resolved_locked(self, res: Reservation) -> Callable[[], None]:
        """The reservation left the table: hand its result over (returns the call to make unlocked)."""
        self._clear_tags(res)
        result = res.result()
        waiters = self._waiters.pop(result.request_id, [])
        if not waiters:
            self._results.pop(result.request_id, None)   # re-inserted last: the dict stays in order of drop time
            self._results[result.request_id] = (result, time.monotonic() + RESULT_TTL_S)

        def hand_over() -> None:
            for fn in waiters:
                fn(result)

        return hand_over

    def _reaper_loop(self) -> None:
        while not self._closed.wait(REAP_INTERVAL_S):
            with self._lock:
                self._table.expire()
                self._drop_stale_results_locked(time.monotonic())
            self._release_ready()

    def _drop_stale_results_locked(self, now: float) -> None:
        """Drop the results past RESULT_TTL_S; the oldest come first, so this stops at the first that is not."""
        results = self._results
        while results:
            request_id, (_, drop_at) = next(iter(results.items()))
            if drop_at > now:
                return
            del results[request_id]

    # ---- connections -------------------------------------------------------------------------------

    def _on_hello(self, sock: socket.socket, hello: dict[str, Any], challenge: bytes) -> None:
        """An authenticated connection (the gate's thread): from here on it has a thread of its own."""
        conn = _Conn(sock)
        with self._lock:
            self._conns.add(conn)
        try:
            peer = sock.getpeername()
        except OSError:
            peer = "?"
        threading.Thread(target=self._serve, args=(conn, peer, hello, challenge), name="kv-recv-conn",
                         daemon=True).start()

    def _serve(self, conn: _Conn, peer: Any, hello: dict[str, Any], challenge: bytes) -> None:
        bind_thread(self.pool.device)
        try:
            configure(conn.wire.sock, self.io_timeout)
            self._handshake(conn, hello, challenge)
            while not self._closed.is_set():
                try:
                    frame = conn.wire.recv(idle_ok=True)
                except IdleTimeout:
                    continue
                self._handle(conn, frame)
        except (FrameError, LayoutMismatchError) as exc:
            self.dropped.drop(f"connection from {peer}: {exc}")
        except (OSError, ConnectionError, RuntimeError) as exc:
            if not self._closed.is_set():
                log.info("kv receiver: connection from %s ended: %s", peer, exc)
        finally:
            conn.wire.close()
            if conn.channel is not None:
                conn.channel.close()
            with self._lock:
                self._conns.discard(conn)
                if conn.session is not None:
                    assert conn.channel is not None  # _handshake sets the channel before the session
                    self._table.drop_owner(conn.session, f"sender connection lost ({conn.channel.name})")
            self._release_ready()

    def _handshake(self, conn: _Conn, hello: dict[str, Any], challenge: bytes) -> None:
        """The rest of an authenticated hello (the gate checked op, version and proof): backend and layout."""
        backend, session = hello.get("backend"), hello.get("session")
        cls = CHANNELS.get(backend) if isinstance(backend, str) else None
        try:
            if cls is None or cls.offer not in self.backends:
                raise LayoutMismatchError(f"backend {backend!r} not offered (receiver offers {self.backends})")
            if not isinstance(session, str):
                raise FrameError("hello.session: expected a string")
            layout = KVLayout.from_dict(cast("dict[str, Any]", hello.get("layout")))  # checks that it is a map
            self.layout.check_compatible(layout)
            regroup = regroup_for(cls, layout, self.layout)
        except (ValueError, LayoutMismatchError) as exc:
            conn.reply(_error_frame(None, None, LayoutMismatchError.code, str(exc)))
            raise LayoutMismatchError(str(exc)) from None
        hello_ok: dict[str, Any] = {"op": "hello_ok", "layout": self.layout.to_dict(), "shm_name": self.shm_name}
        if self.auth_key is not None:
            hello_ok["mac"] = hello_ok_mac(self.auth_key, challenge, hello["nonce"])
        conn.channel = cls.accept(conn.wire, self.views, hello_ok, session=session, timeout=self.io_timeout)
        conn.channel.regroup = regroup
        conn.session = session

    def _handle(self, conn: _Conn, frame: dict[str, Any]) -> None:
        op = frame["op"]
        if op == "write":
            self._handle_write(conn, frame)
            return
        if op not in ("open", "done", "abort"):
            raise FrameError(f"unknown op {op!r}")
        assert conn.session is not None and conn.channel is not None  # frames come after _handshake
        rid, token, xid = frame.get("rid"), frame.get("token"), frame.get("xid")
        if op == "done":
            writes, checksum = _parse_done(frame)
        elif op == "open" and not isinstance(frame.get("blocks"), list):
            raise FrameError("open.blocks: expected a list")
        completed = None
        with self._lock:
            try:
                if op == "open":  # no "ok" reply: nobody waits for one (an error is the only answer)
                    self._table.open(rid, token, conn.session, frame["blocks"], conn.channel.direct)
                elif op == "abort":
                    self._table.abort(rid, token, str(frame.get("reason", "")))
                else:
                    res = self._table.done(rid, token, conn.session, writes, checksum, (conn, xid))
                    if res.state is State.COMPLETE:
                        completed = self._complete_locked(res)
            except TransferError as exc:
                log.warning("kv receiver: %s rejected: %s", op, exc)
                if op != "abort":
                    conn.reply(_error_frame(rid, xid, exc.code, str(exc)))
                return
        if completed is not None:
            completed()
        else:
            self._release_ready()

    def _parse_write(self, conn: _Conn, frame: dict[str, Any]) -> tuple[list[tuple[int, int]], int, int, int, int]:
        runs, l0, l1 = frame.get("runs"), frame.get("l0"), frame.get("l1")
        nbytes, checksum = frame.get("nbytes"), frame.get("checksum")
        assert conn.channel is not None  # frames come after _handshake
        if not isinstance(runs, list) or not runs or not all(
            isinstance(r, list) and len(r) == 2 and all(isinstance(x, int) for x in r) and r[1] > 0 for r in runs
        ):
            raise FrameError("write.runs: expected a non-empty list of [start, length] pairs")
        if not (isinstance(l0, int) and isinstance(l1, int) and 0 <= l0 < l1 <= self.layout.num_layers):
            raise FrameError(f"write.l0/l1: expected 0 <= l0 < l1 <= {self.layout.num_layers}")
        if not isinstance(nbytes, int) or not isinstance(checksum, int):
            raise FrameError("write.nbytes/checksum: wrong types")
        nblocks = sum(n for _, n in runs)
        if nblocks > self.layout.num_blocks:
            raise FrameError("write.runs: more blocks than the pool holds")
        expected = conn.channel.wire_bytes(nblocks, l0, l1)
        if nbytes != expected:
            raise FrameError(f"write.nbytes: {nbytes}, expected {expected} for {nblocks} blocks")
        return [(s, n) for s, n in runs], l0, l1, nbytes, checksum & MASK64

    def _handle_write(self, conn: _Conn, frame: dict[str, Any]) -> None:
        runs, l0, l1, nbytes, checksum = self._parse_write(conn, frame)
        assert conn.session is not None and conn.channel is not None  # frames come after _handshake
        done = _parse_done(frame["done"]) if "done" in frame else None  # the sender's last write may carry it
        rid, xid = frame.get("rid"), frame.get("xid")
        with self._lock:
            try:
                write = self._table.begin_write(rid, frame.get("token"), conn.session, runs, conn.channel.direct)
            except TransferError as exc:
                write, refusal = None, exc
        if write is None:
            log.warning("kv receiver: write rejected: %s", refusal)
            conn.reply(_error_frame(rid, xid, refusal.code, str(refusal)))
            conn.channel.discard(nbytes)
            return
        res = write.reservation
        try:
            landed = conn.channel.receive_runs(runs, l0, l1, frame)
        except BaseException as exc:
            with self._lock:
                self._table.abort_write(write, f"sender lost mid-transfer: {exc}")
            raise
        completed = None
        with self._lock:
            try:
                self._table.end_write(write, nbytes, checksum, landed)
                if done is not None:
                    self._table.done(rid, frame.get("token"), conn.session, *done, (conn, xid))
                if res.state is State.COMPLETE:
                    completed = self._complete_locked(res)
            except TransferError as exc:  # a checksum mismatch (the reservation failed) or a bad done
                conn.reply(_error_frame(rid, xid, exc.code, str(exc)))
        if completed is not None:
            completed()
        else:
            self._release_ready()


def _parse_done(body: Any) -> tuple[int, int]:
    """(writes, checksum) of a done frame, or of the "done" map a last write carries."""
    writes, checksum = (body.get("writes"), body.get("checksum")) if isinstance(body, dict) else (None, None)
    if not isinstance(writes, int) or not isinstance(checksum, int):
        raise FrameError("done: writes and checksum must be ints")
    return writes, checksum & MASK64


def _error_frame(rid: Any, xid: Any, code: str | None, error: str | None) -> dict[str, Any]:
    """A refusal as the sender reads it: the machine code, and the message for people."""
    return {"op": "error", "rid": rid, "xid": xid, "code": code or "failed", "error": error or ""}
