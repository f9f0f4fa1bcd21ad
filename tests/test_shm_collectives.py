"""The CPU ranks' shared-memory all-reduce and gather (engine/shm_collectives.py), between real processes."""

from __future__ import annotations

import multiprocessing as mp
import os

import pytest
import torch

from pdcluster.engine.shm_collectives import ShmCollectives, supported

pytestmark = pytest.mark.skipif(not supported(torch.device("cpu")), reason="shared-memory collectives: x86-64 only")


def _rank(args: tuple, shapes: list[tuple[int, ...]], out) -> None:
    shm = ShmCollectives.attach(*args)
    gen = torch.Generator().manual_seed(shm.rank)
    results = []
    for i, shape in enumerate(shapes):   # mixed shapes and dtypes: the buffers alternate under them
        dtype = torch.float32 if i % 2 == 0 else torch.bfloat16
        x = torch.randn(shape, generator=gen).to(dtype)
        if i % 3 == 2:
            parts = shm.gather(x, 30.0)
            results.append([p.float().numpy().copy() for p in parts] if parts is not None else None)
        else:
            results.append(shm.all_reduce(x, 30.0).float().numpy().copy())   # by value through the queue
    out.put((shm.rank, results))


def _expected(size: int, shapes: list[tuple[int, ...]]) -> list:
    inputs = []
    for r in range(size):
        gen = torch.Generator().manual_seed(r)
        inputs.append([torch.randn(shape, generator=gen).to(torch.float32 if i % 2 == 0 else torch.bfloat16)
                       for i, shape in enumerate(shapes)])
    return inputs


@pytest.mark.parametrize("size", [2, 3])
def test_all_reduce_and_gather_between_processes(size: int) -> None:
    shapes = [(4, 8), (1, 1000), (64, 256), (3, 5, 7), (128, 64), (2, 2)] * 5
    shm = ShmCollectives.create(size, 1 << 20)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(shm.attach_args(r), shapes, out)) for r in range(1, size)]
    for p in procs:
        p.start()
    try:
        _rank(shm.attach_args(0), shapes, out)
        got = dict(out.get(timeout=60) for _ in range(size))
    finally:
        for p in procs:
            p.join(30)
        shm.unlink()
    inputs = _expected(size, shapes)
    for i in range(len(shapes)):
        if i % 3 == 2:
            assert all(got[r][i] is None for r in range(1, size))
            for r in range(size):
                assert torch.equal(torch.from_numpy(got[0][i][r]), inputs[r][i].float())
        else:
            total = inputs[0][i] + inputs[1][i]
            for r in range(2, size):
                total = total + inputs[r][i]
            for r in range(size):   # every rank holds the same bits
                assert torch.equal(torch.from_numpy(got[r][i]), total.float()), (i, r)
    assert not os.path.exists(f"/dev/shm/{shm.name}")


def test_a_missing_rank_times_out_by_name_and_abort_stops_a_wait() -> None:
    shm = ShmCollectives.create(3, 4096)
    shm.unlink()
    with pytest.raises(TimeoutError, match=r"rank\(s\) \[1, 2\]"):
        shm.all_reduce(torch.ones(4), 0.2)
    other = ShmCollectives(shm.name + "-b", 2, 0, 4096, create=True)
    other.unlink()
    other.abort_reason = "rank 1 (pid 7) exited with code -9"
    with pytest.raises(RuntimeError, match="rank 1 .pid 7. exited"):
        other.all_reduce(torch.ones(4), 30.0)
    other.abort_reason = None
    other.peer_check = lambda: "rank 0 exited"
    with pytest.raises(RuntimeError, match="rank 0 exited"):
        other.all_reduce(torch.ones(4), 30.0)


def test_tensors_larger_than_a_slot_do_not_fit() -> None:
    shm = ShmCollectives.create(2, 1024)
    shm.unlink()
    assert shm.fits(torch.ones(256))
    assert not shm.fits(torch.ones(257))
    assert not shm.fits(torch.ones(2, dtype=torch.float32, device="meta"))
