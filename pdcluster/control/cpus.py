"""CPU lists ("0-3,8", as taskset and VLLM_CPU_OMP_THREADS_BIND write them) and sharing cores out.

A node's `cpu_cores` knob, `pdcluster up`'s split of the host (cli/sizing.py `share_host_cores`) and the
tensor-parallel ranks' split of a node's cores (engine/tp_executor.py) all go through here.
"""

from __future__ import annotations

import contextlib
import os
import re
from typing import Iterator

_RANGE = re.compile(r"(\d+)(?:-(\d+))?")


def parse_cpus(text: str) -> list[int]:
    """'0-3,8' -> [0, 1, 2, 3, 8] (sorted, each once; '' -> []); ValueError when malformed."""
    cpus: set[int] = set()
    for part in text.replace(" ", "").split(",") if text.strip() else []:
        match = _RANGE.fullmatch(part)
        if not match:
            raise ValueError(f"{text!r} is not a CPU list like 0-3,8")
        first, last = int(match.group(1)), int(match.group(2) or match.group(1))
        if last < first:
            raise ValueError(f"{text!r}: range {part} runs backwards")
        cpus.update(range(first, last + 1))
    return sorted(cpus)


def format_cpus(cpus: list[int]) -> str:
    """[0, 1, 2, 3, 8] -> '0-3,8', the shortest list `parse_cpus` reads back."""
    parts: list[str] = []
    cpus = sorted(set(cpus))
    start = 0
    for i, cpu in enumerate(cpus):
        if i + 1 == len(cpus) or cpus[i + 1] != cpu + 1:
            first = cpus[start]
            parts.append(str(first) if first == cpu else f"{first}-{cpu}")
            start = i + 1
    return ",".join(parts)


def share_cpus(cpus: list[int], weights: list[int]) -> list[list[int]]:
    """`cpus` cut into one contiguous slice per weight, in order, sizes as near to proportional as whole cores
    go, every slice at least one core and at least its weight when there are enough. With fewer cores than
    weights, slice i is the single core i mod len(cpus): each core shared by as few as can be."""
    if not cpus or not weights:
        return [[] for _ in weights]
    if len(cpus) < len(weights):
        return [[cpus[i % len(cpus)]] for i in range(len(weights))]
    counts = [1] * len(weights)
    for _ in range(len(cpus) - len(weights)):   # each further core to the slice with the most weight per core
        i = max(range(len(weights)), key=lambda i: weights[i] / counts[i])
        counts[i] += 1
    slices, start = [], 0
    for count in counts:
        slices.append(cpus[start:start + count])
        start += count
    return slices


def omp_binding_env(cpus: list[int]) -> dict[str, str]:
    """OpenMP's thread binding to `cpus`, one thread per core in order (the thread that starts a parallel region
    on the first): read once, when the OpenMP runtime loads (with torch)."""
    return {"OMP_PLACES": ",".join(f"{{{cpu}}}" for cpu in cpus), "OMP_PROC_BIND": "close"}


@contextlib.contextmanager
def on_cpus(cpus: list[int]) -> Iterator[None]:
    """Run the block with the calling thread on `cpus` (nothing changes for []): processes started inside
    inherit them from the first instruction; the thread's own CPUs come back after."""
    if not cpus:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)
