"""The KV receiver's front door: a connection proves it holds the cluster secret before any work is done for it.

Challenge-response (docs/kv_transfer.md § Wire format, docs/security.md): on accept the receiver sends
`challenge{version, nonce, auth}`; the sender answers `hello{..., nonce, mac}` with
mac = HMAC-SHA256(kv key, "hello" ‖ challenge nonce ‖ sender nonce ‖ session); the receiver's `hello_ok`
carries HMAC(kv key, "hello_ok" ‖ sender nonce ‖ challenge nonce), so the sender knows it reached a member too.

`Gate` holds every connection that has not yet sent a valid hello, on one selector thread: no thread, channel,
store or process group exists for an unauthenticated peer, at most `max_pending` of them are held (the oldest
is dropped for a new one), each for at most `timeout` seconds and `MAX_HELLO_BYTES` of buffer, and past
`max_connections` authenticated ones a new connection is closed at once.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import selectors
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import msgpack

from pdcluster.control.transport import DroppedFrames
from pdcluster.kv_transfer.errors import HandshakeRefused, from_code
from pdcluster.kv_transfer.tcp import WIRE_VERSION, FrameError, Wire, pack_frame

log = logging.getLogger(__name__)

NONCE_BYTES = 32
MAX_HELLO_BYTES = 16 * 1024   # an unauthenticated peer gets no bigger buffer than this
_LEN = struct.Struct("!I")

__all__ = ["Gate", "HandshakeRefused", "client_handshake", "hello_mac", "hello_ok_mac"]


def hello_mac(key: bytes, challenge: bytes, nonce: bytes, session: str) -> bytes:
    return hmac.new(key, b"hello\0" + challenge + nonce + session.encode(), hashlib.sha256).digest()


def hello_ok_mac(key: bytes, challenge: bytes, nonce: bytes) -> bytes:
    return hmac.new(key, b"hello_ok\0" + nonce + challenge, hashlib.sha256).digest()


def client_handshake(wire: Wire, key: bytes | None, hello: dict[str, Any], where: str) -> dict[str, Any]:
    """Sender side: read the challenge, send `hello` with its proof, return the receiver's `hello_ok` once it
    proved itself. Raises HandshakeRefused when either side cannot prove it holds the secret (code "auth"), the
    receiver is full ("busy") or speaks another version ("version"), LayoutMismatchError ("layout") when the
    receiver refuses the backend or layout: the class and code are the receiver's `code`, never its message."""
    challenge = wire.recv()
    if challenge.get("op") == "error":
        raise from_code(challenge.get("code"), f"receiver {where} refused the connection: {challenge.get('error')}")
    if challenge.get("op") != "challenge" or challenge.get("version") != WIRE_VERSION:
        raise HandshakeRefused(f"receiver {where} speaks another KV wire version "
                               f"({challenge.get('version')!r}, this sender {WIRE_VERSION})", "version")
    nonce_r = challenge.get("nonce")
    if not isinstance(nonce_r, bytes) or len(nonce_r) != NONCE_BYTES:
        raise FrameError("challenge.nonce: expected 32 bytes")
    if challenge.get("auth") and key is None:
        raise HandshakeRefused(f"receiver {where} requires the cluster secret; this node has no cluster_secret")
    if key is not None and not challenge.get("auth"):
        raise HandshakeRefused(f"receiver {where} does not authenticate (no cluster_secret) but this node has one")
    nonce = os.urandom(NONCE_BYTES)
    mac = hello_mac(key, nonce_r, nonce, hello["session"]) if key is not None else b""
    wire.send({**hello, "nonce": nonce, "mac": mac})
    reply = wire.recv()
    if reply["op"] != "hello_ok":
        raise from_code(reply.get("code"), f"receiver {where} refused the handshake: {reply.get('error')}")
    if key is not None and not hmac.compare_digest(_bytes(reply.get("mac")), hello_ok_mac(key, nonce_r, nonce)):
        raise HandshakeRefused(f"receiver {where} could not prove it holds the cluster secret")
    return reply


def _try_send(sock: socket.socket, body: dict[str, Any]) -> None:
    """One small frame, without blocking (best effort: the connection is closed right after)."""
    try:
        sock.setblocking(False)
        sock.send(pack_frame(body))
    except OSError:
        pass


def _bytes(value: Any) -> bytes:
    return value if isinstance(value, bytes) else b""


@dataclass
class _Pending:
    sock: socket.socket
    peer: Any
    challenge: bytes
    deadline: float
    buf: bytearray = field(default_factory=bytearray)


class Gate:
    """Accepts on `listener` and calls `on_hello(sock, hello, challenge)` (on the gate's thread; it must not
    block) for each connection whose hello carried a valid proof; everything else is closed and counted."""

    def __init__(self, listener: socket.socket, key: bytes | None,
                 on_hello: Callable[[socket.socket, dict, bytes], None], active: Callable[[], int], *,
                 max_pending: int = 64, max_connections: int = 64, timeout: float = 2.0,
                 dropped: DroppedFrames | None = None) -> None:
        self.listener = listener
        self.key = key
        self.on_hello = on_hello
        self.active = active
        self.max_pending = max_pending
        self.max_connections = max_connections
        self.timeout = timeout
        self.dropped = dropped or DroppedFrames("kv receiver")
        self.pending: dict[socket.socket, _Pending] = {}   # insertion order = age
        self._sel = selectors.DefaultSelector()

    def run(self, closed: threading.Event) -> None:
        self.listener.setblocking(False)
        self._sel.register(self.listener, selectors.EVENT_READ)
        try:
            while not closed.is_set():
                for key, _ in self._sel.select(timeout=0.1):
                    if key.fileobj is self.listener:
                        self._accept()
                    elif key.fileobj in self.pending:
                        self._read(self.pending[key.fileobj])
                now = time.monotonic()
                for p in [p for p in self.pending.values() if now > p.deadline]:
                    self._refuse(p, f"no hello within {self.timeout} s")
        finally:
            for p in list(self.pending.values()):
                self._close(p)
            self._sel.close()

    def _accept(self) -> None:
        for _ in range(64):   # drain the backlog, a bounded amount per wake-up
            try:
                sock, peer = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return
            if self.active() >= self.max_connections:
                why = f"{self.max_connections} connections already open"
                self.dropped.drop(f"{peer}: refused, {why}")
                _try_send(sock, {"op": "error", "rid": None, "code": "busy", "error": why})
                sock.close()
                continue
            if len(self.pending) >= self.max_pending:
                oldest = next(iter(self.pending.values()))
                self._refuse(oldest, f"dropped for a newer connection ({self.max_pending} handshakes pending)")
            challenge = os.urandom(NONCE_BYTES)
            try:
                sock.setblocking(False)
                sock.send(pack_frame({"op": "challenge", "version": WIRE_VERSION, "nonce": challenge,
                                      "auth": self.key is not None}))
            except OSError:
                sock.close()
                continue
            self.pending[sock] = _Pending(sock, peer, challenge, time.monotonic() + self.timeout)
            self._sel.register(sock, selectors.EVENT_READ)

    def _read(self, p: _Pending) -> None:
        want = 4 if len(p.buf) < 4 else 4 + _LEN.unpack_from(p.buf)[0]
        try:
            data = p.sock.recv(want - len(p.buf))
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._refuse(p, f"connection error before the hello: {exc}")
            return
        if not data:
            self._refuse(p, "closed before the hello")
            return
        p.buf += data
        if len(p.buf) == 4:
            (n,) = _LEN.unpack_from(p.buf)
            if not 0 < n <= MAX_HELLO_BYTES:
                self._refuse(p, f"hello length {n} outside 1..{MAX_HELLO_BYTES}")
            return
        if len(p.buf) < want:
            return
        try:
            hello = msgpack.unpackb(bytes(p.buf[4:]), raw=False, strict_map_key=False)
        except Exception:
            self._refuse(p, "an undecodable hello")
            return
        refusal = self._check(hello, p.challenge)
        if refusal is not None:
            self._refuse(p, refusal[1], code=refusal[0])
            return
        self._sel.unregister(p.sock)
        del self.pending[p.sock]
        p.sock.setblocking(True)
        try:
            self.on_hello(p.sock, hello, p.challenge)
        except Exception:   # the gate must keep accepting
            log.exception("kv receiver: taking an authenticated connection from %s failed", p.peer)
            p.sock.close()

    def _check(self, hello: Any, challenge: bytes) -> tuple[str, str] | None:
        """None when `hello` is a well-formed hello with a valid proof, else (code, why not)."""
        if not isinstance(hello, dict) or hello.get("op") != "hello" or hello.get("version") != WIRE_VERSION:
            return "version", f"expected a hello of version {WIRE_VERSION}"
        nonce, session = hello.get("nonce"), hello.get("session")
        if not isinstance(nonce, bytes) or len(nonce) != NONCE_BYTES or not isinstance(session, str):
            return "failed", "hello.nonce / hello.session: malformed"
        if self.key is not None and not hmac.compare_digest(
                _bytes(hello.get("mac")), hello_mac(self.key, challenge, nonce, session)):
            return "auth", "authentication failed: the sender does not hold this cluster's secret"
        return None

    def _refuse(self, p: _Pending, why: str, code: str | None = None) -> None:
        """Drop a pending connection; with `code`, tell the peer why first."""
        self.dropped.drop(f"{p.peer}: {why}")
        if code is not None:
            _try_send(p.sock, {"op": "error", "rid": None, "code": code, "error": why})
        self._close(p)

    def _close(self, p: _Pending) -> None:
        if self.pending.pop(p.sock, None) is not None:
            self._sel.unregister(p.sock)
        p.sock.close()
