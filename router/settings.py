"""Router knobs. `RouterSettings.from_config` takes `pdcluster.control.config.RouterConfig` (or any object
with some of these attribute names) so the CLI config and tests build the same thing."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, fields
from typing import Any


def default_router_id() -> str:
    return f"router-{socket.gethostname()}-{os.getpid()}"


@dataclass
class RouterSettings:
    model: str = ""                    # model dir: tokenizer, chat template, config.json
    served_model_name: str = ""        # the "model" clients send; default: the dir's name
    max_model_len: int = 0             # 0 = config.json's max_position_embeddings
    host: str = "127.0.0.1"
    port: int = 8000
    node_id: str = ""                  # router id sent as Generate.router; default router-<host>-<pid>
    api_key: str = ""                  # when set: "Authorization: Bearer <api_key>" required
    routing_policy: str = "prefix_aware"  # round_robin | least_loaded | prefix_aware
    disagg_min_tokens: int = 64        # shorter prompts with no cached prefix skip the prefill node
    request_timeout: float = 600.0     # seconds from arrival to the last token
    stall_timeout: float = 20.0        # no message from the decode node this long -> migrate
    max_retries: int = 3               # other decode nodes tried after Rejects
    max_migrations: int = 2            # mid-stream moves to another decode node
    max_n: int = 16
    max_in_flight: int = 4096          # more concurrent requests -> 429
    retry_after: float = 1.0           # Retry-After (s) when nothing can take a request
    load_stale_s: float = 3.0          # Load reports older than this rank a node last

    @classmethod
    def from_config(cls, config: Any, **overrides: Any) -> "RouterSettings":
        values = {f.name: getattr(config, f.name) for f in fields(cls) if hasattr(config, f.name)}
        values.update(overrides)
        settings = cls(**values)
        if not settings.node_id:
            settings.node_id = default_router_id()
        return settings
