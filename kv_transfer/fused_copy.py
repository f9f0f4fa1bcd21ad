"""Copy KV blocks between two CPU pools and checksum both ends in the same pass.

The shm sender's hot loop, compiled with numba. Pools are [planes, num_blocks, words per plane]
(layout.byte_view: a plane is one layer's K or V cache of one rank). Per plane, per block: each source word
is loaded once, stored into the receiver's pool and added to the block's "sent" sum; then the piece just
written is read back from the receiver's pool while it is still in this core's cache and summed again
("landed"). Planes go in the outer loop, so a run of consecutive block ids streams through contiguous
memory. Neither sum costs an extra trip to memory; a separate pass by the receiver would re-read every byte from DRAM
(measured in docs/benchmarks.md).

Large copies are split over threads of our own (the kernel releases the GIL) rather than numba's
parallel layer: its OpenMP workers spin after each region and steal the core the receiver needs, and
its workqueue layer cannot be entered from two sender threads at once. Compiled on first use (then
cached on disk); `warm_up` does it ahead of time.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from itertools import count

import numpy as np
from numba import njit

PARALLEL_MIN_BYTES = 8 << 20  # below this a hand-off to another thread costs more than it saves

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


@njit(nogil=True, cache=True)
def _copy_and_sum(dst, src, dst_ids, src_ids, p0, p1, sent, landed):  # pragma: no cover - compiled
    for i in range(dst_ids.size):
        sent[i] = 0
        landed[i] = 0
    for p in range(p0, p1):
        for i in range(dst_ids.size):
            d = dst[p, dst_ids[i]]
            s = src[p, src_ids[i]]
            acc = np.int64(0)
            for j in range(s.size):  # 0-based: lets LLVM drop the negative-index checks and vectorise
                v = s[j]
                d[j] = v
                acc += v
            sent[i] += acc
            acc = np.int64(0)
            for j in range(d.size):
                acc += d[j]
            landed[i] += acc


def copy_blocks(
    dst_words: np.ndarray, src_words: np.ndarray, dst_ids: np.ndarray, src_ids: np.ndarray, p0: int, p1: int
) -> tuple[np.ndarray, np.ndarray]:
    """dst_words[p, dst_ids[i]] = src_words[p, src_ids[i]] for planes p in [p0, p1). Returns per-block wrapping
    int64 word sums over those planes (same values as checksum.block_sums) of what was read and of what landed.

    dst_words/src_words: integer words [planes, num_blocks, words_per_plane]; ids: int64 arrays of equal length.
    """
    n = len(src_ids)
    sent = np.empty(n, dtype=np.int64)
    landed = np.empty(n, dtype=np.int64)
    nbytes = n * (p1 - p0) * src_words.shape[2] * src_words.itemsize
    threads = min(n, os.cpu_count() or 1) if nbytes >= PARALLEL_MIN_BYTES else 1
    if threads == 1:
        _copy_and_sum(dst_words, src_words, dst_ids, src_ids, p0, p1, sent, landed)
        return sent, landed
    # Several chunks per thread, taken in turn: a thread slowed by another process takes fewer.
    chunks = min(n, 8 * threads)
    bounds = [n * k // chunks for k in range(chunks + 1)]
    next_chunk = count()

    def work() -> None:
        while (k := next(next_chunk)) < chunks:
            sl = slice(bounds[k], bounds[k + 1])
            _copy_and_sum(dst_words, src_words, dst_ids[sl], src_ids[sl], p0, p1, sent[sl], landed[sl])

    futures = [_helpers(threads - 1).submit(work) for _ in range(threads - 1)]
    work()
    for f in futures:
        f.result()
    return sent, landed


def _helpers(n: int) -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=max(1, n), thread_name_prefix="kv-copy")
        return _pool


def warm_up() -> None:
    a = np.zeros((2, 2, 8), dtype=np.int64)
    ids = np.arange(2, dtype=np.int64)
    copy_blocks(a, a.copy(), ids, ids, 0, 2)
