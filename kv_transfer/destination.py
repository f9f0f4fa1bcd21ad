"""Where a sender must write one request's KV: a plain msgpack-able map issued by the receiver."""

from __future__ import annotations

import os
import socket
import time
from dataclasses import asdict, dataclass, field
from typing import Any


def host_id() -> str:
    """Same value ⇔ same kernel boot and the same /dev/shm mount, so a shared-memory pool is shareable.
    The mount's device number tells two private tmpfs apart (containers, network-namespace "hosts"); a
    sender still checks that the pool segment is really there (ShmChannel.auto_rank) before choosing shm."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    try:
        shm = os.stat("/dev/shm").st_dev
    except OSError:
        shm = -1
    return f"{socket.gethostname()}/{boot}/shm:{shm}"


@dataclass
class Destination:
    request_id: str
    address: str  # "host:port" of the receiver's control/data listener
    block_ids: list[int]  # reserved destination blocks, in the order of the request's blocks
    token: str  # auth token: writes without it are rejected
    deadline: float  # the receiver's clock (unix s), for its own use: no other host compares it with theirs
    backends: list[str]  # what the receiver accepts, e.g. ["shm", "tcp", "gloo"]
    layout: dict[str, Any]  # KVLayout.to_dict() of the receiver pool
    host_id: str = ""
    shm_name: str | None = None
    device_uuid: str = ""  # the receiver pool's physical device (cuda_ipc needs the sender on the same GPU)
    # Seconds left when handed on (0: unknown). A sender's deadline is its own monotonic clock at receipt plus
    # this (`expires`); the receiver enforces its deadline anyway, this only saves writing in vain.
    timeout_s: float = 0.0
    # A receiving engine whose KV pool is sliced per tensor-parallel rank: the destinations of its ranks 1, 2, ...
    # (the same blocks in each rank's slice; this one is rank 0's). Empty: the pool holds all of the KV.
    ranks: list["Destination"] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.expires = time.monotonic() + self.timeout_s if self.timeout_s > 0 else float("inf")

    def renew(self, timeout_s: float) -> None:
        """The receiver keeps the blocks `timeout_s` more (its owner heard that the sender still works on them)."""
        self.timeout_s = timeout_s
        self.expires = time.monotonic() + timeout_s if timeout_s > 0 else float("inf")
        for rank in self.ranks:
            rank.renew(timeout_s)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Destination":
        if not isinstance(d, dict):
            raise ValueError("destination: expected a map")
        checks: dict[str, type | tuple[type, ...]] = {
            "request_id": str, "address": str, "token": str, "deadline": (int, float),
            "backends": list, "layout": dict, "block_ids": list,
        }  # fmt: skip
        for name, kind in checks.items():
            if not isinstance(d.get(name), kind) or isinstance(d.get(name), bool):
                raise ValueError(f"destination.{name}: missing or of the wrong type")
        if not all(isinstance(b, int) and not isinstance(b, bool) and b >= 0 for b in d["block_ids"]):
            raise ValueError("destination.block_ids: expected non-negative ints")
        if ":" not in d["address"]:
            raise ValueError(f"destination.address: expected host:port, got {d['address']!r}")
        timeout = d.get("timeout_s", 0.0)
        if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or timeout != timeout:
            raise ValueError("destination.timeout_s: expected a number")
        unknown = set(d) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"destination: unknown fields {sorted(unknown)}")
        ranks = d.get("ranks", [])
        if not isinstance(ranks, list) or any(not isinstance(r, dict) or r.get("ranks") for r in ranks):
            raise ValueError("destination.ranks: expected a list of destinations (of ranks, none with ranks)")
        return cls(**{**d, "ranks": [cls.from_dict(r) for r in ranks]})

    @property
    def host_port(self) -> tuple[str, int]:
        host, _, port = self.address.rpartition(":")
        return host, int(port)
