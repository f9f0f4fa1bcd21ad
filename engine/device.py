"""Device layer: which accelerator this process uses, and how much memory it has free.

`torch_npu` is imported only here and only when asked for (or probed by `detect_device`): on hosts
without CANN its import hook can break, so any failure counts as "no NPU".
"""

from __future__ import annotations

import os

import torch

_DEVICE_KINDS = ("npu", "cuda", "cpu")
_npu_available: bool | None = None


def npu_available() -> bool:
    global _npu_available
    if _npu_available is None:
        try:
            import torch_npu  # noqa: F401

            _npu_available = bool(torch.npu.is_available())
        except Exception:
            _npu_available = False
    return _npu_available


def detect_device() -> str:
    """`npu` when torch_npu imports and sees a device, else `cuda`, else `cpu`.

    `PDCLUSTER_DEVICE` overrides detection (useful on mixed hosts)."""
    forced = os.environ.get("PDCLUSTER_DEVICE")
    if forced:
        return device_type(forced)
    if os.environ.get("PDCLUSTER_SKIP_NPU") != "1" and npu_available():
        return "npu"
    if torch.cuda.is_available():
        return "cuda"
    return "cpu"


def device_type(device: str | torch.device) -> str:
    kind = device.type if isinstance(device, torch.device) else str(device).split(":")[0]
    if kind not in _DEVICE_KINDS:
        raise ValueError(f"device: unsupported device {device!r}; expected one of npu, cuda, cpu")
    return kind


def resolve_device(device: str | torch.device | None) -> torch.device:
    """The torch.device to run on; None means auto-detect."""
    if device is None or device == "auto":
        kind = detect_device()
        return torch.device(kind, 0) if kind != "cpu" else torch.device("cpu")
    kind = device_type(device)
    if kind == "npu":
        if not npu_available():
            raise ValueError("device: 'npu' requested but torch_npu is not importable or sees no NPU")
    elif kind == "cuda" and not torch.cuda.is_available():
        raise ValueError("device: 'cuda' requested but CUDA is not available")
    dev = torch.device(device) if not isinstance(device, torch.device) else device
    if kind != "cpu" and dev.index is None:
        dev = torch.device(kind, 0)
    return dev


def free_memory_bytes(device: torch.device) -> int:
    """Free memory on the device; on CPU, available system memory (MemAvailable)."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    if device.type == "npu":
        free, _total = torch.npu.mem_get_info(device)
        return int(free)
    return available_memory_bytes()


CPU_KV_CACHE_CAP = 4 << 30   # per engine: on CPU the pool shares RAM with everything else


def default_cpu_kv_cache_bytes(memory_fraction: float, num_engines: int = 1) -> int:
    """The KV pool of a CPU engine whose kv_cache_memory is not set: half of `memory_fraction` of the memory
    available now (weights and activations need the rest), split among `num_engines` engines starting on
    this host at the same time (each alone would count the same free memory), at most CPU_KV_CACHE_CAP."""
    return min(CPU_KV_CACHE_CAP, int(available_memory_bytes() * memory_fraction) // 2 // num_engines)


def available_memory_bytes() -> int:
    """System memory available to new allocations without swapping (MemAvailable); 4 GiB if unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 4 << 30

