"""Weights shared by several engines on one host: one read-only copy of each tensor in /dev/shm.

`SharedWeightPool(size="8GiB")` is a directory `/dev/shm/pdcluster-weights-<name>/`:

    pool.json           {"size": bytes}: the budget every model added must fit in
    lock                flock'ed while a model is added or a user comes or goes
    blobs/<hash>        one tensor's bytes, named by the blake2b hash of its content
    models/<key>.json   a loaded model: parameter name -> (hash, dtype, shape); the key hashes the checkpoint
                        files (path, size, mtime), the dtype and the architecture
    users/<pid>-<id>    the pool objects using it, by process; the last one to leave removes the directory

An engine built with `weight_pool=` loads its model once, as usual, hashes each final parameter (after
fusing QKV / gate-up and the dtype cast) and stores the tensors the pool does not hold yet; then every
parameter becomes a view of its blob, mapped `PROT_READ | MAP_SHARED`. A second engine of the same model
(this process or another one naming the same pool) finds the model's entry and maps the blobs without
loading anything; identical tensors (tied embeddings, a tensor shared by two models) are stored once. The
mapping is read-only in the page tables: a model writing into a shared weight gets SIGSEGV instead of
corrupting the other engines. The oneDNN-packed CPU copies (`layers/linear.py`) are skipped for pooled
weights, since each engine would pack a private copy. CPU engines only: device memory is not mapped from
/dev/shm. Importing this module does not import torch.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import hashlib
import json
import mmap
import os
import secrets
import shutil
import warnings
from typing import TYPE_CHECKING, Any, Callable

from pdcluster.control.config import parse_bytes
from pdcluster.control.process import pid_alive

if TYPE_CHECKING:
    import torch

SHM_DIR = "/dev/shm"
POOL_PREFIX = "pdcluster-weights-"
LAYOUT_VERSION = 1   # bump when the model's parameter layout (fusing, names) changes: old entries stop matching


class WeightPoolFull(ValueError):
    """The model's tensors that the pool does not hold yet do not fit in its budget."""


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB ({n} bytes)"


class SharedWeightPool:
    """`size`: the pool's budget in bytes ("4GiB" accepted); None: the size of the pool in use under `name`,
    else what `directory` can hold. `name`: processes naming the same pool share it; default: a fresh name
    private to this process (and whoever is given `.name`)."""

    def __init__(self, size: int | str | None, name: str | None = None, directory: str = SHM_DIR) -> None:
        self.size = parse_bytes(size) if size is not None else shutil.disk_usage(directory).total
        if self.size < 1:
            raise ValueError(f"weight_pool size: must be >= 1 byte, got {size!r}")
        self.name = check_name(name or f"{os.getpid()}-{secrets.token_hex(4)}")
        self.path = os.path.join(directory, POOL_PREFIX + self.name)
        self._tensors: dict[str, torch.Tensor] = {}   # content hash -> the mapped tensor, in this process
        self._pid = os.getpid()
        self._user = f"{self._pid}-{secrets.token_hex(4)}"   # one per pool object: a process may hold several
        self.closed = False
        for attempt in range(5):   # the last user of a pool may remove it while we wait for its lock
            try:
                self._join(size)
                break
            except FileNotFoundError:
                if attempt == 4:
                    raise
        atexit.register(self.close)

    def _join(self, size: int | str | None) -> None:
        for sub in ("blobs", "models", "users"):
            os.makedirs(os.path.join(self.path, sub), mode=0o700, exist_ok=True)
        with self._locked():
            if not os.path.isdir(os.path.join(self.path, "users")):
                raise FileNotFoundError(self.path)
            alive = self._live_users()
            meta = os.path.join(self.path, "pool.json")
            if alive and os.path.isfile(meta):
                with open(meta) as f:
                    existing = json.load(f)["size"]
                if size is None:
                    self.size = existing
                elif existing != self.size:
                    raise ValueError(f"weight pool {self.name!r} is in use with size {_gib(existing)}; "
                                     f"asked for {_gib(self.size)}")
            _write_json(meta, {"size": self.size})
            open(os.path.join(self.path, "users", self._user), "w").close()

    @classmethod
    def from_spec(cls, spec: str) -> "SharedWeightPool":
        """The pool a config names, "NAME[:SIZE]" (e.g. "models:8GiB"); one object per name in a process."""
        name, size = parse_spec(spec)
        pool = _by_name.get(name)
        if pool is None or pool.closed:
            pool = _by_name[name] = cls(size, name=name)
        return pool

    # ---- accounting ------------------------------------------------------------------------------

    @property
    def used_bytes(self) -> int:
        blobs = os.path.join(self.path, "blobs")
        return sum(e.stat().st_size for e in os.scandir(blobs) if not e.name.startswith("."))

    @property
    def free_bytes(self) -> int:
        return max(0, self.size - self.used_bytes)

    def models(self) -> list[str]:
        """The checkpoints whose weights the pool holds."""
        out = []
        for entry in sorted(os.listdir(os.path.join(self.path, "models"))):
            with open(os.path.join(self.path, "models", entry)) as f:
                out.append(json.load(f)["model"])
        return out

    # ---- loading (engine/loader.py) --------------------------------------------------------------

    def load(self, model: Any, model_dir: str, dtype: Any, load_weights: Callable[[], None]) -> bool:
        """Make `model`'s parameters read-only views of the pool's copy of `model_dir`'s weights. If the pool
        has none yet, `load_weights()` fills the model as usual and its tensors are added (WeightPoolFull when
        they do not fit). True when the weights came from the pool without loading."""
        if self.closed:
            raise RuntimeError(f"weight pool {self.name!r} is closed")
        key, files = _model_key(model_dir, dtype, type(model).__name__)
        manifest = self._manifest(key)
        found = manifest is not None
        if manifest is None:
            load_weights()
            with self._locked():
                manifest = self._manifest(key) or self._store(model, key, model_dir, files)
        self._attach(model, manifest)
        return found

    def _manifest(self, key: str) -> dict | None:
        path = os.path.join(self.path, "models", key + ".json")
        if not os.path.isfile(path):
            return None
        with open(path) as f:
            return json.load(f)

    def _store(self, model: Any, key: str, model_dir: str, files: list) -> dict:
        """Under the lock: write the tensors the pool lacks, then the model's entry."""
        from pdcluster.engine.args import dtype_name

        params: dict[str, dict] = {}
        sizes: dict[str, int] = {}     # distinct tensors of this model
        new: dict[str, torch.Tensor] = {}
        blobs = os.path.join(self.path, "blobs")
        for name, p in model.named_parameters(remove_duplicate=False):
            data = p.detach().contiguous()
            digest = hashlib.blake2b(_bytes(data), digest_size=16)
            digest.update(f"{data.dtype}{tuple(data.shape)}".encode())
            h = digest.hexdigest()
            params[name] = {"hash": h, "dtype": dtype_name(data.dtype), "shape": list(data.shape)}
            sizes[h] = data.numel() * data.element_size()
            if h not in new and not os.path.exists(os.path.join(blobs, h)):
                new[h] = data
        total = sum(sizes.values())
        needed = sum(t.numel() * t.element_size() for t in new.values())
        used = self.used_bytes
        if used + needed > self.size:
            raise WeightPoolFull(
                f"weight pool {self.name!r}: model {model_dir} needs {_gib(needed)} more "
                f"({_gib(total)} of distinct tensors, {_gib(total - needed)} already in the pool), but the pool "
                f"has {_gib(self.size - used)} free of {_gib(self.size)}; raise its size or co-deploy fewer models")
        room = shutil.disk_usage(self.path).free
        if needed > room:
            raise WeightPoolFull(f"weight pool {self.name!r}: model {model_dir} needs {_gib(needed)} more, but "
                                 f"{os.path.dirname(self.path)} has {_gib(room)} free")
        for h, data in new.items():
            tmp = os.path.join(blobs, f".{h}.{os.getpid()}")
            with open(tmp, "wb") as f:
                f.write(_bytes(data))
            os.replace(tmp, os.path.join(blobs, h))
        manifest = {"model": os.path.realpath(model_dir), "files": files, "params": params}
        _write_json(os.path.join(self.path, "models", key + ".json"), manifest)
        return manifest

    def _attach(self, model: Any, manifest: dict) -> None:
        import torch

        params = manifest["params"]
        for name, p in model.named_parameters(remove_duplicate=False):
            entry = params.get(name)
            if entry is None:
                raise ValueError(f"weight pool {self.name!r}: no tensor {name!r} for {manifest['model']}")
            t = self._tensor(entry["hash"], getattr(torch, entry["dtype"]), tuple(entry["shape"]))
            if t.shape != p.shape or t.dtype != p.dtype:
                raise ValueError(f"weight pool {self.name!r}: {name} is {tuple(t.shape)} {t.dtype} in the pool, "
                                 f"the model expects {tuple(p.shape)} {p.dtype}")
            p.data = t

    def _tensor(self, h: str, dtype: Any, shape: tuple[int, ...]) -> torch.Tensor:
        import torch

        t = self._tensors.get(h)
        if t is None:
            with open(os.path.join(self.path, "blobs", h), "rb") as f:
                buf = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
            with warnings.catch_warnings():   # "buffer is not writable": that is the point
                warnings.simplefilter("ignore", UserWarning)
                t = torch.frombuffer(buf, dtype=torch.uint8).view(dtype).view(shape)
            self._tensors[h] = t
        return t

    # ---- lifetime --------------------------------------------------------------------------------

    def close(self) -> None:
        """Leave the pool; the last process to leave removes it. Tensors already mapped stay valid."""
        if self.closed or os.getpid() != self._pid:
            return
        self.closed = True
        self._tensors.clear()
        if not os.path.isdir(self.path):
            return
        with self._locked():
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(self.path, "users", self._user))
            if not self._live_users():
                shutil.rmtree(self.path, ignore_errors=True)

    def __enter__(self) -> "SharedWeightPool":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _live_users(self) -> list[int]:
        """Pids of the users/ entries whose process still runs; the dead ones' entries are removed."""
        users = os.path.join(self.path, "users")
        alive = []
        for entry in os.listdir(users):
            pid = _user_pid(entry)
            if pid > 0 and pid_alive(pid):
                alive.append(pid)
            else:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(users, entry))
        return alive

    @contextlib.contextmanager
    def _locked(self):
        fd = os.open(os.path.join(self.path, "lock"), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)


_by_name: dict[str, SharedWeightPool] = {}


def parse_spec(spec: str) -> tuple[str, int | None]:
    """"NAME[:SIZE]" -> (name, bytes or None)."""
    name, sep, size = str(spec).rpartition(":")
    if not sep:
        return check_name(size), None
    if not name:
        raise ValueError(f"weight_pool: expected NAME[:SIZE] such as models:8GiB, got {spec!r}")
    return check_name(name), parse_bytes(size)


def check_name(name: str) -> str:
    if not name or not name.replace("-", "").replace("_", "").replace(".", "").isalnum():
        raise ValueError(f"weight_pool name: letters, digits, '-', '_' and '.' only, got {name!r}")
    return name


def sweep_dead_weight_pools(directory: str = SHM_DIR) -> list[str]:
    """Remove the pools no running process uses (their users were SIGKILLed); the removed names."""
    removed = []
    for entry in os.listdir(directory):
        users = os.path.join(directory, entry, "users")
        if entry.startswith(POOL_PREFIX) and os.path.isdir(users):
            if not any(_user_pid(e) > 0 and pid_alive(_user_pid(e)) for e in os.listdir(users)):
                shutil.rmtree(os.path.join(directory, entry), ignore_errors=True)
                removed.append(entry)
    return removed


def _user_pid(entry: str) -> int:
    """The pid of a users/ entry "<pid>-<token>" (0 for anything else: not a process)."""
    head = entry.split("-", 1)[0]
    return int(head) if head.isdigit() else 0


def _model_key(model_dir: str, dtype: Any, architecture: str) -> tuple[str, list]:
    """Names the weights a load of `model_dir` produces: its files (path, size, mtime), dtype, architecture."""
    files = sorted([os.path.realpath(e.path), e.stat().st_size, e.stat().st_mtime_ns]
                   for e in os.scandir(model_dir) if e.is_file())
    text = json.dumps([LAYOUT_VERSION, files, str(dtype), architecture])
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest(), files


def _bytes(t: torch.Tensor) -> memoryview:
    import torch

    return t.reshape(-1).view(torch.uint8).numpy().data


def _write_json(path: str, data: Any) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)
