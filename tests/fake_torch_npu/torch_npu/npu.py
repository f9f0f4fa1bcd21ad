"""`torch_npu.npu` (also reachable as `torch.npu`): the device API, CPU-backed.

Follows torch_npu's device API, which mirrors torch.cuda (Ascend/op-plugin docs/context/NPU-Device.md, "torch_npu
提供设备相关的部分接口，具体可参考 torch.cuda"; docs/context/Memory-management-API.md): is_available, device_count,
set_device, current_device, device, synchronize, mem_get_info, utilization, get_device_name, Event, Stream.
Memory figures and the device count come from `torch_npu._emulator`; nothing is allocated anywhere but on CPU.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Iterator

from torch_npu import _state


def _index(device: Any) -> int:
    """An int, "npu", "npu:1", or anything with .type/.index (a torch.device)."""
    if device is None:
        return current_device()
    if isinstance(device, int):
        return device
    if isinstance(device, str):
        kind, _, idx = device.partition(":")
        if kind != "npu":
            raise ValueError(f"Expected a npu device, but got: {device}")
        return int(idx) if idx else current_device()
    kind, idx = getattr(device, "type", None), getattr(device, "index", None)
    if kind != "npu":
        raise ValueError(f"Expected a npu device, but got: {device}")
    return current_device() if idx is None else int(idx)


def is_available() -> bool:
    return _state.device_count > 0


def device_count() -> int:
    return _state.device_count


def is_initialized() -> bool:
    return _state._initialized


def init() -> None:
    _state.lazy_init()


def set_device(device: Any) -> None:
    idx = _index(device)
    if idx >= 0:   # torch.cuda.set_device ignores negative indices
        _state.bind(idx)


def current_device() -> int:
    _state.lazy_init()
    bound = _state.bound_device()
    return 0 if bound is None else bound


@contextlib.contextmanager
def device(dev: Any) -> Iterator[None]:
    """Device guard: the thread holds `dev`'s context inside, and the previous device again after."""
    prev = _state.bound_device()
    set_device(dev)
    try:
        yield
    finally:
        if prev is not None:
            _state.bind(prev)


def synchronize(device: Any = None) -> None:
    _state.lazy_init()
    _state.check_index(_index(device))
    _state.require_context("synchronize")


def mem_get_info(device: Any = None) -> tuple[int, int]:
    """(free, total) bytes of the device."""
    _state.lazy_init()
    _state.check_index(_index(device))
    return int(_state.free_memory), int(_state.total_memory)


def utilization(device: Any = None) -> int:
    _state.check_index(_index(device))
    return int(_state.utilization)


def is_bf16_supported() -> bool:
    """torch.npu.is_bf16_supported(), as torch_npu itself calls it (Ascend/pytorch torch_npu/npu/autocast_utils.py:
    `get_amp_supported_dtype` offers bfloat16 only when it is True): whether the chip computes in bfloat16."""
    return _state.bf16_supported


def get_device_name(device: Any = None) -> str:
    _state.check_index(_index(device))
    return _state.device_name


def empty_cache() -> None:
    pass


class Stream:
    """Work on the emulator runs synchronously, so a stream only keeps its device."""

    def __init__(self, device: Any = None, priority: int = 0) -> None:
        _state.lazy_init()
        self.device_index = _state.check_index(_index(device))
        self.priority = priority

    def synchronize(self) -> None:
        _state.require_context("Stream.synchronize")

    def query(self) -> bool:
        return True

    def wait_stream(self, stream: "Stream") -> None:
        pass

    def wait_event(self, event: "Event") -> None:
        pass

    def record_event(self, event: "Event | None" = None) -> "Event":
        event = event or Event()
        event.record(self)
        return event


_current_streams: dict[int, Stream] = {}


def current_stream(device: Any = None) -> Stream:
    idx = _state.check_index(_index(device))
    return _current_streams.setdefault(idx, Stream(idx))


default_stream = current_stream


@contextlib.contextmanager
def stream(s: Stream | None) -> Iterator[None]:
    yield


class Event:
    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False) -> None:
        self.enable_timing = enable_timing
        self._time: float | None = None

    def record(self, stream: Stream | None = None) -> None:
        _state.require_context("Event.record")
        self._time = time.perf_counter()

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def wait(self, stream: Stream | None = None) -> None:
        pass

    def elapsed_time(self, end: "Event") -> float:
        """Milliseconds between this event and `end`, both recorded with enable_timing=True."""
        if not (self.enable_timing and end.enable_timing):
            raise RuntimeError("Both events must be created with argument 'enable_timing=True'.")
        if self._time is None or end._time is None:
            raise RuntimeError("Both events must be recorded before calculating elapsed time.")
        return (end._time - self._time) * 1000.0
