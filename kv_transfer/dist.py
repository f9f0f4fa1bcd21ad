"""Pairwise torch.distributed process groups: one 2-rank group per (sender, receiver) pair.

No global init_process_group: each pair gets its own TCPStore (hosted by the receiver, rank 0) and a
backend process group built directly on it, so any number of prefill/decode pairs can come and go.
gloo (CPU) is exercised by the tests; nccl (CUDA) and hccl (Ascend, via torch_npu) are built the same
way but untested here.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

DIST_BACKENDS = ("gloo", "nccl", "hccl")


def backend_for_device(device_type: str) -> str:
    return {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}.get(device_type, "gloo")


def host_store(host: str, timeout: float) -> dist.TCPStore:
    """Receiver side: a fresh store on a free port; its port goes to the sender in the handshake."""
    return dist.TCPStore(
        host, 0, 2, is_master=True, timeout=datetime.timedelta(seconds=timeout), wait_for_workers=False
    )


def join_store(host: str, port: int, timeout: float) -> dist.TCPStore:
    return dist.TCPStore(host, port, 2, is_master=False, timeout=datetime.timedelta(seconds=timeout))


def pair_group(backend: str, store: dist.Store, rank: int, local_host: str, timeout: float, key: str):
    """Build the 2-rank group; blocks until the peer builds its side (or `timeout`)."""
    store = dist.PrefixStore(f"pdcluster-kv/{key}", store)
    td = datetime.timedelta(seconds=timeout)
    if backend == "gloo":
        opts = dist.ProcessGroupGloo._Options()
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=local_host)]
        opts._timeout = td
        return dist.ProcessGroupGloo(store, rank, 2, opts)
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = td
        return dist.ProcessGroupNCCL(store, rank, 2, opts)
    if backend == "hccl":
        import torch_npu  # noqa: F401  (only on Ascend hosts; see DESIGN.md §7)
        from torch_npu._C._distributed_c10d import ProcessGroupHCCL

        opts = ProcessGroupHCCL.Options()
        opts._timeout = td
        return ProcessGroupHCCL(store, rank, 2, opts)
    raise ValueError(f"backend: expected one of {DIST_BACKENDS}, got {backend!r}")


def send(pg, tensor: torch.Tensor, tag: int) -> None:
    pg.send([tensor], 1 - pg.rank(), tag).wait()


def recv(pg, tensor: torch.Tensor, tag: int) -> None:
    pg.recv([tensor], 1 - pg.rank(), tag).wait()
