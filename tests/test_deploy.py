"""deploy/: the ansible playbooks run for real against localhost into a temporary prefix (services
not managed), and what they render is checked with the real tools: systemd-analyze verify, the
pdcluster config loader, and the etcd binary started from the rendered etcd unit.

Two inventory hosts, both local: `cpuhost` (etcd + router + prefill + decode, device cpu) and
`npuhost` (prefill + decode on two NPUs, device npu) with a fake CANN set_env.sh and hccn.conf, so
the Ascend path (captured CANN environment, HCCL settings, per-device instances) is rendered too. A second
deployment runs tensor parallelism per role: four NPUs, prefill TP 2 (two processes) and decode TP 1 on npuhost.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from pdcluster.cli.config import load_config
from pdcluster.control.etcd_server import etcd_binary, free_port, health_ok

ROOT = Path(__file__).resolve().parents[1]
ANSIBLE_DIR = ROOT / "deploy" / "ansible"
VENV_BIN = Path(sys.executable).parent
ANSIBLE_PLAYBOOK = VENV_BIN / "ansible-playbook"
ANSIBLE_LINT = VENV_BIN / "ansible-lint"
PDCLUSTER = VENV_BIN / "pdcluster"
CLUSTER = "deploytest"
DRAIN_TIMEOUT = 42
NPU_DEVICES = [0, 1]
TP_NPU_DEVICES = [0, 1, 2, 3]   # the tensor-parallel deployment: tensor_parallel_size 2 -> groups [0, 1], [2, 3]
ROUTER_KEYS = ["team-a-0123456789", "team-b-9876543210"]
PREFILL_CORES = str(min(os.sched_getaffinity(0)))   # cpuhost's prefill process runs there (cpu_cores)
TLS_FILES = {"ca.crt": 0o644, "client.crt": 0o644, "client.key": 0o600, "etcd.password": 0o600,
             "cluster.secret": 0o600}

pytestmark = [pytest.mark.deploy, pytest.mark.skipif(not ANSIBLE_PLAYBOOK.exists(),
                                                     reason="ansible-core not installed (pip install -e '.[dev]')")]

FAKE_SET_ENV = """\
export ASCEND_TOOLKIT_HOME=/usr/local/Ascend/ascend-toolkit/latest
export LD_LIBRARY_PATH=${ASCEND_TOOLKIT_HOME}/lib64:/usr/local/Ascend/driver/lib64/driver:${LD_LIBRARY_PATH}
export PATH=${ASCEND_TOOLKIT_HOME}/bin:$PATH
export ASCEND_OPP_PATH=${ASCEND_TOOLKIT_HOME}/opp
export TRICKY_VALUE='a "quoted" \\ value with $dollar'
echo "set_env.sh chatter on stdout must not end up in the environment"
"""


def run_ansible(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, ANSIBLE_NOCOLOR="1", ANSIBLE_FORCE_COLOR="0", ANSIBLE_PIPELINING="1",
               PATH=f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    return subprocess.run([str(ANSIBLE_PLAYBOOK), *args], cwd=ANSIBLE_DIR, env=env, capture_output=True,
                          text=True, timeout=timeout)


def read_unit(path: Path) -> dict[str, list[str]]:
    """'Section.Key' -> values in file order (systemd allows repeated keys such as EnvironmentFile)."""
    out: dict[str, list[str]] = {}
    section = ""
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("["):
            section = line.strip("[]")
            continue
        key, _, value = line.partition("=")
        out.setdefault(f"{section}.{key.strip()}", []).append(value.strip())
    return out


def read_env_file(path: Path) -> dict[str, str]:
    """An EnvironmentFile as systemd reads ours: KEY=value or KEY="value" with \\ escapes."""
    env = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line[0] in "#;":
            continue
        key, _, value = line.partition("=")
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] == '"':
            value = re.sub(r"\\(.)", r"\1", value[1:-1])
        env[key.strip()] = value
    return env


def unit_environment(unit: dict[str, list[str]], instance: str) -> dict[str, str]:
    env: dict[str, str] = {}
    for name in unit.get("Service.EnvironmentFile", []):
        env.update(read_env_file(Path(name.replace("%i", instance))))
    return env


class Deployment:
    """The result of one site.yml run: host prefixes and the values the test chose."""

    def __init__(self, base: Path, npu_devices: list[int] = NPU_DEVICES, host_vars: dict[str, dict] | None = None):
        self.base = base
        self.npu_devices = npu_devices
        self.host_vars = host_vars or {}
        self.cpu = base / "cpu"
        self.npu = base / "npu"
        self.model = base / "models" / "tiny"
        self.etcd_port = free_port()
        self.etcd_peer_port = free_port()
        self.etcd_metrics_port = free_port()
        self.secrets = base / "secrets" / CLUSTER   # pdcluster_secrets_dir's default: next to the inventory
        self.ports = {name: free_port() for name in (
            "prefill_control", "prefill_load", "prefill_kv", "prefill_metrics",
            "decode_control", "decode_load", "decode_kv", "decode_metrics", "router", "router_metrics")}
        self.output = ""

    def config_dir(self, host: str) -> Path:
        return getattr(self, host[:3]) / "etc" / "pdcluster"

    def unit_dir(self, host: str) -> Path:
        return getattr(self, host[:3]) / "etc" / "systemd" / "system"

    def write_inputs(self) -> list[str]:
        (self.base / "cann").mkdir()
        (self.base / "cann" / "set_env.sh").write_text(FAKE_SET_ENV)
        (self.base / "hccn.conf").write_text("".join(
            f"address_{dev}=192.168.100.{10 + dev}\nnetmask_{dev}=255.255.255.0\n" for dev in self.npu_devices))
        local = {"ansible_connection": "local", "ansible_python_interpreter": sys.executable,
                 "pdcluster_advertise_host": "127.0.0.1"}
        inventory = {"all": {
            "hosts": {
                "cpuhost": {**local, "pdcluster_prefix": str(self.cpu), "pdcluster_device": "cpu",
                            "pdcluster_prefill_cpu_cores": [PREFILL_CORES]},
                "npuhost": {**local, "pdcluster_prefix": str(self.npu), "pdcluster_device": "npu",
                            "pdcluster_cann_set_env_scripts": [str(self.base / "cann" / "set_env.sh")],
                            "pdcluster_hccn_conf": str(self.base / "hccn.conf"),
                            "pdcluster_prefill_devices": self.npu_devices,
                            "pdcluster_decode_devices": self.npu_devices},
            },
            "children": {
                "etcd": {"hosts": {"cpuhost": None}},
                "router": {"hosts": {"cpuhost": None}},
                "prefill": {"hosts": {"cpuhost": None, "npuhost": None}},
                "decode": {"hosts": {"cpuhost": None, "npuhost": None}},
            },
        }}
        for host, values in self.host_vars.items():
            inventory["all"]["hosts"][host].update(values)
        (self.base / "inventory.yml").write_text(yaml.safe_dump(inventory))
        p = self.ports
        extra = {
            # The no-root mode: no user creation, no systemctl, no pip; everything under the prefix.
            "pdcluster_manage_services": False, "pdcluster_install": False, "pdcluster_create_user": False,
            "pdcluster_python": sys.executable, "pdcluster_user": "pdsvc", "pdcluster_group": "pdsvc",
            "pdcluster_cluster": CLUSTER, "pdcluster_model": str(self.model),
            "pdcluster_drain_timeout_s": DRAIN_TIMEOUT,
            "pdcluster_etcd_client_port": self.etcd_port, "pdcluster_etcd_peer_port": self.etcd_peer_port,
            "pdcluster_etcd_metrics_port": self.etcd_metrics_port, "pdcluster_router_api_keys": ROUTER_KEYS,
            "pdcluster_prefill_control_port": p["prefill_control"], "pdcluster_prefill_load_port": p["prefill_load"],
            "pdcluster_prefill_kv_port": p["prefill_kv"], "pdcluster_prefill_metrics_port": p["prefill_metrics"],
            "pdcluster_decode_control_port": p["decode_control"], "pdcluster_decode_load_port": p["decode_load"],
            "pdcluster_decode_kv_port": p["decode_kv"], "pdcluster_decode_metrics_port": p["decode_metrics"],
            "pdcluster_router_port": p["router"], "pdcluster_router_metrics_port": p["router_metrics"],
            "pdcluster_router_api_key": 'k3y"with\\quote',
        }
        (self.base / "extra.json").write_text(json.dumps(extra))
        return ["-i", str(self.base / "inventory.yml"), "-e", f"@{self.base / 'extra.json'}"]


def deploy(d: Deployment) -> Deployment:
    args = d.write_inputs()
    result = run_ansible(*args, "site.yml")
    d.output = result.stdout + result.stderr
    assert result.returncode == 0, d.output[-6000:]
    d.args = args
    return d


@pytest.fixture(scope="module")
def deployed(tmp_path_factory) -> Deployment:
    return deploy(Deployment(tmp_path_factory.mktemp("deploy")))


@pytest.fixture(scope="module")
def deployed_tp(tmp_path_factory) -> Deployment:
    """Tensor parallelism set per host and role: npuhost (four NPUs per role) prefills with tensor_parallel_size 2
    and decodes with 1; cpuhost runs TP 2 for both roles with each rank's KV pool its own slice
    (pdcluster_kv_pool_per_rank) and two decode processes. npuhost held instances of tensor_parallel_size 1 (and a
    decode group of 4) before (their files are there): the run must remove those no longer in its groups."""
    tp = {"pdcluster_tensor_parallel_size": 2}
    d = Deployment(tmp_path_factory.mktemp("deploy_tp"), TP_NPU_DEVICES, {
        "cpuhost": {**tp, "pdcluster_kv_pool_per_rank": True, "pdcluster_decode_devices": [0, 1]},
        "npuhost": {**tp, "pdcluster_decode_tensor_parallel_size": 1}})
    d.config_dir("npuhost").mkdir(parents=True)
    for name in ("prefill-0", "prefill-3", "decode-0-1-2-3"):
        for ext in ("yaml", "env"):
            (d.config_dir("npuhost") / f"{name}.{ext}").write_text("# from tensor_parallel_size 1\n")
    return deploy(d)


def recap(output: str) -> dict[str, dict[str, int]]:
    """PLAY RECAP counters per host."""
    hosts = {}
    for host, counters in re.findall(r"^(\S+)\s+:\s+(ok=.*)$", output, re.MULTILINE):
        hosts[host] = {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", counters)}
    return hosts


# --- static checks ---------------------------------------------------------------------------------

def test_every_playbook_passes_syntax_check():
    playbooks = sorted(p.name for p in ANSIBLE_DIR.glob("*.yml"))
    assert {"site.yml", "rolling_upgrade.yml"} <= set(playbooks)
    result = run_ansible("--syntax-check", "-i", "inventory.example.ini", *playbooks, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.skipif(not ANSIBLE_LINT.exists(), reason="ansible-lint not installed")
def test_ansible_lint_production_profile_passes():
    env = dict(os.environ, NO_COLOR="1", PATH=f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    result = subprocess.run([str(ANSIBLE_LINT), "--nocolor"], cwd=ANSIBLE_DIR, env=env, capture_output=True,
                            text=True, timeout=240)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-6000:]
    assert "Profile 'production' was required, and it passed" in out, out[-3000:]


def test_bad_settings_fail_before_touching_the_host(tmp_path):
    d = Deployment(tmp_path)
    d.args = d.write_inputs()
    # An NPU without an address in hccn.conf cannot do cross-host HCCL: the run stops and names it (every
    # device of a tensor-parallel group is checked, not only the group's first).
    result = run_ansible(*d.args, "site.yml", "--limit", "npuhost", "-e",
                         '{"pdcluster_tensor_parallel_size": 2, "pdcluster_decode_devices": [0, 1, 6, 7]}')
    out = result.stdout + result.stderr
    assert result.returncode != 0
    assert "has no address_<id> for NPU(s) ['6', '7']" in out, out[-3000:]
    assert not (d.npu / "etc" / "pdcluster" / "ascend.env").exists()

    # Settings are checked first: nothing is written on any host.
    def refused(*extra: str, deployment: Deployment = d) -> str:
        result = run_ansible(*deployment.args, "site.yml", *extra, "--tags", "checks")
        out = result.stdout + result.stderr
        assert result.returncode != 0, out[-3000:]
        assert not (deployment.cpu / "etc").exists(), "files written despite a failed check"
        return " ".join(out.split())   # fail_msg folds lines: compare with single spaces

    out = refused("-e", "pdcluster_tensor_parallel_size=0")
    assert "pdcluster_tensor_parallel_size=0: must be an integer >= 1" in out, out[-3000:]
    # With tensor_parallel_size 2 each node process owns two devices: three NPUs cannot be split.
    out = refused("-e", '{"pdcluster_tensor_parallel_size": 2, "pdcluster_decode_devices": [0, 1, 2]}')
    assert ("npuhost: pdcluster_decode_devices=[0, 1, 2] lists 3 device(s), not a multiple of "
            "pdcluster_decode_tensor_parallel_size=2") in out, out[-3000:]
    assert "cpuhost: pdcluster_decode_devices" not in out   # on CPU each listed id is one process of 2 ranks
    out = refused("-e", '{"pdcluster_prefill_tensor_parallel_size": 4, "pdcluster_prefill_devices": [0, 1]}')
    assert ("npuhost: pdcluster_prefill_devices=[0, 1] lists 2 device(s), not a multiple of "
            "pdcluster_prefill_tensor_parallel_size=4") in out, out[-3000:]

    # The tensor-parallel size is set per role (pdcluster_<role>_tensor_parallel_size), not in a role's config.
    out = refused("-e", '{"pdcluster_decode_config": {"tensor_parallel_size": 2}}')
    assert "pdcluster_decode_config sets tensor_parallel_size" in out, out[-3000:]
    # One CPU list per node process of the role on the host (npuhost has two decode processes, cpuhost one).
    out = refused("-e", '{"pdcluster_decode_cpu_cores": ["0", "1"]}')
    assert ("cpuhost: pdcluster_decode_cpu_cores=['0', '1'] must be empty or hold one CPU list like \"0-15\" or "
            "\"0-7,16-23\" for each of the 1 decode node process(es)") in out, out[-3000:]
    assert "npuhost: pdcluster_decode_cpu_cores" not in out
    out = refused("-e", '{"pdcluster_decode_cpu_cores": ["0-1,a", "2"]}')
    assert "npuhost: pdcluster_decode_cpu_cores=['0-1,a', '2'] must be empty" in out, out[-3000:]


# --- what site.yml renders -----------------------------------------------------------------------------

def test_site_renders_exactly_the_expected_files(deployed):
    def files(root: Path) -> set[str]:
        return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}

    cfg, units, tls = "etc/pdcluster/", "etc/systemd/system/", "etc/pdcluster/tls/"
    assert files(deployed.cpu) == {tls + name for name in [*TLS_FILES, "etcd.crt", "etcd.key"]} | {
        cfg + "pdcluster.env", cfg + "etcd.yaml", cfg + "router.yaml", cfg + "router.env", cfg + "router.api_keys",
        cfg + "prefill-0.yaml", cfg + "prefill-0.env", cfg + "decode-0.yaml", cfg + "decode-0.env",
        units + "pdcluster-etcd.service", units + "pdcluster-router.service",
        units + "pdcluster-prefill@.service", units + "pdcluster-decode@.service",
    }
    assert (deployed.cpu / "var/lib/pdcluster/etcd").is_dir()
    assert files(deployed.npu) == {tls + name for name in TLS_FILES} | {cfg + "pdcluster.env", cfg + "ascend.env",
                                   units + "pdcluster-prefill@.service", units + "pdcluster-decode@.service"} | {
        f"{cfg}{role}-{dev}.{ext}" for role in ("prefill", "decode") for dev in NPU_DEVICES for ext in ("yaml", "env")}
    assert (deployed.cpu / cfg / "router.env").stat().st_mode & 0o777 == 0o600
    assert (deployed.cpu / cfg / "router.api_keys").stat().st_mode & 0o777 == 0o600
    for root, extra in ((deployed.cpu, {"etcd.crt": 0o644, "etcd.key": 0o600}), (deployed.npu, {})):
        for name, mode in {**TLS_FILES, **extra}.items():
            assert (root / tls / name).stat().st_mode & 0o777 == mode, name
        # Every host has the same CA, password and cluster secret, and a client certificate of its own.
        for name in ("ca.crt", "cluster.secret"):
            assert (root / tls / name).read_bytes() == (deployed.secrets / name).read_bytes()
    assert (deployed.cpu / tls / "client.crt").read_bytes() != (deployed.npu / tls / "client.crt").read_bytes()


def openssl(*args: str) -> str:
    return subprocess.run(["openssl", *args], capture_output=True, text=True, timeout=30, check=True).stdout


@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl not installed")
def test_generated_certificates_chain_to_the_cluster_ca(deployed):
    secrets, tls = deployed.secrets, deployed.config_dir("cpuhost") / "tls"
    assert (secrets / "ca.key").stat().st_mode & 0o777 == 0o600 and not (tls / "ca.key").exists()
    for cert in (tls / "etcd.crt", tls / "client.crt", deployed.config_dir("npuhost") / "tls" / "client.crt"):
        assert openssl("verify", "-CAfile", str(secrets / "ca.crt"), str(cert)).strip().endswith(": OK")
    server = openssl("x509", "-in", str(tls / "etcd.crt"), "-noout", "-text")
    assert "IP Address:127.0.0.1" in server and "TLS Web Server Authentication" in server
    client = openssl("x509", "-in", str(tls / "client.crt"), "-noout", "-subject", "-ext", "extendedKeyUsage")
    assert "CN = pdcluster-client-cpuhost" in client and "TLS Web Client Authentication" in client
    assert "Server" not in client


def test_every_rendered_unit_passes_systemd_analyze_verify(deployed, tmp_path):
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze not installed")
    # Template units are verified as the instances systemctl would start (pdcluster-decode@0, ...).
    names = []
    for host, devices in (("cpuhost", [0]), ("npuhost", NPU_DEVICES)):
        host_dir = tmp_path / host
        host_dir.mkdir()
        for unit in deployed.unit_dir(host).iterdir():
            shutil.copy(unit, host_dir / unit.name)
            if unit.name.endswith("@.service"):
                for dev in devices:
                    instance = host_dir / unit.name.replace("@.service", f"@{dev}.service")
                    instance.symlink_to(unit.name)
                    names.append(str(instance))
            else:
                names.append(str(host_dir / unit.name))
    assert len(names) == 2 + 2 + 2 * len(NPU_DEVICES)
    result = subprocess.run([analyze, "verify", "--man=no", *names], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and result.stdout + result.stderr == "", result.stdout + result.stderr

    # The same check rejects a unit whose binary is missing, so a pass above means something.
    broken = tmp_path / "broken.service"
    broken.write_text(Path(names[0]).read_text().replace(str(PDCLUSTER), "/nonexistent/pdcluster")
                      .replace(str(etcd_binary()), "/nonexistent/etcd"))
    result = subprocess.run([analyze, "verify", "--man=no", str(broken)], capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and "/nonexistent/" in result.stderr


def group_vars(name: str) -> dict:
    return yaml.safe_load((ANSIBLE_DIR / "group_vars" / f"{name}.yml").read_text())


@pytest.mark.parametrize("host,devices", [("cpuhost", [0]), ("npuhost", NPU_DEVICES)])
@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_node_unit_runs_pdcluster_with_its_rendered_config(deployed, host, devices, role):
    check_node_instances(deployed, host, role, [[device] for device in devices], tensor_parallel_size=1)


def check_node_instances(deployed: Deployment, host: str, role: str, groups: list[list[int]],
                         tensor_parallel_size: int, kv_pool_per_rank: bool = False,
                         prefill_processes: int | None = None) -> None:
    """The role's unit and the instances it runs on `host`: one per device group, with its config and env
    (`prefill_processes`: the host's prefill node processes, when not as many as `groups`)."""
    unit = read_unit(deployed.unit_dir(host) / f"pdcluster-{role}@.service")
    config_dir = deployed.config_dir(host)
    overrides = group_vars(role)[f"pdcluster_{role}_config"]
    everywhere = group_vars("all")
    assert unit["Service.Restart"] == ["on-failure"]
    assert unit["Service.KillSignal"] == ["SIGTERM"]
    assert unit["Service.TimeoutStopSec"] == [str(DRAIN_TIMEOUT)]
    assert unit["Service.LimitMEMLOCK"] == ["infinity"]
    assert shlex.split(unit["Service.ExecStopPost"][0]) == [str(PDCLUSTER), "cleanup"]  # dead nodes' shm pools
    assert unit["Service.User"] == ["pdsvc"] and unit["Service.Group"] == ["pdsvc"]
    assert "network-online.target" in unit["Unit.After"][0] and "pdcluster-etcd.service" in unit["Unit.After"][0]
    ascend_env = str(config_dir / "ascend.env")
    assert (ascend_env in unit["Service.EnvironmentFile"]) == (host == "npuhost")

    for index, group in enumerate(groups):
        instance = "-".join(map(str, group))   # "3", or "0-1" with tensor_parallel_size 2
        argv = shlex.split(unit["Service.ExecStart"][0].replace("%i", instance))
        assert argv[:3] == [str(PDCLUSTER), role, "--config"] and len(argv) == 4
        config_path = Path(argv[3])
        assert config_path == config_dir / f"{role}-{instance}.yaml"
        raw = yaml.safe_load(config_path.read_text())
        for key, value in overrides.items():
            assert raw[key] == value, f"{key}: group_vars/{role}.yml says {value}, config has {raw[key]}"
        assert raw["log_format"] == everywhere["pdcluster_log_format"]
        assert raw["enable_prefix_caching"] is everywhere["pdcluster_enable_prefix_caching"]

        # The real loader accepts the file (unknown keys or bad values would raise here).
        config = load_config(role, config_path, env={})
        assert config.role == role and config.cluster == CLUSTER
        assert config.node_id == f"{host}-{role}-{instance}"
        assert config.etcd == [f"127.0.0.1:{deployed.etcd_port}"]
        assert config.host == "127.0.0.1" and config.model == str(deployed.model)
        assert config.device == ("npu" if host == "npuhost" else "cpu")
        assert config.block_size is None   # unset: the engine takes the device's (with_device_defaults)
        assert config.tensor_parallel_size == tensor_parallel_size
        assert config.cpu_cores == (PREFILL_CORES if (host, role) == ("cpuhost", "prefill") else "")
        assert config.collective_timeout == everywhere["pdcluster_collective_timeout"]
        tls = config_dir / "tls"
        assert (config.etcd_ca, config.etcd_cert, config.etcd_key, config.etcd_password_file) == (
            str(tls / "ca.crt"), str(tls / "client.crt"), str(tls / "client.key"), str(tls / "etcd.password"))
        assert config.etcd_user == "pdcluster" and config.cluster_secret == str(tls / "cluster.secret")
        for port in ("control", "load", "metrics"):
            assert getattr(config, f"{port}_port") == deployed.ports[f"{role}_{port}"] + index
        # ranks of a pool sliced per rank (a device's, or kv_pool_per_rank) listen on kv_port + rank (per-rank KV
        # transfer): the processes' ports do not overlap
        assert config.kv_pool_per_rank is kv_pool_per_rank
        sliced = host == "npuhost" or kv_pool_per_rank
        assert config.kv_port == deployed.ports[f"{role}_kv"] + index * (tensor_parallel_size if sliced else 1)

        env = unit_environment(unit, instance)
        assert env["TORCH_DEVICE_BACKEND_AUTOLOAD"] == "0"
        if host == "npuhost":
            # Rank r of the node runs on the r-th listed device; npuhost's decode processes follow its
            # prefill processes in the HCCL port range (a host in both groups).
            assert env["ASCEND_RT_VISIBLE_DEVICES"] == ",".join(map(str, group))
            before = (len(groups) if prefill_processes is None else prefill_processes) if role == "decode" else 0
            assert env["HCCL_IF_BASE_PORT"] == str(60000 + 16 * (before + index))
            assert env["PYTORCH_NPU_ALLOC_CONF"] == "expandable_segments:True"
        else:
            assert not {"ASCEND_RT_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES", "HCCL_IF_BASE_PORT"} & env.keys()


def test_tensor_parallel_nodes_own_consecutive_device_groups(deployed_tp):
    # npuhost: four NPUs per role; prefill tensor_parallel_size 2 -> two processes of two devices, decode 1 -> four.
    check_node_instances(deployed_tp, "npuhost", "prefill", [TP_NPU_DEVICES[:2], TP_NPU_DEVICES[2:]],
                         tensor_parallel_size=2)
    check_node_instances(deployed_tp, "npuhost", "decode", [[d] for d in TP_NPU_DEVICES], tensor_parallel_size=1,
                         prefill_processes=2)
    # A CPU host has no devices to split: each listed id is one process whose 2 ranks share the cores; with each
    # rank's pool its own slice, the two decode processes' kv ports are 2 apart.
    check_node_instances(deployed_tp, "cpuhost", "prefill", [[0]], tensor_parallel_size=2, kv_pool_per_rank=True)
    check_node_instances(deployed_tp, "cpuhost", "decode", [[0], [1]], tensor_parallel_size=2, kv_pool_per_rank=True)
    # Exactly the groups' instances; those of other sizes were removed.
    configs = sorted(p.name for p in deployed_tp.config_dir("npuhost").glob("*-*.*"))
    instances = [("prefill", "0-1"), ("prefill", "2-3")] + [("decode", str(d)) for d in TP_NPU_DEVICES]
    assert configs == sorted(f"{role}-{instance}.{ext}" for role, instance in instances for ext in ("yaml", "env"))


def test_router_unit_and_config(deployed):
    unit = read_unit(deployed.unit_dir("cpuhost") / "pdcluster-router.service")
    argv = shlex.split(unit["Service.ExecStart"][0])
    assert argv == [str(PDCLUSTER), "router", "--config", str(deployed.config_dir("cpuhost") / "router.yaml")]
    assert unit["Service.TimeoutStopSec"] == [str(DRAIN_TIMEOUT)]
    assert "pdcluster-etcd.service" in unit["Unit.Wants"][0]
    env = unit_environment(unit, "")
    config = load_config("router", argv[3], env={k: v for k, v in env.items() if k.startswith("PDCLUSTER_")})
    assert config.port == deployed.ports["router"] and config.metrics_port == deployed.ports["router_metrics"]
    assert config.etcd == [f"127.0.0.1:{deployed.etcd_port}"] and config.cluster == CLUSTER
    assert config.api_key == 'k3y"with\\quote', "the API key must survive env-file quoting exactly"
    assert config.accepted_keys == ('k3y"with\\quote', *ROUTER_KEYS)
    assert config.etcd_ca == str(deployed.config_dir("cpuhost") / "tls" / "ca.crt") and config.etcd_user == "pdcluster"
    assert "k3y" not in Path(argv[3]).read_text(), "the API key belongs in the 0600 env file, not the config"


def test_ascend_env_holds_the_captured_cann_environment_and_hccl_settings(deployed):
    env = read_env_file(deployed.config_dir("npuhost") / "ascend.env")
    assert env["ASCEND_TOOLKIT_HOME"] == "/usr/local/Ascend/ascend-toolkit/latest"
    assert env["ASCEND_OPP_PATH"] == "/usr/local/Ascend/ascend-toolkit/latest/opp"
    assert env["TRICKY_VALUE"] == 'a "quoted" \\ value with $dollar'
    # "$LD_LIBRARY_PATH" was empty: no empty entry (= the working directory) may remain.
    assert env["LD_LIBRARY_PATH"] == ("/usr/local/Ascend/ascend-toolkit/latest/lib64:"
                                      "/usr/local/Ascend/driver/lib64/driver")
    assert env["PATH"].startswith("/usr/local/Ascend/ascend-toolkit/latest/bin:")
    for noise in ("PWD", "SHLVL", "_", "OLDPWD", "PYTHONCOERCECLOCALE"):
        assert noise not in env
    everywhere = group_vars("all")
    assert env["HCCL_CONNECT_TIMEOUT"] == str(everywhere["pdcluster_hccl_connect_timeout"])
    assert env["HCCL_EXEC_TIMEOUT"] == str(everywhere["pdcluster_hccl_exec_timeout"])
    assert env["HCCL_BUFFSIZE"] == str(everywhere["pdcluster_hccl_buffsize"])
    assert env["HCCL_IF_IP"] == "127.0.0.1"
    assert not (deployed.config_dir("cpuhost") / "ascend.env").exists()


def test_second_run_changes_nothing(deployed):
    # npuhost runs the roles with the most logic (CANN capture, hccn check, per-device instances,
    # stale-instance cleanup, restart triggers); limiting to it halves the cost of this check.
    result = run_ansible(*deployed.args, "site.yml", "--limit", "npuhost")
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-4000:]
    counts = recap(out)
    assert set(counts) == {"npuhost"}
    assert all(c["changed"] == 0 and c["failed"] == 0 for c in counts.values()), out[-4000:]
    # ...while the first run did render (and would have restarted) everything.
    assert all(c["changed"] > 0 for c in recap(deployed.output).values())


# --- the rendered units run ------------------------------------------------------------------------

class UnitProcess:
    """Starts a rendered unit's ExecStart with its EnvironmentFiles, the way systemd would."""

    def __init__(self, unit_path: Path, instance: str = "", log_dir: Path | None = None):
        self.unit = read_unit(unit_path)
        self.argv = shlex.split(self.unit["Service.ExecStart"][0].replace("%i", instance))
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": os.environ.get("HOME", "/root")}
        env.update(unit_environment(self.unit, instance))
        log_dir = log_dir or unit_path.parent
        self.log = log_dir / f"{unit_path.stem.replace('@', '-')}{instance}.log"
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(self.argv, env=env, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, cwd=self.unit.get("Service.WorkingDirectory",
                                                                                     [None])[0])

    def stop(self) -> int:
        """SIGTERM, wait TimeoutStopSec (systemd's default 90 s if unset), then SIGKILL like systemd.
        Returns the exit status (negative: killed by that signal)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(float(self.unit.get("Service.TimeoutStopSec", ["90"])[0]))
            except subprocess.TimeoutExpired as timeout:
                self.proc.kill()
                self.proc.wait(10)
                log = self.tail()
                raise AssertionError(f"{self.argv} ignored SIGTERM for TimeoutStopSec; log:\n{log}") from timeout
        return self.proc.returncode

    def tail(self) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-30:])


def etcdctl(deployed: "Deployment", *args: str, user: str | None = "pdcluster", check: bool = True,
            host: str = "cpuhost") -> subprocess.CompletedProcess:
    """etcdctl against the deployed etcd with a host's rendered client certificate, as `user` (None: no login)."""
    tls = deployed.config_dir(host) / "tls"
    env = dict(os.environ, ETCDCTL_API="3")
    if user:
        env.update(ETCDCTL_USER=user, ETCDCTL_PASSWORD=(deployed.secrets / f"etcd-{user}.password").read_text().strip())
    result = subprocess.run([str(etcd_binary().with_name("etcdctl")), "--endpoints",
                             f"https://127.0.0.1:{deployed.etcd_port}", "--cacert", str(tls / "ca.crt"),
                             "--cert", str(tls / "client.crt"), "--key", str(tls / "client.key"), *args],
                            capture_output=True, text=True, timeout=20, env=env)
    assert not check or result.returncode == 0, result.stdout + result.stderr
    return result


def start_etcd_with_auth(deployed: "Deployment", log_dir: Path) -> "UnitProcess":
    """etcd from its rendered unit, then etcd_auth.yml (what site.yml runs once etcd is up; the test
    deployment does not manage services, so it runs here). Returns the running etcd."""
    etcd = UnitProcess(deployed.unit_dir("cpuhost") / "pdcluster-etcd.service", log_dir=log_dir)
    health = f"http://127.0.0.1:{deployed.etcd_metrics_port}/health"
    wait_until(lambda: health_ok(health) or etcd.proc.poll() is not None, 30, "etcd /health")
    assert etcd.proc.poll() is None, etcd.tail()
    deployed.auth_run = run_ansible(*deployed.args, "etcd_auth.yml")
    assert deployed.auth_run.returncode == 0, (deployed.auth_run.stdout + deployed.auth_run.stderr)[-4000:]
    return etcd


def wait_until(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


def test_rendered_etcd_unit_runs_etcd_with_tls_and_auth(deployed, tmp_path):
    etcd = start_etcd_with_auth(deployed, tmp_path)
    try:
        assert recap(deployed.auth_run.stdout)["cpuhost"]["changed"] > 0
        key = f"/pdcluster/{CLUSTER}/probe"
        etcdctl(deployed, "put", key, "hello")
        assert etcdctl(deployed, "get", "--print-value-only", key).stdout.strip() == "hello"
        # The role may not leave /pdcluster/; a certificate without a login, or no certificate, gets nothing.
        assert "permission denied" in etcdctl(deployed, "put", "/elsewhere", "x", check=False).stderr
        anonymous = etcdctl(deployed, "get", key, user=None, check=False)
        assert anonymous.returncode != 0 and "hello" not in anonymous.stdout
        bare = subprocess.run([str(etcd_binary().with_name("etcdctl")), "--endpoints",
                               f"https://127.0.0.1:{deployed.etcd_port}", "--cacert",
                               str(deployed.config_dir("cpuhost") / "tls" / "ca.crt"), "--dial-timeout", "2s",
                               "--command-timeout", "3s", "get", key], capture_output=True, text=True, timeout=20,
                              env=dict(os.environ, ETCDCTL_API="3", ETCDCTL_USER="pdcluster", ETCDCTL_PASSWORD=(
                                  deployed.secrets / "etcd-pdcluster.password").read_text().strip()))
        assert bare.returncode != 0
        # The npu host's own certificate and password file work too, through `pdcluster status`.
        tls = deployed.config_dir("npuhost") / "tls"
        status = subprocess.run([str(PDCLUSTER), "nodes", "--json", "--etcd", f"127.0.0.1:{deployed.etcd_port}",
                                 "--cluster", CLUSTER, "--etcd-ca", str(tls / "ca.crt"), "--etcd-cert",
                                 str(tls / "client.crt"), "--etcd-key", str(tls / "client.key"), "--etcd-user",
                                 "pdcluster", "--etcd-password-file", str(tls / "etcd.password")],
                                capture_output=True, text=True, timeout=60)
        assert status.returncode == 0 and json.loads(status.stdout)["nodes"] == [], status.stderr
        # The auth tasks are idempotent: a second run changes nothing.
        again = run_ansible(*deployed.args, "etcd_auth.yml")
        assert again.returncode == 0 and recap(again.stdout)["cpuhost"]["changed"] == 0, again.stdout[-3000:]
        assert (deployed.cpu / "var/lib/pdcluster/etcd/member").is_dir(), "etcd must use the rendered data dir"
    finally:
        # etcd re-raises SIGTERM after a clean shutdown; systemd counts death by SIGTERM as success.
        assert etcd.stop() in (0, -signal.SIGTERM), etcd.tail()


def _serving_commands_exist() -> bool:
    return all(subprocess.run([str(PDCLUSTER), cmd, "--help"], capture_output=True, timeout=60).returncode == 0
               for cmd in ("router", "prefill", "decode"))


@pytest.mark.timeout(300)
def test_rendered_units_serve_a_request_and_drain_on_sigterm(deployed, tmp_path):
    """etcd + prefill + decode + router started from the rendered units serve a completion; SIGTERM
    drains each node (exit 0) and removes its etcd registration. Runs once `pdcluster router/prefill/
    decode` exist (written after this test); until then it skips."""
    if not _serving_commands_exist():
        pytest.skip("`pdcluster router/prefill/decode` not implemented yet; this test enables itself when they are")
    from pdcluster.engine.testing import make_tiny_model

    make_tiny_model(str(deployed.model), "llama")
    units = deployed.unit_dir("cpuhost")
    procs: dict[str, UnitProcess] = {}
    try:
        procs["etcd"] = start_etcd_with_auth(deployed, tmp_path)
        for role in ("prefill", "decode"):
            procs[role] = UnitProcess(units / f"pdcluster-{role}@.service", "0", log_dir=tmp_path)
        procs["router"] = UnitProcess(units / "pdcluster-router.service", log_dir=tmp_path)
        api_key = 'k3y"with\\quote'
        base = f"http://127.0.0.1:{deployed.ports['router']}"

        def completion() -> dict | None:
            for name, proc in procs.items():
                assert proc.proc.poll() is None, f"{name} exited:\n{proc.tail()}"
            body = json.dumps({"model": deployed.model.name, "prompt": "Hello world", "max_tokens": 4,
                               "temperature": 0}).encode()
            request = urllib.request.Request(f"{base}/v1/completions", data=body, headers={
                "Content-Type": "application/json", "Authorization": f"Bearer {api_key}"})
            try:
                with urllib.request.urlopen(request, timeout=30) as response:
                    return json.loads(response.read())
            except OSError:
                return None

        answer: list[dict] = []
        wait_until(lambda: bool(answer.append(completion()) or answer[-1]), 180, "a completion through the router")
        assert answer[-1]["choices"][0]["text"] != "" or answer[-1]["usage"]["completion_tokens"] > 0
        # The prefill unit's node runs on its cpu_cores (pdcluster_prefill_cpu_cores); the decode one on every core.
        assert os.sched_getaffinity(procs["prefill"].proc.pid) == {int(PREFILL_CORES)}
        assert os.sched_getaffinity(procs["decode"].proc.pid) == os.sched_getaffinity(0)

        for role in ("decode", "prefill"):
            key = f"/pdcluster/{CLUSTER}/nodes/{role}/cpuhost-{role}-0"
            assert etcdctl(deployed, "get", "--print-value-only", key).stdout.strip(), f"{role} not registered"
            assert procs.pop(role).stop() == 0, f"{role} did not drain cleanly on SIGTERM"
            assert etcdctl(deployed, "get", "--print-value-only", key).stdout.strip() == "", f"{role} still registered"
    finally:
        for proc in reversed(list(procs.values())):
            if proc.proc.poll() is None:
                proc.proc.kill()
                proc.proc.wait(10)


# --- Grafana ----------------------------------------------------------------------------------------

DASHBOARD = ROOT / "deploy" / "grafana" / "pdcluster-dashboard.json"
# Metric families whose code is not written yet: until a source file defines any metric of the
# family, the dashboard may use the names agreed in the design; afterwards they must match the code.
AGREED_METRICS = {
    "pdcluster_node_running_requests", "pdcluster_node_waiting_requests", "pdcluster_node_kv_blocks_used",
    "pdcluster_node_kv_blocks_free", "pdcluster_node_prefix_cache_hit_ratio", "pdcluster_node_preemptions_total",
    "pdcluster_kv_transfer_bytes_total", "pdcluster_kv_transfer_seconds", "pdcluster_kv_transfer_failures_total",
    "pdcluster_device_memory_used_bytes", "pdcluster_device_utilization_ratio",
}
FAMILIES = ("pdcluster_router_", "pdcluster_node_", "pdcluster_kv_transfer_", "pdcluster_device_", "pdcluster_etcd_")


def defined_metric_names() -> set[str]:
    names: set[str] = set()
    for package in ("engine", "kv_transfer", "pdcluster", "router", "prefill_node", "decode_node"):
        for path in (ROOT / package).rglob("*.py"):
            names.update(re.findall(r"[\"'](pdcluster_[a-z0-9_]+)[\"']", path.read_text()))
    # prometheus_client exposes a counter declared as `x` (e.g. by CounterMetricFamily) as `x_total`.
    return names | {f"{n}_total" for n in names if not n.endswith("_total")}


def test_grafana_dashboard_queries_pdcluster_metrics_that_exist():
    sys.path.insert(0, str(DASHBOARD.parent))
    try:
        import make_dashboard
    finally:
        sys.path.remove(str(DASHBOARD.parent))
    text = DASHBOARD.read_text()
    assert text == make_dashboard.render(), "pdcluster-dashboard.json is stale: run deploy/grafana/make_dashboard.py"
    dashboard = json.loads(text)
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    assert len(panels) >= 15
    defined = defined_metric_names()
    used: set[str] = set()
    for panel in panels:
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            names = set(re.findall(r"\bpdcluster_[a-z0-9_]+", target["expr"]))
            assert names, f"{panel['title']}: {target['expr']} queries no pdcluster_ metric"
            used |= {re.sub(r"_(bucket|count|sum)$", "", n) for n in names}
    for name in used:
        family = next(f for f in FAMILIES if name.startswith(f))
        family_in_code = any(d.startswith(family) for d in defined)
        assert name in defined or (name in AGREED_METRICS and not family_in_code), \
            f"dashboard queries {name}, which no pdcluster code defines"
    exprs = " ".join(t["expr"] for p in panels for t in p["targets"])
    for metric in ("ttft", "tpot"):
        for q in ("0.5", "0.99"):
            assert f"histogram_quantile({q}, sum by (le) (rate(pdcluster_router_{metric}_seconds_bucket" in exprs
    assert "rate(pdcluster_kv_transfer_bytes_total" in exprs and "pdcluster_kv_transfer_failures_total" in exprs
