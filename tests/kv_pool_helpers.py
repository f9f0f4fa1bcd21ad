"""Model KV and the pools engines of different tensor-parallel sizes hold of it (tests/test_kv_hetero_tp.py,
tests/test_kv_slice_regroup.py)."""

from __future__ import annotations

import torch

from pdcluster.device import rank_kv_heads

LAYERS, BLOCKS, BLOCK_SIZE, HEAD_DIM = 3, 12, 4, 8


def pool_shape(total: int, tp: int, dtype: torch.dtype) -> tuple[int, ...]:
    """The engine's pool shape (engine/kv_cache.py) for a model of `total` KV heads at `tp` ranks."""
    from pdcluster.engine.kv_cache import KVCachePool

    heads = len(rank_kv_heads(total, 0, tp))
    return KVCachePool(BLOCKS, LAYERS, BLOCK_SIZE, heads, HEAD_DIM, dtype, tp=tp).tensor.shape


def model_kv(seed: int, total: int, dtype: torch.dtype) -> torch.Tensor:
    """[layers, K|V, blocks, block_size, model KV heads, row] of random rows (an int8 pool's: values + scale)."""
    from pdcluster.engine.kv_cache import quantize_rows

    g = torch.Generator().manual_seed(seed)
    rows = torch.randn(LAYERS, 2, BLOCKS, BLOCK_SIZE, total, HEAD_DIM, generator=g)
    return quantize_rows(rows) if dtype == torch.int8 else rows.to(dtype)


def split(kv: torch.Tensor, tp: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """The pool a `tp`-rank engine holds of model KV `kv`: rank r's heads in planes 2r (K) and 2r + 1 (V)."""
    total = kv.shape[4]
    pool = torch.zeros(pool_shape(total, tp, kv.dtype), dtype=kv.dtype) if out is None else out
    for r in range(tp):
        heads = rank_kv_heads(total, r, tp)
        pool[:, 2 * r:2 * r + 2] = kv[:, :, :, :, heads.start:heads.stop]
    return pool


def assert_landed(pools: list[torch.Tensor], expected: list[torch.Tensor], src: list[int], dst: list[int]) -> None:
    """Each receiving pool holds its expected pool's blocks `src` in its blocks `dst`, and nothing anywhere else."""
    for got, want in zip(pools, expected, strict=True):
        assert torch.equal(got[:, :, dst], want[:, :, src])
        untouched = [b for b in range(want.shape[2]) if b not in dst]
        assert not got[:, :, untouched].any()


def close_all(*groups) -> None:
    """Close every sender, receiver and shared pool of a transfer test (its `finally`)."""
    for group in groups:
        for item in group:
            item.close()
