"""Installs the CPU emulator of FlashInfer (tests/fake_flashinfer) for one test and removes it after.

    from flashinfer_emulator import flashinfer_emulator_fixture   # noqa: F401  (registers `flashinfer_emulator`)

    def test_x(flashinfer_emulator):
        import flashinfer
        ...

`emulated_flashinfer(float32=True)` also lets the emulator and the engine's FlashInfer backend run float32 (which
real FlashInfer has no kernels for), so an engine on the emulator can be compared token for token with the
float32 reference backends. `subprocess_env()` makes child processes import it too.
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

FAKE_FLASHINFER_DIR = Path(__file__).resolve().parent / "fake_flashinfer"


def _drop_modules() -> dict[str, ModuleType]:
    names = [n for n in sys.modules if n == "flashinfer" or n.startswith("flashinfer.")]
    return {n: sys.modules.pop(n) for n in names}


@contextlib.contextmanager
def emulated_flashinfer(float32: bool = False) -> Iterator[ModuleType]:
    """A real flashinfer already imported (a GPU host) is set aside while the emulator is in, then put back."""
    from pdcluster.engine.attention import flashinfer_backend

    real = {n: m for n, m in _drop_modules().items() if not getattr(m, "EMULATED", False)}
    sys.path.insert(0, str(FAKE_FLASHINFER_DIR))
    kernel_dtypes = flashinfer_backend.KERNEL_DTYPES
    try:
        import flashinfer

        flashinfer._emulator.reset()
        flashinfer._emulator.allow_float32 = float32
        if float32:
            flashinfer_backend.KERNEL_DTYPES = kernel_dtypes + (torch.float32,)
        yield flashinfer
    finally:
        flashinfer_backend.KERNEL_DTYPES = kernel_dtypes
        sys.path.remove(str(FAKE_FLASHINFER_DIR))
        _drop_modules()
        sys.modules.update(real)


def subprocess_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """An environment whose Python processes import the emulator as flashinfer."""
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(FAKE_FLASHINFER_DIR), env.get("PYTHONPATH")) if p)
    return env


@pytest.fixture(name="flashinfer_emulator")
def flashinfer_emulator_fixture() -> Iterator[ModuleType]:
    with emulated_flashinfer() as flashinfer:
        yield flashinfer
