"""Router knobs, declared once: `RouterSettings` is what the app reads; `RouterConfig` is the same knobs plus
the common ones (`pdcluster.control.config.CommonConfig`): what `pdcluster router` loads from the config
file, `PDCLUSTER_<KEY>` env variables and its flags (all derived from these fields)."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from pdcluster.control.config import CommonConfig, check_port, knob

ROUTING_POLICIES = ("round_robin", "least_loaded", "prefix_aware")  # = router.policies.POLICIES (tested)


def default_router_id() -> str:
    return f"router-{socket.gethostname()}-{os.getpid()}"


@dataclass
class RouterSettings:
    model: str = knob("", "model dir: tokenizer, chat template, config.json (no weights are loaded)")
    served_model_name: str = knob("", "the \"model\" clients send; default: the model dir's name")
    max_model_len: int = knob(0, "context limit checked on requests; 0 = config.json's max_position_embeddings")
    host: str = knob("127.0.0.1", "HTTP bind address")
    port: int = knob(8000, "HTTP port of the OpenAI API")
    node_id: str = knob("", "router id sent as Generate.router; default router-<hostname>-<pid>")
    api_key: str = knob("", "when set, requests need \"Authorization: Bearer <api_key>\"")
    routing_policy: str = knob("prefix_aware", "how a decode (and prefill) node is picked (docs/router.md)",
                               choices=ROUTING_POLICIES)
    disagg_min_tokens: int = knob(64, "shorter prompts with no cached prefix are prefilled on the decode node")
    request_timeout: float = knob(600.0, "seconds from arrival to the last token")
    stall_timeout: float = knob(20.0, "seconds without a message from the decode node before migrating")
    max_retries: int = knob(3, "other decode nodes tried after Rejects")
    max_migrations: int = knob(2, "mid-stream moves of a request to another decode node")
    max_n: int = knob(16, "largest n (choices per request) accepted")
    max_in_flight: int = knob(4096, "concurrent requests beyond this get 429")
    retry_after: float = knob(1.0, "Retry-After seconds sent when nothing can take a request")
    load_stale_s: float = knob(3.0, "Load reports older than this many seconds rank a node last")

    @classmethod
    def from_config(cls, config: Any, **overrides: Any) -> "RouterSettings":
        """Settings from any object with some of these attribute names (tests pass small stand-ins)."""
        values = {f.name: getattr(config, f.name) for f in fields(cls) if hasattr(config, f.name)}
        values.update(overrides)
        settings = cls(**values)
        if not settings.node_id:
            settings.node_id = default_router_id()
        return settings

    def validate(self) -> None:
        check_port("port", self.port)
        for name in ("max_model_len", "disagg_min_tokens", "max_retries", "max_migrations"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: must be >= 0, got {getattr(self, name)}")
        for name in ("max_n", "max_in_flight"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        for name in ("request_timeout", "stall_timeout", "load_stale_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be > 0 seconds, got {getattr(self, name)}")
        if self.retry_after < 0:
            raise ValueError(f"retry_after: must be >= 0 seconds, got {self.retry_after}")


@dataclass
class RouterConfig(RouterSettings, CommonConfig):
    """The router's config: the common knobs plus every `RouterSettings` knob (those win on shared names)."""

    def finish(self, kind: str) -> None:
        CommonConfig.finish(self, kind)
        if not self.served_model_name and self.model:
            self.served_model_name = Path(self.model).name

    def validate(self) -> None:
        CommonConfig.validate(self)
        RouterSettings.validate(self)
