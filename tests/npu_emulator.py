"""Installs the CPU emulator of torch_npu (tests/fake_torch_npu) for one test and removes it after.

    from npu_emulator import npu_emulator_fixture   # noqa: F401  (registers the fixture `npu_emulator`)

    def test_x(npu_emulator):
        import torch_npu
        ...

The directory also holds an emulated `vllm_ascend.vllm_ascend_C` (vLLM-Ascend's LoRA custom ops, registered in
torch.ops._C_ascend on import, as the real library does): engine/lora/npu_ops.py loads it as on an Ascend host.

`npu_emulator` binds the test's thread to device 0 (as an engine's thread would) and yields the `torch_npu`
module; `torch_npu._emulator` sets the device count, memory figures and the per-thread context check, and counts
each operator's calls. Child processes see it too when started with `subprocess_env()` in their environment.
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Iterator

import pytest
import torch

FAKE_TORCH_NPU_DIR = Path(__file__).resolve().parent / "fake_torch_npu"


def _drop_modules() -> None:
    """torch_npu and the emulated vLLM-Ascend op library, whose ops leave torch.ops._C_ascend with it."""
    emulated = ["torch_npu"]
    if getattr(sys.modules.get("vllm_ascend"), "EMULATED", False):
        emulated.append("vllm_ascend")
        ops = sys.modules.get("vllm_ascend.vllm_ascend_C")
        if ops is not None:
            ops.unregister()
    for name in [n for n in sys.modules if n.split(".")[0] in emulated]:
        del sys.modules[name]


def _reset_engine_probe() -> None:
    """engine/device.py caches whether torch_npu imported; the answer changes with the emulator."""
    device = sys.modules.get("pdcluster.engine.device")
    if device is not None:
        device._npu_available = None


@contextlib.contextmanager
def emulated_torch_npu(device_count: int = 1, bind: bool = True, **config) -> Iterator[ModuleType]:
    """`import torch_npu` gives the emulator inside; config sets `torch_npu._emulator` fields (free_memory,
    total_memory, utilization, strict_context, bf16_supported, and npu_on_cpu: the engine then takes CPU tensors
    for NPU ones, so `device="npu"` runs its whole NPU path: tests/test_npu_backend.py)."""
    if "torch_npu" in sys.modules and not getattr(sys.modules["torch_npu"], "EMULATED", False):
        raise RuntimeError("a real torch_npu is already imported; the emulator cannot replace it")
    had_npu = hasattr(torch, "npu")
    old_npu = getattr(torch, "npu", None)
    _drop_modules()
    sys.path.insert(0, str(FAKE_TORCH_NPU_DIR))
    try:
        import torch_npu

        torch_npu._emulator.reset()
        torch_npu._emulator.device_count = device_count
        for key, value in config.items():
            if not hasattr(torch_npu._emulator, key):
                raise TypeError(f"unknown emulator setting {key!r}")
            setattr(torch_npu._emulator, key, value)
        if bind:
            torch_npu.npu.set_device(0)
        _reset_engine_probe()
        yield torch_npu
    finally:
        sys.path.remove(str(FAKE_TORCH_NPU_DIR))
        _drop_modules()
        if had_npu:
            torch.npu = old_npu
        elif hasattr(torch, "npu"):
            del torch.npu
        _reset_engine_probe()


def subprocess_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """An environment whose Python processes import the emulator as torch_npu."""
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(FAKE_TORCH_NPU_DIR), env.get("PYTHONPATH")) if p)
    return env


@pytest.fixture(name="npu_emulator")
def npu_emulator_fixture() -> Iterator[ModuleType]:
    with emulated_torch_npu() as torch_npu:
        yield torch_npu
