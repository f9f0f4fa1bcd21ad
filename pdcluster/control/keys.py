"""The cluster secret: one file every router and node of a cluster holds (docs/security.md).

The file is one line `pdcluster-secret-v1 <64 hex digits>` (32 random bytes; `#` lines are comments), mode
0600. Everything the processes authenticate with is derived from it with keyed BLAKE2b, one label per use:
the CURVE keypair every zmq server socket of the cluster uses, the CURVE keypair every client socket uses,
and the HMAC key of the KV-transfer handshake. So one file is all there is to distribute or rotate.
"""

from __future__ import annotations

import hashlib
import logging
import os
import secrets
import stat
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import zmq
from zmq.utils import z85

log = logging.getLogger(__name__)

MAGIC = "pdcluster-secret-v1"
SECRET_BYTES = 32


class SecretError(ValueError):
    """The secret file is missing, malformed, or readable by others."""


@dataclass(frozen=True)
class ClusterKeys:
    """What a process derives from the cluster secret. `repr` shows only the fingerprint."""

    fingerprint: str  # safe to log: tells two secrets apart without revealing either
    server_public: bytes = field(repr=False)  # CURVE keys, z85-encoded (what pyzmq's socket options take)
    server_secret: bytes = field(repr=False)
    client_public: bytes = field(repr=False)
    client_secret: bytes = field(repr=False)
    kv_key: bytes = field(repr=False)  # HMAC-SHA256 key of the KV handshake

    @classmethod
    def from_secret(cls, secret: bytes) -> "ClusterKeys":
        if len(secret) != SECRET_BYTES:
            raise SecretError(f"the cluster secret must be {SECRET_BYTES} bytes, got {len(secret)}")
        server_secret = z85.encode(_derive(secret, b"curve-server"))
        client_secret = z85.encode(_derive(secret, b"curve-client"))
        server_public = zmq.curve_public(server_secret)
        return cls(fingerprint=hashlib.blake2b(server_public, digest_size=6).hexdigest(),
                   server_public=server_public, server_secret=server_secret,
                   client_public=zmq.curve_public(client_secret), client_secret=client_secret,
                   kv_key=_derive(secret, b"kv-handshake"))


def _derive(secret: bytes, label: bytes) -> bytes:
    return hashlib.blake2b(label, key=secret, person=b"pdcluster-v1", digest_size=32).digest()


def generate_secret(path: str | os.PathLike, force: bool = False) -> ClusterKeys:
    """Write a new secret to `path` (mode 0600, atomically: readers see the old file or the new one, never a
    part). Refuses to replace an existing file unless `force`. Returns its keys."""
    path = Path(path)
    secret = secrets.token_bytes(SECRET_BYTES)
    text = (f"# pdcluster cluster secret: every router and node of the cluster holds this file, mode 0600.\n"
            f"{MAGIC} {secret.hex()}\n")
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent or ".")   # created 0600
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        if force:
            os.replace(tmp, path)
        else:
            try:
                os.link(tmp, path)   # fails if path exists: no window where another file is overwritten
            except FileExistsError:
                raise SecretError(f"{path} exists; pass --force to replace it (every node needs the new "
                                  "file then)") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return ClusterKeys.from_secret(secret)


def load_secret(path: str | os.PathLike) -> ClusterKeys:
    """The keys of the secret at `path`. Refuses (SecretError) a file that is not a regular file, that its
    group or others may read or write, or that does not hold a secret."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except FileNotFoundError:
        raise SecretError(f"cluster secret {path} does not exist (create it with `pdcluster keys generate "
                          f"{path}`)") from None
    except OSError as exc:
        raise SecretError(f"cluster secret {path}: {exc.strerror}") from None
    with os.fdopen(fd) as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise SecretError(f"cluster secret {path} is not a regular file")
        if st.st_mode & 0o077:
            raise SecretError(f"permissions {stat.S_IMODE(st.st_mode):04o} for the cluster secret {path} are too "
                              f"open: it must be accessible by its owner only (chmod 600 {path})")
        text = f.read(4096)
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        magic, _, value = line.partition(" ")
        if magic == MAGIC:
            try:
                return ClusterKeys.from_secret(bytes.fromhex(value.strip()))
            except ValueError:
                break
        break
    raise SecretError(f"cluster secret {path}: expected a line '{MAGIC} <{2 * SECRET_BYTES} hex digits>'")


def keys_from_config(path: str, who: str) -> ClusterKeys | None:
    """The keys of a process's `cluster_secret` setting; None (with a loud warning) when it is empty."""
    if not path:
        log.warning("%s: cluster_secret is not set: NOTHING inside the cluster is authenticated. Anyone who can "
                    "reach this process's ports can send it work, abort requests and read token streams "
                    "(docs/security.md). Set cluster_secret to a file made by `pdcluster keys generate`.", who)
        return None
    keys = load_secret(path)
    log.info("%s: cluster secret %s loaded (fingerprint %s)", who, path, keys.fingerprint)
    return keys
