"""Receiver side: owns a KV pool, issues reservations, accepts writes into reserved blocks only.

Threads: one accept loop, one thread per sender connection (it reads straight into the pool), and a
reaper that expires reservations past their deadline. Results reach the owner through `on_done`
(called on an I/O thread), or `poll` / `wait_blocking` / `await wait`.

Wire ops on a connection (see tcp.py for framing): hello → hello_ok | error; open → (error);
write (+ payload for tcp, + a torch.distributed recv for gloo/nccl/hccl, nothing for shm);
done → ack | error; abort. Any frame that is not well-formed drops the connection.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import secrets
import socket
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable

import torch

from pdcluster.kv_transfer import dist as kvdist
from pdcluster.kv_transfer import quant
from pdcluster.kv_transfer.checksum import MASK64, checksum_bytes, checksum_runs, combine, words
from pdcluster.kv_transfer.destination import Destination, host_id
from pdcluster.kv_transfer.errors import ChecksumError, LayoutMismatchError, TransferError
from pdcluster.kv_transfer.layout import KVLayout, byte_view
from pdcluster.kv_transfer.shm import block_tags, token_tag
from pdcluster.kv_transfer.tcp import FrameError, IdleTimeout, configure, recv_frame, recv_into_views, send_frame

log = logging.getLogger(__name__)

WIRE_VERSION = 1


@dataclass
class TransferResult:
    request_id: str
    ok: bool
    error: str | None = None
    checksum: int = 0
    nbytes: int = 0


@dataclass
class _Reservation:
    request_id: str
    block_ids: list[int]
    block_set: frozenset[int]
    token: str
    deadline: float
    state: str = "reserved"  # reserved | open | failing
    session: str | None = None
    backend: str | None = None
    writes: int = 0
    expected_writes: int | None = None
    done_checksum: int = 0
    landed_checksum: int = 0
    nbytes: int = 0
    inflight: int = 0
    error: str | None = None
    release_at: float = 0.0
    done_conn: "_Conn | None" = None
    done_xid: Any = None


class _Conn:
    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.send_lock = threading.Lock()
        self.session: str | None = None
        self.backend: str | None = None
        self.pg = None
        self.store = None

    def reply(self, body: dict[str, Any]) -> None:
        try:
            with self.send_lock:
                send_frame(self.sock, body)
        except OSError as exc:
            log.info("kv receiver: reply to a closed connection dropped: %s", exc)


class KVReceiver:
    def __init__(
        self,
        pool: torch.Tensor,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        advertise_host: str | None = None,
        shm_name: str | None = None,
        on_done: Callable[[str, TransferResult], None] | None = None,
        io_timeout: float = 5.0,
        shm_grace_s: float = 0.5,
    ):
        self.pool = pool
        self.layout = KVLayout.of(pool)
        self.on_done = on_done
        self.io_timeout = io_timeout
        self.shm_grace_s = shm_grace_s
        self.shm_name = shm_name
        self._host = advertise_host or host
        self._words = words(byte_view(pool))
        self._np_bytes = byte_view(pool).numpy() if pool.device.type == "cpu" else None
        self.backends = ["shm"] if shm_name else []
        self._tags = block_tags(shm_name, self.layout.num_blocks) if shm_name else None
        if pool.device.type == "cpu":
            self.backends.append("tcp")
        self.backends.append(kvdist.backend_for_device(pool.device.type))

        self._lock = threading.Lock()
        self._reservations: dict[str, _Reservation] = {}
        self._reserved_blocks: set[int] = set()
        self._results: dict[str, TransferResult] = {}
        self._recent_failures: OrderedDict[str, str] = OrderedDict()  # so late frames learn why
        self._waiters: dict[str, list[Callable[[TransferResult], None]]] = {}
        self._conns: set[_Conn] = set()
        self._closed = threading.Event()

        self._listener = socket.create_server((host, port), backlog=64)
        self._listener.settimeout(0.2)
        self.port = self._listener.getsockname()[1]
        self.address = f"{self._host}:{self.port}"
        self._threads = [
            threading.Thread(target=self._accept_loop, name="kv-recv-accept", daemon=True),
            threading.Thread(target=self._reaper_loop, name="kv-recv-reaper", daemon=True),
        ]
        for t in self._threads:
            t.start()

    # ---- owner API -------------------------------------------------------------------------------

    @property
    def num_active_reservations(self) -> int:
        """Reservations whose blocks the receiver still holds (not yet resolved to the owner)."""
        with self._lock:
            return len(self._reservations)

    def reserve(self, request_id: str, block_ids: list[int], timeout_s: float = 30.0) -> Destination:
        if not block_ids:
            raise ValueError("block_ids: expected at least one block")
        bad = [b for b in block_ids if not isinstance(b, int) or not 0 <= b < self.layout.num_blocks]
        if bad:
            raise ValueError(f"block_ids: {bad[:5]} outside 0..{self.layout.num_blocks - 1}")
        if len(set(block_ids)) != len(block_ids):
            raise ValueError("block_ids: duplicates")
        with self._lock:
            if request_id in self._reservations:
                raise ValueError(f"request_id: {request_id!r} already has an active reservation")
            taken = self._reserved_blocks.intersection(block_ids)
            if taken:
                raise ValueError(f"block_ids: {sorted(taken)[:5]} already reserved by another request")
            res = _Reservation(
                request_id, list(block_ids), frozenset(block_ids), secrets.token_hex(16), time.time() + timeout_s
            )
            self._reservations[request_id] = res
            self._reserved_blocks.update(block_ids)
            if self._tags is not None:  # open to same-host senders holding the token
                self._tags[block_ids] = token_tag(res.token)
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
            shm_name=self.shm_name,
        )

    def cancel(self, request_id: str) -> None:
        """Stop accepting writes; the blocks come back through on_done / wait once no write is in flight."""
        with self._lock:
            res = self._reservations.get(request_id)
            if res is not None:
                self._fail_locked(res, "cancelled by the receiver's owner")
        self._release_ready()

    def poll(self, request_id: str) -> TransferResult | None:
        """The result if resolved (consumed: a second poll returns None), else None."""
        with self._lock:
            return self._results.pop(request_id, None)

    def wait_blocking(self, request_id: str, timeout: float) -> TransferResult:
        done = threading.Event()
        box: list[TransferResult] = []
        self._add_waiter(request_id, lambda r: (box.append(r), done.set()))
        if not done.wait(timeout):
            self._drop_waiters(request_id)
            raise TimeoutError(f"kv transfer {request_id!r}: no result within {timeout} s")
        return _raise_if_failed(box[0])

    async def wait(self, request_id: str, timeout: float) -> TransferResult:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[TransferResult] = loop.create_future()

        def deliver(r: TransferResult) -> None:
            loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result(r))

        self._add_waiter(request_id, deliver)
        try:
            result = await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError:
            self._drop_waiters(request_id)
            raise TimeoutError(f"kv transfer {request_id!r}: no result within {timeout} s") from None
        return _raise_if_failed(result)

    def close(self) -> None:
        self._closed.set()
        self._listener.close()
        with self._lock:
            conns = list(self._conns)
        for c in conns:
            _close_socket(c.sock)
        for t in self._threads:
            t.join(timeout=2)

    # ---- resolution --------------------------------------------------------------------------------

    def _add_waiter(self, request_id: str, fn: Callable[[TransferResult], None]) -> None:
        with self._lock:
            result = self._results.pop(request_id, None)
            if result is None:
                if request_id not in self._reservations:
                    result = TransferResult(request_id, False, "no such reservation")
                else:
                    self._waiters.setdefault(request_id, []).append(fn)
                    return
        fn(result)

    def _drop_waiters(self, request_id: str) -> None:
        with self._lock:
            self._waiters.pop(request_id, None)

    def _fail_locked(self, res: _Reservation, error: str) -> None:
        if res.state == "failing":
            return
        # A same-host sender checks the tags right before copying and does not wait for its open to be
        # seen, so one may be copying even if it never said a word: hold the blocks back before reuse.
        grace = self.shm_grace_s if self._tags is not None and res.backend in (None, "shm") else 0.0
        res.state, res.error, res.release_at = "failing", error, time.time() + grace
        self._clear_tags(res)
        log.warning("kv receiver: reservation %s failed: %s", res.request_id, error)
        if res.done_conn is not None:
            res.done_conn.reply({"op": "error", "rid": res.request_id, "xid": res.done_xid, "error": error})
            res.done_conn = None

    def _release_ready(self) -> None:
        """Resolve failing reservations that no write touches any more."""
        now = time.time()
        with self._lock:
            ready = [
                r for r in self._reservations.values() if r.state == "failing" and r.inflight == 0 and now >= r.release_at
            ]
            calls = [
                self._resolve_locked(r, TransferResult(r.request_id, False, r.error, r.landed_checksum, r.nbytes))
                for r in ready
            ]
        for call in calls:
            call()

    def _resolve_locked(self, res: _Reservation, result: TransferResult) -> Callable[[], None]:
        """Drop the reservation and hand its result over; returns the call to make outside the lock."""
        del self._reservations[res.request_id]
        self._reserved_blocks.difference_update(res.block_ids)
        self._clear_tags(res)
        if not result.ok:
            self._recent_failures[res.request_id] = result.error or ""
            while len(self._recent_failures) > 1024:
                self._recent_failures.popitem(last=False)
        if self.on_done is not None:
            return lambda: self._call_on_done(result)
        waiters = self._waiters.pop(result.request_id, [])
        if not waiters:
            self._results[result.request_id] = result
        return lambda: [fn(result) for fn in waiters]

    def _clear_tags(self, res: _Reservation) -> None:
        if self._tags is not None:
            self._tags[res.block_ids] = 0

    def _call_on_done(self, result: TransferResult) -> None:
        try:
            self.on_done(result.request_id, result)
        except Exception:
            log.exception("kv receiver: on_done callback raised")

    def _maybe_complete_locked(self, res: _Reservation) -> Callable[[], None] | None:
        if res.state == "failing" or res.expected_writes is None or res.writes < res.expected_writes:
            return None
        if res.writes > res.expected_writes or res.landed_checksum != res.done_checksum:
            self._fail_locked(
                res,
                f"checksum mismatch: sender total {res.done_checksum:#x} over {res.expected_writes} writes, "
                f"landed {res.landed_checksum:#x} over {res.writes} writes",
            )
            return None
        if res.done_conn is not None:
            res.done_conn.reply({"op": "ack", "rid": res.request_id, "xid": res.done_xid, "checksum": res.landed_checksum})
        return self._resolve_locked(res, TransferResult(res.request_id, True, None, res.landed_checksum, res.nbytes))

    def _reaper_loop(self) -> None:
        while not self._closed.wait(0.05):
            now = time.time()
            with self._lock:
                for r in self._reservations.values():
                    if r.state != "failing" and now > r.deadline:
                        self._fail_locked(r, f"deadline exceeded ({now - r.deadline:.2f} s late)")
            self._release_ready()

    # ---- connections -------------------------------------------------------------------------------

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                sock, peer = self._listener.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            threading.Thread(target=self._serve, args=(sock, peer), name="kv-recv-conn", daemon=True).start()

    def _serve(self, sock: socket.socket, peer: Any) -> None:
        conn = _Conn(sock)
        with self._lock:
            self._conns.add(conn)
        try:
            configure(sock, self.io_timeout)
            self._handshake(conn, recv_frame(sock))
            while not self._closed.is_set():
                try:
                    frame = recv_frame(sock, idle_ok=True)
                except IdleTimeout:
                    continue
                self._handle(conn, frame)
        except (FrameError, LayoutMismatchError) as exc:
            log.warning("kv receiver: dropping connection from %s: %s", peer, exc)
        except (OSError, ConnectionError, RuntimeError) as exc:
            if not self._closed.is_set():
                log.info("kv receiver: connection from %s ended: %s", peer, exc)
        finally:
            _close_socket(sock)
            with self._lock:
                self._conns.discard(conn)
                if conn.session is not None:
                    for r in self._reservations.values():
                        if r.session == conn.session and r.state != "failing":
                            self._fail_locked(r, f"sender connection lost ({conn.backend})")
            self._release_ready()

    def _handshake(self, conn: _Conn, hello: dict[str, Any]) -> None:
        if hello.get("op") != "hello" or hello.get("version") != WIRE_VERSION:
            raise FrameError(f"expected hello version {WIRE_VERSION}, got op={hello.get('op')!r}")
        backend, session = hello.get("backend"), hello.get("session")
        try:
            if backend not in self.backends:
                raise LayoutMismatchError(f"backend {backend!r} not offered (receiver offers {self.backends})")
            if not isinstance(session, str):
                raise FrameError("hello.session: expected a string")
            self.layout.check_compatible(KVLayout.from_dict(hello.get("layout")))
        except (ValueError, LayoutMismatchError) as exc:
            conn.reply({"op": "error", "rid": None, "error": str(exc)})
            raise LayoutMismatchError(str(exc)) from None
        conn.session, conn.backend = session, backend
        reply: dict[str, Any] = {"op": "hello_ok", "layout": self.layout.to_dict(), "shm_name": self.shm_name}
        if backend in kvdist.DIST_BACKENDS:
            local_ip = conn.sock.getsockname()[0]
            conn.store = kvdist.host_store(local_ip, self.io_timeout)
            reply["store_port"] = conn.store.port
            conn.reply(reply)
            conn.pg = kvdist.pair_group(backend, conn.store, 0, local_ip, self.io_timeout, session)
        else:
            conn.reply(reply)

    def _check_access(self, frame: dict[str, Any]) -> _Reservation:
        """Caller holds the lock. Raises TransferError with the reason a frame is not allowed."""
        rid, token = frame.get("rid"), frame.get("token")
        res = self._reservations.get(rid) if isinstance(rid, str) else None
        if res is None:
            if rid in self._recent_failures:
                raise TransferError(f"reservation {rid!r} already failed: {self._recent_failures[rid]}")
            raise TransferError(f"no active reservation {rid!r}")
        if not isinstance(token, str) or not hmac.compare_digest(token, res.token):
            raise TransferError(f"bad token for reservation {rid!r}")
        if res.state == "failing":
            raise TransferError(f"reservation {rid!r} already failed: {res.error}")
        if time.time() > res.deadline:
            raise TransferError(f"reservation {rid!r} is past its deadline")
        return res

    def _handle(self, conn: _Conn, frame: dict[str, Any]) -> None:
        op = frame["op"]
        if op == "write":
            self._handle_write(conn, frame)
            return
        if op not in ("open", "done", "abort"):
            raise FrameError(f"unknown op {op!r}")
        rid, xid = frame.get("rid"), frame.get("xid")
        completed = None
        with self._lock:
            try:
                res = self._check_access(frame)
            except TransferError as exc:
                log.warning("kv receiver: %s rejected: %s", op, exc)
                if op != "abort":
                    conn.reply({"op": "error", "rid": rid, "xid": xid, "error": str(exc)})
                return
            if op == "open":
                blocks = frame.get("blocks")
                if not isinstance(blocks, list) or not all(isinstance(b, int) and b in res.block_set for b in blocks):
                    log.warning("kv receiver: open of %r names blocks it did not reserve", rid)
                    conn.reply({"op": "error", "rid": rid, "xid": xid, "error": f"open names blocks not reserved by {rid!r}"})
                    return
                # no "ok" reply: nobody waits for one (an error is the only answer to an open)
                res.state, res.session, res.backend = "open", conn.session, conn.backend
            elif op == "abort":
                self._fail_locked(res, f"aborted by the sender: {frame.get('reason', '')}")
            else:
                done = _parse_done(frame)
                if res.state != "open" or res.session != conn.session:
                    # e.g. a sender whose open/writes were rejected but that sent "done" before hearing so:
                    # it must not bind the reservation to its connection (whose close would then fail it).
                    log.warning("kv receiver: done for %r without an accepted open on this connection", rid)
                    conn.reply({"op": "error", "rid": rid, "xid": xid, "error": f"done for {rid!r} without an accepted open"})
                    return
                self._apply_done_locked(res, conn, done, xid)
                completed = self._maybe_complete_locked(res)
        if op == "abort":
            self._release_ready()
        elif completed is not None:
            completed()

    def _apply_done_locked(self, res: _Reservation, conn: _Conn, done: tuple[int, int], xid: Any) -> None:
        res.expected_writes, res.done_checksum, res.done_conn, res.done_xid = done[0], done[1], conn, xid

    def _parse_write(self, frame: dict[str, Any]) -> tuple[list[tuple[int, int]], int, int, int, int, str | None]:
        runs, l0, l1 = frame.get("runs"), frame.get("l0"), frame.get("l1")
        nbytes, checksum, qmode = frame.get("nbytes"), frame.get("checksum"), frame.get("quant")
        if not isinstance(runs, list) or not runs or not all(
            isinstance(r, list) and len(r) == 2 and all(isinstance(x, int) for x in r) and r[1] > 0 for r in runs
        ):
            raise FrameError("write.runs: expected a non-empty list of [start, length] pairs")
        if not (isinstance(l0, int) and isinstance(l1, int) and 0 <= l0 < l1 <= self.layout.num_layers):
            raise FrameError(f"write.l0/l1: expected 0 <= l0 < l1 <= {self.layout.num_layers}")
        if not isinstance(nbytes, int) or not isinstance(checksum, int) or qmode not in (None, "int8"):
            raise FrameError("write.nbytes/checksum/quant: wrong types")
        nblocks = sum(n for _, n in runs)
        if nblocks > self.layout.num_blocks:
            raise FrameError("write.runs: more blocks than the pool holds")
        if qmode == "int8":
            lay = self.layout
            expected = quant.wire_bytes(nblocks, l1 - l0, lay.block_size, lay.num_kv_heads, lay.head_dim)
        else:
            expected = nblocks * (l1 - l0) * self.layout.layer_bytes
        if nbytes != expected:
            raise FrameError(f"write.nbytes: {nbytes}, expected {expected} for {nblocks} blocks")
        return [(s, n) for s, n in runs], l0, l1, nbytes, checksum & MASK64, qmode

    def _handle_write(self, conn: _Conn, frame: dict[str, Any]) -> None:
        runs, l0, l1, nbytes, checksum, qmode = self._parse_write(frame)
        if qmode and conn.backend != "tcp":
            raise FrameError("write.quant: int8 wire compression is only supported over tcp")
        done = _parse_done(frame["done"]) if "done" in frame else None  # the sender's last write may carry it
        landed = frame.get("landed")
        if conn.backend == "shm" and not isinstance(landed, int):
            raise FrameError("write.landed: an shm write must carry the checksum read back from the pool")
        with self._lock:
            try:
                res = self._check_access(frame)
                outside = [s for s, n in runs for b in range(s, s + n) if b not in res.block_set]
                if outside:
                    raise TransferError(f"blocks {outside[:5]} are not reserved by {res.request_id!r}")
            except TransferError as exc:
                res = None
                reason = str(exc)
            else:
                res.inflight += 1
                res.state = "open"
                res.session = res.session or conn.session
                res.backend = conn.backend
        if res is None:
            log.warning("kv receiver: write rejected: %s", reason)
            conn.reply({"op": "error", "rid": frame.get("rid"), "xid": frame.get("xid"), "error": reason})
            self._discard_payload(conn, nbytes)
            return
        try:
            landed = self._receive(conn, runs, l0, l1, nbytes, qmode, landed)
        except BaseException as exc:
            with self._lock:
                res.inflight -= 1
                self._fail_locked(res, f"sender lost mid-transfer: {exc}")
            raise
        completed = None
        with self._lock:
            res.inflight -= 1
            res.writes += 1
            res.nbytes += nbytes
            res.landed_checksum = combine(res.landed_checksum, landed)
            if landed != checksum:
                error = f"checksum mismatch on a write of {nbytes} bytes: sent {checksum:#x}, landed {landed:#x}"
                self._fail_locked(res, error)
                conn.reply({"op": "error", "rid": res.request_id, "xid": frame.get("xid"), "error": error})
            else:
                if done is not None:
                    self._apply_done_locked(res, conn, done, frame.get("xid"))
                completed = self._maybe_complete_locked(res)
        if completed is not None:
            completed()
        else:
            self._release_ready()

    def _receive(
        self, conn: _Conn, runs: list[tuple[int, int]], l0: int, l1: int, nbytes: int, qmode: str | None, landed: int | None
    ) -> int:
        """Land one write's bytes in the pool; return the checksum of what landed."""
        full = l0 == 0 and l1 == self.layout.num_layers
        if conn.backend == "shm":
            # The sender copied into the shared pool and read each block back from it while still in
            # cache (fused_copy): its "landed" sum is of these very pages, without a second DRAM pass here.
            return landed & MASK64
        elif conn.backend == "tcp" and qmode == "int8":
            staging = torch.empty(nbytes, dtype=torch.uint8)
            recv_into_views(conn.sock, [memoryview(staging.numpy())])
            landed = checksum_bytes(staging)
            nblocks = sum(n for _, n in runs)
            lay = self.layout
            kv = quant.dequantize(staging, (nblocks, l1 - l0, 2, lay.block_size, lay.num_kv_heads, lay.head_dim), self.pool.dtype)
            i = 0
            for s, n in runs:
                self.pool[s : s + n, l0:l1].copy_(kv[i : i + n])
                i += n
            return landed
        elif conn.backend == "tcp":
            nb = self._np_bytes
            if full:
                views = [memoryview(nb[s : s + n].reshape(-1)) for s, n in runs]
            else:
                views = [memoryview(nb[b, l0:l1].reshape(-1)) for s, n in runs for b in range(s, s + n)]
            recv_into_views(conn.sock, views)
        else:  # gloo / nccl / hccl: one recv per run when whole blocks are contiguous, else via staging
            if full:
                for s, n in runs:
                    kvdist.recv(conn.pg, self.pool[s : s + n], 0)
            else:
                nblocks = sum(n for _, n in runs)
                staging = torch.empty((nblocks, l1 - l0, *self.pool.shape[2:]), dtype=self.pool.dtype, device=self.pool.device)
                kvdist.recv(conn.pg, staging, 0)
                i = 0
                for s, n in runs:
                    self.pool[s : s + n, l0:l1].copy_(staging[i : i + n])
                    i += n
        return checksum_runs(self._words, runs, l0, l1)

    def _discard_payload(self, conn: _Conn, nbytes: int) -> None:
        """Keep the stream in sync after a rejected write, without touching the pool."""
        if conn.backend == "shm":
            return
        if conn.backend != "tcp":
            raise FrameError("rejected write on a collective stream: dropping the pair")
        scratch = bytearray(min(nbytes, 1 << 20))
        while nbytes:
            got = conn.sock.recv_into(memoryview(scratch)[: min(nbytes, len(scratch))])
            if got == 0:
                raise ConnectionError("peer closed the connection")
            nbytes -= got


def _parse_done(body: Any) -> tuple[int, int]:
    """(writes, checksum) of a done frame, or of the "done" map a last write carries."""
    writes, checksum = (body.get("writes"), body.get("checksum")) if isinstance(body, dict) else (None, None)
    if not isinstance(writes, int) or not isinstance(checksum, int):
        raise FrameError("done: writes and checksum must be ints")
    return writes, checksum & MASK64


def _raise_if_failed(result: TransferResult) -> TransferResult:
    if not result.ok:
        cls = ChecksumError if result.error and "checksum mismatch" in result.error else TransferError
        raise cls(f"kv transfer {result.request_id!r} failed: {result.error}")
    return result


def _close_socket(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()
