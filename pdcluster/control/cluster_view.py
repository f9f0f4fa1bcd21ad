"""A live mirror of a cluster's records in etcd, for routers and nodes."""

from __future__ import annotations

import asyncio
import logging
from typing import Callable

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
from pdcluster.control.records import AdminState, NodeInfo, cluster_prefix, node_key, parse_node

log = logging.getLogger(__name__)

HEALTH_INTERVAL = 5.0  # seconds between the reads that notice a silent, dead connection

Listener = Callable[[str, "str | None"], None]


class ClusterView:
    """A live mirror of a cluster's node records and admin states.

    Initial `get` of `/pdcluster/<cluster>/`, then a watch from the next revision. When etcd goes
    away the last known view stays (routing keeps working) and a full resync replaces it on return.
    Listeners get `(event, node_id)` with event in node_added | node_updated | node_removed | admin |
    resync (a full reload after (re)connecting; node_id None) | disconnected (node_id None).
    """

    def __init__(self, endpoints: list[str], cluster: str, timeout: float = DEFAULT_TIMEOUT,
                 registry: CollectorRegistry | None = None, credentials: EtcdCredentials | None = None):
        self.endpoints = list(endpoints)
        self.credentials = credentials
        self.cluster = cluster
        self.timeout = timeout
        self.nodes: dict[str, NodeInfo] = {}  # node_id -> record
        self.admin: dict[str, AdminState] = {}  # node_id -> admin state (absent = active)
        self.connected = False
        self.synced = asyncio.Event()  # set after the first full sync
        self._listeners: list[Listener] = []
        self._changed = asyncio.Condition()
        self._prefix = cluster_prefix(cluster)
        self._client: aetcd.Client | None = None
        self._task: asyncio.Task | None = None
        self._gauge = etcd_connected_gauge(registry).labels("view") if registry is not None else None

    # -- queries
    def nodes_by_role(self, role: str) -> list[NodeInfo]:
        return sorted((n for n in self.nodes.values() if n.role == role), key=lambda n: n.node_id)

    def admin_state(self, node_id: str) -> str:
        admin = self.admin.get(node_id)
        return admin.state if admin is not None else "active"

    def schedulable(self, role: str) -> list[NodeInfo]:
        """Nodes of `role` that may take new requests (neither cordoned nor draining)."""
        return [n for n in self.nodes_by_role(role) if self.admin_state(n.node_id) == "active"]

    def add_listener(self, listener: Listener) -> None:
        self._listeners.append(listener)

    async def wait_for(self, predicate: Callable[["ClusterView"], bool], timeout: float) -> bool:
        """Wait until `predicate(view)` holds (checked on every change); False on timeout."""
        async with self._changed:
            try:
                await asyncio.wait_for(self._changed.wait_for(lambda: predicate(self)), timeout)
                return True
            except asyncio.TimeoutError:
                return False

    # -- lifecycle
    async def start(self, wait: float = 0.0) -> bool:
        """Start mirroring; wait up to `wait` s for the first full sync; return whether it happened."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name=f"view:{self._prefix}")
        if wait > 0:
            try:
                await asyncio.wait_for(self.synced.wait(), wait)
            except asyncio.TimeoutError:
                pass
        return self.synced.is_set()

    async def stop(self) -> None:
        task, self._task = self._task, None
        await cancel_and_wait(task)
        client, self._client = self._client, None
        await close_quietly(client)
        self._set_connected(False)

    async def _run(self) -> None:
        failures = 0
        while True:
            try:
                await self._session()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if self.connected:
                    failures = 0  # the session had synced: this is a new outage
                (log.warning if failures == 0 else log.debug)(
                    "etcd watch of %s lost (%s: %s); keeping the last known view of %d nodes",
                    self._prefix, type(exc).__name__, exc, len(self.nodes))
            if self.connected:
                self._set_connected(False)
                await self._notify("disconnected", None)
            client, self._client = self._client, None
            await close_quietly(client)
            await asyncio.sleep(backoff(failures, cap=2.0))
            failures += 1

    async def _session(self) -> None:
        self._client = client = await connect(self.endpoints, self.timeout, self.credentials)
        snapshot = await etcd_call(client.get_prefix(self._prefix.encode()), self.timeout)
        nodes: dict[str, NodeInfo] = {}
        admin: dict[str, AdminState] = {}
        for kv in snapshot:
            self._parse_into(kv.key.decode(errors="replace"), kv.value, nodes, admin)
        watch = await etcd_call(client.watch_prefix(self._prefix.encode(), start_revision=snapshot.header.revision + 1),
                            self.timeout)
        self.nodes, self.admin = nodes, admin
        self._set_connected(True)
        self.synced.set()
        log.info("cluster view of %s synced at revision %d: %d nodes", self._prefix, snapshot.header.revision,
                 len(nodes))
        await self._notify("resync", None)

        events = asyncio.ensure_future(self._consume(watch))
        health = asyncio.ensure_future(self._health(client))
        try:
            done, _ = await asyncio.wait({events, health}, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()  # re-raise the failure that ended the session
            raise ConnectionError("etcd watch stream ended")
        finally:
            await cancel_and_wait(events)
            await cancel_and_wait(health)

    async def _consume(self, watch: aetcd.Watch) -> None:
        async for event in watch:
            key = event.kv.key.decode(errors="replace")
            change = self._apply(event.kind, key, event.kv.value)
            if change is not None:
                await self._notify(*change)

    async def _health(self, client: aetcd.Client) -> None:
        """A watch on a dead-but-open connection can stay silent; a periodic read notices."""
        while True:
            await asyncio.sleep(HEALTH_INTERVAL)
            await etcd_call(client.get(self._prefix.encode()), self.timeout)

    def _apply(self, kind: str, key: str, value: bytes) -> tuple[str, str | None] | None:
        rest = key[len(self._prefix):]
        if rest.startswith("nodes/"):
            node_id = rest.split("/", 2)[-1]
            if kind == "DELETE":
                old = self.nodes.get(node_id)
                if old is None or node_key(self.cluster, old.role, node_id) != key:
                    return None
                del self.nodes[node_id]
                return "node_removed", node_id
            known = node_id in self.nodes
            if not self._parse_into(key, value, self.nodes, self.admin):
                self.nodes.pop(node_id, None)  # a broken record must not stay routable
                return ("node_removed", node_id) if known else None
            return ("node_updated" if known else "node_added"), node_id
        if rest.startswith("admin/"):
            node_id = rest[len("admin/"):]
            if kind == "DELETE":
                self.admin.pop(node_id, None)
            elif not self._parse_into(key, value, self.nodes, self.admin):
                return None
            return "admin", node_id
        return None

    def _parse_into(self, key: str, value: bytes, nodes: dict[str, NodeInfo], admin: dict[str, AdminState]) -> bool:
        rest = key[len(self._prefix):]
        try:
            if rest.startswith("nodes/"):
                info = parse_node(self.cluster, key, value)
                nodes[info.node_id] = info
                return True
            if rest.startswith("admin/"):
                admin[rest[len("admin/"):]] = AdminState.from_json(value)
                return True
        except ValueError as exc:
            log.warning("ignoring bad record %s: %s", key, exc)
        return False

    async def _notify(self, event: str, node_id: str | None) -> None:
        for listener in list(self._listeners):
            try:
                listener(event, node_id)
            except Exception:
                log.exception("cluster view listener failed on %s %s", event, node_id)
        async with self._changed:
            self._changed.notify_all()

    def _set_connected(self, up: bool) -> None:
        self.connected = up
        if self._gauge is not None:
            self._gauge.set(1 if up else 0)
