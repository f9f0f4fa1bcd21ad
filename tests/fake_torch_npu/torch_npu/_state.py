"""The emulator's state: the pretend devices, which threads hold a device context, and how often each op ran.

Tests configure it through `torch_npu._emulator` (this module) and read `calls` to check that a code path really
went through the emulated kernels.
"""

from __future__ import annotations

import collections
import threading

device_count = 1
total_memory = 64 << 30
free_memory = 60 << 30
utilization = 0
device_name = "Ascend910B3 (emulated)"
# On Ascend a device context belongs to a thread (aclrtSetDevice): a thread that never called
# torch.npu.set_device fails at its first device op. False turns the check off.
strict_context = True
# The engine's stand-in for NPU tensors (engine/device.py is_npu): with True, pdcluster treats CPU tensors as NPU
# ones and runs its NPU code paths (the npu attention backend, the fused layer ops, NPU defaults) on them.
npu_on_cpu = False
# torch.npu.is_bf16_supported(): False on Atlas 300I / 310P (no bfloat16)
bf16_supported = True

calls: collections.Counter[str] = collections.Counter()

_local = threading.local()
_lock = threading.Lock()
_initialized = False


def reset() -> None:
    global device_count, total_memory, free_memory, utilization, strict_context, _initialized, _local, npu_on_cpu
    global bf16_supported
    device_count, total_memory, free_memory, utilization = 1, 64 << 30, 60 << 30, 0
    npu_on_cpu, bf16_supported = False, True
    strict_context, _initialized, _local = True, False, threading.local()
    calls.clear()


def check_index(index: int) -> int:
    if not 0 <= index < device_count:
        raise RuntimeError(f"Invalid device ID {index}: the emulator has {device_count} NPU(s) "
                           "(ASCEND_RT_VISIBLE_DEVICES)")
    return index


def bind(index: int) -> None:
    """aclrtSetDevice: the calling thread now has device `index`'s context."""
    global _initialized
    _local.device = check_index(index)
    _initialized = True


def bound_device() -> int | None:
    return getattr(_local, "device", None)


def lazy_init() -> None:
    """torch_npu initialises the runtime once per process, binding the thread that does it to device 0;
    threads started later hold no context until they call set_device."""
    global _initialized
    with _lock:
        if not _initialized:
            bind(0)


def require_context(op: str) -> None:
    """What a device op does in a thread without a context (error 107002, seen e.g. in lm-sys/FastChat#2842 and
    vllm-project/vllm-ascend#800)."""
    if strict_context and bound_device() is None:
        raise RuntimeError(f"{op}: NPU error, error code is 107002\n[Error]: The context is empty.\n"
                           "        Check whether acl.rt.set_context or acl.rt.set_device is called.")


def record(op: str) -> None:
    require_context(op)
    calls[op] += 1
