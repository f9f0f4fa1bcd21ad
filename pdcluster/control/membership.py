"""Cluster membership in etcd: who is up (leased node records) and how the operator wants them used (admin state).

Key layout (all values are JSON, readable with `etcdctl get --prefix /pdcluster/`):

    /pdcluster/<cluster>/nodes/<role>/<node_id>  -> NodeInfo     leased: vanishes ~TTL after the node stops refreshing
    /pdcluster/<cluster>/admin/<node_id>         -> AdminState   not leased: survives node and etcd restarts

`Registration` keeps one node's record alive; `ClusterView` mirrors both prefixes for routers and
nodes. Neither ever raises because etcd is away: they keep the last known state, retry with backoff,
and re-register / resync when etcd returns. Every etcd call has a timeout.
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.metadata
import json
import logging
import random
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

import aetcd
from prometheus_client import CollectorRegistry

from pdcluster.control.config import parse_endpoint
from pdcluster.control.metrics import etcd_connected_gauge

log = logging.getLogger(__name__)

ROLES = ("prefill", "decode", "router")
ADMIN_STATES = ("active", "cordoned", "draining")
DEFAULT_TTL = 10
DEFAULT_TIMEOUT = 3.0
# Detect a silently dead etcd connection (no FIN/RST) within ~15 s. etcd refuses client pings more
# often than every 5 s (--grpc-keepalive-min-time) and pings without an open stream.
GRPC_OPTIONS = {"grpc.keepalive_time_ms": 10_000, "grpc.keepalive_timeout_ms": 5_000}

try:
    PDCLUSTER_VERSION = importlib.metadata.version("pdcluster")
except importlib.metadata.PackageNotFoundError:
    PDCLUSTER_VERSION = "0+unknown"


class EtcdUnavailable(ConnectionError):
    """No configured etcd endpoint answered."""


# ---------------------------------------------------------------------------------------------- keys

def cluster_prefix(cluster: str) -> str:
    return f"/pdcluster/{cluster}/"


def nodes_prefix(cluster: str) -> str:
    return f"/pdcluster/{cluster}/nodes/"


def node_key(cluster: str, role: str, node_id: str) -> str:
    return f"/pdcluster/{cluster}/nodes/{role}/{node_id}"


def admin_key(cluster: str, node_id: str) -> str:
    return f"/pdcluster/{cluster}/admin/{node_id}"


# ---------------------------------------------------------------------------------------------- records

@dataclass
class Capacity:
    num_blocks: int = 0
    block_size: int = 0
    max_num_seqs: int = 0


@dataclass
class NodeInfo:
    """What a node tells the cluster about itself. Addresses are complete (zmq: tcp://host:port)."""

    node_id: str
    role: str  # prefill | decode | router
    model: str = ""
    host: str = ""
    control_addr: str = ""  # zmq ROUTER: Generate / Prefill / Abort / Ping
    load_addr: str = ""  # zmq PUB: Load reports at ~2 Hz
    kv_addr: str = ""  # KV transfer listener
    kv_backends: list[str] = field(default_factory=list)  # e.g. ["shm", "tcp"]
    metrics_addr: str = ""  # http://host:port/metrics
    version: str = PDCLUSTER_VERSION
    capacity: Capacity = field(default_factory=Capacity)
    started_at: float = field(default_factory=time.time)  # unix seconds

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), separators=(", ", ": "))

    @classmethod
    def from_json(cls, data: bytes | str) -> "NodeInfo":
        """Parse a record; unknown fields (a newer node) are ignored, bad ones raise ValueError."""
        try:
            body = json.loads(data)
        except (ValueError, UnicodeDecodeError) as exc:
            raise ValueError(f"node record is not JSON: {exc}") from None
        if not isinstance(body, dict):
            raise ValueError("node record is not a JSON object")
        capacity = body.get("capacity") or {}
        if not isinstance(capacity, dict):
            raise ValueError("node record: capacity must be an object")
        cap_names = {f.name for f in dataclasses.fields(Capacity)}
        names = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in body.items() if k in names and k != "capacity"}
        try:
            info = cls(**values, capacity=Capacity(**{k: v for k, v in capacity.items() if k in cap_names}))
        except TypeError as exc:
            raise ValueError(f"node record: {exc}") from None
        info._check()
        return info

    def _check(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"node record: role {self.role!r} is not one of {ROLES}")
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.type == "str" and not isinstance(value, str):
                raise ValueError(f"node record: {f.name} must be a string")
            if f.type == "float" and (not isinstance(value, (int, float)) or isinstance(value, bool)):
                raise ValueError(f"node record: {f.name} must be a number")
        if not self.node_id:
            raise ValueError("node record: node_id is empty")
        if not isinstance(self.kv_backends, list) or not all(isinstance(b, str) for b in self.kv_backends):
            raise ValueError("node record: kv_backends must be a list of strings")
        for f in dataclasses.fields(self.capacity):
            value = getattr(self.capacity, f.name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"node record: capacity.{f.name} must be a non-negative integer")


@dataclass
class AdminState:
    """Operator intent for one node. cordoned: no new requests; draining: finish running ones, then leave."""

    state: str = "active"  # active | cordoned | draining
    reason: str = ""
    since: float = 0.0  # unix seconds of the change

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), separators=(", ", ": "))

    @classmethod
    def from_json(cls, data: bytes | str) -> "AdminState":
        try:
            body = json.loads(data)
        except (ValueError, UnicodeDecodeError) as exc:
            raise ValueError(f"admin record is not JSON: {exc}") from None
        if not isinstance(body, dict) or body.get("state") not in ADMIN_STATES:
            raise ValueError(f"admin record: state must be one of {ADMIN_STATES}")
        return cls(state=body["state"], reason=str(body.get("reason", "")),
                   since=float(body.get("since", 0.0) or 0.0))


# ---------------------------------------------------------------------------------------------- client helpers

async def connect(endpoints: list[str], timeout: float = DEFAULT_TIMEOUT) -> aetcd.Client:
    """A client for the first endpoint that answers a read within `timeout`; EtcdUnavailable otherwise."""
    errors = []
    for endpoint in endpoints:
        host, port = parse_endpoint(endpoint)
        client = aetcd.Client(host, port, timeout=timeout, options=GRPC_OPTIONS)
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


async def _call(awaitable: Awaitable[Any], timeout: float) -> Any:
    """Every etcd call goes through here: aetcd's own deadline plus an asyncio one as a backstop."""
    return await asyncio.wait_for(awaitable, timeout)


async def set_admin_state(client: aetcd.Client, cluster: str, node_id: str, state: str,
                          reason: str = "", timeout: float = DEFAULT_TIMEOUT) -> AdminState:
    """Write the admin state of `node_id` (not leased: it outlives the node's registration)."""
    if state not in ADMIN_STATES:
        raise ValueError(f"admin state {state!r} is not one of {', '.join(ADMIN_STATES)}")
    admin = AdminState(state=state, reason=reason, since=time.time())
    await _call(client.put(admin_key(cluster, node_id).encode(), admin.to_json().encode()), timeout)
    return admin


async def get_admin_state(client: aetcd.Client, cluster: str, node_id: str,
                          timeout: float = DEFAULT_TIMEOUT) -> AdminState:
    """The admin state of `node_id`; `active` when none was ever set."""
    kv = await _call(client.get(admin_key(cluster, node_id).encode()), timeout)
    return AdminState.from_json(kv.value) if kv is not None else AdminState()


async def list_admin_states(client: aetcd.Client, cluster: str,
                            timeout: float = DEFAULT_TIMEOUT) -> dict[str, AdminState]:
    prefix = f"/pdcluster/{cluster}/admin/"
    result = await _call(client.get_prefix(prefix.encode()), timeout)
    states = {}
    for kv in result:
        node_id = kv.key.decode()[len(prefix):]
        try:
            states[node_id] = AdminState.from_json(kv.value)
        except ValueError as exc:
            log.warning("ignoring bad admin record %s: %s", kv.key.decode(), exc)
    return states


async def list_nodes(client: aetcd.Client, cluster: str, role: str | None = None,
                     timeout: float = DEFAULT_TIMEOUT) -> list[NodeInfo]:
    """Registered nodes (optionally of one role), sorted by role then node id; bad records are skipped."""
    prefix = nodes_prefix(cluster) + (f"{role}/" if role else "")
    result = await _call(client.get_prefix(prefix.encode()), timeout)
    nodes = []
    for kv in result:
        try:
            nodes.append(_parse_node(cluster, kv.key.decode(), kv.value))
        except ValueError as exc:
            log.warning("ignoring bad node record %s: %s", kv.key.decode(errors="replace"), exc)
    return sorted(nodes, key=lambda n: (n.role, n.node_id))


def _parse_node(cluster: str, key: str, value: bytes) -> NodeInfo:
    role, _, node_id = key[len(nodes_prefix(cluster)):].partition("/")
    info = NodeInfo.from_json(value)
    if (info.role, info.node_id) != (role, node_id):
        raise ValueError(f"record says {info.role}/{info.node_id} but its key says {role}/{node_id}")
    return info


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


def _backoff(attempt: int, cap: float) -> float:
    """Exponential backoff from 0.2 s up to `cap`, with jitter so a fleet does not retry in lockstep."""
    return min(cap, 0.2 * 2 ** attempt) * random.uniform(0.7, 1.3)


# ---------------------------------------------------------------------------------------------- registration

class Registration:
    """Keeps `/pdcluster/<cluster>/nodes/<role>/<node_id>` alive under one etcd lease.

    The lease is refreshed every TTL/3. A lost lease (expired, revoked) or a deleted key is
    re-registered; a lost etcd connection is retried with backoff and the same lease is reused if
    it survived. Nothing here raises to the caller because etcd is away.
    """

    def __init__(self, endpoints: list[str], cluster: str, info: NodeInfo, ttl: int = DEFAULT_TTL,
                 timeout: float = DEFAULT_TIMEOUT, registry: CollectorRegistry | None = None):
        self.endpoints = list(endpoints)
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
                    client = await connect(self.endpoints, self.timeout)
                await _call(client.revoke_lease(lease_id), self.timeout)
                log.info("deregistered %s", self.key)
        except Exception as exc:
            log.warning("deregister %s failed (%r); the record expires within %d s", self.key, exc, self.ttl)
        finally:
            await close_quietly(client)
            self._set_connected(False)

    async def abandon(self) -> None:
        """Stop refreshing without revoking (what a crash looks like): the record expires after the TTL."""
        await self._stop_task()
        client, self._client = self._client, None
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
                await asyncio.sleep(_backoff(failures, cap=max(0.5, min(2.0, self.ttl / 3))))
                failures += 1

    async def _session(self) -> None:
        """One connected stretch: (re)register, then refresh until the lease is lost or etcd fails."""
        if self._client is None:
            self._client = await connect(self.endpoints, self.timeout)
        client = self._client
        if self.lease_id is not None and not await self._refresh(client):
            log.warning("lease of %s expired while etcd was unreachable; registering anew", self.key)
            self.lease_id = None
        if self.lease_id is None:
            lease = await _call(client.lease(self.ttl), self.timeout)
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
                kv = await _call(client.get(self.key.encode()), self.timeout)
                if kv is None or kv.lease != self.lease_id:
                    log.warning("record %s vanished from etcd; writing it again", self.key)
                    await self._put(client)

    async def _refresh(self, client: aetcd.Client) -> bool:
        reply = await _call(client.refresh_lease(self.lease_id), self.timeout)
        return reply is not None and reply.TTL > 0

    async def _put(self, client: aetcd.Client) -> None:
        await _call(client.put(self.key.encode(), self.info.to_json().encode(), lease=self.lease_id), self.timeout)

    def _set_connected(self, up: bool) -> None:
        if self._gauge is not None:
            self._gauge.set(1 if up else 0)


# ---------------------------------------------------------------------------------------------- view

Listener = Callable[[str, "str | None"], None]


class ClusterView:
    """A live mirror of a cluster's node records and admin states.

    Initial `get` of `/pdcluster/<cluster>/`, then a watch from the next revision. When etcd goes
    away the last known view stays (routing keeps working) and a full resync replaces it on return.
    Listeners get `(event, node_id)` with event in node_added | node_updated | node_removed | admin |
    resync (a full reload after (re)connecting; node_id None) | disconnected (node_id None).
    """

    def __init__(self, endpoints: list[str], cluster: str, timeout: float = DEFAULT_TIMEOUT,
                 registry: CollectorRegistry | None = None, health_interval: float = 5.0):
        self.endpoints = list(endpoints)
        self.cluster = cluster
        self.timeout = timeout
        self.health_interval = health_interval
        self.nodes: dict[str, NodeInfo] = {}  # node_id -> record
        self.admin: dict[str, AdminState] = {}  # node_id -> admin state (absent = active)
        self.connected = False
        self.revision = 0  # etcd revision the view reflects
        self.version = 0  # bumped on every change; cheap "did anything change" check
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
            await asyncio.sleep(_backoff(failures, cap=2.0))
            failures += 1

    async def _session(self) -> None:
        self._client = client = await connect(self.endpoints, self.timeout)
        snapshot = await _call(client.get_prefix(self._prefix.encode()), self.timeout)
        nodes: dict[str, NodeInfo] = {}
        admin: dict[str, AdminState] = {}
        for kv in snapshot:
            self._parse_into(kv.key.decode(errors="replace"), kv.value, nodes, admin)
        watch = await _call(client.watch_prefix(self._prefix.encode(), start_revision=snapshot.header.revision + 1),
                            self.timeout)
        self.nodes, self.admin, self.revision = nodes, admin, snapshot.header.revision
        self._set_connected(True)
        self.synced.set()
        log.info("cluster view of %s synced at revision %d: %d nodes", self._prefix, self.revision, len(nodes))
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
            self.revision = max(self.revision, event.kv.mod_revision)
            change = self._apply(event.kind, key, event.kv.value)
            if change is not None:
                await self._notify(*change)

    async def _health(self, client: aetcd.Client) -> None:
        """A watch on a dead-but-open connection can stay silent; a periodic read notices."""
        while True:
            await asyncio.sleep(self.health_interval)
            await _call(client.get(self._prefix.encode()), self.timeout)

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
                info = _parse_node(self.cluster, key, value)
                nodes[info.node_id] = info
                return True
            if rest.startswith("admin/"):
                admin[rest[len("admin/"):]] = AdminState.from_json(value)
                return True
        except ValueError as exc:
            log.warning("ignoring bad record %s: %s", key, exc)
        return False

    async def _notify(self, event: str, node_id: str | None) -> None:
        self.version += 1
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
