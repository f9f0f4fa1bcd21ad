"""The command link between rank 0 of a tensor-parallel engine and the KV endpoint of one of its other ranks.

Each other rank's endpoint (endpoint.py) listens on a Unix socket in a private directory (mode 0700: only this
user's processes reach it) and rank 0 connects once. Over it rank 0 asks (`ask` / `request`: a reply, or a
TransferError, within a timeout) and tells (`post`: no reply), and the rank reports what happened on its own
(events: a transfer's part acknowledged or failed, a reservation's part resolved). Frames are the KV wire's
(tcp.py: a length, then a msgpack map with `op`).

A link that breaks (the rank died, its endpoint closed) fails its pending requests at once and calls `on_lost`:
rank 0's sender and receiver then fail that rank's parts still pending (code "lost"), so nobody waits for a rank
that is gone.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import os
import shutil
import socket
import tempfile
import threading
from typing import Any, Callable

from pdcluster.kv_transfer.errors import TransferError, from_code
from pdcluster.kv_transfer.tcp import IdleTimeout, Wire

log = logging.getLogger(__name__)

REQUEST_TIMEOUT_S = 5.0   # an endpoint answers from its own thread (a reservation, a cancel, a count)
IDLE_S = 0.5   # a link's reader wakes this often without traffic, to notice that it was closed

Handler = Callable[[str, dict[str, Any]], Any]   # (op, frame) -> reply value, or a Future of it
EventHandler = Callable[[int, dict[str, Any]], None]   # (rank, frame)
LostHandler = Callable[[int, str], None]   # (rank, why)


class LinkServer:
    """The rank's end: takes rank 0's one connection and runs `handle(op, frame)` for each frame on one thread; a
    frame with an `id` is answered with what it returns (when that is a Future: once it resolves) or the
    TransferError it raises. `event` reports to rank 0 from any thread."""

    def __init__(self, handle: Handler) -> None:
        self._handle = handle
        self._dir = tempfile.mkdtemp(prefix="pdcluster-rank-")
        self.address = os.path.join(self._dir, "link")
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(self.address)
        self._listener.listen(1)
        self._listener.settimeout(IDLE_S)
        self._wire: Wire | None = None
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="kv-rank-link", daemon=True)
        self._thread.start()

    def event(self, op: str, **body: Any) -> None:
        """Tell rank 0; dropped while no link is up (before it connected, or once it is gone: nobody would hear)."""
        wire = self._wire
        if wire is None:
            return
        try:
            wire.send({"op": op, **body})
        except OSError:
            pass

    def close(self) -> None:
        self._closed.set()
        self._listener.close()
        if self._wire is not None:
            self._wire.close()
        self._thread.join(2 * IDLE_S)
        shutil.rmtree(self._dir, ignore_errors=True)

    def _serve(self) -> None:
        while not self._closed.is_set():
            try:
                sock, _ = self._listener.accept()
                break
            except socket.timeout:
                continue
            except OSError:
                return
        else:
            return
        shutil.rmtree(self._dir, ignore_errors=True)   # connected: nobody else may
        sock.settimeout(IDLE_S)
        wire = self._wire = Wire(sock)
        while not self._closed.is_set():
            try:
                frame = wire.recv(idle_ok=True)
            except IdleTimeout:
                continue
            except Exception as exc:   # rank 0 went away (its engine stops this rank next)
                if not self._closed.is_set():
                    log.info("kv rank link: rank 0 is gone: %s", exc)
                return
            self._answer(wire, frame)

    def _answer(self, wire: Wire, frame: dict[str, Any]) -> None:
        rid = frame.get("id")
        try:
            value = self._handle(frame["op"], frame)
        except Exception as exc:
            value = _failed_future(exc)
        if rid is None:
            return
        if not isinstance(value, concurrent.futures.Future):
            value = _done_future(value)
        value.add_done_callback(lambda fut: self._reply(wire, rid, fut))

    def _reply(self, wire: Wire, rid: int, fut: concurrent.futures.Future) -> None:
        exc = fut.exception()
        if exc is None:
            body: dict[str, Any] = {"op": "reply", "id": rid, "value": fut.result()}
        else:
            if not isinstance(exc, TransferError):
                log.warning("kv rank link: request failed: %r", exc)
            code = exc.code if isinstance(exc, TransferError) else "failed"
            body = {"op": "reply", "id": rid, "code": code, "error": f"{type(exc).__name__}: {exc}"}
        try:
            wire.send(body)
        except OSError:
            pass


class RankLink:
    """Rank 0's end of rank `rank`'s link."""

    def __init__(self, rank: int, address: str, on_event: EventHandler, on_lost: LostHandler,
                 timeout: float = REQUEST_TIMEOUT_S) -> None:
        self.rank = rank
        self._on_event, self._on_lost = on_event, on_lost
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout)
        try:
            sock.connect(address)
        except OSError:
            sock.close()
            raise
        sock.settimeout(IDLE_S)
        self._wire = Wire(sock)
        self._lock = threading.Lock()
        self._pending: dict[int, concurrent.futures.Future] = {}
        self._ids = itertools.count(1)
        self.lost: str | None = None   # why the link broke; None while it is up
        self._closing = False
        threading.Thread(target=self._read_loop, name=f"kv-rank-link-{rank}", daemon=True).start()

    def ask(self, op: str, **body: Any) -> concurrent.futures.Future:
        """Send a request; the Future of its reply value (or of the TransferError it failed with)."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self.lost is not None:
                fut.set_exception(self._lost_error())
                return fut
            rid = next(self._ids)
            self._pending[rid] = fut
        fut.add_done_callback(lambda _: self._forget(rid))
        try:
            self._wire.send({"op": op, "id": rid, **body})
        except OSError as exc:
            self._break(f"send failed: {exc}")
        return fut

    def request(self, op: str, timeout: float = REQUEST_TIMEOUT_S, **body: Any) -> Any:
        """`ask` and wait for the reply (TransferError, code "timeout", when none came within `timeout`)."""
        fut = self.ask(op, **body)
        try:
            return fut.result(timeout)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            raise TransferError(f"tensor-parallel rank {self.rank}: no answer to {op} within {timeout} s",
                                "timeout") from None

    def post(self, op: str, **body: Any) -> bool:
        """Send without a reply; False when the link is down (the rank's part is then failed by `on_lost`)."""
        if self.lost is not None:
            return False
        try:
            self._wire.send({"op": op, **body})
        except OSError as exc:
            self._break(f"send failed: {exc}")
            return False
        return True

    def close(self) -> None:
        self._closing = True
        self._break("closed")

    def _forget(self, rid: int) -> None:
        with self._lock:
            self._pending.pop(rid, None)

    def _lost_error(self) -> TransferError:
        return TransferError(f"tensor-parallel rank {self.rank}'s KV endpoint is gone: {self.lost}", "lost")

    def _read_loop(self) -> None:
        while True:
            try:
                frame = self._wire.recv(idle_ok=True)
            except IdleTimeout:
                if self.lost is not None:
                    return
                continue
            except Exception as exc:
                self._break(f"{type(exc).__name__}: {exc}")
                return
            if frame["op"] != "reply":
                try:
                    self._on_event(self.rank, frame)
                except Exception:
                    log.exception("kv rank link %d: handling %s failed", self.rank, frame["op"])
                continue
            with self._lock:
                fut = self._pending.pop(frame.get("id", 0), None)
            if fut is None or fut.done():   # timed out meanwhile
                continue
            if "code" in frame:
                fut.set_exception(from_code(frame["code"], f"tensor-parallel rank {self.rank}: {frame.get('error')}"))
            else:
                fut.set_result(frame.get("value"))

    def _break(self, why: str) -> None:
        with self._lock:
            if self.lost is not None:
                return
            self.lost = why
            pending, self._pending = list(self._pending.values()), {}
        self._wire.close()
        for fut in pending:
            if not fut.done():
                fut.set_exception(self._lost_error())
        if not self._closing:
            log.error("tensor-parallel rank %d's KV link broke: %s", self.rank, why)
            self._on_lost(self.rank, why)


class RankLinks:
    """Rank 0's links to ranks 1 .. size-1, by rank; whoever uses them registers for events by op (`on`) and for
    lost ranks (`on_lost`) before its first request."""

    def __init__(self, addresses: list[str]) -> None:
        self.size = len(addresses) + 1
        self._events: dict[str, list[EventHandler]] = {}
        self._lost: list[LostHandler] = []
        self.links: list[RankLink] = []
        try:
            for rank, address in enumerate(addresses, start=1):
                self.links.append(RankLink(rank, address, self._event, self._rank_lost))
        except BaseException:
            self.close()
            raise

    def __getitem__(self, rank: int) -> RankLink:
        return self.links[rank - 1]

    def on(self, op: str, fn: EventHandler) -> None:
        self._events.setdefault(op, []).append(fn)

    def on_lost(self, fn: LostHandler) -> None:
        self._lost.append(fn)

    def close(self) -> None:
        for link in self.links:
            link.close()

    def _event(self, rank: int, frame: dict[str, Any]) -> None:
        for fn in self._events.get(frame["op"], []):
            fn(rank, frame)

    def _rank_lost(self, rank: int, why: str) -> None:
        for fn in self._lost:
            fn(rank, why)


def _done_future(value: Any) -> concurrent.futures.Future:
    fut: concurrent.futures.Future = concurrent.futures.Future()
    fut.set_result(value)
    return fut


def _failed_future(exc: BaseException) -> concurrent.futures.Future:
    fut: concurrent.futures.Future = concurrent.futures.Future()
    fut.set_exception(exc)
    return fut
