"""A whole cluster on this machine, one process per service, kept running: `LocalCluster`.

It starts (or reuses) etcd, one router and N prefill + M decode nodes as subprocesses running
`pdcluster router|prefill|decode --config <generated yaml>` (all holding one cluster secret it generates in its
work dir, docs/security.md), waits until the router sees them all, restarts children that die (`supervise`),
and stops everything on exit (SIGTERM, then SIGKILL after a timeout; etcd stopped; temp files removed;
shared-memory KV pools of nodes that died removed). Children end with it even when it is killed outright
(`control.process.with_parent`), and the next start removes the work dir such a run left behind. Without a
model it serves SmolLM2 (`cli.default_model`). `pdcluster up`, the end-to-end tests and `benchmarks/serving.py`
drive it.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from pdcluster.cli.sizing import node_device_env, node_knob, share_host_cores, size_node_memory
from pdcluster.control.config import CommonConfig, check_advertised_host, declared_default, parse_endpoint
from pdcluster.control.cpus import format_cpus, on_cpus
from pdcluster.control.etcd_server import EtcdServer, free_port, is_reachable
from pdcluster.control.process import pid_alive, with_parent
from pdcluster.router.settings import RouterConfig

log = logging.getLogger(__name__)

STOP_TIMEOUT = 20.0  # SIGTERM -> SIGKILL
RESTART_BACKOFF = (1.0, 2.0, 4.0, 8.0, 16.0, 30.0)   # seconds before the 1st, 2nd, ... restart of a child
MAX_RESTARTS = 5   # within RESTART_WINDOW: then the child is given up on (as systemd's StartLimitBurst)
RESTART_WINDOW = 600.0
WORK_DIR_PREFIX = "pdcluster-up-"   # + "<pid>-<random>" in the temp dir


@dataclass
class Service:
    """One child process of the cluster."""

    kind: str  # router | prefill | decode
    node_id: str
    proc: subprocess.Popen
    log_path: Path
    metrics_port: int = 0
    port: int = 0  # router HTTP
    restarts: list[float] = field(default_factory=list)   # monotonic times of its restarts
    restart_at: float | None = None   # when it died: the time its restart is due

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    @property
    def metrics_url(self) -> str:
        port = self.port if self.kind == "router" else self.metrics_port
        return f"http://127.0.0.1:{port}/metrics"

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


@dataclass
class LocalCluster:
    model: str | None = None  # HF model dir; None: SmolLM2 (`cli.default_model`), converted once into the cache
    num_prefill: int = 1
    num_decode: int = 1
    port: int = declared_default(RouterConfig, "port")  # router HTTP port; 0 = pick a free one
    etcd: str | None = None  # "host:port" of an etcd to use; None or unreachable: start one
    cluster: str = declared_default(CommonConfig, "cluster")
    node_config: dict[str, Any] = field(default_factory=dict)  # engine knobs etc. for prefill + decode
    router_config: dict[str, Any] = field(default_factory=dict)
    lease_ttl: int = declared_default(CommonConfig, "lease_ttl")
    log_level: str = declared_default(CommonConfig, "log_level")
    threads_per_node: int | None = None  # OMP_NUM_THREADS of node processes (None: one per core of its share)
    cluster_secret: str | None = None  # secret file for every service; None: a new one in the work dir; "": none
    work_dir: Path | None = None
    etcd_server: EtcdServer | None = None
    services: list[Service] = field(default_factory=list)
    _own_dir: bool = False
    _node_env: dict[str, dict[str, str]] = field(default_factory=dict)  # node id -> its visible devices
    _cores: tuple[list[int], list[list[int]]] | None = None   # core_plan()'s

    # ---- lifecycle -------------------------------------------------------------------------------

    def start(self, timeout: float = 120.0) -> "LocalCluster":
        try:
            self._start(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self, timeout: float) -> None:
        if self.work_dir is None:
            sweep_stale_work_dirs()
            self.work_dir = Path(tempfile.mkdtemp(prefix=f"{WORK_DIR_PREFIX}{os.getpid()}-"))
            self._own_dir = True
        if self.cluster_secret is None:
            from pdcluster.control.keys import generate_secret

            self.cluster_secret = str(self.work_dir / "cluster.secret")
            generate_secret(self.cluster_secret, force=True)
        self.resolve_model()
        size_node_memory(self.node_config, self.num_prefill + self.num_decode)
        self._start_etcd()
        assert self.etcd is not None
        for config in (self.router_config, self.node_config):   # refused before any child starts
            check_advertised_host(config.get("host", "127.0.0.1"), [self.etcd])
        if self.port == 0:
            self.port = free_port()
        deadline = time.monotonic() + timeout
        self.start_router()
        for i in range(self.num_prefill):
            self.start_node("prefill", f"prefill-{i}")
        for i in range(self.num_decode):
            self.start_node("decode", f"decode-{i}")
        self.wait_ready(self.num_prefill, self.num_decode, max(1.0, deadline - time.monotonic()))

    def resolve_model(self) -> str:
        """The model dir; without one, the default model's (`cli.default_model`: SmolLM2, converted once into the
        cache), which also sets the nodes' dtype and the served name when they are not given."""
        if self.model is None:
            from pdcluster.cli.default_model import default_model

            self.model = default_model(self.node_config, self.router_config)
        return self.model

    def _start_etcd(self) -> None:
        if self.etcd and is_reachable(self.etcd, timeout=1.0):
            log.info("using etcd at %s", self.etcd)
            return
        assert self.work_dir is not None
        client_port = 0
        if self.etcd:
            host, port = parse_endpoint(self.etcd)
            if host in ("127.0.0.1", "localhost") and _port_free(port):
                client_port = port
        self.etcd_server = EtcdServer(data_dir=self.work_dir / "etcd" / "data", client_port=client_port,
                                      end_with_parent=True)
        with on_cpus(self.core_plan()[0]):
            self.etcd_server.start()
        self.etcd = self.etcd_server.endpoint
        log.info("started etcd at %s", self.etcd)

    def stop(self) -> None:
        """SIGTERM every service (router first), SIGKILL what is left after STOP_TIMEOUT; stop etcd."""
        routers = [s for s in self.services if s.kind == "router"]
        nodes = [s for s in self.services if s.kind != "router"]
        for group in (routers, nodes):
            for s in group:
                if s.alive:
                    s.proc.send_signal(signal.SIGTERM)
            for s in group:
                _wait_or_kill(s.proc, STOP_TIMEOUT)
        self.services = []
        self.sweep_dead_pools()
        if self.etcd_server is not None:
            self.etcd_server.stop()
        if self._own_dir and self.work_dir is not None:
            shutil.rmtree(self.work_dir, ignore_errors=True)

    def __enter__(self) -> "LocalCluster":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # ---- services --------------------------------------------------------------------------------

    def start_router(self) -> Service:
        config = {"etcd": [self.etcd], "cluster": self.cluster, "port": self.port, "model": self.model,
                  "log_level": self.log_level, "cluster_secret": self.cluster_secret, **self.router_config}
        return self._spawn("router", "router-0", config, port=self.port)

    def start_node(self, kind: str, node_id: str, **overrides: Any) -> Service:
        metrics_port = free_port()
        config = {"etcd": [self.etcd], "cluster": self.cluster, "model": self.model, "node_id": node_id,
                  "metrics_port": metrics_port, "lease_ttl": self.lease_ttl, "log_level": self.log_level,
                  "cluster_secret": self.cluster_secret,
                  **self.node_config, **overrides}
        if config.get("kv_offload_disk_path"):   # each node its own directory of the disk KV tier
            config["kv_offload_disk_path"] = str(Path(config["kv_offload_disk_path"]) / node_id)
        index = sum(1 for s in self.services if s.kind != "router")
        shares = self.core_plan()[1]
        if shares and not config.get("cpu_cores"):
            config["cpu_cores"] = format_cpus(shares[index % len(shares)])
        self._node_env[node_id] = node_device_env(node_knob(config, "device"),
                                                  int(node_knob(config, "tensor_parallel_size")),
                                                  index, self.num_prefill + self.num_decode)
        return self._spawn(kind, node_id, config, metrics_port=metrics_port)

    def _spawn(self, kind: str, node_id: str, config: dict[str, Any], **extra: Any) -> Service:
        assert self.work_dir is not None
        config_path = self.work_dir / f"{node_id}.yaml"
        config_path.write_text(yaml.safe_dump({k: v for k, v in config.items() if v is not None}))
        log_path = self.work_dir / f"{node_id}.log"
        service = Service(kind, node_id, self._launch(kind, config_path, log_path), log_path, **extra)
        self.services.append(service)
        return service

    def _launch(self, kind: str, config_path: Path, log_path: Path) -> subprocess.Popen:
        env = {**os.environ, **self._node_env.get(config_path.stem, {})}
        if kind != "router" and self.threads_per_node:
            env["OMP_NUM_THREADS"] = str(self.threads_per_node)
        cmd = with_parent([sys.executable, "-m", "pdcluster", kind, "--config", str(config_path)])
        with open(log_path, "ab") as out, on_cpus(self.core_plan()[0] if kind == "router" else []):
            return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)

    def core_plan(self) -> tuple[list[int], list[list[int]]]:
        """(the router's and etcd's cores, each node's) of this process's CPUs, shared once among the nodes
        (`sizing.share_host_cores`, weighted by tensor_parallel_size); ([], []) when the user placed the
        nodes (threads_per_node, or cpu_cores in node_config, which every node then takes as it is)."""
        if self._cores is None:
            if self.threads_per_node or self.node_config.get("cpu_cores"):
                self._cores = ([], [])
            else:
                tp = int(node_knob(self.node_config, "tensor_parallel_size"))
                cores = sorted(os.sched_getaffinity(0))
                self._cores = share_host_cores(cores, [tp] * (self.num_prefill + self.num_decode), self.num_prefill)
                log.info("cores %s: router + etcd %s; nodes %s", format_cpus(cores),
                         format_cpus(self._cores[0]) or "any core",
                         ", ".join(format_cpus(c) for c in self._cores[1]))
        return self._cores

    def supervise(self) -> list[str]:
        """Restart children that died, with backoff (RESTART_BACKOFF), while the others keep serving; what
        happened, one line per event. Raises RuntimeError for a child that died MAX_RESTARTS times within
        RESTART_WINDOW (it would only keep failing)."""
        events = []
        now = time.monotonic()
        for s in self.dead_services():
            if s.restart_at is None:
                s.restarts = [t for t in s.restarts if now - t < RESTART_WINDOW]
                if len(s.restarts) >= MAX_RESTARTS:
                    raise RuntimeError(f"{s.kind} {s.node_id} died {len(s.restarts) + 1} times in "
                                       f"{RESTART_WINDOW:.0f} s (exit code {s.proc.returncode}); log {s.log_path}:\n"
                                       f"{s.log_tail()}")
                delay = RESTART_BACKOFF[min(len(s.restarts), len(RESTART_BACKOFF) - 1)]
                s.restart_at = now + delay
                events.append(f"{s.kind} {s.node_id} exited with code {s.proc.returncode}; restarting in {delay:.0f} s")
            elif now >= s.restart_at:
                assert self.work_dir is not None
                s.proc = self._launch(s.kind, self.work_dir / f"{s.node_id}.yaml", s.log_path)
                s.restarts.append(now)
                s.restart_at = None
                events.append(f"{s.kind} {s.node_id} restarted (pid {s.proc.pid}, restart {len(s.restarts)})")
        for line in events:
            log.warning("%s", line)
        return events

    def service(self, node_id: str) -> Service:
        return next(s for s in self.services if s.node_id == node_id)

    def dead_services(self) -> list[Service]:
        """Children that exited; the shared-memory KV pools they could not remove are removed now."""
        dead = [s for s in self.services if not s.alive]
        if dead:
            self.sweep_dead_pools()
        return dead

    @staticmethod
    def sweep_dead_pools() -> None:
        from pdcluster.kv_transfer.shm import sweep_dead_pools

        for name in sweep_dead_pools():
            log.warning("removed /dev/shm/%s, the KV pool of a node process that died", name)

    # ---- readiness -------------------------------------------------------------------------------

    def health(self) -> dict[str, Any] | None:
        """The router's /health body, 200 or 503 alike ("status" says which: ok, no_decode_nodes, draining);
        None while it does not answer."""
        try:
            try:
                resp = urllib.request.urlopen(self.url + "/health", timeout=2.0)
            except urllib.error.HTTPError as exc:   # a 503 carries the same fields, beside "error"
                resp = exc
            with resp:
                return json.loads(resp.read())
        except (OSError, ValueError):
            return None

    def wait_ready(self, num_prefill: int, num_decode: int, timeout: float = 60.0,
                   nodes: set[str] | None = None, serving: bool = False) -> dict[str, Any]:
        """Until the router's /health lists the nodes (at least these counts, or exactly `nodes`); `serving`:
        and answers 200 (every model it serves has a decode node: requests are served)."""
        deadline = time.monotonic() + timeout
        health = None
        while time.monotonic() < deadline:
            dead = self.dead_services()
            if dead:
                s = dead[0]
                raise RuntimeError(f"{s.kind} {s.node_id} exited with code {s.proc.returncode}; "
                                   f"log {s.log_path}:\n{s.log_tail()}")
            health = self.health()
            if health is not None:
                listed = set(health.get("prefill_nodes", [])) | set(health.get("decode_nodes", []))
                counted = (nodes <= listed if nodes is not None
                           else len(health.get("prefill_nodes", [])) >= num_prefill
                           and len(health.get("decode_nodes", [])) >= num_decode)
                if counted and (not serving or health.get("status") == "ok"):
                    return health
            time.sleep(0.1)
        tails = "\n".join(f"--- {s.node_id}\n{s.log_tail(10)}" for s in self.services)
        raise TimeoutError(f"cluster not ready within {timeout:.0f} s (router health: {health})\n{tails}")


def sweep_stale_work_dirs(tmp: str | None = None) -> list[Path]:
    """Remove the work dirs of `pdcluster up` runs whose process is gone (killed before it could clean up;
    its children ended with it). Returns the dirs removed."""
    removed = []
    for path in Path(tmp or tempfile.gettempdir()).glob(f"{WORK_DIR_PREFIX}*-*"):
        pid = path.name[len(WORK_DIR_PREFIX):].split("-", 1)[0]
        if pid.isdigit() and not pid_alive(int(pid)) and path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def _port_free(port: int) -> bool:
    import socket

    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def _wait_or_kill(proc: subprocess.Popen, timeout: float) -> int:
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        log.warning("process %d did not stop within %.0f s: SIGKILL", proc.pid, timeout)
        proc.kill()
        return proc.wait(10)
