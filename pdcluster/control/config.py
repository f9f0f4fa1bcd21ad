"""Node and router configuration.

Precedence, lowest to highest: dataclass defaults < config file (YAML or TOML) < environment
variables `PDCLUSTER_<UPPER_NAME>` < explicit overrides (CLI flags). `load_config` is the one entry.

A config file may hold keys for several kinds: top-level keys apply to every kind that has them,
and a section named after a kind (`router:`, `prefill:`, `decode:`) applies to that kind only.
A key that no kind knows is an error naming the key.
"""

from __future__ import annotations

import dataclasses
import os
import re
import socket
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

KINDS = ("router", "prefill", "decode")
ENV_PREFIX = "PDCLUSTER_"
DTYPES = ("auto", "float32", "float16", "bfloat16")
DEVICES = ("auto", "npu", "cuda", "cpu")
KV_BACKENDS = ("auto", "shm", "tcp", "gloo", "nccl", "hccl")
LOG_FORMATS = ("text", "json")
ROUTING_POLICIES = ("round_robin", "least_loaded", "prefix_aware")  # = router.policies.POLICIES
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


@dataclass
class CommonConfig:
    """Knobs every pdcluster process has."""

    cluster: str = "default"  # etcd key namespace: /pdcluster/<cluster>/...
    etcd: list[str] = field(default_factory=lambda: ["127.0.0.1:2379"])  # host:port endpoints
    node_id: str = ""  # default: <kind>-<hostname>-<pid>
    host: str = "127.0.0.1"  # address this process binds and advertises to peers
    metrics_port: int = 0  # Prometheus /metrics; 0 = pick a free port
    log_format: str = "text"  # text | json
    log_level: str = "INFO"
    lease_ttl: int = 10  # seconds an etcd registration outlives its last refresh (nodes)

    def validate(self) -> None:
        if self.lease_ttl < 1:
            raise ValueError(f"lease_ttl: must be >= 1 second, got {self.lease_ttl}")
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", self.cluster):
            raise ValueError(f"cluster: {self.cluster!r} must be letters, digits, '_', '.' or '-'")
        if not self.etcd:
            raise ValueError("etcd: at least one host:port endpoint is required")
        for endpoint in self.etcd:
            parse_endpoint(endpoint)
        if not re.fullmatch(r"[A-Za-z0-9_.:-]+", self.node_id):
            raise ValueError(f"node_id: {self.node_id!r} must be letters, digits, '_', '.', ':' or '-'")
        _check_port("metrics_port", self.metrics_port)
        _check_choice("log_format", self.log_format, LOG_FORMATS)
        self.log_level = self.log_level.upper()
        _check_choice("log_level", self.log_level, LOG_LEVELS)


@dataclass
class NodeConfig(CommonConfig):
    """A prefill or decode node; the engine knobs follow vLLM / vLLM-Ascend names and meanings."""

    role: str = "decode"  # prefill | decode (set by load_config from the kind)
    model: str = ""  # HF checkpoint directory
    dtype: str = "auto"  # auto (checkpoint dtype; fp32 on CPU) | float32 | float16 | bfloat16
    device: str = "auto"  # auto (npu > cuda > cpu) | npu | cuda | cpu
    block_size: int = 16  # tokens per KV block (vLLM-Ascend commonly uses 128)
    max_num_seqs: int = 256  # max concurrently running sequences
    max_num_batched_tokens: int = 2048  # token budget of one engine step
    max_model_len: int = 0  # 0 = the model's max_position_embeddings
    gpu_memory_utilization: float = 0.9  # fraction of device memory for weights + activations + KV
    kv_cache_memory: int = 0  # KV pool size in bytes ("4GiB" accepted); 0 = derive from utilization
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    tensor_parallel_size: int = 1
    kv_backend: str = "auto"  # auto | shm | tcp | gloo | nccl | hccl
    control_port: int = 0  # zmq ROUTER for Generate/Prefill/Abort; 0 = free port
    load_port: int = 0  # zmq PUB for Load reports; 0 = free port
    kv_port: int = 0  # KV transfer listener; 0 = free port

    def validate(self) -> None:
        super().validate()
        _check_choice("role", self.role, ("prefill", "decode"))
        if not self.model:
            raise ValueError("model: a checkpoint directory is required")
        _check_choice("dtype", self.dtype, DTYPES)
        _check_choice("device", self.device, DEVICES)
        _check_choice("kv_backend", self.kv_backend, KV_BACKENDS)
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "tensor_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.tensor_parallel_size > 1:
            raise ValueError(f"tensor_parallel_size={self.tensor_parallel_size}: "
                             "tensor parallelism is not implemented yet; use 1 and scale out with more nodes")
        if self.max_model_len < 0:
            raise ValueError(f"max_model_len: must be >= 0, got {self.max_model_len}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization: must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.kv_cache_memory < 0:
            raise ValueError(f"kv_cache_memory: must be >= 0 bytes, got {self.kv_cache_memory}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) < max_model_len "
                             f"({self.max_model_len}) needs enable_chunked_prefill")
        for name in ("control_port", "load_port", "kv_port"):
            _check_port(name, getattr(self, name))


@dataclass
class RouterConfig(CommonConfig):
    """The OpenAI-compatible front door."""

    port: int = 8000  # HTTP port
    model: str = ""  # checkpoint dir for the tokenizer/chat template (no weights are loaded)
    served_model_name: str = ""  # name clients use in "model"; default: the model dir's name
    routing_policy: str = "prefix_aware"  # one of ROUTING_POLICIES (see docs/router.md)
    api_key: str = ""  # when set, requests need "Authorization: Bearer <api_key>"
    request_timeout: float = 600.0  # seconds from arrival to the last token
    disagg_min_tokens: int = 64  # shorter prompts with no cached prefix are prefilled on the decode node

    def validate(self) -> None:
        super().validate()
        _check_port("port", self.port)
        if self.disagg_min_tokens < 0:
            raise ValueError(f"disagg_min_tokens: must be >= 0, got {self.disagg_min_tokens}")
        _check_choice("routing_policy", self.routing_policy, ROUTING_POLICIES)
        if self.request_timeout <= 0:
            raise ValueError(f"request_timeout: must be > 0 seconds, got {self.request_timeout}")


Config = NodeConfig | RouterConfig
CONFIG_CLASSES: dict[str, type[NodeConfig] | type[RouterConfig]] = {
    "router": RouterConfig, "prefill": NodeConfig, "decode": NodeConfig,
}


def load_config(kind: str, file: str | os.PathLike | None = None,
                overrides: dict[str, Any] | None = None,
                env: typing.Mapping[str, str] | None = None) -> Config:
    """Build the validated config of one process kind ("router" | "prefill" | "decode").

    `overrides` are CLI values; keys whose value is None are ignored (an option not given).
    `env` defaults to os.environ. Raises ValueError naming the offending key or value.
    """
    if kind not in CONFIG_CLASSES:
        raise ValueError(f"unknown config kind {kind!r}; expected one of {', '.join(KINDS)}")
    cls = CONFIG_CLASSES[kind]
    names = {f.name: f for f in dataclasses.fields(cls)}
    values: dict[str, Any] = {}

    if file is not None:
        for key, value in _file_values(kind, Path(file)).items():
            if key in names:
                values[key] = _coerce(names[key], value, f"{file}: {key}")

    env = os.environ if env is None else env
    for name, f in names.items():
        raw = env.get(ENV_PREFIX + name.upper())
        if raw is not None:
            values[name] = _coerce(f, raw, f"{ENV_PREFIX}{name.upper()}")

    for key, value in (overrides or {}).items():
        if value is None:
            continue
        if key not in names:
            raise ValueError(f"unknown {kind} option {key!r}")
        values[key] = _coerce(names[key], value, key)

    if cls is NodeConfig:
        if values.get("role", kind) != kind:
            raise ValueError(f"role: {values['role']!r} contradicts the process kind {kind!r}")
        values["role"] = kind
    config = cls(**values)
    if not config.node_id:
        config.node_id = f"{kind}-{socket.gethostname()}-{os.getpid()}"
    if isinstance(config, RouterConfig) and not config.served_model_name and config.model:
        config.served_model_name = Path(config.model).name
    config.validate()
    return config


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """'host:port' (an optional http:// is dropped) -> (host, port); ValueError when malformed."""
    text = endpoint.strip()
    for scheme in ("http://", "https://"):
        if text.startswith(scheme):
            text = text[len(scheme):]
    text = text.rstrip("/")
    host, sep, port = text.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"etcd endpoint {endpoint!r} is not host:port")
    return host, int(port)


def parse_bytes(value: str | int) -> int:
    """'4GiB', '512M', '1e9', 1024 -> bytes (K/M/G/T are powers of 1024 with or without 'iB')."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    match = re.fullmatch(r"\s*([0-9.eE+]+)\s*([KMGT]?)(i?B)?\s*", str(value), re.IGNORECASE)
    if not match:
        raise ValueError(f"{value!r} is not a byte size like 4GiB or 512MiB")
    number, unit = float(match.group(1)), match.group(2).upper()
    return int(number * 1024 ** ("_KMGT".index(unit) if unit else 0))


def _file_values(kind: str, path: Path) -> dict[str, Any]:
    """Top-level keys plus the `kind` section, with every key checked against all kinds."""
    data = _read_file(path)
    known = {f.name for cls in CONFIG_CLASSES.values() for f in dataclasses.fields(cls)}
    values: dict[str, Any] = {}
    for key, value in data.items():
        if key in KINDS:
            if not isinstance(value, dict):
                raise ValueError(f"{path}: section {key!r} must be a mapping")
            section_known = {f.name for f in dataclasses.fields(CONFIG_CLASSES[key])}
            for sub in value:
                if sub not in section_known:
                    raise ValueError(f"{path}: unknown key {key}.{sub!r}")
        elif key not in known:
            raise ValueError(f"{path}: unknown key {key!r}")
        else:
            values[key] = value
    values.update(data.get(kind) or {})
    return values


def _read_file(path: Path) -> dict[str, Any]:
    suffix = path.suffix.lower()
    text = path.read_text()
    if suffix == ".toml":
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise ValueError(f"{path}: invalid TOML: {exc}") from None
    elif suffix in (".yaml", ".yml"):
        import yaml

        try:
            data = yaml.safe_load(text) or {}
        except yaml.YAMLError as exc:
            raise ValueError(f"{path}: invalid YAML: {exc}") from None
    else:
        raise ValueError(f"{path}: config files must end in .yaml, .yml or .toml")
    if not isinstance(data, dict):
        raise ValueError(f"{path}: top level must be a mapping")
    return data


def _coerce(f: dataclasses.Field, value: Any, where: str) -> Any:
    """Convert a file/env/CLI value to the field's type; ValueError names `where`."""
    target = f.type if not isinstance(f.type, str) else _FIELD_TYPES[f.type]
    try:
        if f.name == "kv_cache_memory":
            return parse_bytes(value)
        if target is bool:
            if isinstance(value, bool):
                return value
            text = str(value).strip().lower()
            if text in ("1", "true", "yes", "on"):
                return True
            if text in ("0", "false", "no", "off"):
                return False
            raise ValueError("expected true/false")
        if target is int:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError("expected an integer")
            return int(value)
        if target is float:
            if isinstance(value, bool):
                raise ValueError("expected a number")
            return float(value)
        if target is str:
            if not isinstance(value, (str, int, float)) or isinstance(value, bool):
                raise ValueError("expected a string")
            return str(value)
        if target == list[str]:
            items = value.split(",") if isinstance(value, str) else value
            if not isinstance(items, (list, tuple)):
                raise ValueError("expected a list or a comma-separated string")
            return [str(item).strip() for item in items if str(item).strip()]
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{where}: invalid value {value!r} ({exc})") from None
    raise TypeError(f"config field {f.name} has unsupported type {target}")


# `from __future__ import annotations` makes field types strings; map the ones used above.
_FIELD_TYPES: dict[str, Any] = {"str": str, "int": int, "float": float, "bool": bool, "list[str]": list[str]}


def _check_port(name: str, port: int) -> None:
    if not 0 <= port < 65536:
        raise ValueError(f"{name}: {port} is not a TCP port (0-65535; 0 = pick a free one)")


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name}: {value!r} is not one of {', '.join(choices)}")
