"""One OpenMP team per process: the engine thread's.

Each thread that runs a parallel torch op becomes the master of its own OpenMP team, whose workers live as long as
that thread does. GNU OpenMP (torch's CPU wheels) spins ~3 ms for the next parallel region only while the threads it
manages are no more than the CPUs it may use; beyond that it spins 100 iterations and sleeps on a futex, so every
parallel region then pays a worker wake-up. A node builds its model on the main thread (a first team) and steps it on
the engine thread (a second one): on 2 cores that alone made each engine step 2-3x slower (docs/benchmarks.md,
"Serving vs vllm serve"). `release_thread_team` gives the calling thread's team back (OpenMP 5.0
`omp_pause_resource_all`); the engine thread calls it for the thread that built the engine.
"""

from __future__ import annotations

import ctypes
import functools
import logging

log = logging.getLogger(__name__)

OMP_PAUSE_SOFT = 1


@functools.cache
def _libgomp() -> ctypes.CDLL | None:
    """The GNU OpenMP runtime this process has loaded (torch's), or None (not loaded, or another runtime)."""
    try:
        with open("/proc/self/maps") as maps:
            path = next((line.split()[-1] for line in maps if "/libgomp" in line), None)
    except OSError:
        return None
    if path is None:
        return None
    lib = ctypes.CDLL(path)   # already mapped: the same library, not a second copy
    return lib if hasattr(lib, "omp_pause_resource_all") else None


def release_thread_team() -> bool:
    """Let the calling thread's OpenMP worker threads exit (they come back at its next parallel region). False
    where there is nothing to release this way (no libgomp, or inside a parallel region)."""
    lib = _libgomp()
    if lib is None:
        return False
    return lib.omp_pause_resource_all(OMP_PAUSE_SOFT) == 0
