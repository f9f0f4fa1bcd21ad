"""Socket plumbing shared by sender and receiver: framing, scatter/gather bulk I/O, keepalive.

A frame is a 4-byte big-endian length and a msgpack map. Bulk payloads follow their header frame as
raw bytes and are read with recvmsg_into straight into views of the KV pool (no staging buffer).
"""

from __future__ import annotations

import socket
import struct
import threading
from typing import Any, Sequence

import msgpack

MAX_HEADER_BYTES = 4 * 1024 * 1024
WIRE_VERSION = 4  # of the frames in docs/kv_transfer.md; checked in the challenge and the hello (4: error codes)
MAX_IOV = 512  # buffers per sendmsg/recvmsg call (IOV_MAX is 1024 on Linux)
_LEN = struct.Struct("!I")


class FrameError(ValueError):
    """A malformed frame: the connection is dropped."""


class IdleTimeout(Exception):
    """No byte of a new frame arrived within the socket timeout (the connection is just idle)."""


def configure(sock: socket.socket, timeout: float) -> None:
    """Timeouts plus aggressive keepalive so a silently dead peer is noticed within ~4 s."""
    sock.settimeout(timeout)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", 2), ("TCP_KEEPINTVL", 1), ("TCP_KEEPCNT", 2)):
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)
    for buf in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        sock.setsockopt(socket.SOL_SOCKET, buf, 4 * 1024 * 1024)


def recv_exact(sock: socket.socket, n: int, *, idle_ok: bool = False) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        try:
            k = sock.recv_into(view[got:])
        except socket.timeout:
            if idle_ok and got == 0:
                raise IdleTimeout() from None
            raise
        if k == 0:
            raise ConnectionError("peer closed the connection")
        got += k
    return bytes(buf)


def recv_frame(sock: socket.socket, *, idle_ok: bool = False) -> dict[str, Any]:
    (n,) = _LEN.unpack(recv_exact(sock, 4, idle_ok=idle_ok))
    if n == 0 or n > MAX_HEADER_BYTES:
        raise FrameError(f"frame length {n} outside 1..{MAX_HEADER_BYTES}")
    data = recv_exact(sock, n)
    try:
        body = msgpack.unpackb(data, raw=False, strict_map_key=False)
    except Exception as exc:
        raise FrameError(f"undecodable frame: {exc}") from None
    if not isinstance(body, dict) or not isinstance(body.get("op"), str):
        raise FrameError("frame is not a map with a string 'op'")
    return body


def _advance(views: list[memoryview], n: int) -> list[memoryview]:
    while n:
        if n >= len(views[0]):
            n -= len(views[0])
            views.pop(0)
        else:
            views[0] = views[0][n:]
            n = 0
    return views


def send_views(sock: socket.socket, views: list[memoryview]) -> None:
    """writev of all views (gather I/O), handling partial sends."""
    views = [v for v in views if len(v)]
    while views:
        sent = sock.sendmsg(views[:MAX_IOV])
        views = _advance(views, sent)


def recv_into_views(sock: socket.socket, views: list[memoryview]) -> None:
    """readv straight into the destination views (scatter I/O), handling partial reads."""
    views = [v for v in views if len(v)]
    while views:
        got = sock.recvmsg_into(views[:MAX_IOV])[0]
        if got == 0:
            raise ConnectionError("peer closed the connection mid-payload")
        views = _advance(views, got)


def drain(sock: socket.socket, nbytes: int) -> None:
    """Read and drop nbytes (a rejected write's payload), keeping the stream in sync."""
    scratch = bytearray(min(nbytes, 1 << 20))
    while nbytes:
        got = sock.recv_into(memoryview(scratch)[: min(nbytes, len(scratch))])
        if got == 0:
            raise ConnectionError("peer closed the connection")
        nbytes -= got


def pack_frame(body: dict[str, Any]) -> bytes:
    data = msgpack.packb(body, use_bin_type=True)
    return _LEN.pack(len(data)) + data


class Wire:
    """One connection shared by threads: each frame (header + payload) goes out whole, in one gather."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self._send_lock = threading.Lock()

    def send(self, body: dict[str, Any], payload: Sequence[memoryview] = ()) -> None:
        with self._send_lock:
            send_views(self.sock, [memoryview(pack_frame(body)), *payload])

    def recv(self, *, idle_ok: bool = False) -> dict[str, Any]:
        return recv_frame(self.sock, idle_ok=idle_ok)

    def shutdown(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def close(self) -> None:
        self.shutdown()
        self.sock.close()
