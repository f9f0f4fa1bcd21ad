"""asyncio zmq sockets that speak `pdcluster.control.protocol`.

Four small wrappers: `RouterServer` (a node's control socket), `DealerClient` (one peer's
connection to it), `LoadPublisher` / `LoadSubscriber` (the ~2 Hz Load reports).

Sends are synchronous and never block: a dead or slow peer makes `send` return False instead of
stalling the sender's event loop (ROUTER_MANDATORY + NOBLOCK + bounded HWMs). Receives are async
and never raise on bad input: frames that fail `protocol.decode` are logged and dropped.

With `keys` (`pdcluster.control.keys.ClusterKeys`, from the cluster secret) every socket speaks CURVE: server
sockets (ROUTER, PUB) take only clients holding the cluster's client key (checked by a ZAP handler thread,
one per process), so a peer without the secret completes no handshake and no frame of it is ever delivered;
every frame is encrypted and authenticated. Without keys, sockets are plain (docs/security.md).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import time
from typing import Callable, cast

import zmq
import zmq.asyncio
from zmq.auth.thread import ThreadAuthenticator

from pdcluster.control.keys import ClusterKeys
from pdcluster.control.protocol import MAX_FRAME_BYTES, Load, Message, ProtocolError, decode, encode

log = logging.getLogger(__name__)

DEFAULT_HWM = 10_000
LOAD_HWM = 100  # stale load reports are worthless: drop rather than queue
HEARTBEAT_IVL_MS = 1_000
HEARTBEAT_TIMEOUT_MS = 3_000


def _context() -> zmq.asyncio.Context:
    return zmq.asyncio.Context.instance()


def _socket(kind: int, hwm: int, keys: ClusterKeys | None = None, server: bool = False) -> zmq.asyncio.Socket:
    """A socket with the common options; with `keys`, a CURVE server (`server`) or client of the cluster."""
    sock = _context().socket(kind)
    if keys is not None and server:
        domain = _zap_allow(keys)
        sock.setsockopt(zmq.ZAP_DOMAIN, domain)
        sock.setsockopt(zmq.CURVE_SECRETKEY, keys.server_secret)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.server_public)
        sock.setsockopt(zmq.CURVE_SERVER, 1)
    elif keys is not None:
        sock.setsockopt(zmq.CURVE_SERVERKEY, keys.server_public)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.client_public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, keys.client_secret)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.setsockopt(zmq.RCVHWM, hwm)
    # A frame over the protocol's limit is refused by zmq before it is buffered (the peer is disconnected),
    # not read whole into memory and then dropped by `decode`.
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
    return sock


class _ClusterClients:
    """The ZAP policy: a CURVE client is let in iff its public key is the client key of the secret the server
    socket was made with (its ZAP domain names that secret, so sockets of two clusters can share a process)."""

    def __init__(self) -> None:
        self.allowed: dict[str, bytes] = {}   # ZAP domain -> the cluster's client public key (z85)

    def callback(self, domain: str, client_key: bytes) -> bool:
        ok = self.allowed.get(domain) == client_key
        if not ok:
            AUTH_FAILURES.drop(f"a CURVE client with a key that is not the cluster's (domain {domain})")
        return ok


_zap: ThreadAuthenticator | None = None
_zap_policy = _ClusterClients()


def _zap_allow(keys: ClusterKeys) -> bytes:
    """Start this process's ZAP handler (once) and let the clients of `keys` in; returns the ZAP domain."""
    global _zap
    if _zap is None:
        _zap = ThreadAuthenticator(_context())
        _zap.start()
    domain = f"pdcluster-{keys.fingerprint}"
    _zap_policy.allowed[domain] = keys.client_public
    _zap.configure_curve_callback(domain, credentials_provider=_zap_policy)
    return domain.encode()


def _send_now(sock: zmq.asyncio.Socket, frames: list[bytes]) -> None:
    """Send without waiting; raises zmq.Again / ZMQError at once.

    Goes through the asyncio socket (not a sync shadow) so its edge-triggered event
    bookkeeping stays right: with NOBLOCK the returned future is already resolved.
    """
    fut = cast(asyncio.Future, sock.send_multipart(frames, flags=zmq.NOBLOCK))   # typed as a bare Awaitable
    exc = fut.exception()
    if exc is not None:
        raise exc


def _bind(sock: zmq.asyncio.Socket, addr: str) -> str:
    """Bind; "tcp://host:0" and "tcp://host:*" pick a free port. Returns the actual endpoint."""
    if addr.startswith("tcp://") and addr.endswith(":0"):
        addr = addr[:-1] + "*"
    sock.bind(addr)
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)


class DroppedFrames:
    """What a socket drops (undecodable frames, wrong frame counts, unexpected types): counted for the
    metrics, and logged at most once per LOG_EVERY_S with the number dropped since, so a flood of garbage
    neither fills the log nor slows the loop."""

    LOG_EVERY_S = 10.0

    def __init__(self, where: str) -> None:
        self.where = where
        self.count = 0
        self._unlogged = 0
        self._logged_at = -self.LOG_EVERY_S

    def drop(self, why: str) -> None:
        self.count += 1
        self._unlogged += 1
        now = time.monotonic()
        if now - self._logged_at >= self.LOG_EVERY_S:
            log.warning("%s: dropped %d bad frame(s) (%d in all); the last: %s", self.where, self._unlogged,
                        self.count, why)
            self._unlogged, self._logged_at = 0, now

    def decode(self, frame: bytes) -> Message | None:
        try:
            return decode(frame)
        except ProtocolError as exc:
            self.drop(f"{len(frame)} bytes: {exc}")
            return None


# CURVE clients of this process's server sockets refused by the ZAP handler: they knew the server key but not
# the cluster's client key. A client without CURVE, or with another secret's server key, fails the handshake
# inside zmq before any ZAP request (and is not counted here).
AUTH_FAILURES = DroppedFrames("zmq authentication")


class RouterServer:
    """A node's control socket: many DEALER peers, addressed by their zmq identity."""

    def __init__(self, hwm: int = DEFAULT_HWM, keys: ClusterKeys | None = None) -> None:
        self._sock = _socket(zmq.ROUTER, hwm, keys, server=True)
        # Unknown/disconnected identity -> EHOSTUNREACH instead of a silent drop.
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        # A peer that reconnects with its identity (DealerClient's is stable) takes it over even while this
        # side still holds the old connection (a network blip it has not noticed), so streams to it go on.
        self._sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self._sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
        self._sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
        self.address = ""
        self.dropped = DroppedFrames("control socket")

    def bind(self, addr: str) -> str:
        self.address = _bind(self._sock, addr)
        self.dropped.where = f"control socket {self.address}"
        return self.address

    async def recv(self) -> tuple[bytes, Message]:
        """Next valid message and its sender's identity; bad frames are logged and skipped."""
        while True:
            frames = await self._sock.recv_multipart(copy=True)
            if len(frames) != 2:
                self.dropped.drop(f"a message of {len(frames)} frames")
                continue
            msg = self.dropped.decode(frames[1])
            if msg is not None:
                return frames[0], msg

    def send(self, identity: bytes, msg: Message) -> bool:
        """Queue `msg` for `identity`; False when that peer is gone or its queue is full."""
        try:
            _send_now(self._sock, [identity, encode(msg)])
            return True
        except zmq.Again:
            log.warning("router socket %s: peer %r queue full, dropped %s", self.address, identity, msg.TYPE)
        except zmq.ZMQError as exc:
            log.info("router socket %s: peer %r unreachable (%s), dropped %s",
                     self.address, identity, exc, msg.TYPE)
        return False

    def close(self) -> None:
        self._sock.close(linger=0)


class DealerClient:
    """One connection to one peer's RouterServer."""

    def __init__(self, hwm: int = DEFAULT_HWM, dropped: DroppedFrames | None = None,
                 keys: ClusterKeys | None = None, identity: bytes | None = None) -> None:
        self._sock = _socket(zmq.DEALER, hwm, keys)
        if identity is not None:   # kept across reconnects: the peer keeps addressing replies to it
            self._sock.setsockopt(zmq.IDENTITY, identity)
        self.dropped = dropped or DroppedFrames("dealer")
        self._sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
        self._sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
        self._sock.setsockopt(zmq.RECONNECT_IVL, 100)
        self._sock.setsockopt(zmq.RECONNECT_IVL_MAX, 2_000)
        self.address = ""

    def connect(self, addr: str) -> None:
        self.address = addr
        self._sock.connect(addr)

    def send(self, msg: Message) -> bool:
        """Queue `msg`; False when the outgoing queue is full (peer dead or far behind)."""
        try:
            _send_now(self._sock, [encode(msg)])
            return True
        except zmq.Again:
            log.warning("dealer to %s: queue full, dropped %s", self.address, msg.TYPE)
        except zmq.ZMQError as exc:
            log.warning("dealer to %s: send failed (%s), dropped %s", self.address, exc, msg.TYPE)
        return False

    async def recv(self, timeout: float | None = None) -> Message | None:
        """Next valid message, or None after `timeout` seconds (None = wait forever)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if deadline is None:
                frames = await self._sock.recv_multipart()
            else:
                left = deadline - time.monotonic()
                if left <= 0 or not await self._sock.poll(left * 1000):
                    return None
                frames = await self._sock.recv_multipart()
            if len(frames) != 1:
                self.dropped.drop(f"from {self.address}: a message of {len(frames)} frames")
                continue
            msg = self.dropped.decode(frames[0])
            if msg is not None:
                return msg

    def close(self) -> None:
        self._sock.close(linger=0)


class PeerDealers:
    """One DEALER per peer node, connected on first use and reconnected when the peer's address
    changes; every message a peer sends goes to `on_message(node_id, msg)` (on the event loop)."""

    def __init__(self, on_message: Callable[[str, Message], None], keys: ClusterKeys | None = None,
                 owner: str = "") -> None:
        self._on_message = on_message
        self._keys = keys
        self._owner = owner   # this process's id: part of each dealer's stable zmq identity
        self._instance = os.urandom(4).hex()   # two processes configured with one id still differ
        self._peers: dict[str, tuple[str, DealerClient, asyncio.Task]] = {}
        self.dropped = DroppedFrames("peer connections")   # shared by every peer's dealer

    def send(self, node_id: str, address: str, msg: Message) -> bool:
        peer = self._peers.get(node_id)
        if peer is None or peer[0] != address:
            self.drop(node_id)
            dealer = DealerClient(dropped=self.dropped, keys=self._keys, identity=self.identity(node_id))
            dealer.connect(address)
            reader = asyncio.create_task(self._read_loop(node_id, dealer), name=f"peer:{node_id}")
            peer = self._peers[node_id] = (address, dealer, reader)
        return peer[1].send(msg)

    def identity(self, node_id: str) -> bytes:
        """The zmq identity of the connection to `node_id`: stable for this object's life, unique per peer
        connection; at most 255 bytes (zmq's limit), never starting with a zero byte."""
        ident = f"{self._owner or 'peer'}/{node_id}/{self._instance}".encode()
        return ident if len(ident) <= 255 else b"h" + hashlib.blake2b(ident, digest_size=32).hexdigest().encode()

    def send_existing(self, node_id: str, msg: Message) -> bool:
        """Send only on an open connection (e.g. an Abort); False when there is none."""
        peer = self._peers.get(node_id)
        return peer is not None and peer[1].send(msg)

    def drop(self, node_id: str) -> None:
        peer = self._peers.pop(node_id, None)
        if peer is not None:
            peer[2].cancel()
            peer[1].close()

    def close(self) -> None:
        for node_id in list(self._peers):
            self.drop(node_id)

    async def _read_loop(self, node_id: str, dealer: DealerClient) -> None:
        while True:
            msg = await dealer.recv()
            if msg is None:   # (only after a timeout, and there is none)
                continue
            try:
                self._on_message(node_id, msg)
            except Exception:
                log.exception("handling %s from %s failed", msg.TYPE, node_id)


class LoadPublisher:
    """PUB socket a node publishes its `Load` on; routers subscribe."""

    def __init__(self, keys: ClusterKeys | None = None) -> None:
        self._sock = _socket(zmq.PUB, LOAD_HWM, keys, server=True)
        self.address = ""

    def bind(self, addr: str) -> str:
        self.address = _bind(self._sock, addr)
        return self.address

    def publish(self, load: Load) -> None:
        if not load.timestamp:
            load.timestamp = time.time()
        try:
            _send_now(self._sock, [encode(load)])
        except zmq.ZMQError as exc:  # PUB drops on HWM itself; anything else is worth a line
            log.warning("load publisher %s: %s", self.address, exc)

    async def run(self, get_load: Callable[[], Load], interval: float = 0.5) -> None:
        """Publish `get_load()` every `interval` seconds until cancelled."""
        while True:
            try:
                self.publish(get_load())
            except Exception:  # a bad snapshot must not stop the reports
                log.exception("load publisher %s: get_load failed", self.address)
            await asyncio.sleep(interval)

    def close(self) -> None:
        self._sock.close(linger=0)


class LoadSubscriber:
    """SUB socket connected to any number of LoadPublishers."""

    def __init__(self, keys: ClusterKeys | None = None) -> None:
        self._sock = _socket(zmq.SUB, LOAD_HWM, keys)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        self._sock.setsockopt(zmq.RECONNECT_IVL, 100)
        self._sock.setsockopt(zmq.RECONNECT_IVL_MAX, 2_000)
        self.addresses: set[str] = set()
        self.dropped = DroppedFrames("load subscriber")

    def connect(self, addr: str) -> None:
        if addr not in self.addresses:
            self._sock.connect(addr)
            self.addresses.add(addr)

    def disconnect(self, addr: str) -> None:
        if addr in self.addresses:
            self.addresses.discard(addr)
            try:
                self._sock.disconnect(addr)
            except zmq.ZMQError:
                pass

    async def recv(self, timeout: float | None = None) -> Load | None:
        """Next Load report, or None after `timeout` seconds. Non-Load frames are dropped."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0 or not await self._sock.poll(left * 1000):
                    return None
            frame = await self._sock.recv()
            msg = self.dropped.decode(frame)
            if isinstance(msg, Load):
                return msg
            if msg is not None:
                self.dropped.drop(f"an unexpected {msg.TYPE} message")

    def close(self) -> None:
        self._sock.close(linger=0)
