"""A stand-in for one tensor-parallel rank of an engine whose KV pool is sliced per rank, in a real process: it
holds its pool slice and runs the node's `RankEndpoint` on it, driven by the test as the engine drives a rank
(engine/tp_worker.py): rank 0's messages in order with the steps, and per step the endpoint's layer hook after each
layer. No model runs; the KV moves for real (sockets, the endpoint's own channels and link)."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
from multiprocessing.connection import Connection

import torch

from pdcluster.kv_transfer.per_rank import RankEndpointSpec

START_TIMEOUT_S = 60.0


def slice_kv(shape: tuple[int, ...], dtype: torch.dtype, seed: int | None) -> torch.Tensor:
    """A rank's pool slice: random rows for `seed` (the same in every process), zeros for None."""
    if seed is None:
        return torch.zeros(shape, dtype=dtype)
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _serve(spec: RankEndpointSpec, shape: tuple[int, ...], dtype: str, seed: int | None, rank: int, size: int,
           conn: Connection, corrupt: str) -> None:
    from contextlib import ExitStack

    from pdcluster.kv_transfer.testing import corrupt_writes

    with ExitStack() as stack:
        if corrupt:
            stack.enter_context(corrupt_writes(corrupt))
        pool = slice_kv(shape, getattr(torch, dtype), seed)
        endpoint = spec(pool, rank, size)
        if endpoint.kv_pool is not None:   # the engine moves the (still empty) pool there
            pool = endpoint.kv_pool
        conn.send(endpoint.info)
        while True:
            kind, body = conn.recv()
            if kind == "message":
                endpoint.on_message(body)
            elif kind == "step":
                hook = endpoint.layer_hook()
                for layer in range(shape[0]):
                    if hook is not None:
                        hook(layer)
                conn.send(hook is not None)
            elif kind == "pool":
                conn.send(pool.clone())
            elif kind == "stop":
                endpoint.close()
                conn.send("stopped")
                return


class RankProcess:
    """Rank `rank` of `size`: its slice of `shape` (random for `seed`, else zeros) behind `spec`'s endpoint; with
    `corrupt` (a channel name) every write it sends over that channel is damaged (kv_transfer/testing.py)."""

    def __init__(self, spec: RankEndpointSpec, shape: tuple[int, ...], dtype: torch.dtype, seed: int | None,
                 rank: int = 1, size: int = 2, corrupt: str = "") -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(spec, shape, str(dtype).removeprefix("torch."), seed, rank,
                                                     size, child, corrupt), daemon=True)
        self.proc.start()
        child.close()
        self.rank = rank
        self._info: dict | None = None

    @property
    def info(self) -> dict:
        """The endpoint's `info` (waits for it to start: build several RankProcess first, then ask)."""
        if self._info is None:
            if not self.conn.poll(START_TIMEOUT_S):
                self.kill()
                raise TimeoutError(f"rank {self.rank}'s endpoint did not start within {START_TIMEOUT_S} s")
            self._info = self.conn.recv()
        return self._info

    def tell(self, message: dict) -> None:
        """As LLMEngine.tell_rank_agent: a message in order with the steps."""
        self.conn.send(("message", message))

    def step(self) -> bool:
        """One step's layers; whether the endpoint streamed any transfer during it."""
        self.conn.send(("step", None))
        return self.conn.recv()

    def pool(self) -> torch.Tensor:
        self.conn.send(("pool", None))
        return self.conn.recv()

    def kill(self) -> None:
        if self.proc.is_alive():
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.join(10)

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self.conn.send(("stop", None))
                self.conn.poll(10) and self.conn.recv()
            except (OSError, EOFError):
                pass
        self.proc.join(10)
        if self.proc.is_alive():
            self.kill()


class SlicedEngine:
    """An engine of `n` ranks whose KV pool is sliced per rank, each slice `shape` (its rank's K and V planes): rank
    0's slice here, ranks 1.. in processes (RankProcess); closed with `stack`. Sending (`seeds`: each rank's slice,
    random rows) its `sender` is rank 0's RankedSender; receiving (`seeds` None: zeros), its `receiver` is rank 0's
    RankedReceiver, every slice in shared memory with `shm`."""

    def __init__(self, stack, shape: tuple[int, ...], n: int, seeds: tuple[int, ...] | None = None,
                 backend: str = "tcp", shm: bool = False) -> None:
        from pdcluster.kv_transfer import KVReceiver, KVSender, SharedKVPool
        from pdcluster.kv_transfer.per_rank import RankedReceiver, RankedSender, RankLinks

        self.shape, self.n, self.seeds = shape, n, seeds
        spec = RankEndpointSpec(receive=False, backend=backend) if seeds else \
            RankEndpointSpec(receive=True, shared_memory=shm)
        self.procs = [RankProcess(spec, shape, torch.float32, seeds[r] if seeds else None, rank=r, size=n)
                      for r in range(1, n)]
        for proc in self.procs:
            stack.callback(proc.close)
        links = RankLinks([p.info["link"] for p in self.procs])
        stack.callback(links.close)
        if seeds:
            self.pool0 = slice_kv(shape, torch.float32, seeds[0])
            local = KVSender(self.pool0, backend=backend, rank_slice=(0, n))
            stack.callback(local.close)
            self.sender = RankedSender(local, links, lambda rank, message: self.procs[rank - 1].tell(message))
            return
        seg = SharedKVPool.create(shape, torch.float32) if shm else None
        if seg is not None:
            stack.callback(seg.close)
        self.pool0 = seg.tensor if seg is not None else slice_kv(shape, torch.float32, None)
        rx = KVReceiver(self.pool0, shm_name=seg.name if seg is not None else None, rank_slice=(0, n))
        stack.callback(rx.close)
        self.receiver = RankedReceiver(rx, links, [p.info["kv_addr"] for p in self.procs])

    def step(self) -> None:
        """A step of every other rank: each streams the layers of the transfers started before it."""
        for proc in self.procs:
            assert proc.step(), f"rank {proc.rank} streamed nothing during the step"

    def pools(self) -> list[torch.Tensor]:
        return [self.pool0, *(p.pool() for p in self.procs)]

    def model_kv(self) -> torch.Tensor:
        """A sending engine's KV as one pool of every model head (the slices' heads in rank order)."""
        assert self.seeds is not None
        return torch.cat([slice_kv(self.shape, torch.float32, seed) for seed in self.seeds], dim=4)


def serve_every_prompt_remotely(cluster, prompts: list[list[int]], n: int, texts: list[str]) -> dict:
    """A P/D cluster of nodes sliced per rank ("tiny-gqa") answers `prompts` (every other one streamed) with
    `texts`, every prompt prefilled on the prefill node, the bytes sent = the bytes received, and afterwards no
    KV block used or reserved on either node and no transfer failure. Returns the nodes' metrics then."""
    import asyncio

    from cluster_helpers import client, complete, node_metrics, total, wait_idle

    async def serve() -> list[str]:
        api = client(cluster)
        outs = [await complete(api, "tiny-gqa", p, n, stream=i % 2 == 0) for i, p in enumerate(prompts)]
        assert all(o.usage == n for o in outs)
        return [o.text for o in outs]

    assert asyncio.run(serve()) == texts
    decode, prefill = node_metrics(cluster, "decode"), node_metrics(cluster, "prefill")
    assert decode["decode-0"].get('pdcluster_node_prefills_total{path="remote"}', 0.0) == len(prompts)
    # every rank's slice: rank 0's from its pool, the others' from their own processes
    sent = total(prefill, "pdcluster_kv_transfer_bytes_total{")
    assert sent == total(decode, "pdcluster_kv_received_bytes_total{") > 0
    after = wait_idle(cluster)   # no KV block used or reserved on either node
    assert total(after, "pdcluster_kv_transfer_failures_total") == 0
    return after
