"""cuda_ipc: KV between two processes on one GPU (a one-GPU host running a prefill and a decode node), where
NCCL refuses to make a group of two ranks on the same device.

The sender shares its pool once per connection as a CUDA IPC handle (the fields torch.multiprocessing's
`reduce_tensor` sends: `UntypedStorage._share_cuda_()`, carried as msgpack, never pickled) and the receiver
maps it (`UntypedStorage._new_shared_cuda`). Each write frame names its source runs; the receiver, having
checked the reservation for that write like any other (`begin_write`), copies them device-to-device from the
mapped pool into its own blocks (one strided copy per run covering the write's planes) and sums what landed.
So the channel is not `direct`: nothing lands in a pool without the receiver's check, and the sender's "sent"
checksum against the receiver's "landed" one catches a source that changed under the copy (blocks released
by a sender that gave up). Between pools whose heads are split over other ranks (regroup.py) the receiver's
copy goes from the sender's rank planes straight into its own head slices (`Regroup.copy`, as shm does on the
sender), so regrouping costs no staging. The sender synchronises its device before announcing a write, so the
bytes it names are computed. Chosen by `kv_backend=auto` when both pools are on the same physical GPU (same host, same
device UUID in the destination); two GPUs of one host keep nccl.

CPU path (tests; never picked by auto): a CPU pool is shared through torch's file_system strategy instead (the
torch_shm_manager socket and file name go where the CUDA handle would), so the same code runs over host
memory. The sender's pool must be moved into shared memory (`share_cpu_pool`) before anything views it: the
move swaps the storage's memory in place, and numpy views made earlier (the checksum views) would keep the
old pages. A receiver offers it on CPU only with PDCLUSTER_KV_CUDA_IPC_ON_CPU=1.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch

from pdcluster.kv_transfer.channel import Channel, DstRuns, PoolViews, Runs, Staged
from pdcluster.kv_transfer.checksum import checksum_runs
from pdcluster.kv_transfer.destination import Destination, host_id
from pdcluster.kv_transfer.errors import LayoutMismatchError, TransferError, from_code
from pdcluster.kv_transfer.tcp import FrameError, Wire

CPU_PATH_ENV = "PDCLUSTER_KV_CUDA_IPC_ON_CPU"


def device_uuid(device: torch.device) -> str:
    """The physical device a pool lives on, the same in every process whatever its visible-device numbering:
    "GPU-<uuid>" for cuda, "cpu" for host memory, "" when unknown."""
    if device.type == "cuda":
        uuid = getattr(torch.cuda.get_device_properties(device), "uuid", None)
        return f"GPU-{uuid}" if uuid is not None else ""
    return "cpu" if device.type == "cpu" else ""


def share_cpu_pool(pool: torch.Tensor) -> torch.Tensor:
    """CPU path: move `pool`'s storage into shared memory (file_system strategy) in place, before any view of it
    is made; returns the pool."""
    pool.untyped_storage()._share_filename_cpu_()
    return pool


def export_pool(pool: torch.Tensor) -> dict[str, Any]:
    """What another process needs to map `pool`: its storage's IPC handle and the tensor's geometry."""
    storage = pool.untyped_storage()
    geometry = {"dtype": str(pool.dtype).removeprefix("torch."), "size": list(pool.shape),
                "stride": list(pool.stride()), "offset": pool.storage_offset()}
    if pool.device.type == "cuda":
        _device, handle, size, offset, ref_handle, ref_offset, event, event_sync = storage._share_cuda_()
        return {**geometry, "kind": "cuda", "handle": handle, "storage_bytes": size, "storage_offset": offset,
                "ref_handle": ref_handle, "ref_offset": ref_offset, "event": event, "event_sync": bool(event_sync)}
    if pool.device.type == "cpu":
        if not storage.is_shared():
            raise TransferError("cuda_ipc on CPU: the pool is not in shared memory (share_cpu_pool before the "
                                "sender is built)")
        manager, name, size = storage._share_filename_cpu_()
        return {**geometry, "kind": "cpu", "manager": manager, "name": name, "storage_bytes": size}
    raise TransferError(f"cuda_ipc: cannot share a pool on {pool.device}")


def open_pool(d: dict[str, Any], device: torch.device) -> torch.Tensor:
    """The pool `export_pool` described, mapped into this process on `device` (this process's index of the same
    physical GPU)."""
    try:
        kind, dtype = d["kind"], getattr(torch, str(d["dtype"]))
        size, stride, offset = tuple(d["size"]), tuple(d["stride"]), int(d["offset"])
        if kind == "cuda" and device.type == "cuda":
            storage = torch.UntypedStorage._new_shared_cuda(
                device.index or 0, d["handle"], d["storage_bytes"], d["storage_offset"], d["ref_handle"],
                d["ref_offset"], d["event"], d["event_sync"])
        elif kind == "cpu" and device.type == "cpu":
            storage = torch.UntypedStorage._new_shared_filename_cpu(d["manager"], d["name"], d["storage_bytes"])
        else:
            raise FrameError(f"cuda_ipc: a {kind!r} pool cannot be mapped on {device}")
    except (KeyError, TypeError, AttributeError) as exc:
        raise FrameError(f"cuda_ipc: malformed pool handle: {exc!r}") from None
    if not isinstance(dtype, torch.dtype):
        raise FrameError(f"cuda_ipc: unknown dtype {d['dtype']!r}")
    return torch.empty(0, dtype=dtype, device=device).set_(storage, offset, size, stride)


@dataclass
class IpcStaged(Staged):
    src: list[int] = field(default_factory=list)   # first source block of each run, for the receiver's copy


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class CudaIpcChannel(Channel):
    name = "cuda_ipc"
    offer = "cuda_ipc"
    regroups = True   # the receiver copies the sender's heads into its own slices (regroup.py `copy`)

    def __init__(self, wire: Wire, pool: PoolViews, remote: torch.Tensor | None = None):
        super().__init__(wire, pool)
        self.remote = remote   # receiver side: the sender's pool, mapped here
        self.remote_planes = remote.flatten(0, 1) if remote is not None else None

    @classmethod
    def offered(cls, pool: PoolViews, shm_name: str | None) -> bool:
        kind = pool.tensor.device.type
        return kind == "cuda" or (kind == "cpu" and os.environ.get(CPU_PATH_ENV) == "1")

    @classmethod
    def auto_rank(cls, pool: PoolViews, dst: Destination) -> int | None:
        device = pool.tensor.device
        same = device.type == "cuda" and dst.host_id == host_id() and dst.device_uuid == device_uuid(device) != ""
        return 0 if same else None

    # ---- handshake: the sender's pool handle, then the receiver's word that it mapped it ----------------

    @classmethod
    def connect(cls, wire: Wire, pool: PoolViews, hello_ok: dict[str, Any], **_: Any) -> "CudaIpcChannel":
        mine, theirs = device_uuid(pool.tensor.device), hello_ok.get("device_uuid")
        if theirs != mine:
            raise LayoutMismatchError(f"cuda_ipc: the receiver's pool is on {theirs!r}, this one on {mine!r}: CUDA "
                                      "IPC here moves KV between processes of one GPU (use nccl across GPUs)")
        wire.send({"op": "ipc_pool", "pool": export_pool(pool.tensor)})
        reply = wire.recv()
        if reply.get("op") != "ipc_ok":
            raise from_code(reply.get("code"), f"cuda_ipc: the receiver could not map this pool: {reply.get('error')}")
        return cls(wire, pool)

    @classmethod
    def accept(cls, wire: Wire, pool: PoolViews, hello_ok: dict[str, Any], *, session: str,
               timeout: float) -> "CudaIpcChannel":
        wire.send({**hello_ok, "device_uuid": device_uuid(pool.tensor.device)})
        frame = wire.recv()
        if frame.get("op") != "ipc_pool" or not isinstance(frame.get("pool"), dict):
            raise FrameError("cuda_ipc: expected the sender's ipc_pool frame")
        try:
            remote = open_pool(frame["pool"], pool.tensor.device)
            mine = pool.tensor   # planes and heads per plane may differ (another split): checked per write
            if (remote.shape[0], remote.shape[3], remote.shape[5], remote.dtype) != \
                    (mine.shape[0], mine.shape[3], mine.shape[5], mine.dtype):
                raise FrameError(f"cuda_ipc: the sender's pool {tuple(remote.shape)} {remote.dtype} does not match "
                                 f"this pool's layers, block size and rows ({tuple(mine.shape)} {mine.dtype})")
        except (FrameError, RuntimeError) as exc:
            wire.send({"op": "error", "rid": None, "code": "failed", "error": str(exc)})
            raise FrameError(str(exc)) from None
        wire.send({"op": "ipc_ok"})
        return cls(wire, pool, remote)

    # ---- sender: name the runs (the receiver copies them) -----------------------------------------------

    def stage(self, token: str, part: Runs, l0: int, l1: int) -> Staged:
        _sync(self.pool.tensor.device)   # the layers named are computed before the receiver reads them
        src_runs = [(s, n) for _, s, n in part]
        p0, p1 = self.pool.plane_range(l0, l1)
        checksum = checksum_runs(self.pool.words, src_runs, p0, p1) if self.regroup is None \
            else self.regroup.sent_checksum(self.pool.row_words, src_runs, l0, l1)
        return IpcStaged(checksum, self.wire_bytes(sum(n for _, n in src_runs), l0, l1), src=[s for s, _ in src_runs])

    def ship(self, body: dict[str, Any], staged: Staged) -> None:
        assert isinstance(staged, IpcStaged), "cuda_ipc ships what its own stage made"
        super().ship({**body, "src": staged.src}, staged)

    # ---- receiver: copy from the mapped pool ------------------------------------------------------------

    def receive_runs(self, runs: DstRuns, l0: int, l1: int, frame: dict[str, Any]) -> int:
        src = frame.get("src")
        if not isinstance(src, list) or len(src) != len(runs) or not all(isinstance(s, int) for s in src):
            raise FrameError("write.src: expected one source block per run")
        remote = self.remote
        assert remote is not None, "a write before the handshake mapped the sender's pool"
        blocks = remote.shape[2]
        for s, (_, n) in zip(src, runs, strict=True):
            if not 0 <= s <= blocks - n:
                raise FrameError(f"write.src: blocks {s}..{s + n - 1} outside the sender's {blocks}-block pool")
        sender = self.pool.layout if self.regroup is None else self.regroup.src
        if (remote.shape[1], remote.shape[4]) != (sender.kv_planes, sender.num_kv_heads):
            raise FrameError(f"cuda_ipc: the sender's pool {tuple(remote.shape)} is not the layout it announced "
                             f"({sender.kv_planes} planes of {sender.num_kv_heads} heads)")
        if self.regroup is not None:
            self.regroup.copy(self.pool.tensor, remote, [(d, s, n) for s, (d, n) in zip(src, runs, strict=True)],
                              l0, l1)
            return self.regroup.landed_checksum(self.pool.row_words, list(runs), l0, l1)
        p0, p1 = self.pool.plane_range(l0, l1)
        assert self.remote_planes is not None
        for s, (d, n) in zip(src, runs, strict=True):
            self.pool.planes[p0:p1, d:d + n].copy_(self.remote_planes[p0:p1, s:s + n])
        return checksum_runs(self.pool.words, runs, p0, p1)   # reads the landed bytes back (after the copies)

    def discard(self, nbytes: int) -> None:
        """A rejected write carries no bytes on the socket: nothing to skip, nothing copied."""

    def close(self) -> None:
        self.remote = self.remote_planes = None   # unmaps once the last view goes
