"""The router's view of the cluster: membership from a node source + the nodes' Load reports.

The source is `pdcluster.control.cluster_view.ClusterView` in production and `StaticNodeSource` in tests;
both only need `nodes_by_role(role)` and `admin_state(node_id)`. Everything here is soft state rebuilt
from the source and the reports, so any number of routers can serve one cluster at once.
"""

from __future__ import annotations

import asyncio
import logging
import posixpath
import time
from dataclasses import dataclass, field
from typing import Callable, Collection, Protocol

from pdcluster.control.keys import ClusterKeys
from pdcluster.control.protocol import Load
from pdcluster.control.records import NodeInfo
from pdcluster.control.transport import LoadSubscriber
from pdcluster.router.prefix_index import PrefixIndex

log = logging.getLogger(__name__)

ACTIVE = "active"
# A node missing from a source's full reload (`resynced_at`, after an etcd outage) while its Load reports still
# arrive (within LIVE_REPORT_S; nodes report every 0.5 s) lost its lease while etcd was away and is registering
# again: it stays routable for up to RESYNC_GRACE_S instead of dropping out (and failing requests) for the
# second or two that takes.
RESYNC_GRACE_S = 10.0
LIVE_REPORT_S = 2.0


class NodeSource(Protocol):
    """What the router needs from membership; `pdcluster.control.cluster_view.ClusterView` is one. A source
    may also have `resynced_at` (monotonic time of its last full reload; see RESYNC_GRACE_S)."""

    def nodes_by_role(self, role: str) -> list[NodeInfo]: ...

    def admin_state(self, node_id: str) -> str:
        """"active", "cordoned" or "draining"."""
        ...


class StaticNodeSource:
    """A fixed, editable node list (tests, or a router pointed at nodes without etcd)."""

    def __init__(self, nodes: list[NodeInfo] | None = None) -> None:
        self._nodes: dict[str, NodeInfo] = {n.node_id: n for n in nodes or []}
        self._admin: dict[str, str] = {}

    # Edits build new dicts and swap them in, so a router thread may read while a test thread edits.
    def add(self, node: NodeInfo) -> None:
        self._nodes = {**self._nodes, node.node_id: node}

    def remove(self, node_id: str) -> None:
        self._nodes = {k: v for k, v in self._nodes.items() if k != node_id}

    def set_nodes(self, nodes: list[NodeInfo]) -> None:
        self._nodes = {n.node_id: n for n in nodes}

    def set_admin_state(self, node_id: str, state: str) -> None:
        self._admin = {**self._admin, node_id: state}

    def nodes_by_role(self, role: str) -> list[NodeInfo]:
        return [n for n in list(self._nodes.values()) if n.role == role]

    def admin_state(self, node_id: str) -> str:
        return self._admin.get(node_id, ACTIVE)


@dataclass
class NodeState:
    info: NodeInfo
    admin: str = ACTIVE
    load: Load | None = None
    load_time: float = 0.0  # time.monotonic() of the last report
    index: PrefixIndex = field(default_factory=PrefixIndex)   # its KV blocks by tier (Load.kv_events)
    # Work this router sent since the node's last report, so a burst between two reports spreads out.
    assigned_since_report: int = 0
    prefill_tokens_since_report: int = 0
    reports: int = 0   # Load reports received

    @property
    def id(self) -> str:
        return self.info.node_id

    @property
    def block_size(self) -> int:
        """Its KV block size: from its load reports, before the first one from its registration (16 for a node
        that registered none)."""
        if self.load is not None:
            return self.load.block_size
        return self.info.capacity.block_size or 16

    def serves(self, model: str) -> bool:
        """Whether the node serves the model named `model`. Nodes before served names registered their model
        dir's path; its last part is their served name (so a rolling upgrade keeps routing to them)."""
        name = self.info.model
        return name == model or ("/" in name and posixpath.basename(name.rstrip("/")) == model)

    def holds(self, num_tokens: int) -> bool:
        """Whether a sequence of `num_tokens` fits the node's max_model_len (0: the node did not say)."""
        limit = self.info.capacity.max_model_len
        return not limit or num_tokens <= limit

    def accepting(self) -> bool:
        if self.admin not in ("", ACTIVE):
            return False
        return self.load is None or self.load.state == "serving"

    def update(self, load: Load) -> None:
        self.load = load
        self.load_time = time.monotonic()
        self.index.apply(load.kv_seq, load.kv_events, load.kv_snapshot)
        self.assigned_since_report = 0
        self.prefill_tokens_since_report = 0
        self.reports += 1


class RouterCluster:
    def __init__(self, source: NodeSource, sync_interval: float = 0.5, load_stale_s: float = 3.0,
                 keys: ClusterKeys | None = None) -> None:
        self.source = source
        self.keys = keys   # the cluster secret's: CURVE on the Load subscription and on the decode nodes' dealers
        self.sync_interval = sync_interval
        self.load_stale_s = load_stale_s
        self._nodes: dict[str, NodeState] = {}
        self._subscriber: LoadSubscriber | None = None
        self._tasks: list[asyncio.Task] = []
        self._resubscribed: dict[str, float] = {}  # node id -> monotonic time its Load subscription was renewed
        self.on_removed: list[Callable[[str], None]] = []

    async def start(self) -> None:
        self._subscriber = LoadSubscriber(keys=self.keys)
        self.sync()
        self._tasks = [asyncio.create_task(self._sync_loop()), asyncio.create_task(self._load_loop())]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._subscriber is not None:
            self._subscriber.close()

    def load_dropped_frames(self):
        """The Load subscriber's `DroppedFrames` (None before start)."""
        return self._subscriber.dropped if self._subscriber is not None else None

    def sync(self) -> None:
        """Re-read the source: add new nodes, drop gone ones, refresh admin states."""
        seen: set[str] = set()
        for role in ("decode", "prefill"):
            for info in self.source.nodes_by_role(role):
                seen.add(info.node_id)
                state = old = self._nodes.get(info.node_id)
                if state is None or state.info != info:
                    state = NodeState(info=info, load=state.load if state else None,
                                      load_time=state.load_time if state else 0.0,
                                      index=state.index if state else PrefixIndex())
                    self._nodes[info.node_id] = state
                    if self._subscriber is not None:
                        if old is not None and old.info.load_addr and old.info.load_addr != info.load_addr:
                            self._subscriber.disconnect(old.info.load_addr)   # else it stays connected forever
                        if info.load_addr:
                            self._subscriber.connect(info.load_addr)
                state.admin = self.source.admin_state(info.node_id) or ACTIVE
        now, resynced = time.monotonic(), getattr(self.source, "resynced_at", 0.0)
        for node_id in [i for i in self._nodes if i not in seen]:
            if now - resynced < RESYNC_GRACE_S and now - self._nodes[node_id].load_time < LIVE_REPORT_S:
                continue
            gone = self._nodes.pop(node_id)
            self._resubscribed.pop(node_id, None)
            if self._subscriber is not None and gone.info.load_addr:
                self._subscriber.disconnect(gone.info.load_addr)
            log.info("node %s left the cluster view", node_id)
            for callback in self.on_removed:
                callback(node_id)

    async def _sync_loop(self) -> None:
        while True:
            await asyncio.sleep(self.sync_interval)
            try:
                self.sync()
                self.resubscribe_stale()
            except Exception:  # a flaky source must not stop routing on the last known view
                log.exception("cluster sync failed")

    def resubscribe_stale(self) -> None:
        """A fresh Load connection, once per `load_stale_s`, to each node whose reports stopped. After a silent
        partition heals, the old TCP connection sits in retransmission backoff about as long again as the cut
        lasted (no heartbeat on PUB/SUB), so the node would stay ranked last that long."""
        now = time.monotonic()
        for state in self._nodes.values():
            addr = state.info.load_addr
            if (self._subscriber is None or not addr or state.load is None or now - state.load_time <= self.load_stale_s
                    or now - self._resubscribed.get(state.id, 0.0) < self.load_stale_s):
                continue
            self._resubscribed[state.id] = now
            self._subscriber.disconnect(addr)
            self._subscriber.connect(addr)

    async def _load_loop(self) -> None:
        assert self._subscriber is not None
        while True:
            load = await self._subscriber.recv()   # (None only after a timeout, and this one waits forever)
            if load is not None and (state := self._nodes.get(load.node_id)) is not None:
                state.update(load)

    def nodes(self, role: str) -> list[NodeState]:
        return [s for s in self._nodes.values() if s.info.role == role]

    def candidates(self, role: str, exclude: Collection[str] = frozenset(), model: str | None = None,
                   num_tokens: int = 0) -> list[NodeState]:
        """Nodes of `role` that take new work (of `model`, able to hold `num_tokens` when they say how many
        they can); ones whose reports went stale (maybe dead) only as a last resort."""
        now = time.monotonic()
        nodes = [s for s in self.nodes(role) if s.accepting() and s.id not in exclude
                 and (model is None or s.serves(model)) and s.holds(num_tokens)]
        fresh = [s for s in nodes if s.load is None or now - s.load_time <= self.load_stale_s]
        return fresh or nodes

    def holders(self, model: str | None = None) -> list[NodeState]:
        """Nodes (any role, cordoned and draining ones too) of `model` whose Load reports are fresh: the ones a
        decode node may fetch a prefix from."""
        now = time.monotonic()
        return [s for s in self._nodes.values() if (model is None or s.serves(model)) and s.load is not None
                and now - s.load_time <= self.load_stale_s]

    def get(self, node_id: str) -> NodeState | None:
        return self._nodes.get(node_id)

    def is_alive(self, node_id: str) -> bool:
        return node_id in self._nodes
