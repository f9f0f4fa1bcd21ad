"""Shared by the native kernels' tests: a kernel source built for a CPU with AVX2 and no AVX-512 (-march=x86-64-v3,
AMD Zen 2/3, Intel before Skylake-SP) whatever this CPU has, so its 8-lane path is tested on every machine that
can run it."""

from __future__ import annotations

import contextlib
import ctypes
import shutil
import subprocess
from pathlib import Path

import pytest

from pdcluster.engine.attention import native


def cpu_flags() -> set[str]:
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        return set(next((line for line in f if line.startswith("flags")), ":").split(":", 1)[1].split())
    return set()


needs_avx2_cpu = pytest.mark.skipif(not {"avx2", "fma", "f16c"} <= cpu_flags() or not shutil.which("cc"),
                                    reason="this CPU cannot run an AVX2 build (or no C compiler)")


def build_avx2(source: Path, out: Path) -> ctypes.CDLL:
    flags = [f for f in native.FLAGS if not f.startswith("-march=")]
    subprocess.run([shutil.which("cc") or "gcc", *flags, "-march=x86-64-v3", str(source), "-o", str(out), "-lm"],
                   check=True, capture_output=True, timeout=120)
    return ctypes.CDLL(str(out))
