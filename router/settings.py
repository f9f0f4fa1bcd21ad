"""Router knobs, declared once: `RouterSettings` is what the app reads; `RouterConfig` is the same knobs plus
the common ones (`pdcluster.control.config.CommonConfig`): what `pdcluster router` loads from the config
file, `PDCLUSTER_<KEY>` env variables and its flags (all derived from these fields)."""

from __future__ import annotations

import math
import os
import socket
from dataclasses import dataclass, fields
from functools import cached_property
from pathlib import Path
from typing import Any

from pdcluster.control.config import CommonConfig, check_port, knob, parse_bytes
from pdcluster.control.sampling_params import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS
from pdcluster.router.reasoning import REASONING_PARSERS
from pdcluster.router.tool_parsers import TOOL_CALL_PARSERS

ROUTING_POLICIES = ("round_robin", "least_loaded", "prefix_aware")  # = router.policies.POLICIES (tested)


def default_router_id() -> str:
    return f"router-{socket.gethostname()}-{os.getpid()}"


@dataclass
class RouterSettings:
    model: str = knob("", "model dir: tokenizer, chat template, config.json (no weights are loaded)")
    served_model_name: str = knob("", "the \"model\" clients send; default: the model dir's name")
    models: list[str] = knob(help="more served models, each a model dir or name=dir (comma-separated)",
                             factory=list)
    max_model_len: int = knob(0, "context limit checked on requests; 0 = each model's max_position_embeddings")
    host: str = knob("127.0.0.1", "HTTP bind address")
    port: int = knob(8000, "HTTP port of the OpenAI API")
    node_id: str = knob("", "router id sent as Generate.router; default router-<hostname>-<pid>")
    api_key: str = knob("", "when set, requests need \"Authorization: Bearer <api_key>\"")
    api_key_file: str = knob("", "file of accepted API keys, one per line ('#' comments), besides api_key")
    metrics_require_key: bool = knob(True, "with API keys set, GET /metrics needs one too (false: open to all)")
    routing_policy: str = knob("prefix_aware", "how a decode (and prefill) node is picked (docs/router.md)",
                               choices=ROUTING_POLICIES)
    disagg_min_tokens: int = knob(64, "shorter prompts with no cached prefix are prefilled on the decode node")
    rebalance_threshold: int = knob(0, "decode nodes of a model whose running + waiting requests differ by more "
                                       "than this: the router moves a long stream from the busiest to another, with "
                                       "its KV (0: off)")
    migration_precopy: bool = knob(True, "a stream moving to another decode node (rebalancing, a drain with "
                                         "migration, a node short of KV blocks) has its KV copied there while it "
                                         "decodes on, and is handed over at a block boundary (off: handed over "
                                         "first, its whole KV copied in the pause)")
    prefix_fetch: bool = knob(True, "prefix_aware: a decode node fetches a prompt's prefix from the node whose pool "
                                    "holds more of it (FetchKV) instead of computing it")
    request_timeout: float = knob(3600.0, "seconds from arrival to the last token: a last-resort bound (a node that "
                                           "stops answering is found by stall_timeout)")
    queue_timeout: float = knob(5.0, "seconds a request waits for a decode node of its model to appear (a router "
                                     "started before its nodes) before it gets 503; 0 = at once")
    stall_timeout: float = knob(20.0, "seconds without a message from the decode node before migrating")
    max_retries: int = knob(3, "other decode nodes tried after Rejects")
    max_migrations: int = knob(2, "mid-stream moves of a request to another decode node")
    max_n: int = knob(16, "largest n (choices per request) accepted")
    max_in_flight: int = knob(4096, "concurrent requests beyond this get 429")
    retry_after: float = knob(1.0, "Retry-After seconds sent when nothing can take a request")
    load_stale_s: float = knob(3.0, "Load reports older than this many seconds rank a node last")
    max_body_bytes: int = knob(16 << 20, "larger request bodies get 413 (e.g. 16MiB)", parse=parse_bytes)
    max_stop_strings: int = knob(16, f"most stop strings per request (engines refuse > {MAX_STOP_STRINGS})")
    max_stop_chars: int = knob(256, f"longest stop string (engines refuse > {MAX_STOP_STRING_CHARS})")
    max_stop_token_ids: int = knob(64, f"most stop_token_ids per request (engines refuse > {MAX_STOP_TOKEN_IDS})")
    tool_call_parser: list[str] = knob(help="how tool calls are read from each model's output (tool_choice "
                                            "auto): hermes, llama3_json or mistral for every model, or "
                                            "name=parser per served model (comma-separated); unset: auto is "
                                            "refused", factory=list)
    reasoning_parser: list[str] = knob(help="how each model's <think> part becomes reasoning_content: "
                                            "deepseek_r1 or qwen3 for every model, or name=parser per served "
                                            "model (comma-separated); unset: no split", factory=list)
    tokenizer_threads: int = knob(4, "threads that tokenize and render chat templates off the event loop")
    keep_alive_timeout: float = knob(75.0, "seconds an idle client connection is kept open; longer than clients' "
                                           "and load balancers' idle expiry (httpx/openai: 5 s), or a reused "
                                           "connection can meet the router's close: the client reads a reset")
    workers: int = knob(1, "router processes sharing the port (SO_REUSEPORT), each with its own etcd view, "
                           "connections and limits (max_in_flight is per process)")

    @classmethod
    def from_config(cls, config: Any, **overrides: Any) -> "RouterSettings":
        """Settings from any object with some of these attribute names (tests pass small stand-ins)."""
        values = {f.name: getattr(config, f.name) for f in fields(cls) if hasattr(config, f.name)}
        values.update(overrides)
        settings = cls(**values)
        if not settings.node_id:
            settings.node_id = default_router_id()
        return settings

    def served_models(self) -> list[tuple[str, str]]:
        """(served name, model dir) of every model: `model` (named `served_model_name`), then `models`."""
        out = [(self.served_model_name or _dir_name(self.model), self.model)] if self.model else []
        for entry in self.models:
            name, sep, path = entry.partition("=")
            out.append((name, path) if sep and name and "/" not in name else (_dir_name(entry), entry))
        return out

    def model_parser(self, knob: str, model: str) -> str:
        """`tool_call_parser` / `reasoning_parser` of the served `model` ("" = none): its name=parser entry,
        else a bare entry (every model's)."""
        entries: list[str] = getattr(self, knob)
        named = dict(e.partition("=")[::2] for e in entries if "=" in e)
        bare = [e for e in entries if "=" not in e]
        return named.get(model, bare[0] if bare else "")

    @cached_property
    def accepted_keys(self) -> tuple[str, ...]:
        """`api_key` and the keys of `api_key_file` (read once; restart the router to apply a changed file).
        Empty: the API is open."""
        return tuple(([self.api_key] if self.api_key else []) +
                     (read_api_keys(self.api_key_file) if self.api_key_file else []))

    def validate(self) -> None:
        check_port("port", self.port)
        if self.api_key_file:
            try:
                if not read_api_keys(self.api_key_file):
                    raise ValueError(f"api_key_file: {self.api_key_file} holds no key (an open API is api_key_file "
                                     "unset, not an empty file)")
            except OSError as exc:
                raise ValueError(f"api_key_file: cannot read {self.api_key_file} ({exc.strerror})") from None
        names = [name for name, _ in self.served_models()]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"models: served names must be unique, got {', '.join(twice)} more than once")
        for name, cap in (("max_stop_strings", MAX_STOP_STRINGS), ("max_stop_chars", MAX_STOP_STRING_CHARS),
                          ("max_stop_token_ids", MAX_STOP_TOKEN_IDS)):
            if not 0 <= getattr(self, name) <= cap:
                raise ValueError(f"{name}: must be in [0, {cap}] (the engines' limit), got {getattr(self, name)}")
        for name, known in (("tool_call_parser", TOOL_CALL_PARSERS), ("reasoning_parser", REASONING_PARSERS)):
            for entry in getattr(self, name):
                parser = entry.partition("=")[2] if "=" in entry else entry
                if parser not in known:
                    raise ValueError(f"{name}: unknown parser {parser!r} in {entry!r} (one of {', '.join(known)})")
        for name in ("max_body_bytes", "tokenizer_threads", "workers"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        for name in ("max_model_len", "disagg_min_tokens", "max_retries", "max_migrations"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: must be >= 0, got {getattr(self, name)}")
        for name in ("max_n", "max_in_flight"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        for name in ("request_timeout", "stall_timeout", "load_stale_s", "keep_alive_timeout"):
            if not 0 < getattr(self, name) < math.inf:
                raise ValueError(f"{name}: must be > 0 seconds and finite, got {getattr(self, name)}")
        for name in ("retry_after", "queue_timeout"):
            if not 0 <= getattr(self, name) < math.inf:
                raise ValueError(f"{name}: must be >= 0 seconds and finite, got {getattr(self, name)}")


def read_api_keys(path: str) -> list[str]:
    """The keys of an API key file: one per line, surrounding blanks stripped; empty lines and '#' comments skipped."""
    with open(path, encoding="utf-8") as f:
        lines = (line.strip() for line in f)
        return [line for line in lines if line and not line.startswith("#")]


def _dir_name(path: str) -> str:
    return Path(path).name


@dataclass
class RouterConfig(RouterSettings, CommonConfig):
    """The router's config: the common knobs plus every `RouterSettings` knob (those win on shared names)."""

    def finish(self, kind: str) -> None:
        CommonConfig.finish(self, kind)
        if not self.served_model_name and self.model:
            self.served_model_name = _dir_name(self.model)

    def validate(self) -> None:
        CommonConfig.validate(self)
        RouterSettings.validate(self)
