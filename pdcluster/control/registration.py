"""A node's own record in etcd, kept alive under a lease for as long as the node runs.

The node id is claimed, not just written: `/pdcluster/<cluster>/ids/<node_id>` (the `Holder` record) is
created in one etcd transaction with the node record, only if absent. A second process with the same id
gets `NodeIdTaken` naming the holder; the id frees up when the holder's lease expires, or at once when the
holder is provably gone (same boot of the same machine and its pid is dead or belongs to another process).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import socket
import time
from dataclasses import asdict, dataclass, field

import aetcd
from prometheus_client import CollectorRegistry

from pdcluster.control.etcd_client import (
    DEFAULT_TIMEOUT,
    EtcdCredentials,
    backoff,
    cancel_and_wait,
    close_quietly,
    connect,
    etcd_call,
)
from pdcluster.control.metrics import etcd_connected_gauge
from pdcluster.control.records import NodeInfo, cluster_prefix, node_key

log = logging.getLogger(__name__)

DEFAULT_TTL = 10


def id_key(cluster: str, node_id: str) -> str:
    return f"{cluster_prefix(cluster)}ids/{node_id}"


def boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def _pid_started(pid: int) -> float:
    """The process's start time (unix s), 0.0 if there is no such process."""
    import psutil

    try:
        return psutil.Process(pid).create_time()
    except (psutil.NoSuchProcess, psutil.AccessDenied, ValueError):
        return 0.0


@dataclass
class Holder:
    """Who holds a node id: enough to name it in an error and to prove it gone."""

    role: str = ""
    hostname: str = field(default_factory=socket.gethostname)
    boot_id: str = field(default_factory=boot_id)
    pid: int = field(default_factory=os.getpid)
    pid_started: float = 0.0  # the process's start time per the kernel (guards against pid reuse)
    started_at: float = field(default_factory=time.time)  # unix s, for people (not compared across hosts)
    claim: str = field(default_factory=lambda: secrets.token_hex(8))  # this Registration's, to know its own

    def __post_init__(self) -> None:
        if not self.pid_started and self.pid == os.getpid():
            self.pid_started = _pid_started(self.pid)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, data: bytes) -> "Holder":
        try:
            body = json.loads(data)
            return cls(**{k: body[k] for k in cls.__dataclass_fields__ if k in body})
        except (ValueError, TypeError, UnicodeDecodeError):
            return cls(hostname="?", boot_id="?", pid=0, pid_started=-1.0, started_at=0.0, claim="?")

    def describe(self) -> str:
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started_at))
        return f"{self.role or 'a node'} on host {self.hostname} (pid {self.pid}, started {started})"

    def provably_gone(self) -> bool:
        """Same machine, same boot, and its pid is dead or now another process: the holder cannot be alive."""
        if not self.boot_id or self.boot_id != boot_id() or self.pid <= 0:
            return False
        started = _pid_started(self.pid)
        return started == 0.0 or (self.pid_started > 0 and abs(started - self.pid_started) > 1.0)


class NodeIdTaken(RuntimeError):
    """Another live process holds this node id."""

    def __init__(self, node_id: str, holder: Holder) -> None:
        super().__init__(f"node id {node_id!r} is held by {holder.describe()}; pick another id, or stop that "
                         f"process (a crashed holder's claim ends when its etcd lease expires)")
        self.holder = holder


class Registration:
    """Keeps `/pdcluster/<cluster>/nodes/<role>/<node_id>` alive under one etcd lease.

    The lease is refreshed every TTL/3. A lost lease (expired, revoked) or a deleted key is
    re-registered; a lost etcd connection is retried with backoff and the same lease is reused if
    it survived. Nothing here raises to the caller because etcd is away.
    """

    def __init__(self, endpoints: list[str], cluster: str, info: NodeInfo, ttl: int = DEFAULT_TTL,
                 timeout: float = DEFAULT_TIMEOUT, registry: CollectorRegistry | None = None,
                 credentials: EtcdCredentials | None = None, holder: Holder | None = None):
        self.endpoints = list(endpoints)
        self.credentials = credentials
        self.cluster = cluster
        self.info = info
        self.ttl = int(ttl)
        self.timeout = timeout
        self.key = node_key(cluster, info.role, info.node_id)
        self.id_key = id_key(cluster, info.node_id)
        self.holder = holder or Holder(role=info.role)
        self.taken: NodeIdTaken | None = None  # set when another process holds the id (the task then ends)
        self.lease_id: int | None = None
        self.registrations = 0  # how many times the key was (re)written under a fresh or recovered lease
        self._registered = asyncio.Event()
        self._wake = asyncio.Event()
        self._client: aetcd.Client | None = None
        self._task: asyncio.Task | None = None
        self._gauge = etcd_connected_gauge(registry).labels("registration") if registry is not None else None

    @property
    def registered(self) -> bool:
        return self._registered.is_set()

    @property
    def task(self) -> asyncio.Task | None:
        """The keep-alive task; it ends (with `NodeIdTaken`) only if another process holds the id."""
        return self._task

    async def start(self, wait: float = 0.0) -> bool:
        """Start the keep-alive task; wait up to `wait` s for the first registration; return whether done.
        Raises `NodeIdTaken` if another live process holds the node id."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name=f"registration:{self.key}")
        return await self.wait_registered(wait)

    async def wait_registered(self, timeout: float) -> bool:
        if timeout > 0 and self._task is not None:
            registered = asyncio.ensure_future(self._registered.wait())
            await asyncio.wait([registered, self._task], timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            registered.cancel()
        if self.taken is not None:
            raise self.taken
        return self.registered

    def update(self, info: NodeInfo) -> None:
        """Publish a changed record (same role and id) at the next chance."""
        if (info.role, info.node_id) != (self.info.role, self.info.node_id):
            raise ValueError("update() cannot change a registration's role or node_id")
        self.info = info
        self._wake.set()

    async def deregister(self) -> None:
        """Clean stop: revoke the lease so the record disappears at once (best effort within the timeout)."""
        await self._stop_task()
        lease_id, self.lease_id = self.lease_id, None
        client, self._client = self._client, None
        try:
            if lease_id is not None:
                if client is None:
                    client = await connect(self.endpoints, self.timeout, self.credentials)
                await etcd_call(client.revoke_lease(lease_id), self.timeout)
                log.info("deregistered %s", self.key)
        except Exception as exc:
            log.warning("deregister %s failed (%r); the record expires within %d s", self.key, exc, self.ttl)
        finally:
            await close_quietly(client)
            self._set_connected(False)

    async def _stop_task(self) -> None:
        task, self._task = self._task, None
        await cancel_and_wait(task)
        self._registered.clear()

    async def _run(self) -> None:
        failures = 0
        while True:
            try:
                await self._session()
                failures = 0
            except asyncio.CancelledError:
                raise
            except NodeIdTaken as exc:
                self._registered.clear()
                self.taken = exc
                log.error("%s", exc)
                self.lease_id = None
                client, self._client = self._client, None
                await close_quietly(client)
                raise
            except Exception as exc:
                self._registered.clear()
                self._set_connected(False)
                (log.warning if failures == 0 else log.debug)(
                    "etcd session for %s lost (%s: %s); retrying", self.key, type(exc).__name__, exc)
                client, self._client = self._client, None
                await close_quietly(client)
                await asyncio.sleep(backoff(failures, cap=max(0.5, min(2.0, self.ttl / 3))))
                failures += 1

    async def _session(self) -> None:
        """One connected stretch: (re)register, then refresh until the lease is lost or etcd fails."""
        if self._client is None:
            self._client = await connect(self.endpoints, self.timeout, self.credentials)
        client = self._client
        if self.lease_id is not None and not await self._refresh(client):
            log.warning("lease of %s expired while etcd was unreachable; registering anew", self.key)
            self.lease_id = None
        if self.lease_id is None:
            lease = await etcd_call(client.lease(self.ttl), self.timeout)
            self.lease_id = lease.id
        await self._claim(client)
        self.registrations += 1
        self._registered.set()
        self._set_connected(True)
        log.info("registered %s (lease %x, ttl %d s)", self.key, self.lease_id, self.ttl)

        refreshes = 0
        while True:
            try:
                await asyncio.wait_for(self._wake.wait(), self.ttl / 3)
                woken = True
            except asyncio.TimeoutError:
                woken = False
            if woken:  # update() asked for a new record; a failed put ends the session, the next one re-puts
                self._wake.clear()
                await self._put(client)
            if not await self._refresh(client):
                log.warning("lease of %s lost; registering anew", self.key)
                self.lease_id = None
                self._registered.clear()
                return
            refreshes += 1
            if refreshes % 3 == 0:  # about once per TTL: heal a record deleted by hand
                kv = await etcd_call(client.get(self.key.encode()), self.timeout)
                if kv is None or kv.lease != self.lease_id:
                    log.warning("record %s vanished from etcd; writing it again", self.key)
                    await self._claim(client)

    async def _refresh(self, client: aetcd.Client) -> bool:
        reply = await etcd_call(client.refresh_lease(self.lease_id), self.timeout)
        return reply is not None and reply.TTL > 0

    async def _claim(self, client: aetcd.Client) -> None:
        """Create the id claim and the record under our lease, only if the id is free (or already ours);
        take it over from a provably gone holder; NodeIdTaken if someone else holds it."""
        tx = client.transactions
        key = self.id_key.encode()
        for _ in range(3):
            ok, replies = await etcd_call(client.transaction(
                compare=[tx.create(key) == 0],
                success=[tx.put(key, self.holder.to_json().encode(), lease=self.lease_id),
                         tx.put(self.key.encode(), self.info.to_json().encode(), lease=self.lease_id)],
                failure=[tx.get(key)]), self.timeout)
            if ok:
                return
            if not replies or not replies[0]:
                continue  # deleted between compare and get: try again
            value, meta = replies[0][0]
            holder = Holder.from_json(value)
            mine = holder.claim == self.holder.claim
            if mine and meta.lease == self.lease_id:
                await self._put(client)
                return
            if not mine and not holder.provably_gone():
                raise NodeIdTaken(self.info.node_id, holder)
            if not mine:
                log.warning("node id %s: previous holder %s is gone; taking the id over", self.info.node_id,
                            holder.describe())
            # Ours under a lost lease, or a dead holder's: delete exactly that claim, then claim again.
            await etcd_call(client.transaction(compare=[tx.mod(key) == meta.mod_revision],
                                               success=[tx.delete(key)], failure=[]), self.timeout)
        raise RuntimeError(f"node id {self.info.node_id!r}: claim contended; retrying")

    async def _put(self, client: aetcd.Client) -> None:
        await etcd_call(client.put(self.key.encode(), self.info.to_json().encode(), lease=self.lease_id), self.timeout)

    def _set_connected(self, up: bool) -> None:
        if self._gauge is not None:
            self._gauge.set(1 if up else 0)
