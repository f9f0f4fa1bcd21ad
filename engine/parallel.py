"""This process's place in a tensor-parallel group, and the collectives the sharded layers use.

One engine spans `size` ranks, one process per device (rank 0 is the engine's own process, the others are
`engine/tp_worker.py` processes). The group is torch.distributed's default process group with the device's
backend: gloo on CPU, nccl on CUDA, hccl on NPU (the same calls for all three). Every collective has the
group's timeout: a rank that died or hangs makes the others raise instead of waiting forever.
"""

from __future__ import annotations

import datetime
import os
import time
from dataclasses import dataclass

import torch

from pdcluster.engine.config import ModelConfig
from pdcluster.engine.shm_collectives import ShmCollectives
from pdcluster.engine.tp_shards import check_divisible

BACKEND_FOR_DEVICE = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}
ALREADY_IN_GROUP = ("tensor parallelism: this process already belongs to a torch.distributed group (another "
                    "tensor-parallel engine is alive here: shut it down first with LLM.shutdown() / "
                    "AsyncLLMEngine.shutdown(), or build it in a `with` block)")


@dataclass
class TPGroup:
    rank: int = 0
    size: int = 1
    backend: str = ""
    collective_seconds: float = 0.0   # time this rank spent in collectives (waits for the others included)
    shm: ShmCollectives | None = None  # CPU ranks: all-reduce and gather through shared memory, not gloo
    timeout_s: float = 60.0

    def abort(self, reason: str) -> None:
        """From another thread: a rank is gone, so a collective waiting for it stops now."""
        if self.shm is not None:
            self.shm.abort_reason = reason

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the ranks, in place."""
        if self.size > 1:
            start = time.perf_counter()
            if self.shm is not None and self.shm.fits(x):
                self.shm.all_reduce(x, self.timeout_s)
            else:
                torch.distributed.all_reduce(x)
            self.collective_seconds += time.perf_counter() - start
        return x

    def gather_last_dim(self, x: torch.Tensor, sizes: list[int]) -> torch.Tensor | None:
        """Every rank's `x` concatenated along the last dim, on rank 0 (None on the others); rank r's part has
        `sizes[r]` columns (vocab shards may differ by one): parts are padded to the largest, then trimmed.
        A gather moves half the bytes of an all-gather; hccl has no gather, so there it is an all-gather."""
        if self.size == 1:
            return x
        width = max(sizes)
        if x.shape[-1] < width:
            x = torch.nn.functional.pad(x, (0, width - x.shape[-1]))
        x = x.contiguous()
        start = time.perf_counter()
        parts: list[torch.Tensor] | None
        if self.shm is not None and self.shm.fits(x):
            parts = self.shm.gather(x, self.timeout_s)
        elif self.backend == "hccl":
            flat = x.new_empty((self.size * x.shape[0], *x.shape[1:]))
            (getattr(torch.distributed, "all_gather_single", None) or torch.distributed.all_gather_into_tensor)(
                flat, x)   # all_gather_single: the newer name (torch >= 2.12)
            parts = list(flat.view(self.size, *x.shape))
        else:
            parts = [torch.empty_like(x) for _ in range(self.size)] if self.rank == 0 else None
            torch.distributed.gather(x, parts, dst=0)
        self.collective_seconds += time.perf_counter() - start
        if self.rank != 0 or parts is None:   # (rank 0 always has the parts)
            return None
        return torch.cat([part[..., :n] for part, n in zip(parts, sizes, strict=True)], dim=-1)


def backend_for(device_type: str) -> str:
    """The collective backend of a device type; raises ValueError when this torch build lacks it."""
    backend = BACKEND_FOR_DEVICE[device_type]
    dist = torch.distributed
    have = {"gloo": dist.is_available() and dist.is_gloo_available(),
            "nccl": dist.is_available() and dist.is_nccl_available(),
            "hccl": "hccl" in getattr(dist.Backend, "backend_list", [])}[backend]
    if not have:
        raise ValueError(f"tensor_parallel_size > 1 on {device_type} needs the {backend} collective backend, "
                         f"which this torch build lacks"
                         + (" (import torch_npu registers hccl)" if backend == "hccl" else ""))
    return backend


def init_group(rank: int, size: int, device: torch.device, store: torch.distributed.Store,
               timeout_s: float, shm: ShmCollectives | None = None) -> TPGroup:
    """Join the group (blocks until every rank joined, or `timeout_s`). `shm`: this rank's handle on the
    CPU ranks' shared-memory collectives, which then carry the collectives that fit its slots."""
    if torch.distributed.is_initialized():
        raise RuntimeError(ALREADY_IN_GROUP)
    # All ranks of one engine are on one host: gloo talks over loopback unless told otherwise.
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    if device.type == "npu":   # HCCL's own timeouts (CANN env vars; documented ranges [120, 7200] and [68, 17340] s)
        os.environ.setdefault("HCCL_CONNECT_TIMEOUT", str(min(7200, max(120, int(timeout_s)))))
        os.environ.setdefault("HCCL_EXEC_TIMEOUT", str(min(17340, max(68, int(timeout_s)))))
    torch.distributed.init_process_group(backend_for(device.type), store=store, rank=rank, world_size=size,
                                         timeout=datetime.timedelta(seconds=timeout_s))
    return TPGroup(rank, size, backend_for(device.type), shm=shm, timeout_s=timeout_s)


def leave_group() -> None:
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def rank_device(device: torch.device, rank: int) -> torch.device:
    """The device rank `rank` runs on: cpu for every rank, else index `rank` of the visible devices."""
    return device if device.type == "cpu" else torch.device(device.type, rank)


def set_device(device: torch.device) -> None:
    """Bind the calling thread to `device` (on Ascend the binding is per thread: an unbound thread's device
    calls fail with "the context is empty")."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    elif device.type == "npu":
        torch.npu.set_device(device)  # type: ignore[attr-defined]  # set by torch_npu


def check_tensor_parallel(config: ModelConfig, tp: int, device: torch.device, weight_pool=None) -> None:
    """Refuse a tensor-parallel configuration that cannot run, before any process starts."""
    if tp == 1:
        return
    if torch.distributed.is_initialized():   # before any rank starts (init_group checks again, for the workers)
        raise RuntimeError(ALREADY_IN_GROUP)
    check_divisible(config, tp)
    backend_for(device.type)
    have = visible_devices(device.type)
    if device.type != "cpu" and tp > have:   # CPU ranks may share cores (slower, still correct)
        where = {"cuda": "CUDA_VISIBLE_DEVICES", "npu": "ASCEND_RT_VISIBLE_DEVICES"}[device.type]
        raise ValueError(f"tensor_parallel_size {tp} needs {tp} {device.type} devices, this process sees {have} "
                         f"(see {where})")
    if weight_pool is not None:
        raise ValueError("weight_pool: not supported with tensor_parallel_size > 1 (each rank holds other shards)")


def visible_devices(device_type: str) -> int:
    if device_type == "cuda":
        return torch.cuda.device_count()
    if device_type == "npu":
        import torch_npu  # noqa: F401  (registers torch.npu)

        return torch.npu.device_count()  # type: ignore[attr-defined]
    return os.cpu_count() or 1
