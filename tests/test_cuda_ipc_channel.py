"""The cuda_ipc KV channel (two processes on one GPU) through its CPU path: the same channel code with the
sender's pool shared through torch's file_system strategy instead of a CUDA IPC handle. The channel alone over
a socket pair, a real receiver and a sender in another process, and when `kv_backend=auto` picks it."""

from __future__ import annotations

import asyncio
import datetime
import multiprocessing as mp
import os
import socket
import threading
from types import SimpleNamespace

import pytest
import torch

from pdcluster.kv_transfer import KVReceiver, KVSender
from pdcluster.kv_transfer import cuda_ipc_channel as ipc
from pdcluster.kv_transfer.backends import choose, offered
from pdcluster.kv_transfer.channel import PoolViews
from pdcluster.kv_transfer.cuda_ipc_channel import CudaIpcChannel, share_cpu_pool
from pdcluster.kv_transfer.destination import Destination, host_id
from pdcluster.kv_transfer.dist_channel import NcclChannel
from pdcluster.kv_transfer.errors import TransferError
from pdcluster.kv_transfer.layout import blocks_of
from pdcluster.kv_transfer.tcp import FrameError, Wire

SHAPE = (3, 2, 16, 4, 2, 8)   # layers, k/v, blocks, block_size, heads, head_dim (engine/kv_cache.py)


def source(seed: int = 0, dtype=torch.bfloat16, shape=SHAPE) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return share_cpu_pool(torch.randn(shape, generator=g).to(dtype))


@pytest.fixture
def cpu_path(monkeypatch):
    monkeypatch.setenv(ipc.CPU_PATH_ENV, "1")


@pytest.fixture
def channels(cpu_path):
    """(sender channel, receiver channel, source pool, destination pool), connected over a socket pair."""
    a, b = socket.socketpair()
    src, dst = source(), torch.zeros(SHAPE, dtype=torch.bfloat16)
    rx: list = []
    t = threading.Thread(target=lambda: rx.append(CudaIpcChannel.accept(Wire(b), PoolViews(dst), {"op": "hello_ok"},
                                                                        session="s", timeout=5)))
    t.start()
    hello_ok = Wire(a).recv()
    assert hello_ok["device_uuid"] == "cpu"
    tx = CudaIpcChannel.connect(Wire(a), PoolViews(src), hello_ok)
    t.join(5)
    yield tx, rx[0], src, dst
    a.close()
    b.close()


def write(tx, rx, part, l0, l1, before_receive=None):
    checksum = tx.write_runs("tok", part, l0, l1, lambda c, n: {"op": "write"})
    frame = rx.wire.recv()
    assert frame["nbytes"] == rx.wire_bytes(sum(n for _, _, n in part), l0, l1)
    if before_receive:
        before_receive()
    return frame, checksum, rx.receive_runs([(d, n) for d, _, n in part], l0, l1, frame)


@pytest.mark.parametrize("l0, l1", [(0, 3), (1, 2)])
def test_receiver_copies_exactly_the_runs(channels, l0, l1):
    tx, rx, src, dst = channels
    part = [(5, 0, 2), (1, 9, 1)]   # (dst_start, src_start, n)
    frame, sent, landed = write(tx, rx, part, l0, l1)
    assert frame["src"] == [0, 9] and sent == landed == frame["checksum"] and "landed" not in frame
    assert not CudaIpcChannel.direct   # the receiver checks each write before a byte lands
    assert torch.equal(blocks_of(dst, [5, 6, 1])[:, l0:l1].view(torch.int16),
                       blocks_of(src, [0, 1, 9])[:, l0:l1].view(torch.int16))
    dst[l0:l1, :, [5, 6, 1]] = 0
    assert not dst.view(torch.uint8).any()   # nothing else was touched


def test_a_source_changed_under_the_copy_fails_the_checksum(channels):
    tx, rx, src, _ = channels
    _, sent, landed = write(tx, rx, [(0, 3, 1)], 0, 3, before_receive=lambda: src[1, 0, 3].add_(1))
    assert sent != landed


def test_source_runs_outside_the_senders_pool_are_refused(channels):
    _, rx, _, dst = channels
    with pytest.raises(FrameError, match="outside the sender"):
        rx.receive_runs([(0, 2)], 0, 3, {"src": [SHAPE[2] - 1]})
    with pytest.raises(FrameError, match="one source block per run"):
        rx.receive_runs([(0, 1)], 0, 3, {})
    assert not dst.view(torch.uint8).any()


def test_pool_handle_checks(cpu_path):
    with pytest.raises(TransferError, match="not in shared memory"):
        ipc.export_pool(torch.zeros(4))
    with pytest.raises(FrameError, match="malformed"):
        ipc.open_pool({"kind": "cpu"}, torch.device("cpu"))
    a, b = socket.socketpair()
    with a, b:
        with pytest.raises(TransferError, match="CUDA IPC here moves KV between processes of one GPU"):
            CudaIpcChannel.connect(Wire(a), PoolViews(source()), {"op": "hello_ok", "device_uuid": "GPU-other"})


# ---- a receiver here, a sender in another process -------------------------------------------------------------

def _send(dst: dict, src_ids: list[int], device: str, conn) -> None:
    pool = source(seed=3) if device == "cpu" else source_on(device)
    sender = KVSender(pool, backend="cuda_ipc" if device == "cpu" else "auto")   # auto: the same GPU, so cuda_ipc
    try:
        t = sender.start(dst, src_ids)
        t.send_layers(0, 1)
        t.send_layers(1, 3)
        conn.send(("ok", t.finish(timeout=10), t.backend))
    except Exception as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}", None))
    finally:
        sender.close()


def source_on(device: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    return torch.randn(SHAPE, generator=g).to(torch.bfloat16).to(device)


@pytest.mark.slow   # a spawned sender process (imports torch)
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU"))])
def test_round_trip_between_processes(device, monkeypatch):
    """cpu: the CPU path; cuda (benchmarks/gpu_check.py runs it on a GPU): both pools on one GPU, the sender on
    kv_backend=auto, which must pick cuda_ipc over nccl."""
    monkeypatch.setenv(ipc.CPU_PATH_ENV, "1")
    dst_pool = torch.zeros(SHAPE, dtype=torch.bfloat16, device=device)
    rx = KVReceiver(dst_pool)
    try:
        assert "cuda_ipc" in rx.backends
        dst = rx.reserve("a", [7, 2, 3, 12])
        assert dst.device_uuid == ipc.device_uuid(dst_pool.device) != "" and dst.host_id == host_id()
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_send, args=(dst.to_dict(), [0, 5, 6, 15], device, child))
        proc.start()
        assert parent.poll(60), "sender did not answer"
        status, value, backend = parent.recv()
        proc.join(10)
        assert status == "ok" and backend == "cuda_ipc", value
        res = asyncio.run(rx.wait("a", 10))
        assert res.ok and res.checksum == value
        want = blocks_of(source_on("cpu"), [0, 5, 6, 15])
        assert torch.equal(blocks_of(dst_pool, [7, 2, 3, 12]).cpu().view(torch.int16), want.view(torch.int16))
        untouched = [b for b in range(SHAPE[2]) if b not in (7, 2, 3, 12)]
        assert not blocks_of(dst_pool, untouched).view(torch.uint8).any()
        assert rx.num_active_reservations == 0
    finally:
        rx.close()


# ---- selection ---------------------------------------------------------------------------------------------------

def test_offered_on_cuda_pools_and_on_cpu_only_when_asked(monkeypatch):
    views = PoolViews(torch.zeros(SHAPE))
    monkeypatch.delenv(ipc.CPU_PATH_ENV, raising=False)
    assert "cuda_ipc" not in offered(views, None)
    monkeypatch.setenv(ipc.CPU_PATH_ENV, "1")
    assert "cuda_ipc" in offered(views, None)
    gpu = SimpleNamespace(tensor=SimpleNamespace(device=torch.device("cuda", 0)), on_cpu=False)
    assert CudaIpcChannel.offered(gpu, None)


def _dst(uuid: str, same_host: bool = True) -> Destination:
    return Destination("r", "127.0.0.1:1", [0], "t" * 32, 0.0, ["nccl", "cuda_ipc"], {},
                       host_id() if same_host else "x/y", None, device_uuid=uuid)


def test_auto_picks_cuda_ipc_only_on_the_same_gpu(monkeypatch):
    """Two nodes on one GPU: cuda_ipc (NCCL refuses two ranks on one device); another GPU or another host: nccl.
    An older receiver without a device UUID gets nccl too."""
    monkeypatch.setattr(ipc, "device_uuid", lambda device: "GPU-1234" if device.type == "cuda" else "cpu")
    gpu = SimpleNamespace(tensor=SimpleNamespace(device=torch.device("cuda", 0)), on_cpu=False)
    assert choose("auto", None, gpu, _dst("GPU-1234")) is CudaIpcChannel
    assert choose("auto", None, gpu, _dst("GPU-5678")) is NcclChannel
    assert choose("auto", None, gpu, _dst("GPU-1234", same_host=False)) is NcclChannel
    assert choose("auto", None, gpu, _dst("")) is NcclChannel
    cpu = PoolViews(torch.zeros(SHAPE))
    with pytest.raises(TransferError, match="no common KV backend"):   # never auto-picked on CPU
        choose("auto", None, cpu, _dst("cpu"))


def test_pdcluster_up_on_one_gpu_shares_it(caplog):
    """`pdcluster up` with one GPU for a prefill and a decode node: both see it (no visible-devices split), each
    sizes its KV pool from half the usual fraction of the memory it finds free, and the log says KV goes
    through cuda_ipc."""
    from pdcluster.cli.sizing import node_device_env, shared_memory_fraction

    one = lambda device: 1   # noqa: E731
    assert node_device_env("cuda", 1, 0, 2, one) == node_device_env("cuda", 1, 1, 2, one) == {}
    assert "cuda_ipc" in caplog.text
    assert shared_memory_fraction("cuda", 1, 2, 0.9, one) == pytest.approx(0.45)
    assert shared_memory_fraction("cuda", 1, 3, 0.9, lambda d: 2) == pytest.approx(0.45)   # 2 nodes on one of them
    assert shared_memory_fraction("cuda", 1, 2, 0.9, lambda d: 2) == 0.9                     # a GPU each
    assert shared_memory_fraction("cpu", 1, 2, 0.9, one) == 0.9


def test_nccl_groups_fail_a_transfer_not_the_process(monkeypatch):
    """NcclChannel sets PyTorch's NCCL error handling before building its group (communicator aborted, wait()
    raises after the timeout), unless the environment chose otherwise."""
    import torch.distributed as dist

    built = []

    class FakeNccl:
        class Options:
            pass

        def __init__(self, store, rank, size, opts):
            built.append((dict(os.environ), opts._timeout))

    monkeypatch.setattr(dist, "ProcessGroupNCCL", FakeNccl, raising=False)
    env = {k: v for k, v in os.environ.items() if k != "TORCH_NCCL_ASYNC_ERROR_HANDLING"}
    monkeypatch.setattr(os, "environ", {**env, "TORCH_NCCL_BLOCKING_WAIT": "0"})   # an operator's choice stays
    NcclChannel.make_group(None, 0, "127.0.0.1", datetime.timedelta(seconds=7))
    env, timeout = built[0]
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2" and env["TORCH_NCCL_BLOCKING_WAIT"] == "0"
    assert timeout == datetime.timedelta(seconds=7)
