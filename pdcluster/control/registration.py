"""A node's own record in etcd, kept alive under a lease for as long as the node runs."""

from __future__ import annotations

import asyncio
import logging

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
from pdcluster.control.records import NodeInfo, node_key

log = logging.getLogger(__name__)

DEFAULT_TTL = 10


class Registration:
    """Keeps `/pdcluster/<cluster>/nodes/<role>/<node_id>` alive under one etcd lease.

    The lease is refreshed every TTL/3. A lost lease (expired, revoked) or a deleted key is
    re-registered; a lost etcd connection is retried with backoff and the same lease is reused if
    it survived. Nothing here raises to the caller because etcd is away.
    """

    def __init__(self, endpoints: list[str], cluster: str, info: NodeInfo, ttl: int = DEFAULT_TTL,
                 timeout: float = DEFAULT_TIMEOUT, registry: CollectorRegistry | None = None,
                 credentials: EtcdCredentials | None = None):
        self.endpoints = list(endpoints)
        self.credentials = credentials
        self.cluster = cluster
        self.info = info
        self.ttl = int(ttl)
        self.timeout = timeout
        self.key = node_key(cluster, info.role, info.node_id)
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

    async def start(self, wait: float = 0.0) -> bool:
        """Start the keep-alive task; wait up to `wait` s for the first registration; return whether done."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name=f"registration:{self.key}")
        return await self.wait_registered(wait)

    async def wait_registered(self, timeout: float) -> bool:
        if timeout > 0:
            try:
                await asyncio.wait_for(self._registered.wait(), timeout)
            except asyncio.TimeoutError:
                pass
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
        await self._put(client)
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
                    await self._put(client)

    async def _refresh(self, client: aetcd.Client) -> bool:
        reply = await etcd_call(client.refresh_lease(self.lease_id), self.timeout)
        return reply is not None and reply.TTL > 0

    async def _put(self, client: aetcd.Client) -> None:
        await etcd_call(client.put(self.key.encode(), self.info.to_json().encode(), lease=self.lease_id), self.timeout)

    def _set_connected(self, up: bool) -> None:
        if self._gauge is not None:
            self._gauge.set(1 if up else 0)
