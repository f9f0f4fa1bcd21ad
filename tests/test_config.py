"""Config loading (defaults < file < env < overrides), validation, the flags and config classes derived from
the knob declarations (EngineArgs, RouterSettings, CommonConfig), and the logging setup the config drives."""

from __future__ import annotations

import dataclasses
import io
import json
import logging
import os
import re
from pathlib import Path

import pytest
import typer
import yaml

from pdcluster.cli.config import KINDS, load_config
from pdcluster.cli.main import app
from pdcluster.control.config import CommonConfig, env_name, field_type, parse_bytes, parse_endpoint, settings
from pdcluster.control.keys import generate_secret
from pdcluster.control.log import bind_request_id, setup_logging
from pdcluster.engine.args import EngineArgs
from pdcluster.node.config import NODE_DEFAULTS, TIMEOUT_KNOBS, NodeConfig, engine_args_from_config
from pdcluster.router.settings import RouterConfig, RouterSettings

DOCS = Path(__file__).resolve().parents[1] / "docs"

YAML = """
cluster: prod
etcd: [10.0.0.1:2379, 10.0.0.2:2379]
host: 10.0.0.7        # with a remote etcd, a routable address (a loopback one is refused)
model: /models/qwen2-0.5b
block_size: 128
port: 9000            # router-only key at top level: fine for node kinds, used by the router
decode:
  max_num_seqs: 64
  kv_cache_memory: 2GiB
prefill:
  enable_prefix_caching: false
router:
  routing_policy: round_robin
"""

TOML = """
cluster = "prod"
etcd = ["10.0.0.1:2379"]
host = "10.0.0.7"
model = "/models/qwen2-0.5b"
[decode]
max_num_seqs = 32
kv_backend = "tcp"
[router]
port = 8080
"""


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_defaults():
    cfg = load_config("decode", overrides={"model": "/m"}, env={})
    assert isinstance(cfg, NodeConfig)
    assert (cfg.role, cfg.cluster, cfg.etcd, cfg.block_size, cfg.kv_backend) == (
        "decode", "default", ["127.0.0.1:2379"], None, "auto")   # block size unset: the device's default
    assert cfg.node_id.startswith("decode-") and str(os.getpid()) in cfg.node_id
    router = load_config("router", env={})
    assert isinstance(router, RouterConfig) and router.port == 8000 and router.log_format == "text"


def test_yaml_sections_and_precedence(tmp_path):
    path = write(tmp_path, "cluster.yaml", YAML)
    decode = load_config("decode", path, env={})
    assert (decode.cluster, decode.block_size, decode.max_num_seqs) == ("prod", 128, 64)
    assert decode.etcd == ["10.0.0.1:2379", "10.0.0.2:2379"]
    assert decode.kv_cache_memory == 2 * 1024**3
    assert decode.enable_prefix_caching is True  # the prefill section does not leak into decode
    prefill = load_config("prefill", path, env={})
    assert prefill.enable_prefix_caching is False and prefill.max_num_seqs == 256
    router = load_config("router", path, env={})
    assert (router.port, router.routing_policy, router.served_model_name) == (9000, "round_robin", "qwen2-0.5b")

    env = {"PDCLUSTER_MAX_NUM_SEQS": "48", "PDCLUSTER_ENABLE_CHUNKED_PREFILL": "false",
           "PDCLUSTER_ETCD": "a:1, b:2", "PDCLUSTER_BLOCK_SIZE": "64", "PDCLUSTER_LOG_LEVEL": "debug"}
    cfg = load_config("decode", path, overrides={"block_size": 32, "node_id": None}, env=env)
    assert cfg.max_num_seqs == 48  # env beats the file
    assert cfg.enable_chunked_prefill is False
    assert cfg.etcd == ["a:1", "b:2"]
    assert cfg.block_size == 32  # overrides beat env
    assert cfg.log_level == "DEBUG"
    assert cfg.node_id.startswith("decode-")  # a None override means "not given"


def test_toml(tmp_path):
    path = write(tmp_path, "cluster.toml", TOML)
    decode = load_config("decode", path, env={})
    assert (decode.cluster, decode.max_num_seqs, decode.kv_backend) == ("prod", 32, "tcp")
    assert load_config("router", path, env={}).port == 8080


@pytest.mark.parametrize("text, match", [
    ("modle: x\n", "unknown key 'modle'"),
    ("decode:\n  port: 1\n", r"unknown key decode\.'port'"),
    ("decode: 5\n", "section 'decode' must be a mapping"),
    ("- a\n- b\n", "top level must be a mapping"),
    ("block_size: [1\n", "invalid YAML"),
    ("block_size: lots\n", "block_size: invalid value 'lots'"),
    ("enable_prefix_caching: maybe\n", "enable_prefix_caching: invalid value"),
])
def test_bad_files(tmp_path, text, match):
    with pytest.raises(ValueError, match=match):
        body = text if text.startswith("-") else "model: /m\n" + text
        load_config("decode", write(tmp_path, "c.yaml", body), env={})


def test_bad_values_are_named():
    cases = [
        ({"tensor_parallel_size": 0}, "tensor_parallel_size: must be >= 1"),
        ({"kv_backend": "rdma"}, "kv_backend: 'rdma'"),
        ({"device": "tpu"}, "device: 'tpu'"),
        ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
        ({"block_size": -16}, "block_size: must be >= 1"),   # 0 is unset
        ({"etcd": ["nohost"]}, "'nohost' is not host:port"),
        ({"control_port": 70000}, "control_port"),
        ({"cluster": "a/b"}, "cluster:"),
        ({"max_num_seqs": 2.5}, "max_num_seqs: invalid value"),
        ({"bogus": 1}, "unknown decode option 'bogus'"),
        ({"lease_ttl": 0}, "lease_ttl: must be >= 1"),
        ({"role": "prefill"}, "unknown decode option 'role'"),  # the kind sets it
        ({"kv_cache_memory": -1}, "kv_cache_memory: must be >= 1"),
        ({"kv_reserve_tokens": -1}, "kv_reserve_tokens: must be >= 0"),
        ({"enable_chunked_prefill": False, "max_model_len": 4096}, "needs enable_chunked_prefill"),
    ]
    for overrides, match in cases:
        with pytest.raises(ValueError, match=match):
            load_config("decode", overrides={"model": "/m", **overrides}, env={})
    with pytest.raises(ValueError, match="model: a checkpoint directory is required"):
        load_config("prefill", env={})
    with pytest.raises(ValueError, match="PDCLUSTER_TENSOR_PARALLEL_SIZE: invalid value 'two'"):
        load_config("decode", overrides={"model": "/m"}, env={"PDCLUSTER_TENSOR_PARALLEL_SIZE": "two"})
    with pytest.raises(ValueError, match="unknown config kind"):
        load_config("worker", env={})
    with pytest.raises(ValueError, match=r"\.yaml, \.yml or \.toml"):
        load_config("router", "/etc/hosts", env={})


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_loopback_host_with_a_remote_etcd_is_refused_naming_both(kind):
    base = {} if kind == "router" else {"model": "/m"}
    for host, etcd in (("127.0.0.1", "10.0.0.1:2379"), ("localhost", "http://etcd-1:2379"),
                       ("::1", "10.0.0.1:2379")):
        with pytest.raises(ValueError, match=f"host: {re.escape(host)} is a loopback address but etcd endpoint "
                                             f"{re.escape(etcd)} is not"):
            load_config(kind, overrides={**base, "host": host, "etcd": f"127.0.0.1:2379,{etcd}"}, env={})
    # one host (loopback on both sides, `pdcluster up`) and a routable host with a remote etcd are fine
    for host, etcd in (("127.0.0.1", "localhost:2379"), ("127.0.0.1", "[::1]:2379"), ("10.0.0.7", "10.0.0.1:2379"),
                       ("node-3.example", "etcd-1:2379"), ("10.0.0.7", "127.0.0.1:2379")):
        assert load_config(kind, overrides={**base, "host": host, "etcd": etcd}, env={}).host == host
    assert load_config(kind, overrides=base, env={}).etcd == ["127.0.0.1:2379"]


def test_node_self_check_wants_an_address_of_this_host():
    from pdcluster.node.config import check_host_is_here

    here = {"127.0.0.1", "10.0.0.7"}
    check_host_is_here("10.0.0.7", ["10.0.0.1:2379"], here)
    check_host_is_here("127.0.0.1", ["127.0.0.1:2379"], here)
    check_host_is_here("localhost", ["localhost:2379"], here)
    with pytest.raises(ValueError, match=r"host: 10\.0\.0\.8 \(10\.0\.0\.8\) is not an address of this host "
                                         r"\(its interfaces: 10\.0\.0\.7, 127\.0\.0\.1\)"):
        check_host_is_here("10.0.0.8", ["10.0.0.1:2379"], here)
    with pytest.raises(ValueError, match="host: 0.0.0.0 is a wildcard"):
        check_host_is_here("0.0.0.0", ["127.0.0.1:2379"], here)
    with pytest.raises(ValueError, match="is a loopback address but etcd endpoint 10.0.0.1:2379 is not"):
        check_host_is_here("127.0.0.1", ["10.0.0.1:2379"], here)
    check_host_is_here("127.0.0.1", ["127.0.0.1:2379"])   # psutil's list of this machine's interfaces


def test_node_command_refuses_a_loopback_host_with_a_remote_etcd_before_starting():
    from typer.testing import CliRunner

    result = CliRunner().invoke(app, ["decode", "--model", "/m", "--host", "127.0.0.1", "--etcd", "10.0.0.1:2379"])
    assert result.exit_code == 2
    assert "host: 127.0.0.1 is a loopback address but etcd endpoint 10.0.0.1:2379 is not" in result.output


@pytest.mark.slow
def test_node_that_would_advertise_a_wildcard_exits_at_start(tiny_llama, tmp_path):
    """The self-check runs in the node process after it bound its sockets: exit 2, the reason in the log."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "pdcluster", "prefill", "--model", tiny_llama, "--device", "cpu",
                           "--kv-cache-memory", "8MiB", "--host", "0.0.0.0", "--etcd", "127.0.0.1:1"],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "host: 0.0.0.0 is a wildcard" in proc.stdout + proc.stderr


def test_env_defaults_to_process_environment(monkeypatch):
    monkeypatch.setenv("PDCLUSTER_CLUSTER", "from-env")
    assert load_config("router").cluster == "from-env"


def test_parsers():
    assert parse_endpoint("http://etcd-1:2379/") == ("etcd-1", 2379)
    assert parse_endpoint("[::1]:2379") == ("::1", 2379)
    assert parse_bytes("512MiB") == 512 * 1024**2 and parse_bytes("1.5G") == 1536 * 1024**2 and parse_bytes(7) == 7
    with pytest.raises(ValueError):
        parse_bytes("lots")


def test_json_logging_carries_node_and_request_ids():
    stream = io.StringIO()
    cfg = load_config("router", overrides={"log_format": "json", "log_level": "info", "node_id": "router-a"}, env={})
    setup_logging(cfg.log_level, cfg.log_format, node_id=cfg.node_id, stream=stream)
    try:
        logger = logging.getLogger("pdcluster.test")
        logger.info("plain %d", 1)
        logger.info("tagged", extra={"request_id": "r-1"})
        with bind_request_id("r-2"):
            logger.warning("from context")
        logger.debug("below level")
        lines = [json.loads(line) for line in stream.getvalue().splitlines()]
        assert [entry["msg"] for entry in lines] == ["plain 1", "tagged", "from context"]
        assert {entry["node_id"] for entry in lines} == {"router-a"}
        assert "request_id" not in lines[0] and lines[1]["request_id"] == "r-1" and lines[2]["request_id"] == "r-2"
        assert lines[2]["level"] == "WARNING" and lines[0]["logger"] == "pdcluster.test"
        assert lines[0]["ts"].endswith("Z")

        text = io.StringIO()
        setup_logging("INFO", "text", node_id="n1", stream=text)
        with bind_request_id("r-3"):
            logger.info("hello")
        assert "n1 pdcluster.test: hello [rid=r-3]" in text.getvalue()
        assert stream.getvalue().count("\n") == 3  # the replaced JSON handler got nothing more
    finally:
        root = logging.getLogger()
        for handler in [h for h in root.handlers if getattr(h, "_pdcluster", False)]:
            root.removeHandler(handler)


# ---- one declaration: config classes, env variables and flags derive from the knob fields

def _default(f: dataclasses.Field):
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def _sample(f: dataclasses.Field):
    """A valid value different from the field's default."""
    base, _ = field_type(f)
    default, choices = _default(f), f.metadata["choices"]
    if choices:
        return next(c for c in choices if c != default)
    if f.name in SAMPLES:
        return SAMPLES[f.name]
    return {"bool": lambda: not default, "int": lambda: (default or 0) + 3, "float": lambda: default / 2,
            "str": lambda: f"x-{f.name}", "list[str]": lambda: ["h1:1", "h2:2"]}[base]()


def _text(value) -> str:
    return ",".join(value) if isinstance(value, list) else str(value).lower() if isinstance(value, bool) else str(value)


def _flags(kind: str, argv: list[str]) -> dict:
    """What `pdcluster <kind> <argv>` passes to the loader (parsed by the generated click options)."""
    command = typer.main.get_command(app).commands[kind]
    params = dict(command.make_context(kind, argv).params)
    params.pop("config")
    return params


# Knobs whose text form is a keyword, not free text (`str | int`: a number or "auto"), or a CPU list.
SAMPLES = {"max_num_batched_tokens": "auto", "cpu_cores": str(min(os.sched_getaffinity(0))),
           "tool_call_parser": ["hermes", "big=mistral"], "reasoning_parser": ["qwen3", "big=deepseek_r1"],
           "speculative_config": '{"method": "ngram", "num_speculative_tokens": 3}',
           "lora_modules": ["a=/adapters/a", "b=/adapters/b"]}
# Knobs whose only valid value is the default: setting another must fail with this (and not "unknown key").
ONLY_DEFAULT: dict[str, str] = {}
# Knobs naming a file that must exist when the config is validated, and knobs valid only with others set.
FILE_KNOBS = {"etcd_ca", "etcd_cert", "etcd_key", "etcd_password_file", "api_key_file", "cluster_secret"}
NEEDS = {"etcd_cert": ("etcd_key", "etcd_ca"), "etcd_key": ("etcd_cert", "etcd_ca"),
         "etcd_user": ("etcd_password_file",), "etcd_password_file": ("etcd_user",),
         "etcd": ("host",),   # a remote etcd needs a host that is not loopback
         "kv_offload_disk_path": ("kv_offload_disk_bytes",), "kv_offload_disk_bytes": ("kv_offload_disk_path",),
         "lora_modules": ("enable_lora",)}
NEEDED_VALUES = {"kv_offload_disk_bytes": "1GiB", "enable_lora": True}   # else "someone"


def _a_file(tmp_path: Path, name: str) -> str:
    path = tmp_path / f"{name}.txt"
    if name == "cluster_secret":   # a real secret file (format and mode are checked)
        generate_secret(path, force=True)
    else:
        path.write_text("a-secret-line\n")
    return str(path)


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.slow
def test_every_declared_knob_is_settable_from_file_env_and_flags(kind, tmp_path):
    fields = settings(KINDS[kind])
    assert len(fields) > 20
    for f in fields:
        value = _a_file(tmp_path, f.name) if f.name in FILE_KNOBS else _sample(f)
        base = {} if kind == "router" or f.name == "model" else {"model": "/m"}
        base.update({k: _a_file(tmp_path, k) if k in FILE_KNOBS else NEEDED_VALUES.get(k, "someone")
                     for k in NEEDS.get(f.name, ())})
        flag = "--" + f.name.replace("_", "-")
        argv = [f"{flag}" if value else f"--no-{flag[2:]}"] if isinstance(value, bool) else [flag, _text(value)]
        for key, other in base.items():
            argv += ["--" + key.replace("_", "-")] + ([] if other is True else [other])
        path = tmp_path / f"{f.name}.yaml"
        path.write_text(yaml.safe_dump({**base, f.name: value}))
        env = {env_name(k): _text(v) for k, v in {**base, f.name: value}.items()}
        ways = {"file": lambda path=path: load_config(kind, path, env={}),
                "env": lambda env=env: load_config(kind, env=env),
                "flag": lambda argv=argv: load_config(kind, overrides=_flags(kind, argv), env={})}
        for way, load in ways.items():
            if f.name in ONLY_DEFAULT:
                with pytest.raises(ValueError, match=ONLY_DEFAULT[f.name]):
                    load()
            else:
                assert getattr(load(), f.name) == value, f"{kind} {f.name} via {way}"


def test_config_classes_derive_from_the_declarations():
    engine = {f.name: f for f in settings(EngineArgs)}
    node = {f.name: f for f in settings(NodeConfig)}
    router = {f.name: f for f in settings(RouterConfig)}
    common = {f.name for f in settings(CommonConfig)}
    assert "kv_pool_factory" not in node and "kv_pool_tensor" not in node and "kv_pool_factory" not in engine
    timeouts = set(TIMEOUT_KNOBS)
    own = {"kv_backend", "control_port", "load_port", "kv_port", "served_model_name", "cpu_cores", "drain_migrate",
           "preempt_migrate", "kv_reserve_tokens"}
    assert set(engine) | common | own | timeouts == set(node)
    for name, f in engine.items():  # same type, help and default (unless the node says otherwise)
        assert (node[name].type, node[name].metadata["help"]) == (f.type, f.metadata["help"]) and f.metadata["help"]
        assert _default(node[name]) == NODE_DEFAULTS.get(name, _default(f))
    assert {f.name for f in dataclasses.fields(RouterSettings)} | common == set(router)
    assert all(f.metadata["help"] for f in settings(RouterConfig) + settings(NodeConfig))
    # A NodeConfig becomes EngineArgs knob for knob; the code-only fields come as extras.
    cfg = load_config("prefill", overrides={"model": "/m", "max_num_seqs": 7, "kv_cache_memory": "1MiB",
                                            "max_model_len": 0, "dtype": "bfloat16"}, env={})
    args = engine_args_from_config(cfg, kv_pool_factory=print)
    assert (args.max_num_seqs, args.kv_cache_memory, args.max_model_len, args.dtype) == (7, 1 << 20, None, "bfloat16")
    assert args.kv_pool_factory is print and args.device == "auto"


def test_node_config_declares_exactly_the_engine_knobs():
    """NodeConfig declares the engine knobs by name (for the type checker); they cannot drift from EngineArgs:
    the same names in the same order, the same types, and each one's help, choices and parser from EngineArgs."""
    from pdcluster.node.config import ENGINE_KNOBS, engine_knob

    engine = settings(EngineArgs)
    own = [f for f in dataclasses.fields(NodeConfig) if f.name in {e.name for e in engine}]
    assert [f.name for f in own] == [f.name for f in engine] == list(ENGINE_KNOBS)
    for node_field, engine_field in zip(own, engine, strict=True):
        assert node_field.type == engine_field.type and field_type(node_field) == field_type(engine_field)
        assert node_field.metadata == engine_field.metadata
    with pytest.raises(ValueError, match="kv_pool_factory is not a setting"):
        engine_knob("kv_pool_factory")
    with pytest.raises(KeyError):
        engine_knob("no_such_knob")


def test_router_docs_list_only_settable_settings():
    """Every knob docs/router.md's settings section names is a RouterConfig key, and every key is named."""
    text = (DOCS / "router.md").read_text()
    section = text[text.index("## Settings"):]
    section = section[:section.index("\n## ", 1)]
    values = {choice for f in settings(RouterConfig) for choice in f.metadata["choices"]}
    named = set(re.findall(r"`([a-z_]+)`", section)) - values
    router = {f.name for f in settings(RouterConfig)}
    assert {f.name for f in dataclasses.fields(RouterSettings)} <= named <= router, named - router


def test_router_config_is_the_router_settings(tmp_path):
    path = tmp_path / "r.toml"
    path.write_text('stall_timeout = 5\nmax_retries = 1\n[router]\nmax_in_flight = 10\nload_stale_s = 0.5\n')
    cfg = load_config("router", path, overrides={"max_migrations": 0}, env={"PDCLUSTER_MAX_N": "2"})
    assert isinstance(cfg, RouterSettings)
    assert (cfg.stall_timeout, cfg.max_retries, cfg.max_in_flight, cfg.load_stale_s, cfg.max_migrations, cfg.max_n) \
        == (5.0, 1, 10, 0.5, 0, 2)
    for key, value, match in [("stall_timeout", 0, "stall_timeout: must be > 0"),
                              ("max_in_flight", 0, "max_in_flight: must be >= 1"),
                              ("max_retries", -1, "max_retries: must be >= 0"),
                              ("routing_policy", "random", "routing_policy: 'random' is not one of")]:
        with pytest.raises(ValueError, match=match):
            load_config("router", overrides={key: value}, env={})


def test_dtype_auto_is_resolved_by_the_engine(tmp_path):
    import torch

    from pdcluster.engine.config import resolve_dtype

    (tmp_path / "config.json").write_text('{"torch_dtype": "float16"}')
    assert resolve_dtype("auto", torch.device("cuda", 0), str(tmp_path)) == torch.float16
    assert resolve_dtype("auto", torch.device("cuda", 0), str(tmp_path / "missing")) == torch.bfloat16
    assert resolve_dtype("bf16", torch.device("cpu"), str(tmp_path)) == torch.bfloat16
    assert EngineArgs(model="/m", dtype="auto").dtype == "auto"
    with pytest.raises(ValueError, match="dtype"):
        EngineArgs(model="/m", dtype="int8")


@pytest.mark.parametrize("saved", ["float32", "bfloat16", "float16", None])
def test_dtype_auto_on_cpu_keeps_a_16_bit_checkpoint_where_the_cpu_computes_it(tmp_path, monkeypatch, saved):
    """As `vllm serve` does with a bf16 / fp16 checkpoint; float32 where the CPU would emulate the type, and for a
    float32 checkpoint (which vLLM would downcast)."""
    import torch

    from pdcluster.engine import config

    if saved:
        (tmp_path / "config.json").write_text(f'{{"torch_dtype": "{saved}"}}')
    cpu = torch.device("cpu")
    for native in (True, False):
        monkeypatch.setattr(config, "cpu_computes_natively", lambda dtype, native=native: native or
                            dtype == torch.float32)
        expected = getattr(torch, saved or "bfloat16") if native else torch.float32
        assert config.resolve_dtype("auto", cpu, str(tmp_path)) == expected
        assert config.resolve_dtype("float16", cpu, str(tmp_path)) == torch.float16   # asked for: as asked


def test_cpu_computes_natively_agrees_with_onednn():
    import torch

    from pdcluster.engine.config import cpu_computes_natively

    assert cpu_computes_natively(torch.float32)
    assert cpu_computes_natively(torch.bfloat16) == bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    assert cpu_computes_natively(torch.float16) == bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())


def _doc_table_keys(text: str, heading: str) -> set[str]:
    section = text[text.index(heading) + len(heading):]
    section = section[:section.index("\n#")]
    return set(re.findall(r"^\| `([a-z_]+)` \|", section, re.MULTILINE))


def test_operations_docs_tables_list_exactly_the_declared_knobs():
    text = (DOCS / "operations.md").read_text()
    common = {f.name for f in settings(CommonConfig)}
    assert _doc_table_keys(text, "### Every process") == common
    assert _doc_table_keys(text, "### Prefill and decode nodes\n") == {f.name for f in settings(NodeConfig)} - common
    assert _doc_table_keys(text, "### Router\n\n| key") | {"host", "node_id"} == {
        f.name for f in dataclasses.fields(RouterSettings)}
