"""Shared by tests/test_migration_sliced_pools.py: decode nodes whose KV pool is sliced per tensor-parallel rank
(tensor_parallel_size 2, `kv_pool_per_rank` on CPU) on a tiny GQA model, a node's rank processes; and, without a
cluster, a `KVLender` wired to a `PrefixFetches` (FetchKV and KVFetched handed over in process) whose KV moves for
real between two engines sliced per rank (tests/rank_kv_helpers.py: rank 1 of each in its own process)."""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Callable

import psutil
from cluster_helpers import client, complete, wait_idle
from migration_helpers import BLOCK, CLUSTER, MODEL_NAME, decode_cluster, metric, only, reference, router_metric

from pdcluster.cli.admin import drain_node, set_state
from pdcluster.cli.supervisor import LocalCluster

SLICED = {"tensor_parallel_size": 2, "kv_pool_per_rank": True}
PROMPT, OUTPUT = 60, 3000   # the stream must still run when the drain moves it


def sliced_model(directory) -> str:
    """Heads a tensor_parallel_size of 2 splits (4 KV heads: 2 per slice), long enough to decode 1200 tokens."""
    from pdcluster.engine.testing import make_tiny_model

    return make_tiny_model(str(directory / MODEL_NAME), "llama", num_attention_heads=8, num_key_value_heads=4,
                           hidden_size=64, intermediate_size=128, max_position_embeddings=4096)


def sliced_cluster(model: str, work, **router) -> LocalCluster:
    return decode_cluster(model, work, node=SLICED, **router)


async def drain_moves_the_stream_with_its_kv(cluster: LocalCluster, model: str, seed: int) -> None:
    """A stream decoding on decode-0 moves to decode-1 by `pdcluster drain decode-0 --migrate`: the same tokens as
    the offline engine, its history's KV copied (every block but the partial last one), nothing recomputed but the
    last token, decode-0 exits cleanly and decode-1 holds nothing afterwards."""
    rng = random.Random(seed)
    prompt = [rng.randrange(3, 400) for _ in range(PROMPT)]
    (want,) = reference(model, [prompt], OUTPUT)
    await only(cluster, "decode-0")   # the stream starts on decode-0
    progress = [0]
    stream = asyncio.create_task(complete(client(cluster), MODEL_NAME, prompt, OUTPUT, progress=progress))
    while progress[0] < 24:
        assert not stream.done(), stream.result()
        await asyncio.sleep(0.02)
    computed = metric(cluster, "decode-1", "pdcluster_node_prefill_tokens_total")
    drain = asyncio.create_task(drain_node([cluster.etcd], CLUSTER, "decode-0", timeout=90, migrate=True))
    await asyncio.sleep(0.3)
    assert not stream.done(), "the stream ended before the drain: make OUTPUT longer"
    await set_state([cluster.etcd], CLUSTER, "decode-1", "active")
    await asyncio.wait_for(drain, 120)
    out = await asyncio.wait_for(stream, 180)
    assert out.text == want and out.usage == OUTPUT and out.finish == "length"
    fetched = metric(cluster, "decode-1", "pdcluster_node_kv_fetched_blocks_total")
    recomputed = metric(cluster, "decode-1", "pdcluster_node_prefill_tokens_total") - computed
    assert fetched >= (PROMPT + 24) // BLOCK - 1, (fetched, recomputed)
    assert metric(cluster, "decode-1", 'pdcluster_node_pre_copies_total{outcome="ok"}') == 1
    assert metric(cluster, "decode-1", 'pdcluster_node_kv_fetches_total{outcome="failed"}') == 0
    # every rank's slice landed on decode-1: nothing of the history computed again, only the last token (which
    # samples the next one)
    assert router_metric(cluster, "pdcluster_router_resumed_recomputed_tokens_total") == 0
    assert router_metric(cluster, "pdcluster_router_migrations_total") == 1
    assert recomputed == 1, (fetched, recomputed)
    assert not cluster.service("decode-0").alive or cluster.service("decode-0").proc.wait(30) == 0
    wait_idle(cluster)   # no block used or reserved on decode-1 (on every rank)


def rank_processes(cluster: LocalCluster, node_id: str) -> list[psutil.Process]:
    """The node's tensor-parallel rank processes (ranks 1..: spawned children, not multiprocessing's helpers)."""
    node = psutil.Process(cluster.service(node_id).proc.pid)
    return [p for p in node.children() if "spawn_main" in " ".join(p.cmdline()) and
            "resource_tracker" not in " ".join(p.cmdline())]


# ---- a lender and a fetch in one process ---------------------------------------------------------------------


class FakeEngineThread:
    """The engine thread as the lender and the fetch see it: `call` / `post` run at once on the event loop; the
    lender's pins and the fetch's end are recorded."""

    def __init__(self, cached: list[int]) -> None:
        self.cached = cached   # the pool blocks published under the asked hashes
        self.pinned: list[int] = []
        self.done: list[tuple[str, list[int], int]] = []   # kv_fetch_done calls

    def pin_cached(self, hashes: list[int]) -> list[int]:
        blocks = self.cached[:len(hashes)]
        self.pinned += blocks
        return blocks

    def unpin(self, blocks: list[int]) -> None:
        for b in blocks:
            self.pinned.remove(b)

    def kv_fetch_done(self, rid: str, blocks: list[int], n: int) -> None:
        self.done.append((rid, blocks, n))

    def call(self, fn) -> asyncio.Future:
        fut = asyncio.get_running_loop().create_future()
        fut.set_result(fn(self))
        return fut

    def post(self, fn) -> None:
        fn(self)


@dataclass
class Peers:
    """PeerDealers between the asking node and the lender: FetchKV goes to `lender.handle` on the loop."""

    lender: object = None
    sent: list = field(default_factory=list)
    on_send: Callable[[], None] | None = None   # e.g. a rank dies once the reservation is made

    def send(self, node_id: str, addr: str, msg) -> bool:
        self.sent.append(msg)
        if self.on_send is not None:
            self.on_send()
        asyncio.get_running_loop().call_soon(self.lender.handle, b"asker", msg)   # type: ignore[attr-defined]
        return True


def view_of(holder: str, slices: int) -> SimpleNamespace:
    """A cluster view holding one decode node `holder` whose pool is cut into `slices` rank slices."""
    node = SimpleNamespace(role="decode", control_addr="tcp://127.0.0.1:1",
                           capacity=SimpleNamespace(kv_rank_slices=slices))
    return SimpleNamespace(nodes={holder: node})


def fetch_once(sender, holder_slices: int, receiver, lend_engine: FakeEngineThread, fetch_engine: FakeEngineThread,
               src: list[int], dst: list[int], on_send: Callable[[], None] | None = None) -> tuple[str, int, str]:
    """Request "r1" on the asking node (`receiver`) fetches the blocks its holder "decode-0" (`sender`, its pool in
    `holder_slices` rank slices; `lend_engine` has `src` cached) lends; (rid, blocks landed, why not all)."""
    from prometheus_client import CollectorRegistry

    from pdcluster.decode_node.prefix_fetch import PrefixFetches
    from pdcluster.node.kv_lender import KVLender

    ended: list[tuple[str, int, str]] = []

    async def run() -> None:
        tasks: set[asyncio.Task] = set()
        peers = Peers(on_send=on_send)
        fetches = PrefixFetches("decode-1", receiver, peers, view_of("decode-0", holder_slices),  # type: ignore
                                fetch_engine, 20.0, 10.0, CollectorRegistry(),  # type: ignore[arg-type]
                                lambda coro, name: tasks.add(asyncio.create_task(coro, name=name)))
        lender = KVLender(lend_engine, lambda: sender,  # type: ignore[arg-type]
                          lambda who, msg: fetches.answered("decode-0", msg))
        peers.lender = lender
        done = asyncio.Event()
        fetches.on_end = lambda rid, n, why: (ended.append((rid, n, why)), done.set())  # type: ignore[func-returns-value]
        fetches.start("r1", dst, [101 + i for i in range(len(dst))], "decode-0")
        await asyncio.wait_for(done.wait(), 30)
        await asyncio.wait_for(lender.close(), 10)

    asyncio.run(run())
    return ended[0]
