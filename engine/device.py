"""Device layer: which accelerator this process uses, and how much memory it has free.

`torch_npu` is imported only here and only when asked for (or probed by `detect_device`): on hosts
without CANN its import hook can break, so any failure counts as "no NPU".
"""

from __future__ import annotations

import logging
import os
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch

from pdcluster.device import is_npu

if TYPE_CHECKING:
    from pdcluster.engine.args import EngineArgs

log = logging.getLogger(__name__)

_DEVICE_KINDS = ("npu", "cuda", "cpu")
_npu_available: bool | None = None


def npu_available() -> bool:
    global _npu_available
    if _npu_available is None:
        try:
            import torch_npu  # noqa: F401

            _npu_available = bool(torch.npu.is_available())  # type: ignore[attr-defined]  # set by torch_npu
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
        if is_npu(torch.device("cpu")):   # the emulator's NPU tensors are CPU tensors (is_npu)
            return torch.device("cpu")
    elif kind == "cuda" and not torch.cuda.is_available():
        raise ValueError("device: 'cuda' requested but CUDA is not available")
    dev = torch.device(device) if not isinstance(device, torch.device) else device
    if kind != "cpu" and dev.index is None:
        dev = torch.device(kind, 0)
    return dev


# NPU defaults: the fused attention's paged prefill (Q_S > 1) takes blocks of a multiple of 128 in 128..512
# (torch_npu-npu_fused_infer_attention_score.md), and it takes float16 / bfloat16 only.
NPU_BLOCK_SIZE = 128
CPU_BLOCK_SIZE = 128
CUDA_BLOCK_SIZE = 16


def device_kind(device: torch.device) -> str:
    """npu / cuda / cpu: which kernels the device runs (`is_npu`)."""
    return "npu" if is_npu(device) else device.type


def npu_dtype() -> torch.dtype:
    """bfloat16, or float16 on chips without bfloat16 (Atlas 300I / 310P: `torch.npu.is_bf16_supported()`)."""
    check = getattr(torch.npu, "is_bf16_supported", None)  # type: ignore[attr-defined]
    return torch.bfloat16 if check is None or check() else torch.float16


def with_device_defaults(args: "EngineArgs", device: torch.device) -> "EngineArgs":
    """`args` with the device's defaults where they were left unset: block size 128 on CPU (vLLM-CPU's default: the
    decode kernel reads a block's rows for all KV heads as one run, 48 KB at SmolLM2's shapes instead of 6 KB, and
    is 1.15-1.2x faster over 2k contexts, docs/benchmarks.md "Decode attention") and on NPU (where 16 is taken as
    128 too: the paged prefill cannot take it), 16 on CUDA; on NPU dtype "auto" → bfloat16 (float16 without bf16).
    float32 on NPU is refused: the fused attention takes float16 / bfloat16 only."""
    changes: dict[str, Any] = {}
    if is_npu(device):
        if args.dtype in ("float32", torch.float32):
            raise ValueError("dtype: float32 does not run on NPU (npu_fused_infer_attention_score takes float16 / "
                             "bfloat16); use dtype auto, bfloat16 or float16")
        if args.block_size in (None, 16):
            changes["block_size"] = NPU_BLOCK_SIZE
        if args.dtype == "auto":
            changes["dtype"] = str(npu_dtype()).removeprefix("torch.")
        if changes:
            log.info("NPU defaults: %s", ", ".join(f"{k}={v}" for k, v in changes.items()))
    elif args.block_size is None:
        changes["block_size"] = CPU_BLOCK_SIZE if device.type == "cpu" else CUDA_BLOCK_SIZE
    return replace(args, **changes) if changes else args


def free_memory_bytes(device: torch.device) -> int:
    """Free memory on the device; on CPU, available system memory (MemAvailable)."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    if device.type == "npu":   # (the emulator's stand-in tensors live in host memory: counted below)
        free, _total = torch.npu.mem_get_info(device)  # type: ignore[attr-defined]
        return int(free)
    return available_memory_bytes()


# HCCL communicators a node holds at once, besides torch's allocator: its tensor-parallel group and KV pair
# groups with the peers it is talking to.
HCCL_COMMUNICATORS = 3


def collective_headroom_bytes(device: torch.device) -> int:
    """Device memory to leave out of the KV pool for the collective library. On NPU each HCCL communicator
    takes 2 x HCCL_BUFFSIZE MB of its own (send and receive buffers; CANN environment variable reference,
    HCCL_BUFFSIZE: default 200, "exclusively used by HCCL"); NCCL's buffers are small and come out of the
    `gpu_memory_utilization` margin."""
    if device.type != "npu":
        return 0
    return 2 * int(os.environ.get("HCCL_BUFFSIZE", "200")) * HCCL_COMMUNICATORS << 20


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

