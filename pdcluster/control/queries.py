"""One-shot reads and writes of the cluster records (the admin CLI, tests): nodes and admin states."""

from __future__ import annotations

import logging
import time

import aetcd

from pdcluster.control.etcd_client import DEFAULT_TIMEOUT, etcd_call
from pdcluster.control.records import ADMIN_STATES, AdminState, NodeInfo, admin_key, nodes_prefix, parse_node

log = logging.getLogger(__name__)


async def set_admin_state(client: aetcd.Client, cluster: str, node_id: str, state: str,
                          reason: str = "", timeout: float = DEFAULT_TIMEOUT, migrate: bool = False) -> AdminState:
    """Write the admin state of `node_id` (not leased: it outlives the node's registration)."""
    if state not in ADMIN_STATES:
        raise ValueError(f"admin state {state!r} is not one of {', '.join(ADMIN_STATES)}")
    admin = AdminState(state=state, reason=reason, since=time.time(), migrate=migrate and state == "draining")
    await etcd_call(client.put(admin_key(cluster, node_id).encode(), admin.to_json().encode()), timeout)
    return admin


async def get_admin_state(client: aetcd.Client, cluster: str, node_id: str,
                          timeout: float = DEFAULT_TIMEOUT) -> AdminState:
    """The admin state of `node_id`; `active` when none was ever set."""
    kv = await etcd_call(client.get(admin_key(cluster, node_id).encode()), timeout)
    return AdminState.from_json(kv.value) if kv is not None else AdminState()


async def list_admin_states(client: aetcd.Client, cluster: str,
                            timeout: float = DEFAULT_TIMEOUT) -> dict[str, AdminState]:
    prefix = f"/pdcluster/{cluster}/admin/"
    result = await etcd_call(client.get_prefix(prefix.encode()), timeout)
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
    result = await etcd_call(client.get_prefix(prefix.encode()), timeout)
    nodes = []
    for kv in result:
        try:
            nodes.append(parse_node(cluster, kv.key.decode(), kv.value))
        except ValueError as exc:
            log.warning("ignoring bad node record %s: %s", kv.key.decode(errors="replace"), exc)
    return sorted(nodes, key=lambda n: (n.role, n.node_id))
