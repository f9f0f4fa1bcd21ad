"""Connecting to etcd and calling it with deadlines; the task helpers the long-lived etcd sessions share.

Every etcd call goes through `etcd_call` (a timeout on each), so a dead etcd can only ever make a call fail.
"""

from __future__ import annotations

import asyncio
import logging
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Awaitable

import aetcd
import grpc
from aetcd import rpc, watcher

from pdcluster.control.config import parse_endpoint, read_first_line

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT = 3.0
# Detect a silently dead etcd connection (no FIN/RST) within ~15 s. etcd refuses client pings more
# often than every 5 s (--grpc-keepalive-min-time) and pings without an open stream.
# Reconnect backoff capped at 2 s: gRPC's default grows to 120 s on the subchannel that every new channel to
# the same address shares, so after a 30 s etcd outage nodes stayed away for a minute or more once etcd was back
# and their leases expired (tests/test_fault_drills.py).
GRPC_OPTIONS = {"grpc.keepalive_time_ms": 10_000, "grpc.keepalive_timeout_ms": 5_000,
                "grpc.initial_reconnect_backoff_ms": 500, "grpc.min_reconnect_backoff_ms": 500,
                "grpc.max_reconnect_backoff_ms": 2_000}


class EtcdUnavailable(ConnectionError):
    """No configured etcd endpoint answered."""


@dataclass(frozen=True)
class EtcdCredentials:
    """How to prove who we are to etcd: TLS (CA, client certificate and key) and etcd auth (user, password file).
    Empty fields are unset; no `ca` means plaintext. The files are read at every connect, so a reconnect
    picks up rotated certificates and passwords."""

    ca: str = ""
    cert: str = ""
    key: str = ""
    user: str = ""
    password_file: str = ""

    @classmethod
    def from_config(cls, config: Any) -> "EtcdCredentials":
        """From the `etcd_*` knobs of a config (`CommonConfig`)."""
        return cls(*(getattr(config, f"etcd_{name}", "") or "" for name in ("ca", "cert", "key", "user",
                                                                             "password_file")))

    def channel_credentials(self) -> grpc.ChannelCredentials | None:
        if not self.ca:
            return None
        def read(path: str) -> bytes | None:
            return Path(path).read_bytes() if path else None

        return grpc.ssl_channel_credentials(read(self.ca), read(self.key), read(self.cert))

    def login(self) -> dict[str, str]:
        if not self.user:
            return {}
        return {"username": self.user, "password": read_first_line(self.password_file)}


class Client(aetcd.Client):
    """aetcd 1.0's client, which opens only plaintext channels, plus TLS: `connect` is aetcd's own with a
    secure channel when `tls` is given (keep it in step with aetcd.Client.connect when aetcd changes)."""

    _is_connecting: bool   # aetcd.Client's

    def __init__(self, host: str, port: int, tls: grpc.ChannelCredentials | None = None, **kwargs: Any):
        super().__init__(host, port, **kwargs)
        self._tls = tls

    async def connect(self) -> None:
        if self._tls is None:
            return await super().connect()
        if self._connected.is_set():
            return
        if self._is_connecting:
            await asyncio.wait_for(self._connected.wait(), self._connect_wait_timeout)
            return
        try:
            self._is_connecting = True
            self.channel = grpc.aio.secure_channel(f"{self._host}:{self._port}", self._tls,
                                                   options=list(self._options.items()))
            if self._username is not None:
                self.auth_stub = rpc.AuthStub(self.channel)
                resp = await self.auth_stub.Authenticate(
                    rpc.AuthenticateRequest(name=self._username, password=self._password), timeout=self._timeout)
                self.metadata = (("token", resp.token),)
            self.kvstub = rpc.KVStub(self.channel)
            self.clusterstub = rpc.ClusterStub(self.channel)
            self.leasestub = rpc.LeaseStub(self.channel)
            self.maintenancestub = rpc.MaintenanceStub(self.channel)
            self._watcher = watcher.Watcher(rpc.WatchStub(self.channel), timeout=self._timeout,
                                            metadata=self.metadata)
            self._connected.set()
        finally:
            self._is_connecting = False


async def connect(endpoints: list[str], timeout: float = DEFAULT_TIMEOUT,
                  credentials: EtcdCredentials | None = None) -> aetcd.Client:
    """A client for the first endpoint that answers a read within `timeout`; EtcdUnavailable otherwise."""
    credentials = credentials or EtcdCredentials()
    errors = []
    for endpoint in endpoints:
        host, port = parse_endpoint(endpoint)
        try:
            client = Client(host, port, tls=credentials.channel_credentials(), timeout=timeout,
                            options=GRPC_OPTIONS, **credentials.login())
        except OSError as exc:  # a credential file vanished or became unreadable since the config was checked
            raise EtcdUnavailable(f"etcd credentials: {exc}") from None
        try:
            await asyncio.wait_for(client.get(b"/pdcluster/"), timeout)
            return client
        except Exception as exc:  # aetcd/grpc raise many types; all mean "not this endpoint now"
            errors.append(f"{endpoint}: {type(exc).__name__}: {exc}")
            await close_quietly(client)
    raise EtcdUnavailable("no etcd endpoint reachable (" + "; ".join(errors) + ")")


async def close_quietly(client: aetcd.Client | None) -> None:
    if client is None:
        return
    try:
        await asyncio.wait_for(client.close(), DEFAULT_TIMEOUT)
    except Exception as exc:
        log.debug("closing etcd client: %r", exc)


async def etcd_call(awaitable: Awaitable[Any], timeout: float) -> Any:
    """Every etcd call goes through here: aetcd's own deadline plus an asyncio one as a backstop."""
    return await asyncio.wait_for(awaitable, timeout)


async def cancel_and_wait(task: asyncio.Future | None, timeout: float = 5.0) -> None:
    """Cancel `task` and wait until it is done.

    Cancels again while it runs: before Python 3.12 `asyncio.wait_for` can swallow a cancellation
    that lands as its inner call completes, and a plain `task.cancel(); await task` then hangs.
    """
    if task is None:
        return
    deadline = asyncio.get_running_loop().time() + timeout
    while not task.done():
        if asyncio.get_running_loop().time() > deadline:
            log.error("task %r ignored cancellation for %.0f s; leaving it", task, timeout)
            return
        task.cancel()
        await asyncio.wait({task}, timeout=0.05)
    if not task.cancelled() and task.exception() is not None:
        log.debug("task %r ended with %r", task, task.exception())


def backoff(attempt: int, cap: float) -> float:
    """Exponential backoff from 0.2 s up to `cap`, with jitter so a fleet does not retry in lockstep."""
    return min(cap, 0.2 * 2 ** attempt) * random.uniform(0.7, 1.3)
