"""Config loading (defaults < file < env < overrides), validation, and the logging setup it drives."""

from __future__ import annotations

import io
import json
import logging
import os

import pytest

from pdcluster.control.config import NodeConfig, RouterConfig, load_config, parse_bytes, parse_endpoint
from pdcluster.control.log import bind_request_id, setup_logging

YAML = """
cluster: prod
etcd: [10.0.0.1:2379, 10.0.0.2:2379]
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
    assert (cfg.role, cfg.cluster, cfg.etcd, cfg.block_size, cfg.kv_backend) == ("decode", "default", ["127.0.0.1:2379"], 16, "auto")
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
        ({"tensor_parallel_size": 2}, "tensor parallelism is not implemented yet"),
        ({"kv_backend": "rdma"}, "kv_backend: 'rdma'"),
        ({"device": "tpu"}, "device: 'tpu'"),
        ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
        ({"block_size": 0}, "block_size: must be >= 1"),
        ({"etcd": ["nohost"]}, "'nohost' is not host:port"),
        ({"control_port": 70000}, "control_port"),
        ({"cluster": "a/b"}, "cluster:"),
        ({"max_num_seqs": 2.5}, "max_num_seqs: invalid value"),
        ({"bogus": 1}, "unknown decode option 'bogus'"),
        ({"lease_ttl": 0}, "lease_ttl: must be >= 1"),
        ({"role": "prefill"}, "contradicts"),
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
        assert lines[2]["level"] == "WARNING" and lines[0]["logger"] == "pdcluster.test" and lines[0]["ts"].endswith("Z")

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
