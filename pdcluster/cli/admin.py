"""The operator's commands: status, nodes, cordon / uncordon, drain, health.

Membership and admin state come from etcd (docs/design.md §6); live numbers come from each node's Load
publisher, subscribed to for a moment (at most `LOAD_WAIT` s) — nothing here writes load into etcd — and
device utilization / memory from each node's /metrics (`pdcluster.monitor.read_node_metrics`).
Every function talks to etcd with timeouts and raises `AdminError` with a message meant for the
operator; `pdcluster.cli.main` turns that into a non-zero exit.
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from pdcluster.control.config import (
    DEFAULT_ETCD,
    ETCD_SECURITY,
    CommonConfig,
    check_etcd_security,
    declared_default,
    env_name,
    parse_endpoint,
)
from pdcluster.control.etcd_client import EtcdCredentials, EtcdUnavailable, close_quietly, connect
from pdcluster.control.keys import ClusterKeys, SecretError, load_secret
from pdcluster.control.protocol import Load
from pdcluster.control.queries import get_admin_state, list_admin_states, list_nodes, set_admin_state
from pdcluster.control.records import AdminState, NodeInfo
from pdcluster.control.transport import LoadSubscriber

ENV_ETCD = "PDCLUSTER_ETCD"
ENV_CLUSTER = "PDCLUSTER_CLUSTER"
LOAD_WAIT = 1.5  # seconds to listen for Load reports (nodes publish at ~2 Hz)
# seconds an etcd read may take: a one-shot command waits out an etcd that a busy host starves for a moment (the
# nodes' default, 3 s, timed out here on a 2-core box under a migration drill); a refused login still fails at once
ETCD_WAIT = 10.0
METRICS_WAIT = 1.5  # seconds to wait for a node's /metrics
USAGE_KEYS = ("device_kind", "device_utilization_pct", "device_memory_used_bytes", "device_memory_total_bytes",
              "batch_occupancy", "preemptions", "expert_imbalance", "spec_method", "spec_acceptance_rate",
              "spec_mean_accepted_length")
DRAIN_POLL = 0.25


class AdminError(Exception):
    """A failure the operator should read (unknown node, etcd down, drain timeout)."""


def etcd_endpoints(flag: str | None) -> list[str]:
    """`--etcd` or $PDCLUSTER_ETCD ("host:port[,host:port]"), else the local default; validated."""
    text = flag or os.environ.get(ENV_ETCD) or DEFAULT_ETCD
    endpoints = [e.strip() for e in text.split(",") if e.strip()]
    if not endpoints:
        raise AdminError(f"--etcd: no endpoint in {text!r}")
    for endpoint in endpoints:
        try:
            parse_endpoint(endpoint)
        except ValueError as exc:
            raise AdminError(f"--etcd: {exc}") from None
    return endpoints


def cluster_name(flag: str | None) -> str:
    return flag or os.environ.get(ENV_CLUSTER) or declared_default(CommonConfig, "cluster")


def cluster_keys() -> ClusterKeys | None:
    """The keys of $PDCLUSTER_CLUSTER_SECRET (the nodes' cluster_secret): without them an authenticated
    cluster's Load reports cannot be read, and every node shows as unreachable."""
    path = os.environ.get(env_name("cluster_secret"), "")
    try:
        return load_secret(path) if path else None
    except SecretError as exc:
        raise AdminError(str(exc)) from None


def etcd_credentials(flags: dict[str, str | None]) -> EtcdCredentials:
    """TLS / auth for etcd from the `--etcd-ca ...` flags, else $PDCLUSTER_ETCD_CA ..., checked like a
    service's config (pairs complete, files readable)."""
    values = {name: flags.get(name) or os.environ.get(env_name(name)) or "" for name in ETCD_SECURITY}
    try:
        check_etcd_security(SimpleNamespace(**values))
    except ValueError as exc:
        raise AdminError(str(exc)) from None
    return EtcdCredentials.from_config(SimpleNamespace(**values))


@dataclass
class NodeStatus:
    """One node as the operator sees it: its etcd record, admin state and (if it answered) its Load."""

    info: NodeInfo
    admin: AdminState
    load: Load | None = None
    usage: dict[str, Any] | None = None   # pdcluster.monitor KEYS from the node's /metrics, if it answered

    @property
    def state(self) -> str:
        """What the node itself reports (serving | cordoned | draining); "unreachable" when it sent no
        Load in time; "registered" for a record without a Load publisher (a router)."""
        if self.load is not None:
            return self.load.state
        return "unreachable" if self.info.load_addr else "registered"

    def to_dict(self, now: float | None = None) -> dict[str, Any]:
        load, info, usage = self.load, self.info, self.usage or {}
        total = load.total_blocks if load else info.capacity.num_blocks
        return {
            "node_id": info.node_id, "role": info.role, "host": info.host, "model": info.model,
            "admin_state": self.admin.state, "state": self.state,
            "running": load.running if load else None, "waiting": load.waiting if load else None,
            "kv_blocks_total": total,
            "kv_blocks_used": total - load.free_blocks if load else None,
            "kv_blocks_free": load.free_blocks if load else None,
            "queued_prefill_tokens": load.queued_prefill_tokens if load else None,
            "tokens_per_s": round(load.tokens_per_s, 2) if load else None,   # generated (docs/operations.md)
            "prefill_tokens_per_s": round(load.prefill_tokens_per_s, 2) if load and info.role == "prefill" else None,
            # routers: running = requests in flight; open token streams and failed requests since start
            "streams": load.streams if load and info.role == "router" else None,
            "errors": load.errors if load and info.role == "router" else None,
            "transfer_gbps": round(load.transfer_gbps, 6) if load else None,
            **{key: usage.get(key) for key in USAGE_KEYS},
            "uptime_s": round((now or time.time()) - info.started_at, 1),
            "version": info.version, "control_addr": info.control_addr, "load_addr": info.load_addr,
            "metrics_addr": info.metrics_addr,
        }


@dataclass
class Health:
    healthy: bool
    reasons: list[str] = field(default_factory=list)  # why unhealthy (empty when healthy)
    notes: list[str] = field(default_factory=list)  # worth knowing, not failing
    nodes: list[NodeStatus] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"healthy": self.healthy, "reasons": self.reasons, "notes": self.notes,
                "nodes": {n.info.node_id: {"role": n.info.role, "admin_state": n.admin.state, "state": n.state}
                          for n in self.nodes}}


# ---------------------------------------------------------------------------------------------- etcd

async def _client(endpoints: list[str], credentials: EtcdCredentials | None):
    try:
        return await connect(endpoints, timeout=ETCD_WAIT, credentials=credentials)
    except EtcdUnavailable as exc:
        raise AdminError(str(exc)) from None


async def collect_loads(nodes: list[NodeInfo], timeout: float = LOAD_WAIT) -> dict[str, Load]:
    """Latest Load of each node that publishes one within `timeout` s (returns early when all did)."""
    wanted = {n.node_id for n in nodes if n.load_addr}
    loads: dict[str, Load] = {}
    if not wanted:
        return loads
    sub = LoadSubscriber(keys=cluster_keys())
    try:
        for node in nodes:
            if node.load_addr:
                sub.connect(node.load_addr)
        deadline = time.monotonic() + timeout
        while not wanted <= loads.keys():
            left = deadline - time.monotonic()
            if left <= 0:
                break
            load = await sub.recv(timeout=left)
            if load is None:
                break
            if load.node_id in wanted:
                loads[load.node_id] = load
    finally:
        sub.close()
    return loads


async def cluster_status(endpoints: list[str], cluster: str, load_wait: float = LOAD_WAIT,
                         credentials: EtcdCredentials | None = None) -> list[NodeStatus]:
    """Every registered node (routers too, if they register) with its admin state and live Load."""
    client = await _client(endpoints, credentials)
    try:
        nodes = await list_nodes(client, cluster)
        admin = await list_admin_states(client, cluster)
    finally:
        await close_quietly(client)
    if load_wait <= 0:
        return [NodeStatus(n, admin.get(n.node_id, AdminState())) for n in nodes]
    loads, usages = await asyncio.gather(collect_loads(nodes, load_wait), collect_usages(nodes))
    return [NodeStatus(n, admin.get(n.node_id, AdminState()), loads.get(n.node_id), usages.get(n.node_id))
            for n in nodes]


async def collect_usages(nodes: list[NodeInfo], timeout: float = METRICS_WAIT) -> dict[str, dict[str, Any]]:
    """Device and engine figures of each node whose /metrics answers within `timeout` s."""
    from pdcluster.monitor import read_node_metrics

    async def one(node: NodeInfo) -> dict[str, Any] | None:
        try:
            return await asyncio.to_thread(read_node_metrics, node.metrics_addr, timeout)
        except Exception:   # down, not a node, or not answering: the table shows "-"
            return None

    wanted = [n for n in nodes if n.metrics_addr and n.role in ("prefill", "decode")]
    results = await asyncio.gather(*(one(n) for n in wanted))
    return {n.node_id: r for n, r in zip(wanted, results, strict=True) if r is not None}


async def _find(client: Any, cluster: str, node_id: str) -> NodeInfo | None:
    return next((n for n in await list_nodes(client, cluster) if n.node_id == node_id), None)


def _unknown(cluster: str, node_id: str, nodes: list[NodeInfo]) -> AdminError:
    known = ", ".join(n.node_id for n in nodes) or "none"
    return AdminError(f"unknown node {node_id!r} in cluster {cluster!r} (registered: {known})")


async def set_state(endpoints: list[str], cluster: str, node_id: str, state: str, reason: str = "",
                    credentials: EtcdCredentials | None = None) -> AdminState:
    """cordon (state "cordoned") / uncordon ("active"). The node must be registered, except that a
    node with an admin record may be uncordoned while it is down (it comes back active)."""
    client = await _client(endpoints, credentials)
    try:
        nodes = await list_nodes(client, cluster)
        if not any(n.node_id == node_id for n in nodes):
            has_record = node_id in await list_admin_states(client, cluster)
            if not (state == "active" and has_record):
                raise _unknown(cluster, node_id, nodes)
        return await set_admin_state(client, cluster, node_id, state, reason)
    finally:
        await close_quietly(client)


async def drain_node(endpoints: list[str], cluster: str, node_id: str, timeout: float,
                     reason: str = "pdcluster drain", credentials: EtcdCredentials | None = None,
                     migrate: bool = False) -> float:
    """Mark `node_id` draining, wait until its etcd record is gone (it finished its requests, or with `migrate`
    moved them to other decode nodes, and exited), then leave it cordoned so a restarted instance takes no
    traffic until `uncordon`. Returns the seconds it took; AdminError on an unknown node or after `timeout` s."""
    started = time.monotonic()
    client = await _client(endpoints, credentials)
    try:
        nodes = await list_nodes(client, cluster)
        node = next((n for n in nodes if n.node_id == node_id), None)
        if node is None:
            raise _unknown(cluster, node_id, nodes)
        await set_admin_state(client, cluster, node_id, "draining", reason, migrate=migrate)
        deadline = started + timeout
        while await _find(client, cluster, node_id) is not None:
            if time.monotonic() >= deadline:
                raise AdminError(f"node {node_id!r} still registered after {timeout:g} s of draining "
                                 "(it stays marked draining)")
            await asyncio.sleep(DRAIN_POLL)
        # Without this a restarted node would read "draining" and leave again at once.
        if (await get_admin_state(client, cluster, node_id)).state == "draining":
            await set_admin_state(client, cluster, node_id, "cordoned", "drained; uncordon to take traffic")
        return time.monotonic() - started
    finally:
        await close_quietly(client)


async def check_health(endpoints: list[str], cluster: str, load_wait: float = LOAD_WAIT,
                       credentials: EtcdCredentials | None = None) -> Health:
    """Healthy: etcd answers, and at least one decode node is registered, active and answering Load
    (a decode node can prefill locally, so it is also a prefill path). Prefill nodes are a note."""
    try:
        nodes = await cluster_status(endpoints, cluster, load_wait, credentials)
    except AdminError as exc:
        return Health(False, [f"etcd unreachable: {exc}"])
    health = Health(True, nodes=nodes)
    decode = [n for n in nodes if n.info.role == "decode"]
    serving = [n for n in decode if n.admin.state == "active" and n.state == "serving"]
    if not decode:
        health.reasons.append(f"no decode node registered in cluster {cluster!r}")
    elif not serving:
        states = ", ".join(f"{n.info.node_id}: {n.admin.state}/{n.state}" for n in decode)
        health.reasons.append(f"no decode node is active and answering ({states})")
    prefill = [n for n in nodes if n.info.role == "prefill" and n.admin.state == "active" and n.state == "serving"]
    if not prefill:
        health.notes.append("no prefill node serving: decode nodes prefill locally")
    for n in nodes:
        if n.state == "unreachable":  # a dead process whose lease has not expired yet
            health.notes.append(f"{n.info.role} {n.info.node_id}: no Load report within {load_wait:g} s")
    health.healthy = not health.reasons
    return health


# ---------------------------------------------------------------------------------------------- output

def _num(value: Any, fmt: str = "{}") -> str:
    return "-" if value is None else fmt.format(value)


def _uptime(seconds: float) -> str:
    seconds = int(max(0, seconds))
    days, rest = divmod(seconds, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{days}d{hours}h" if days else f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s"


def _memory(d: dict[str, Any]) -> str:
    used, total = d["device_memory_used_bytes"], d["device_memory_total_bytes"]
    return "-" if used is None or total is None else f"{used / 2**30:.1f}/{total / 2**30:.1f} GiB"


def _spec(d: dict[str, Any]) -> str:
    """Speculative decoding: "<method> <acceptance %> x<mean accepted length>", or "-"."""
    if not d.get("spec_method"):
        return "-"
    rate, length = d["spec_acceptance_rate"], d["spec_mean_accepted_length"]
    return f"{d['spec_method']} " + ("no drafts yet" if rate is None else f"{rate:.0%} x{length:.2f}")


STATE_STYLES = {"serving": "green", "cordoned": "yellow", "draining": "magenta", "unreachable": "red"}


def status_table(nodes: list[NodeStatus], cluster: str):
    """A rich Table of `nodes` (what `pdcluster status` prints)."""
    from rich.table import Table

    table = Table(title=f"pdcluster {cluster!r}: {len(nodes)} node(s)", title_justify="left")
    numbers = {"run", "wait", "KV used/free", "tok/s", "prefill tok/s", "util", "mem used/total", "xfer GB/s",
               "experts max/mean", "spec decode", "uptime"}
    now = time.time()
    rows = [n.to_dict(now) for n in nodes]
    speculating = any(d.get("spec_method") for d in rows)   # the column only where a node speculates
    for name in ("role", "node", "host", "state", "model", "run", "wait", "KV used/free", "tok/s", "prefill tok/s",
                 "device", "util", "mem used/total", "xfer GB/s", "experts max/mean", "spec decode", "uptime",
                 "version"):
        if name != "spec decode" or speculating:
            table.add_column(name, justify="right" if name in numbers else "left", no_wrap=True)
    for n, d in zip(nodes, rows, strict=True):
        state = n.state if n.admin.state == "active" or n.admin.state == n.state else f"{n.state} ({n.admin.state})"
        kv = "-" if d["kv_blocks_used"] is None else f"{d['kv_blocks_used']}/{d['kv_blocks_free']}"
        if d["streams"] is not None:   # a router has no KV: its streams and errors in that column
            kv = f"{d['streams']} streams, {d['errors']} err"
        table.add_row(d["role"], d["node_id"], d["host"], f"[{STATE_STYLES.get(n.state, 'white')}]{state}[/]",
                      os.path.basename(d["model"].rstrip("/")) or "-", _num(d["running"]), _num(d["waiting"]), kv,
                      _num(d["tokens_per_s"], "{:.1f}"), _num(d["prefill_tokens_per_s"], "{:.0f}"),
                      d["device_kind"] or "-",
                      _num(d["device_utilization_pct"], "{:.0f}%"), _memory(d),
                      _num(d["transfer_gbps"], "{:.2f}"), _num(d["expert_imbalance"], "{:.2f}"),
                      *([_spec(d)] if speculating else []), _uptime(d["uptime_s"]), d["version"])
    return table


def nodes_table(nodes: list[NodeStatus], cluster: str):
    """Membership only (no Load): what `pdcluster nodes` prints."""
    from rich.table import Table

    table = Table(title=f"pdcluster {cluster!r}: {len(nodes)} registered node(s)", title_justify="left")
    for name in ("role", "node", "admin", "host", "control", "kv", "metrics", "version"):
        table.add_column(name, no_wrap=True)
    for n in nodes:
        i = n.info
        kv = f"{i.kv_addr} ({','.join(i.kv_backends)})" if i.kv_addr else "-"
        table.add_row(i.role, i.node_id, n.admin.state, i.host, i.control_addr or "-", kv, i.metrics_addr or "-",
                      i.version)
    return table
