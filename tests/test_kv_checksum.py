"""The transfer checksum's two implementations (numpy for CPU pools, torch for device pools) and the
fused copy-and-checksum kernel of the shm path."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pdcluster.kv_transfer import fused_copy
from pdcluster.kv_transfer.checksum import block_sums, checksum_runs, weighted, words
from pdcluster.kv_transfer.layout import byte_view


def _pool(num_blocks: int, plane_bytes: int, seed: int) -> torch.Tensor:
    """A byte pool [planes = 3, num_blocks, plane_bytes] (layout.byte_view's shape)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (3, num_blocks, plane_bytes), dtype=torch.uint8, generator=g)


@pytest.mark.parametrize("plane_bytes", [64, 36, 18])  # int64, int32 and int16 words
def test_numpy_and_torch_checksums_agree(plane_bytes):
    pool = _pool(8, plane_bytes, 0)
    pool[:, 0] = 255  # large words: the sums wrap around 2**64 on both sides
    np_words = words(pool)
    torch_words = torch.from_numpy(np_words)  # a torch tensor takes the device (torch) branch
    assert isinstance(np_words, np.ndarray)
    for runs, l0, l1 in (([(0, 8)], 0, 3), ([(5, 2), (0, 3)], 1, 2), ([(7, 1)], 0, 1)):
        assert checksum_runs(np_words, runs, l0, l1) == checksum_runs(torch_words, runs, l0, l1)
    many = [(b, 1) for b in (7, 0, 5, 2, 3, 6, 1, 4)] + [(2, 3)]   # more than MANY_RUNS: the compiled pass
    assert checksum_runs(np_words, many, 1, 3) == checksum_runs(torch_words, many, 1, 3)
    # the same blocks in another order give another checksum: a block in the wrong slot shows
    assert checksum_runs(np_words, [(0, 1), (1, 1)], 0, 3) != checksum_runs(np_words, [(1, 1), (0, 1)], 0, 3)


@pytest.mark.parametrize("split", [False, True])
def test_fused_copy_copies_listed_blocks_and_sums_both_ends(monkeypatch, split):
    if split:  # force the multi-thread split even for this small copy
        monkeypatch.setattr(fused_copy, "PARALLEL_MIN_BYTES", 0)
    # pools [layers = 3, k|v, blocks, block_size 2, heads 1, head_dim 4]: planes 2..5 are layers 1 and 2
    src_pool = _pool(10, 2 * 32, 1).view(torch.float32).view(3, 2, 10, 2, 1, 4)
    dst_pool = torch.zeros((3, 2, 6, 2, 1, 4), dtype=torch.float32)
    src_w, dst_w = words(byte_view(src_pool)), words(byte_view(dst_pool))
    src_ids, dst_ids = np.array([9, 2, 4], dtype=np.int64), np.array([1, 5, 0], dtype=np.int64)
    sent, landed = fused_copy.copy_blocks(dst_w, src_w, dst_ids, src_ids, 2, 6)
    assert torch.equal(dst_pool[1:3, :, [1, 5, 0]].view(torch.int32), src_pool[1:3, :, [9, 2, 4]].view(torch.int32))
    assert not dst_pool[0].any() and not dst_pool[:, :, [2, 3, 4]].any()  # other layers and blocks untouched
    want = block_sums(src_w, [(9, 1), (2, 1), (4, 1)], 2, 6)
    assert sent.tolist() == landed.tolist() == want.tolist()
    assert weighted(landed) == checksum_runs(dst_w, [(1, 1), (5, 1), (0, 1)], 2, 6)
