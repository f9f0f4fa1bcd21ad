"""The records pdcluster keeps in etcd, and where (all values are JSON: `etcdctl get --prefix /pdcluster/`).

    /pdcluster/<cluster>/nodes/<role>/<node_id>  -> NodeInfo     leased: vanishes ~TTL after the node stops refreshing
    /pdcluster/<cluster>/admin/<node_id>         -> AdminState   not leased: survives node and etcd restarts
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import time
from dataclasses import dataclass, field

ROLES = ("prefill", "decode", "router")
ADMIN_STATES = ("active", "cordoned", "draining")

try:
    PDCLUSTER_VERSION = importlib.metadata.version("pdcluster")
except importlib.metadata.PackageNotFoundError:
    PDCLUSTER_VERSION = "0+unknown"


def cluster_prefix(cluster: str) -> str:
    return f"/pdcluster/{cluster}/"


def nodes_prefix(cluster: str) -> str:
    return f"/pdcluster/{cluster}/nodes/"


def node_key(cluster: str, role: str, node_id: str) -> str:
    return f"/pdcluster/{cluster}/nodes/{role}/{node_id}"


def admin_key(cluster: str, node_id: str) -> str:
    return f"/pdcluster/{cluster}/admin/{node_id}"


@dataclass
class Capacity:
    num_blocks: int = 0
    block_size: int = 0
    max_num_seqs: int = 0
    max_model_len: int = 0  # longest sequence (prompt + output) the node runs; 0 = not said (older node)
    tensor_parallel_size: int = 0  # devices its engine spans (KV regroups between CPU pools of any); 0 = not said
    kv_rank_slices: int = 0  # its KV pool is sliced per rank over this many ranks (moved rank to rank); 0 = whole


@dataclass
class NodeInfo:
    """What a node tells the cluster about itself. Addresses are complete (zmq: tcp://host:port)."""

    node_id: str
    role: str  # prefill | decode | router
    model: str = ""  # the served model name requests carry (routers route on it)
    host: str = ""
    control_addr: str = ""  # zmq ROUTER: Generate / Prefill / Abort / Ping
    load_addr: str = ""  # zmq PUB: Load reports at ~2 Hz
    kv_addr: str = ""  # KV transfer listener
    kv_backends: list[str] = field(default_factory=list)  # e.g. ["shm", "tcp"]
    kv_rank_addrs: list[str] = field(default_factory=list)  # a pool sliced per rank: ranks 1..'s KV listeners
    metrics_addr: str = ""  # http://host:port/metrics
    version: str = PDCLUSTER_VERSION
    capacity: Capacity = field(default_factory=Capacity)
    speculative: str = ""  # nodes: the engine's speculative_config, canonical JSON ("": none)
    prefix_hash_seed: int = 0  # nodes: where their block hash chains start (control/block_hash.py `hash_seed`)
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
            if f.type == "int" and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
                raise ValueError(f"node record: {f.name} must be a non-negative integer")
        if not self.node_id:
            raise ValueError("node record: node_id is empty")
        for name in ("kv_backends", "kv_rank_addrs"):
            value = getattr(self, name)
            if not isinstance(value, list) or not all(isinstance(b, str) for b in value):
                raise ValueError(f"node record: {name} must be a list of strings")
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
    migrate: bool = False  # draining: move running requests to other decode nodes with their KV, not finish them

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
                   since=float(body.get("since", 0.0) or 0.0), migrate=body.get("migrate") is True)


def parse_node(cluster: str, key: str, value: bytes) -> NodeInfo:
    """The record stored at `key`; ValueError when it is bad or names another node than its key."""
    role, _, node_id = key[len(nodes_prefix(cluster)):].partition("/")
    info = NodeInfo.from_json(value)
    if (info.role, info.node_id) != (role, node_id):
        raise ValueError(f"record says {info.role}/{info.node_id} but its key says {role}/{node_id}")
    return info
