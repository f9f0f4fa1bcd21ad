"""N "hosts" on one machine for multi-host tests: network namespaces on a bridge, each with its own address
(10.<s>.0.<k>/16, s from 231 up: the first private test range no route of this machine covers yet), its own
loopback, and its own /dev/shm (every process runs in a private mount namespace with a fresh tmpfs there). Real
pdcluster processes run in them.

Root only (`ip netns`, mounts): the `hosts` fixture (and `module_hosts`, one set for a test module) skips with
the reason otherwise. Everything it made, processes, namespaces, veths and the bridge, is removed at teardown,
also when the test failed.

Partitions: `Host.link_down()` / `link_up()` pull and plug a host's cable (its veth on the bridge);
`Host.drop_from(addr, ...)` silently drops, in this host's input, every packet from those addresses (nft; a
one-way cut), `cut(a, b)` does it on both ends, `Host.heal()` removes the rules and plugs the cable back.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest

# Run `cmd` with a private /dev/shm: a new mount namespace (unshare), a tmpfs mounted over /dev/shm in it.
SHM_WRAPPER = "mount -t tmpfs -o size=512m,mode=1777 tmpfs /dev/shm && exec \"$@\""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def unavailable() -> str | None:
    """Why the harness cannot run here (None: it can)."""
    if os.geteuid() != 0:
        return "multi-host tests need root (network namespaces, mounts); run them as root (CI does)"
    for tool in ("ip", "unshare", "mount"):
        if shutil.which(tool) is None:
            return f"multi-host tests need `{tool}` (apt-get install -y iproute2 util-linux mount)"
    probe = f"pdt{uuid.uuid4().hex[:6]}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"`ip netns add` fails here: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


def nft_missing() -> str | None:
    """Why packet-filter partitions cannot run here (None: they can)."""
    if shutil.which("nft") is None:
        return "partition drills need `nft` (apt-get install -y nftables; `make test-deps` does it as root)"
    return None


NFT_TABLE = "pdpartition"


@dataclass
class Host:
    name: str  # its network namespace
    address: str
    work_dir: Path
    veth: str = ""  # its cable: the veth end on the bridge
    procs: list[subprocess.Popen] = field(default_factory=list)

    def link_down(self) -> None:
        """Unplug: nothing in or out (packets are lost silently, as with a pulled cable)."""
        _ip("link", "set", self.veth, "down")

    def link_up(self) -> None:
        _ip("link", "set", self.veth, "up")

    def drop_from(self, *addresses: str) -> None:
        """Silently drop every packet from `addresses` arriving at this host (a one-way cut: what this host
        sends still leaves). Rules add up until `heal()`."""
        self._nft(f"add table inet {NFT_TABLE}")
        self._nft(f"add chain inet {NFT_TABLE} input {{ type filter hook input priority 0 ; policy accept ; }}")
        for address in addresses:
            self._nft(f"add rule inet {NFT_TABLE} input ip saddr {address} drop")

    def heal(self) -> None:
        """Remove this host's drop rules and plug its cable back in."""
        self._nft(f"delete table inet {NFT_TABLE}", check=False)
        self.link_up()

    def _nft(self, command: str, check: bool = True) -> None:
        subprocess.run(["ip", "netns", "exec", self.name, "nft", *command.split()], capture_output=True, text=True,
                       check=check)

    def popen(self, cmd: list[str], log_name: str, env: dict[str, str] | None = None) -> subprocess.Popen:
        """Start `cmd` on this host (own netns, own /dev/shm); output to work_dir/log_name."""
        wrapped = ["ip", "netns", "exec", self.name, "unshare", "--mount", "--propagation", "private",
                   "sh", "-c", SHM_WRAPPER, "sh", *cmd]
        with open(self.work_dir / log_name, "ab") as out:
            proc = subprocess.Popen(wrapped, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env={**os.environ, **(env or {})}, start_new_session=True)
        self.procs.append(proc)
        return proc

    def run(self, cmd: list[str], timeout: float = 30.0) -> subprocess.CompletedProcess:
        wrapped = ["ip", "netns", "exec", self.name, "unshare", "--mount", "--propagation", "private",
                   "sh", "-c", SHM_WRAPPER, "sh", *cmd]
        return subprocess.run(wrapped, capture_output=True, text=True, timeout=timeout)

    def exec(self, cmd: list[str], timeout: float = 10.0) -> subprocess.CompletedProcess:
        """Run `cmd` in this host's network namespace only (cheap: no private /dev/shm), e.g. `ss`."""
        return subprocess.run(["ip", "netns", "exec", self.name, *cmd], capture_output=True, text=True,
                              timeout=timeout)

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM each process group, SIGKILL what is left after `timeout`."""
        for proc in self.procs:
            if proc.poll() is None:
                _signal_group(proc, signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                _signal_group(proc, signal.SIGKILL)
                proc.wait(5)


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


def free_subnet(first: int = 231, last: int = 254) -> int:
    """The first s in [first, last] whose 10.s.0.0/16 no route of this machine touches. A bridge left by a killed
    run (its namespaces outlive it) keeps its route; a second bridge on the same range would lose every packet
    the test itself sends to its hosts to the first one."""
    routes = _ip("-4", "route", "show").stdout
    for subnet in range(first, last + 1):
        if not re.search(rf"(^|[^0-9])10\.{subnet}\.", routes, re.MULTILINE):
            return subnet
    raise RuntimeError(f"no free 10.x.0.0/16 test range between 10.{first} and 10.{last}: {routes}")


class Hosts:
    """Makes hosts on one bridge; `close()` removes all of it."""

    def __init__(self, work_dir: Path) -> None:
        tag = uuid.uuid4().hex[:5]
        self.tag = tag
        self.bridge = f"pdbr{tag}"
        self.subnet = free_subnet()  # hosts are 10.<subnet>.0.<k>/16
        self.work_dir = work_dir
        self.hosts: list[Host] = []
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"10.{self.subnet}.0.254/16", "dev", self.bridge)  # the machine itself, for the test
        _ip("link", "set", self.bridge, "up")

    def add(self) -> Host:
        i = len(self.hosts) + 1
        name, veth, peer = f"pd{self.tag}h{i}", f"pd{self.tag}v{i}", f"pd{self.tag}p{i}"
        _ip("netns", "add", name)
        host = Host(name, f"10.{self.subnet}.0.{i}", self.work_dir / name, veth)
        self.hosts.append(host)
        host.work_dir.mkdir(parents=True, exist_ok=True)
        _ip("link", "add", veth, "type", "veth", "peer", "name", peer)
        _ip("link", "set", veth, "master", self.bridge)
        _ip("link", "set", veth, "up")
        _ip("link", "set", peer, "netns", name)
        ns = ("-n", name)
        _ip(*ns, "link", "set", peer, "name", "eth0")
        _ip(*ns, "addr", "add", f"{host.address}/16", "dev", "eth0")
        _ip(*ns, "link", "set", "eth0", "up")
        _ip(*ns, "link", "set", "lo", "up")
        return host

    def close(self) -> None:
        for host in self.hosts:
            host.stop()
        for i, host in enumerate(self.hosts, 1):
            _ip("link", "del", f"pd{self.tag}v{i}", check=False)
            _ip("netns", "del", host.name, check=False)
        _ip("link", "del", self.bridge, check=False)


def cut(a: Host, b: Host) -> None:
    """A two-way partition between two hosts (each drops the other's packets); both keep every other link."""
    a.drop_from(b.address)
    b.drop_from(a.address)


@contextmanager
def host_factory(work_dir: Path):
    """`make(n)` -> n fresh Host objects on one bridge; all of it torn down on exit. Skips without root."""
    why = unavailable()
    if why:
        pytest.skip(why)
    made: list[Hosts] = []

    def make(n: int) -> list[Host]:
        net = Hosts(work_dir / f"net{len(made)}")
        made.append(net)
        for _ in range(n):
            net.add()
        return net.hosts

    try:
        yield make
    finally:
        for net in made:
            net.close()


@pytest.fixture
def hosts(tmp_path):
    """Factory: `hosts(n)` -> n fresh Host objects on one bridge; torn down after the test."""
    with host_factory(tmp_path) as make:
        yield make


@pytest.fixture(scope="module")
def module_hosts(tmp_path_factory):
    """`hosts` for a whole test module (drills sharing one cluster)."""
    with host_factory(tmp_path_factory.mktemp("hosts")) as make:
        yield make
