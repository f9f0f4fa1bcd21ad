"""Live migration and prefix fetch between decode nodes whose KV pool is sliced per tensor-parallel rank
(tensor_parallel_size 2, `kv_pool_per_rank` on CPU: each rank's process holds its own slice), with node processes
(real etcd, a router, two decode nodes, the official openai client): every rank lends its slice to the same rank of
the other node over its own channel (the lender's RankedSender into the asker's per-rank reservations), so a stream
moved by `pdcluster drain NODE --migrate` recomputes nothing of its history and a prefix computed on one node is
fetched by the other; a holder whose rank process dies mid-fetch costs a recompute, never the answer, and leaves no
block reserved. Without a cluster: the lender and the fetch over two engines sliced per rank, a sending rank killed
mid-copy."""

from __future__ import annotations

import asyncio
import random
import time
from contextlib import ExitStack

import pytest
import torch
from cluster_helpers import client, complete, wait_idle
from migration_helpers import BLOCK, CLUSTER, MODEL_NAME, metric, only, reference, router_metric
from migration_sliced_helpers import (
    OUTPUT,
    PROMPT,
    FakeEngineThread,
    drain_moves_the_stream_with_its_kv,
    fetch_once,
    rank_processes,
    sliced_cluster,
    sliced_model,
)
from rank_kv_helpers import SlicedEngine

from pdcluster.cli.admin import drain_node, set_state
from pdcluster.kv_transfer import KVReceiver, KVSender, sweep_dead_pools


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return sliced_model(tmp_path_factory.mktemp("sliced-migrate"))


@pytest.mark.cluster
@pytest.mark.timeout(300)
async def test_drain_migrate_moves_a_stream_with_every_ranks_kv_and_recomputes_nothing(model, tmp_path):
    with sliced_cluster(model, tmp_path) as cluster:
        await drain_moves_the_stream_with_its_kv(cluster, model, seed=3)


@pytest.mark.cluster
@pytest.mark.timeout(300)
async def test_a_source_rank_killed_mid_migration_falls_back_to_recompute_and_leaks_nothing(model, tmp_path):
    """decode-0's rank 1 stops (its engine stalls), decode-0 drains with migration (decode-1 pre-copies from it:
    the lender cannot even pin), then rank 1 dies: the stream moves to decode-1 by recompute, token for token the
    same, and decode-1 holds no block and no reservation afterwards."""
    rng = random.Random(7)
    prompt = [rng.randrange(3, 400) for _ in range(PROMPT)]
    (want,) = reference(model, [prompt], OUTPUT)
    with sliced_cluster(model, tmp_path) as cluster:
        await only(cluster, "decode-0")
        progress = [0]
        stream = asyncio.create_task(complete(client(cluster), MODEL_NAME, prompt, OUTPUT, progress=progress))
        while progress[0] < 24:
            assert not stream.done(), stream.result()
            await asyncio.sleep(0.02)
        (rank1,) = rank_processes(cluster, "decode-0")
        rank1.suspend()
        try:
            await set_state([cluster.etcd], CLUSTER, "decode-1", "active")
            drain = asyncio.create_task(drain_node([cluster.etcd], CLUSTER, "decode-0", timeout=30, migrate=True))
            await asyncio.sleep(2.0)   # the move is asked for and decode-1's pre-copy waits on decode-0
        finally:
            rank1.kill()
        out = await asyncio.wait_for(stream, 180)
        assert out.text == want and out.usage == OUTPUT and out.finish == "length"
        await asyncio.gather(drain, return_exceptions=True)
        assert metric(cluster, "decode-1", 'pdcluster_node_pre_copies_total{outcome="ok"}') == 0
        assert router_metric(cluster, "pdcluster_router_resumed_recomputed_tokens_total") > 0   # the fallback
        assert cluster.service("decode-0").proc.wait(60) != 0   # its engine failed
        wait_idle(cluster)


@pytest.fixture(scope="module")
def fetch_cluster(model, tmp_path_factory):
    with sliced_cluster(model, tmp_path_factory.mktemp("sliced-fetch")) as c:
        yield c


@pytest.mark.cluster
@pytest.mark.timeout(240)
async def test_a_prefix_computed_on_one_sliced_node_is_fetched_rank_by_rank_by_the_other(fetch_cluster):
    cluster, api = fetch_cluster, client(fetch_cluster)
    rng = random.Random(5)
    first = [rng.randrange(3, 400) for _ in range(100)]
    second = first + [rng.randrange(3, 400) for _ in range(30)]     # 130 tokens, 8 full blocks
    await only(cluster, "decode-0")
    cold = await complete(api, MODEL_NAME, second, 8)                # decode-0 computes it all, keeps the blocks
    await asyncio.sleep(1.5)   # the router learns decode-0's blocks from its next Load reports
    await only(cluster, "decode-1")
    computed = metric(cluster, "decode-1", "pdcluster_node_prefill_tokens_total")
    again = await complete(api, MODEL_NAME, second, 8)
    assert again.tokens == cold.tokens and again.finish == cold.finish
    assert metric(cluster, "decode-1", "pdcluster_node_kv_fetched_blocks_total") == (130 - 1) // BLOCK
    assert metric(cluster, "decode-1", 'pdcluster_node_kv_fetches_total{outcome="ok"}') == 1
    assert metric(cluster, "decode-1", "pdcluster_node_prefill_tokens_total") - computed == 130 - 8 * BLOCK
    assert metric(cluster, "decode-0", "pdcluster_node_kv_lent_blocks_total") == 8
    wait_idle(cluster)


@pytest.mark.cluster
@pytest.mark.timeout(240)
async def test_a_holder_whose_rank_process_dies_mid_fetch_costs_a_recompute(fetch_cluster):
    """Runs last on its cluster: decode-0 loses its rank 1 (and so its engine) while decode-1 fetches from it."""
    cluster, api = fetch_cluster, client(fetch_cluster)
    rng = random.Random(6)
    prompt = [rng.randrange(3, 400) for _ in range(120)]             # 7 full blocks
    await only(cluster, "decode-0")
    cold = await complete(api, MODEL_NAME, prompt, 8)
    await asyncio.sleep(1.5)
    await only(cluster, "decode-1")
    failed = metric(cluster, "decode-1", 'pdcluster_node_kv_fetches_total{outcome="failed"}')
    missed = metric(cluster, "decode-1", "pdcluster_node_kv_fetch_missed_blocks_total")
    (rank1,) = rank_processes(cluster, "decode-0")
    rank1.suspend()   # decode-0's engine stalls in its next step: the fetch it is asked for is in flight when it dies
    try:
        request = asyncio.create_task(complete(api, MODEL_NAME, prompt, 8))
        end = time.monotonic() + 10
        while metric(cluster, "decode-1", "pdcluster_node_loading_kv_requests") != 1:
            assert time.monotonic() < end, "decode-1 did not start the fetch"
            await asyncio.sleep(0.1)
    finally:
        rank1.kill()
    again = await asyncio.wait_for(request, 90)
    assert again.tokens == cold.tokens
    assert metric(cluster, "decode-1", 'pdcluster_node_kv_fetches_total{outcome="failed"}') == failed + 1
    assert metric(cluster, "decode-1", "pdcluster_node_kv_fetch_missed_blocks_total") == missed + 7
    assert cluster.service("decode-0").proc.wait(60) != 0   # its engine failed
    wait_idle(cluster)   # decode-1 holds no block and no reservation, on any rank


# ---- without a cluster: the lender and the fetch over real per-rank channels -------------------------------------

LAYERS, BLOCK_SIZE, HEADS, HEAD_DIM, NUM_BLOCKS = 2, 4, 2, 8, 12
SHAPE = (LAYERS, 2, NUM_BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM)   # one rank's slice: 2 of the model's 4 KV heads
SRC, DST = [3, 7, 1], [9, 2, 5]


def lend_and_fetch(stack: ExitStack, kill: str = "") -> tuple[FakeEngineThread, FakeEngineThread, SlicedEngine,
                                                               SlicedEngine, tuple[str, int, str]]:
    """Two engines sliced over 2 ranks. `kill`: "holder" (its rank 1 dies before the copy: its link breaks, the
    lender's rank-1 part fails at once) or "asker" (its rank 1 dies once every rank reserved the blocks, before the
    lender writes them)."""
    holder = SlicedEngine(stack, SHAPE, 2, seeds=(11, 12))
    asker = SlicedEngine(stack, SHAPE, 2, shm=True)
    if kill == "holder":
        holder.procs[0].kill()
    on_send = asker.procs[0].kill if kill == "asker" else None
    lend_engine, fetch_engine = FakeEngineThread(SRC), FakeEngineThread([])
    ended = fetch_once(holder.sender, 2, asker.receiver, lend_engine, fetch_engine, SRC, DST, on_send)
    return lend_engine, fetch_engine, holder, asker, ended


@pytest.mark.slow
def test_the_lender_sends_every_ranks_slice_into_the_same_rank_of_the_asker():
    with ExitStack() as stack:
        lend_engine, fetch_engine, holder, asker, ended = lend_and_fetch(stack)
        assert ended == ("r1", 3, "")
        assert fetch_engine.done == [("r1", DST, 3)] and not lend_engine.pinned   # unpinned once acknowledged
        for got, want in zip(asker.pools(), holder.pools(), strict=True):   # rank r's blocks into rank r's slice
            assert torch.equal(got[:, :, DST], want[:, :, SRC])
        assert asker.receiver.num_active_reservations == 0


@pytest.mark.slow
@pytest.mark.parametrize("kill", ["holder", "asker"])
def test_a_rank_killed_mid_copy_ends_the_fetch_empty_with_nothing_held(kill):
    with ExitStack() as stack:
        lend_engine, fetch_engine, _, asker, (rid, n, why) = lend_and_fetch(stack, kill)
        assert (rid, n) == ("r1", 0) and "rank 1" in why, why
        assert fetch_engine.done == [("r1", DST, 0)]   # the blocks are computed instead
        assert not lend_engine.pinned                   # the lender's pins let go
        assert asker.receiver.num_active_reservations == 0   # every rank's part of the reservation is gone
    sweep_dead_pools()   # a killed rank's slice in /dev/shm (a node sweeps these when it starts)


@pytest.mark.slow
@pytest.mark.parametrize("sliced", ["holder", "asker"])
def test_a_sliced_pool_and_one_pool_lend_to_each_other_with_the_heads_regrouped(sliced):
    """Not the same slicing on both sides: a holder sliced over 2 ranks into one pool (both its ranks write into
    the one reservation), or one pool into slices (the lender's one-rank RankedSender writes every slice)."""
    whole_shape = SHAPE[:4] + (2 * HEADS,) + SHAPE[5:]
    with ExitStack() as stack:
        lend_engine, fetch_engine = FakeEngineThread(SRC), FakeEngineThread([])
        if sliced == "holder":
            holder = SlicedEngine(stack, SHAPE, 2, seeds=(11, 12))
            pool = torch.zeros(whole_shape)
            receiver = KVReceiver(pool)
            stack.callback(receiver.close)
            ended = fetch_once(holder.sender, 2, receiver, lend_engine, fetch_engine, SRC, DST)
            got, want = pool, holder.model_kv()
        else:
            want = torch.randn(whole_shape, generator=torch.Generator().manual_seed(13))
            sender = KVSender(want, backend="tcp")
            stack.callback(sender.close)
            asker = SlicedEngine(stack, SHAPE, 2, shm=True)
            receiver = asker.receiver   # type: ignore[assignment]
            ended = fetch_once(sender, 0, receiver, lend_engine, fetch_engine, SRC, DST)
            got = torch.cat(asker.pools(), dim=4)
        assert ended == ("r1", 3, "")
        assert torch.equal(got[:, :, DST], want[:, :, SRC])
        assert not lend_engine.pinned and receiver.num_active_reservations == 0
