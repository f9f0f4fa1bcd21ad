"""Keep the memory of freed activations in the process instead of returning it to the kernel (glibc malloc).

torch's CPU tensors come from malloc. glibc serves a request above its mmap threshold (128 KiB at first, rising to at
most 32 MiB as such blocks are freed) with a fresh mmap and unmaps it on free, and gives the heap's free top back
above its trim threshold: every step's large temporaries (a prefill chunk's MLP activations, the logits) are then
new pages, and a page fault per 4 KiB on first touch. A 2048-token prefill of SmolLM2 took 45-80k minor faults and
~10 % of its time for that; with the thresholds below, none after the first steps (docs/benchmarks.md "Freed
activations kept"). vLLM-CPU's deployment guide gets the same effect by preloading tcmalloc.

What the process keeps is bounded: blocks above MMAP_THRESHOLD are still mapped and unmapped per use, and free
memory at the heap's top above TRIM_THRESHOLD is still returned. Not applied when the user chose an allocator or
glibc's settings (LD_PRELOAD of another malloc, MALLOC_*_ / GLIBC_TUNABLES), or with PDCLUSTER_MALLOC_TUNING=0.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3   # glibc's mallopt parameters (malloc.h)
MMAP_THRESHOLD = 64 << 20    # requests up to this come from the heap (and are reused)
TRIM_THRESHOLD = 256 << 20   # free memory kept at a heap's top before it goes back to the kernel
TOP_PAD = 32 << 20           # extra the heap grows by at once


def _user_chose() -> bool:
    env = os.environ
    return (env.get("PDCLUSTER_MALLOC_TUNING", "1") == "0" or "malloc" in env.get("LD_PRELOAD", "")
            or any(name.startswith("MALLOC_") and name.endswith("_") for name in env)
            or "glibc.malloc" in env.get("GLIBC_TUNABLES", ""))


@functools.cache
def keep_freed_memory() -> bool:
    """Set glibc's thresholds for this process (once); False where not applied (another libc or allocator, or the
    user's own settings)."""
    if _user_chose():
        return False
    path = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(path) if path else None
    except OSError:
        libc = None
    mallopt = getattr(libc, "mallopt", None)
    if mallopt is None or not hasattr(libc, "gnu_get_libc_version"):   # (musl, macOS: their own allocators)
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    done = all(mallopt(param, value) == 1 for param, value in
               ((M_MMAP_THRESHOLD, MMAP_THRESHOLD), (M_TRIM_THRESHOLD, TRIM_THRESHOLD), (M_TOP_PAD, TOP_PAD)))
    if not done:
        log.warning("mallopt refused the engine's malloc thresholds: large temporaries stay mmap'd per use")
    return done
