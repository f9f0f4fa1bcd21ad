"""Where a sender must write one request's KV: a plain msgpack-able map issued by the receiver."""

from __future__ import annotations

import socket
from dataclasses import asdict, dataclass
from typing import Any


def host_id() -> str:
    """Same value ⇔ same kernel (so /dev/shm is shareable, modulo containers: attach is still tried)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


@dataclass
class Destination:
    request_id: str
    address: str  # "host:port" of the receiver's control/data listener
    block_ids: list[int]  # reserved destination blocks, in the order of the request's blocks
    token: str  # auth token: writes without it are rejected
    deadline: float  # unix seconds; writes after it are rejected and the blocks returned
    backends: list[str]  # what the receiver accepts, e.g. ["shm", "tcp", "gloo"]
    layout: dict[str, Any]  # KVLayout.to_dict() of the receiver pool
    host_id: str = ""
    shm_name: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Destination":
        if not isinstance(d, dict):
            raise ValueError("destination: expected a map")
        checks = {
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
        unknown = set(d) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"destination: unknown fields {sorted(unknown)}")
        return cls(**d)

    @property
    def host_port(self) -> tuple[str, int]:
        host, _, port = self.address.rpartition(":")
        return host, int(port)
