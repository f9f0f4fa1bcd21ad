"""End-to-end transfer checksum: cheap enough to leave on.

Per block, the wrapping int64 sum of its bytes viewed as 64-bit words; blocks are then combined with
odd weights (2k+1) so a block landing in the wrong slot changes the result. CPU pools are summed with
numpy, or for many scattered runs one numba pass (one thread either way: no OpenMP team to wake or to fight
the peer process for the cores); device pools
with torch on the device. Both wrap modulo 2**64, so a GPU sender and a CPU receiver agree. Far
cheaper than zlib.crc32 (measured in docs/benchmarks.md; see docs/kv_transfer.md).
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit

MASK64 = (1 << 64) - 1
Words = np.ndarray | torch.Tensor


def words(byte_tensor: torch.Tensor) -> Words:
    """Reinterpret the last (byte) dim of a uint8 tensor as the widest integer words that fit:
    a numpy view for CPU tensors, a torch view on the device otherwise."""
    n = byte_tensor.shape[-1]
    for dtype, size in ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2)):
        if n % size == 0:
            view = byte_tensor.view(dtype)
            break
    else:
        view = byte_tensor
    return view.numpy() if view.device.type == "cpu" else view


def row_words(pool: torch.Tensor) -> Words:
    """A pool [layers, planes, blocks, block_size, heads, row] as [layers * planes, blocks, block_size, heads, words
    per row], words no wider than one (token, head) row: sums over them do not depend on how heads are grouped
    into planes (regroup.py)."""
    nl, kv, nb, bs, nh = pool.shape[:5]
    return words(pool.view(torch.uint8).reshape(nl * kv, nb, bs, nh, -1))


def checksum_runs(pool_words: Words, block_runs: list[tuple[int, int]], p0: int, p1: int) -> int:
    """Checksum of blocks (start, length)... restricted to planes [p0, p1) (layout.planes(l0, l1)), in run order.

    pool_words: words(byte_view(pool)), shape [planes, num_blocks, words_per_plane].
    """
    return weighted(block_sums(pool_words, block_runs, p0, p1))


def block_sums(pool_words: Words, block_runs: list[tuple[int, int]], p0: int, p1: int) -> Words:
    """Per-block wrapping sums of planes [p0, p1), in run order (a block's sum does not depend on the layout:
    addition modulo 2**64 is order-free)."""
    if isinstance(pool_words, np.ndarray):
        if len(block_runs) > MANY_RUNS:   # scattered blocks: one compiled pass instead of 2 numpy calls per run
            runs = np.asarray(block_runs, dtype=np.int64).reshape(-1, 2)
            out = np.empty(int(runs[:, 1].sum()), dtype=np.int64)
            _run_sums(pool_words, runs[:, 0].copy(), runs[:, 1].copy(), p0, p1, out)
            return out
        # the contiguous word axis first (one streaming pass per plane run), then the few planes
        sums = [pool_words[p0:p1, s : s + n].sum(axis=2, dtype=np.int64).sum(axis=0, dtype=np.int64)
                for s, n in block_runs]
        return sums[0] if len(sums) == 1 else np.concatenate(sums)
    sums_t = [pool_words[p0:p1, s : s + n].sum(dim=(0, 2)) for s, n in block_runs]
    return sums_t[0] if len(sums_t) == 1 else torch.cat(sums_t)


MANY_RUNS = 8


@njit(nogil=True, cache=True)
def _run_sums(w, starts, lens, p0, p1, out):  # pragma: no cover - compiled
    k = 0
    for r in range(starts.size):
        for b in range(starts[r], starts[r] + lens[r]):
            acc = np.int64(0)
            for p in range(p0, p1):
                row = w[p, b]
                for j in range(row.size):
                    acc += row[j]
            out[k] = acc
            k += 1


def weighted(per_block: Words) -> int:
    """Combine per-block sums with weights 1, 3, 5, ... so a block in the wrong slot shows."""
    if isinstance(per_block, np.ndarray):
        weights = np.arange(1, 2 * per_block.size, 2, dtype=np.int64)
        return int((per_block * weights).sum(dtype=np.int64)) & MASK64
    weights_t = torch.arange(1, 2 * per_block.numel(), 2, dtype=torch.int64, device=per_block.device)
    return int((per_block * weights_t).sum().item()) & MASK64


def checksum_bytes(flat: torch.Tensor) -> int:
    """Checksum of a flat uint8 buffer (staging of compressed payloads)."""
    w = words(flat.reshape(1, -1))
    return int(w.sum(dtype=np.int64) if isinstance(w, np.ndarray) else w.sum().item()) & MASK64


def combine(a: int, b: int) -> int:
    return (a + b) & MASK64


def combine_ranks(checksums: list[int]) -> int:
    """One checksum of a transfer made of one part per tensor-parallel rank (per_rank/), in rank order, weighted
    1, 3, 5, ... like blocks so that a part landing in another rank's slice shows."""
    return sum((2 * r + 1) * c for r, c in enumerate(checksums)) & MASK64
