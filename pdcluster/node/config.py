"""The prefill / decode node config: the common knobs, the node's own, and every `EngineArgs` knob.

`NodeConfig` declares the engine knobs by name so a type checker sees them, but takes each one's default,
help text, choices and parser from `EngineArgs` (declared there, once) through `engine_knob`, with the
node-side defaults in `NODE_DEFAULTS`; tests/test_config.py checks that the declared engine fields are exactly
the settings of `EngineArgs`, with the same types. `engine_args_from_config` turns a config back into
`EngineArgs`, which also validates the engine knobs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import ipaddress
import logging
import os
import socket
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pdcluster.control.config import CommonConfig, check_advertised_host, check_port, knob, settings
from pdcluster.control.cpus import format_cpus, omp_binding_env, parse_cpus
from pdcluster.engine.args import EngineArgs

if TYPE_CHECKING:
    import torch

    from pdcluster.engine.speculative.config import SpeculativeConfig
    from pdcluster.engine.weight_pool import SharedWeightPool

log = logging.getLogger(__name__)

KV_BACKENDS = ("auto", "shm", "tcp", "gloo", "nccl", "hccl", "cuda_ipc")
ROLES = ("prefill", "decode")
NODE_DEFAULTS: dict[str, Any] = {
    "model": "",        # required, checked by validate (EngineArgs has no default)
    "dtype": "auto",    # vLLM's default: float32 on CPU, else the checkpoint's dtype
    "device": "auto",
}
ENGINE_KNOBS = tuple(f.name for f in settings(EngineArgs))
TIMEOUT_KNOBS = ("prefill_timeout", "heartbeat_interval", "router_reconnect_timeout", "kv_connect_timeout",
                 "kv_ack_timeout", "kv_landing_timeout", "kv_release_timeout", "drain_timeout")
_ENGINE_FIELDS = {f.name: f for f in dataclasses.fields(EngineArgs)}


def engine_knob(name: str) -> Any:
    """The node-config field of the `EngineArgs` knob `name`: its metadata, and its default unless the node
    has its own (`NODE_DEFAULTS`)."""
    f = _ENGINE_FIELDS[name]
    if not f.metadata.get("setting"):
        raise ValueError(f"EngineArgs.{name} is not a setting")
    return dataclasses.field(default=NODE_DEFAULTS.get(name, f.default), metadata=f.metadata)


@dataclass
class NodeConfig(CommonConfig):
    """A prefill or decode node: the common knobs, the node's own, and every EngineArgs knob."""

    role: str = ""  # set from the process kind by `finish`; not a setting
    kv_backend: str = knob("auto", "KV transfer backend; auto: hccl on NPU, shm on one host, cuda_ipc on one GPU, "
                                   "else tcp", choices=KV_BACKENDS)
    control_port: int = knob(0, "zmq ROUTER port for Generate/Prefill/Abort; 0 = pick a free port")
    load_port: int = knob(0, "zmq PUB port for Load reports; 0 = pick a free port")
    kv_port: int = knob(0, "KV transfer listener port; 0 = pick a free port")
    # Timeouts (docs/operations.md "Timeouts" lists them all, with what happens when each fires).
    prefill_timeout: float = knob(15.0, "decode: seconds without word from the prefill node on a prompt (its "
                                  "PrefillDone, or its Progress while the prompt is queued or computing; the KV "
                                  "reservation lives as long) before prefilling locally; below the router's "
                                  "stall_timeout")
    heartbeat_interval: float = knob(1.0, "decode: seconds between Progress messages to the router for a "
                                     "request that sent no token lately (queued, waiting on its prefill)")
    router_reconnect_timeout: float = knob(10.0, "decode: seconds a request's tokens are held while its router "
                                           "is unreachable (reconnecting) before the request is aborted")
    kv_connect_timeout: float = knob(5.0, "prefill: seconds to connect to a decode node's KV receiver and "
                                     "finish the handshake; a destination that does not answer fails only "
                                     "its own prompts")
    kv_ack_timeout: float = knob(10.0, "prefill: seconds to wait for the receiver's checksum ack of a transfer")
    kv_landing_timeout: float = knob(5.0, "decode: seconds after a PrefillDone for the receiver to confirm the KV "
                                     "landed (checksum) before prefilling locally")
    kv_release_timeout: float = knob(10.0, "decode: seconds to wait for the receiver to give a cancelled "
                                     "reservation's blocks back (no write can land any more) before freeing "
                                     "them anyway")
    drain_timeout: float = knob(60.0, "seconds a draining node waits for its requests to finish before exiting")
    drain_migrate: bool = knob(False, "decode: every drain (SIGTERM too) moves the running requests to other decode "
                                      "nodes with their KV instead of finishing them (`pdcluster drain --migrate`: "
                                      "that drain only)")
    preempt_migrate: bool = knob(False, "decode: when the KV pool is about to preempt (fewer free blocks than "
                                        "two per running request), ask the router to move the newest running "
                                        "request to another decode node with its KV instead (off: preemption by "
                                        "recompute)")
    kv_reserve_tokens: int = knob(512, "decode: output tokens of KV room kept for every request the node runs "
                                       "(up to its max_tokens) before it starts another remote prefill: a prompt "
                                       "that would cut into that room waits on this node instead of making the "
                                       "pool preempt (and recompute) later (0: start every prompt at once)")
    served_model_name: str = knob("", "the \"model\" requests name to be routed here; default: the model dir's name")
    cpu_cores: str = knob("", "CPUs this node runs on, a list like 0-3,8 (as taskset): one torch thread each, "
                          "OpenMP threads bound one per core; empty = the CPUs the process was started with")

    # The engine's knobs (EngineArgs), in its order.
    model: str = engine_knob("model")
    dtype: str | torch.dtype = engine_knob("dtype")
    device: str | None = engine_knob("device")
    block_size: int | None = engine_knob("block_size")
    kv_cache_dtype: str = engine_knob("kv_cache_dtype")
    kv_cache_memory: int | None = engine_knob("kv_cache_memory")
    gpu_memory_utilization: float = engine_knob("gpu_memory_utilization")
    num_gpu_blocks_override: int | None = engine_knob("num_gpu_blocks_override")
    max_num_seqs: int = engine_knob("max_num_seqs")
    max_num_batched_tokens: str | int = engine_knob("max_num_batched_tokens")
    max_model_len: int | None = engine_knob("max_model_len")
    max_context_len_to_capture: int | None = engine_knob("max_context_len_to_capture")
    attention_sinks: int = engine_knob("attention_sinks")
    streaming_window: int = engine_knob("streaming_window")
    enable_chunked_prefill: bool = engine_knob("enable_chunked_prefill")
    enable_prefix_caching: bool = engine_knob("enable_prefix_caching")
    prefix_cache_salt: str = engine_knob("prefix_cache_salt")
    kv_offload_host_bytes: int = engine_knob("kv_offload_host_bytes")
    kv_offload_disk_path: str = engine_knob("kv_offload_disk_path")
    kv_offload_disk_bytes: int = engine_knob("kv_offload_disk_bytes")
    tensor_parallel_size: int = engine_knob("tensor_parallel_size")
    enable_expert_parallel: bool = engine_knob("enable_expert_parallel")
    collective_timeout: float = engine_knob("collective_timeout")
    kv_pool_per_rank: bool = engine_knob("kv_pool_per_rank")
    attention_backend: str | None = engine_knob("attention_backend")
    enforce_eager: bool = engine_knob("enforce_eager")
    seed: int = engine_knob("seed")
    speculative_config: str | dict | SpeculativeConfig | None = engine_knob("speculative_config")
    weight_pool: str | SharedWeightPool | None = engine_knob("weight_pool")
    enable_lora: bool = engine_knob("enable_lora")
    max_loras: int = engine_knob("max_loras")
    max_lora_rank: int = engine_knob("max_lora_rank")
    max_cpu_loras: int | None = engine_knob("max_cpu_loras")
    lora_modules: dict[str, str] | list[str] | str | None = engine_knob("lora_modules")

    def finish(self, kind: str) -> None:
        super().finish(kind)
        self.role = kind

    def validate(self) -> None:
        super().validate()
        if self.role not in ROLES:
            raise ValueError(f"role: {self.role!r} is not one of {', '.join(ROLES)}")
        if not self.model:
            raise ValueError("model: a checkpoint directory is required")
        for name in ("control_port", "load_port", "kv_port"):
            check_port(name, getattr(self, name))
        if self.kv_reserve_tokens < 0:
            raise ValueError(f"kv_reserve_tokens: must be >= 0, got {self.kv_reserve_tokens}")
        for name in TIMEOUT_KNOBS:
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: must be > 0 seconds, got {getattr(self, name)}")
        try:
            cores, usable = parse_cpus(self.cpu_cores), os.sched_getaffinity(0)
        except ValueError as exc:
            raise ValueError(f"cpu_cores: {exc}") from None
        if not set(cores) <= usable:
            raise ValueError(f"cpu_cores: {self.cpu_cores} is not within the CPUs this process may use "
                             f"({format_cpus(sorted(usable))})")
        engine_args_from_config(self)  # EngineArgs checks the engine knobs


def engine_args_from_config(config: Any, **extra: Any) -> EngineArgs:
    """`EngineArgs` for a node config (the engine knobs map one to one); `extra` adds code-only fields
    such as `kv_pool_factory`."""
    knobs = {name: getattr(config, name) for name in ENGINE_KNOBS}
    knobs["prefix_cache_salt"] = knobs["prefix_cache_salt"] or f"cluster:{config.cluster}"
    return EngineArgs(**knobs, **extra)


def use_cpu_cores(config: NodeConfig) -> None:
    """The node process's start on its `cpu_cores` (nothing for ""), before torch loads: the process moves to
    those cores, and (one rank, no binding of the user's in the environment) OpenMP binds its threads one per
    core; then torch uses one thread per core unless OMP_NUM_THREADS says otherwise. Tensor-parallel ranks
    split the cores among themselves (engine/tp_executor.py)."""
    cores = parse_cpus(config.cpu_cores)
    if not cores:
        return
    os.sched_setaffinity(0, cores)
    bound = (config.tensor_parallel_size == 1 and "torch" not in sys.modules
             and not any(k in os.environ for k in ("OMP_PLACES", "OMP_PROC_BIND", "GOMP_CPU_AFFINITY")))
    binding = omp_binding_env(cores) if bound else {}
    os.environ.update(binding)
    import torch

    for name in binding:   # read once as OpenMP loaded: child processes (compile workers) must not bind to them
        del os.environ[name]
    for tid in os.listdir("/proc/self/task"):   # loading OpenMP bound this thread (and what it started) to one core
        with contextlib.suppress(ProcessLookupError):
            os.sched_setaffinity(int(tid), cores)
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(len(cores))
    log.info("cpu_cores %s: %d torch threads%s", format_cpus(cores), torch.get_num_threads(),
             ", OpenMP threads bound one per core" if bound else "")


def check_host_is_here(host: str, etcd: list[str], addresses: set[str] | None = None) -> None:
    """The node's self-check at start: peers dial `host`, so it must be an address of one of this host's
    interfaces (`addresses`; default: psutil's list), or loopback with etcd on loopback. ValueError saying why
    not."""
    try:
        resolved = {str(info[4][0]).split("%")[0] for info in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)}
    except socket.gaierror as exc:
        raise ValueError(f"host: {host} does not resolve ({exc})") from None
    ips = [ipaddress.ip_address(a) for a in resolved]
    if any(ip.is_unspecified for ip in ips):
        raise ValueError(f"host: {host} is a wildcard: it binds every interface, but peers cannot dial it; set "
                         "host to the address other hosts reach this one by")
    if all(ip.is_loopback for ip in ips):
        check_advertised_host(str(ips[0]), etcd)
        return
    here = _interface_addresses() if addresses is None else addresses
    if not resolved & here:
        raise ValueError(f"host: {host} ({', '.join(sorted(resolved))}) is not an address of this host (its "
                         f"interfaces: {', '.join(sorted(here))}); peers dialing it would not reach this node")


def _interface_addresses() -> set[str]:
    import psutil

    return {a.address.split("%")[0] for addrs in psutil.net_if_addrs().values() for a in addrs
            if a.family in (socket.AF_INET, socket.AF_INET6)}
