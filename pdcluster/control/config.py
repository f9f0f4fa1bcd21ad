"""The configuration loader every pdcluster process uses, and the knobs they all share.

Each knob is declared once, as a dataclass field made with `knob()` (default, help text, choices): the
engine's in `pdcluster.engine.args.EngineArgs` (the node config derives from it, `pdcluster.node.config`),
the router's in `pdcluster.router.settings`, the common ones in `CommonConfig` here. The config file keys,
the environment variables and the `pdcluster` command's flags are all derived from those fields.

Precedence, lowest to highest: dataclass defaults < config file (YAML or TOML) < environment
variables `PDCLUSTER_<UPPER_NAME>` < explicit overrides (CLI flags). `load_config` is the one entry.

A config file may hold keys for several kinds: top-level keys apply to every kind that has them,
and a section named after a kind (`router:`, `prefill:`, `decode:`) applies to that kind only.
A key that no kind knows is an error naming the key.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import re
import socket
import typing
from dataclasses import MISSING, dataclass
from pathlib import Path
from typing import Any, Callable

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

ENV_PREFIX = "PDCLUSTER_"
LOG_FORMATS = ("text", "json")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
DEFAULT_ETCD = "127.0.0.1:2379"   # the etcd of a one-host cluster (`pdcluster up`), and what admin commands ask
ETCD_SECURITY = ("etcd_ca", "etcd_cert", "etcd_key", "etcd_user", "etcd_password_file")  # TLS and auth to etcd


def knob(default: Any = MISSING, help: str = "", *, choices: tuple[str, ...] = (), parse: Callable | None = None,
         setting: bool = True, factory: Callable[[], Any] | None = None) -> Any:
    """A dataclass field that is a configuration knob. `help` is the flag's help text; `choices` the values
    a config may give (checked by `check_choices`); `parse` converts a raw file/env/flag value before
    the type coercion (e.g. `parse_bytes`); `setting=False` marks a field only code can pass."""
    metadata = {"help": help, "choices": choices, "parse": parse, "setting": setting}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def settings(cls: type) -> list[dataclasses.Field]:
    """The fields of a config class that are knobs a user sets (file key, env variable, flag)."""
    return [f for f in dataclasses.fields(cls) if f.metadata.get("setting", False)]


def declared_default(cls: type, name: str) -> Any:
    """The default a config class declares for the knob `name` (for code that fills in a config dict)."""
    f = next((f for f in dataclasses.fields(cls) if f.name == name), None)
    if f is None:
        raise KeyError(f"{cls.__name__} has no knob {name!r}")
    return f.default_factory() if f.default_factory is not MISSING else f.default


def env_name(name: str) -> str:
    return ENV_PREFIX + name.upper()


@dataclass
class CommonConfig:
    """Knobs every pdcluster process has. A subclass adds its own and may override `finish` / `validate`."""

    cluster: str = knob("default", "cluster name: etcd key namespace /pdcluster/<cluster>/...")
    etcd: list[str] = knob(help="etcd endpoints host:port[,host:port...]", factory=lambda: [DEFAULT_ETCD])
    node_id: str = knob("", "unique id in the cluster; default: <kind>-<hostname>-<pid>")
    host: str = knob("127.0.0.1", "address this process binds and advertises to peers")
    metrics_port: int = knob(0, "port of the Prometheus /metrics endpoint (nodes); 0 = pick a free port")
    log_format: str = knob("text", "text, or json (one JSON object per line)", choices=LOG_FORMATS)
    log_level: str = knob("INFO", "log level", choices=LOG_LEVELS)
    lease_ttl: int = knob(10, "seconds an etcd registration outlives its last refresh (nodes)")
    cluster_secret: str = knob("", "cluster secret file (`pdcluster keys generate`, mode 0600) that authenticates "
                               "every zmq and KV connection; empty = nothing inside the cluster is authenticated")
    etcd_ca: str = knob("", "CA certificate (PEM file) that signed etcd's server certificate; set = TLS to etcd")
    etcd_cert: str = knob("", "client certificate (PEM file) shown to etcd (--client-cert-auth); needs etcd_key")
    etcd_key: str = knob("", "private key (PEM file) of etcd_cert")
    etcd_user: str = knob("", "etcd auth user; its password is read from etcd_password_file")
    etcd_password_file: str = knob("", "file holding etcd_user's password (first line)")

    def finish(self, kind: str) -> None:
        """Fill the defaults that depend on the process kind (called by `load_config` before `validate`)."""
        if not self.node_id:
            self.node_id = f"{kind}-{socket.gethostname()}-{os.getpid()}"

    def validate(self) -> None:
        self.log_level = self.log_level.upper()
        check_choices(self)
        if self.lease_ttl < 1:
            raise ValueError(f"lease_ttl: must be >= 1 second, got {self.lease_ttl}")
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", self.cluster):
            raise ValueError(f"cluster: {self.cluster!r} must be letters, digits, '_', '.' or '-'")
        if not self.etcd:
            raise ValueError("etcd: at least one host:port endpoint is required")
        for endpoint in self.etcd:
            parse_endpoint(endpoint)
        check_advertised_host(self.host, self.etcd)
        if not re.fullmatch(r"[A-Za-z0-9_.:-]+", self.node_id):
            raise ValueError(f"node_id: {self.node_id!r} must be letters, digits, '_', '.', ':' or '-'")
        check_port("metrics_port", self.metrics_port)
        if self.cluster_secret:
            from pdcluster.control.keys import SecretError, load_secret

            try:   # a missing, malformed or group-readable secret fails the start
                load_secret(self.cluster_secret)
            except SecretError as exc:
                raise ValueError(f"cluster_secret: {exc}") from None
        check_etcd_security(self)


def load_config(kind: str, file: str | os.PathLike | None = None, overrides: dict[str, Any] | None = None,
                env: typing.Mapping[str, str] | None = None, *, kinds: typing.Mapping[str, type]) -> Any:
    """Build the validated config of one process kind; `kinds` maps every kind to its config class
    (`pdcluster.cli.config.KINDS`: router, prefill, decode), so a file's keys are checked against all.

    `overrides` are CLI values; keys whose value is None are ignored (an option not given).
    `env` defaults to os.environ. Raises ValueError naming the offending key or value.
    """
    if kind not in kinds:
        raise ValueError(f"unknown config kind {kind!r}; expected one of {', '.join(kinds)}")
    cls = kinds[kind]
    names = {f.name: f for f in settings(cls)}
    values: dict[str, Any] = {}

    if file is not None:
        for key, value in _file_values(kind, Path(file), kinds).items():
            if key in names:
                values[key] = coerce(names[key], value, f"{file}: {key}")

    env = os.environ if env is None else env
    for name, f in names.items():
        raw = env.get(env_name(name))
        if raw is not None:
            values[name] = coerce(f, raw, env_name(name))

    for key, value in (overrides or {}).items():
        if value is None:
            continue
        if key not in names:
            raise ValueError(f"unknown {kind} option {key!r}")
        values[key] = coerce(names[key], value, key)

    config = cls(**values)
    config.finish(kind)
    config.validate()
    return config


def check_etcd_security(config: Any) -> None:
    """The etcd TLS / auth knobs come in pairs and name readable files (checked at start, not at first use)."""
    for first, second in (("etcd_cert", "etcd_key"), ("etcd_user", "etcd_password_file")):
        if bool(getattr(config, first)) != bool(getattr(config, second)):
            raise ValueError(f"{first} and {second}: set both or neither")
    if config.etcd_cert and not config.etcd_ca:
        raise ValueError("etcd_cert: a client certificate needs etcd_ca (TLS to etcd)")
    for name in ("etcd_ca", "etcd_cert", "etcd_key", "etcd_password_file"):
        check_readable_file(name, getattr(config, name))
    if config.etcd_password_file and not read_first_line(config.etcd_password_file):
        raise ValueError(f"etcd_password_file: {config.etcd_password_file} is empty")


def check_readable_file(name: str, path: str) -> None:
    """An empty path is "not set"; anything else must be a file this process can read."""
    if path and not (os.path.isfile(path) and os.access(path, os.R_OK)):
        raise ValueError(f"{name}: {path} is not a readable file")


def read_first_line(path: str) -> str:
    """The first line of a secret file, without its line break (a password, say)."""
    with open(path, encoding="utf-8") as f:
        return f.readline().rstrip("\r\n")


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


def is_loopback(host: str) -> bool:
    """A loopback address or the name localhost (other names are not resolved: config checks stay offline)."""
    name = host.strip("[]").lower()
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def check_advertised_host(host: str, etcd: list[str]) -> None:
    """`host` is where peers dial this process: a loopback one is only good when etcd, and so the cluster it
    announces this process to, is on loopback too."""
    if not is_loopback(host):
        return
    remote = [e for e in etcd if not is_loopback(parse_endpoint(e)[0])]
    if remote:
        raise ValueError(f"host: {host} is a loopback address but etcd endpoint {remote[0]} is not; processes on "
                         f"other hosts would dial their own {host}. Set host to an address they reach this host by "
                         "(or run etcd on loopback for a one-host cluster)")


def parse_bytes(value: str | int) -> int:
    """'4GiB', '512M', '1e9', 1024 -> bytes (K/M/G/T are powers of 1024 with or without 'iB')."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    match = re.fullmatch(r"\s*([0-9.eE+]+)\s*([KMGT]?)(i?B)?\s*", str(value), re.IGNORECASE)
    if not match:
        raise ValueError(f"{value!r} is not a byte size like 4GiB or 512MiB")
    number, unit = float(match.group(1)), match.group(2).upper()
    return int(number * 1024 ** ("_KMGT".index(unit) if unit else 0))


def _file_values(kind: str, path: Path, kinds: typing.Mapping[str, type]) -> dict[str, Any]:
    """Top-level keys plus the `kind` section, with every key checked against all kinds."""
    data = _read_file(path)
    known = {f.name for cls in kinds.values() for f in settings(cls)}
    values: dict[str, Any] = {}
    for key, value in data.items():
        if key in kinds:
            if not isinstance(value, dict):
                raise ValueError(f"{path}: section {key!r} must be a mapping")
            section_known = {f.name for f in settings(kinds[key])}
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


def coerce(f: dataclasses.Field, value: Any, where: str) -> Any:
    """Convert a file/env/CLI value to the field's type; ValueError names `where`.

    An optional field (`int | None`, `str | None`) is unset by an empty value, "none", or, for numbers, 0.
    """
    base, optional = field_type(f)
    try:
        if optional and (value is None or str(value).strip().lower() in ("", "none", "null")):
            return None
        if f.metadata.get("parse"):
            value = f.metadata["parse"](value)
        if base == "bool":
            if isinstance(value, bool):
                return value
            text = str(value).strip().lower()
            if text in ("1", "true", "yes", "on"):
                return True
            if text in ("0", "false", "no", "off"):
                return False
            raise ValueError("expected true/false")
        if base == "int":
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError("expected an integer")
            number = int(value)
            return None if optional and number == 0 else number
        if base == "float":
            if isinstance(value, bool):
                raise ValueError("expected a number")
            return float(value)
        if base == "str":
            if not isinstance(value, (str, int, float)) or isinstance(value, bool):
                raise ValueError("expected a string")
            return str(value)
        if base == "list[str]":
            items = value.split(",") if isinstance(value, str) else value
            if not isinstance(items, (list, tuple)):
                raise ValueError("expected a list or a comma-separated string")
            return [str(item).strip() for item in items if str(item).strip()]
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{where}: invalid value {value!r} ({exc})") from None
    raise TypeError(f"config field {f.name} has unsupported type {f.type}")


_BASE_TYPES = ("bool", "int", "float", "str", "list[str]")


def field_type(f: dataclasses.Field) -> tuple[str | None, bool]:
    """(base type name, optional) of a knob: "int | None" -> ("int", True); "str | torch.dtype" -> ("str", False).
    Annotations are strings under `from __future__ import annotations`; the first member we coerce wins."""
    text = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    parts = [part.strip() for part in text.split("|")]
    return next((part for part in parts if part in _BASE_TYPES), None), "None" in parts


def check_choices(config: Any) -> None:
    """Every knob declared with `choices` holds one of them (None = unset is allowed)."""
    for f in dataclasses.fields(config):
        value, choices = getattr(config, f.name), f.metadata.get("choices")
        if choices and value is not None and value not in choices:
            raise ValueError(f"{f.name}: {value!r} is not one of {', '.join(choices)}")


def check_port(name: str, port: int) -> None:
    if not 0 <= port < 65536:
        raise ValueError(f"{name}: {port} is not a TCP port (0-65535; 0 = pick a free one)")
