"""torch.distributed channels (gloo, nccl, hccl): one 2-rank process group per sender connection.

No global init_process_group: the receiver hosts a TCPStore on a free port (its port goes to the
sender in hello_ok) and both sides build the backend's process group directly on a PrefixStore, so any
number of prefill/decode pairs can come and go. Write headers go over the socket; the bytes follow as
send/recv on the group: one tensor per (plane, run) straight from/into the pool (a run of consecutive
blocks is contiguous in each plane), no staging. Between pools whose heads are split over other ranks
(regroup.py) the sender sends the planes of the ranks the receiver needs, whole, straight from its pool, and
the receiver takes them into one staging tensor per write on its device and copies each head into its slot
(`Regroup.land`): a collective moves contiguous tensors only, and a receiving plane interleaves several
sending ranks' heads per token. gloo (CPU) is exercised by the tests; nccl (CUDA) and hccl (Ascend, via
torch_npu) are built the same way but untested here.
"""

from __future__ import annotations

import datetime
import os
from typing import Any

import torch
import torch.distributed as dist

from pdcluster.kv_transfer.channel import Channel, DstRuns, PoolViews, Runs, Staged
from pdcluster.kv_transfer.checksum import checksum_runs
from pdcluster.kv_transfer.destination import Destination
from pdcluster.kv_transfer.tcp import FrameError, Wire


class DistChannel(Channel):
    device: str  # the pool device type this backend serves
    regroups = True  # whole sending planes into a staging tensor, landed in the receiver's head slices
    rank_for_auto: int | None = 1  # picked by "auto" for a pool on `device` ahead of tcp

    def __init__(self, wire: Wire, pool: PoolViews, group: Any, store: Any):
        super().__init__(wire, pool)
        self.group, self._store = group, store  # the store must outlive the group

    @classmethod
    def offered(cls, pool: PoolViews, shm_name: str | None) -> bool:
        return pool.tensor.device.type == cls.device

    @classmethod
    def auto_rank(cls, pool: PoolViews, dst: Destination) -> int | None:
        return cls.rank_for_auto if pool.tensor.device.type == cls.device else None

    @classmethod
    def make_group(cls, store: dist.Store, rank: int, local_host: str, timeout: datetime.timedelta) -> Any:
        raise NotImplementedError

    @classmethod
    def _group(cls, store: dist.Store, rank: int, wire: Wire, timeout: float, session: str) -> Any:
        """Build the 2-rank group; blocks until the peer builds its side (or `timeout`)."""
        prefixed = dist.PrefixStore(f"pdcluster-kv/{session}", store)
        local_host = wire.sock.getsockname()[0]
        return cls.make_group(prefixed, rank, local_host, datetime.timedelta(seconds=timeout))

    @classmethod
    def connect(
        cls, wire: Wire, pool: PoolViews, hello_ok: dict[str, Any], *, session: str, connect_timeout: float,
        io_timeout: float,
    ) -> "DistChannel":  # fmt: skip
        port = hello_ok.get("store_port")
        if not isinstance(port, int):
            raise FrameError("hello_ok.store_port: expected an int")
        host = wire.sock.getpeername()[0]
        td = datetime.timedelta(seconds=connect_timeout)
        store = dist.TCPStore(host, port, 2, is_master=False, timeout=td)
        return cls(wire, pool, cls._group(store, 1, wire, io_timeout, session), store)

    @classmethod
    def accept(
        cls, wire: Wire, pool: PoolViews, hello_ok: dict[str, Any], *, session: str, timeout: float
    ) -> "DistChannel":
        td = datetime.timedelta(seconds=timeout)
        store = dist.TCPStore(wire.sock.getsockname()[0], 0, 2, is_master=True, timeout=td, wait_for_workers=False)
        wire.send({**hello_ok, "store_port": store.port})
        return cls(wire, pool, cls._group(store, 0, wire, timeout, session), store)

    def wire_bytes(self, nblocks: int, l0: int, l1: int) -> int:
        if self.regroup is None:
            return super().wire_bytes(nblocks, l0, l1)
        return nblocks * (l1 - l0) * self.regroup.plane_layer_bytes

    def stage(self, token: str, part: Runs, l0: int, l1: int) -> Staged:
        src_runs = [(s, n) for _, s, n in part]
        nbytes = self.wire_bytes(sum(n for _, n in src_runs), l0, l1)
        if self.regroup is not None:
            tensors = [self.pool.planes[q, s:s + n] for layer in range(l0, l1)
                       for q in self.regroup.wire_planes(layer) for s, n in src_runs]
            return Staged(self.regroup.sent_checksum(self.pool.row_words, src_runs, l0, l1), nbytes, tensors=tensors)
        p0, p1 = self.pool.plane_range(l0, l1)
        tensors = _run_views(self.pool, src_runs, p0, p1)
        return Staged(checksum_runs(self.pool.words, src_runs, p0, p1), nbytes, tensors=tensors)

    def ship(self, body: dict[str, Any], staged: Staged) -> None:
        super().ship(body, staged)
        for x in staged.tensors:
            self.group.send([x], 1 - self.group.rank(), 0).wait()

    def receive_runs(self, runs: DstRuns, l0: int, l1: int, frame: dict[str, Any]) -> int:
        if self.regroup is not None:
            return self._receive_regrouped(list(runs), l0, l1)
        p0, p1 = self.pool.plane_range(l0, l1)
        for view in _run_views(self.pool, list(runs), p0, p1):
            self._recv(view)
        return checksum_runs(self.pool.words, runs, p0, p1)

    def _receive_regrouped(self, runs: list[tuple[int, int]], l0: int, l1: int) -> int:
        regroup = self.regroup
        assert regroup is not None
        src, pool = regroup.src, self.pool.tensor
        staging = torch.empty((l1 - l0, len(regroup.wire_ranks), 2, sum(n for _, n in runs), src.block_size,
                               src.num_kv_heads, src.row), dtype=pool.dtype, device=pool.device)
        for layer in range(l1 - l0):   # in the sender's wire order: layer, wire rank, K/V, run
            for w in range(len(regroup.wire_ranks)):
                for kv in (0, 1):
                    i = 0
                    for _, n in runs:
                        self._recv(staging[layer, w, kv, i:i + n])
                        i += n
        regroup.land(pool, staging, runs, l0, l1)
        return regroup.landed_checksum(self.pool.row_words, runs, l0, l1)

    def _recv(self, tensor: torch.Tensor) -> None:
        self.group.recv([tensor], 1 - self.group.rank(), 0).wait()

    def discard(self, nbytes: int) -> None:
        raise FrameError("rejected write on a collective stream: dropping the pair")

    def close(self) -> None:
        """The pair's group goes with its connection (HCCL / NCCL hold device buffers and communicators until
        shut down; a peer that never comes back must not pin them)."""
        group, self.group = self.group, None
        shutdown = getattr(group, "shutdown", None)
        if shutdown is not None:
            try:
                shutdown()
            except Exception:   # a group whose peer is already gone may refuse: it is dropped anyway
                pass
        self._store = None


def _run_views(pool: PoolViews, runs: list[tuple[int, int]], p0: int, p1: int) -> list[torch.Tensor]:
    """Contiguous pool views, one per (plane, run), in wire order."""
    return [pool.planes[p, s : s + n] for p in range(p0, p1) for s, n in runs]


class GlooChannel(DistChannel):
    name = "gloo"
    offer = "gloo"
    device = "cpu"
    rank_for_auto = 3  # on CPU, tcp (rank 2) is the faster choice

    @classmethod
    def make_group(cls, store: dist.Store, rank: int, local_host: str, timeout: datetime.timedelta) -> Any:
        opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # torch's private, not in its stubs
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=local_host)]
        opts._timeout = timeout
        return dist.ProcessGroupGloo(store, rank, 2, opts)


class NcclChannel(DistChannel):
    name = "nccl"
    offer = "nccl"
    device = "cuda"

    # A dead or stuck peer must fail its transfer, not the node: PyTorch's default (3) tears the process down
    # from the watchdog. 2 aborts just the communicator; blocking wait makes `wait()` raise in the transfer's
    # thread after the group timeout (io_timeout). Read when a group is built; the environment may override.
    # (pytorch.org/docs/stable/torch_nccl_environment_variables.html)
    ERROR_ENV = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2", "TORCH_NCCL_BLOCKING_WAIT": "1"}

    @classmethod
    def make_group(cls, store: dist.Store, rank: int, local_host: str, timeout: datetime.timedelta) -> Any:
        for key, value in cls.ERROR_ENV.items():
            os.environ.setdefault(key, value)
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, 2, opts)


class HcclChannel(DistChannel):
    name = "hccl"
    offer = "hccl"
    device = "npu"

    @classmethod
    def make_group(cls, store: dist.Store, rank: int, local_host: str, timeout: datetime.timedelta) -> Any:
        import torch_npu  # noqa: F401  (only on Ascend hosts; docs/design.md §9)
        from torch_npu._C._distributed_c10d import ProcessGroupHCCL

        opts = ProcessGroupHCCL.Options()
        opts._timeout = timeout
        return ProcessGroupHCCL(store, rank, 2, opts)
