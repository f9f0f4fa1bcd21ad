"""Live migration (pre-copy, then hand-back at a block boundary) under faults, with node processes (real etcd, a
router, decode nodes, the official openai client): the target dies during the pre-copy, the source dies between
the pre-copy and the end of the stop-and-copy, the router is killed mid-migration and restarted. Each time no
request is lost or duplicated (a surviving stream is token for token the undisturbed greedy output; the router's
own death fails its client's connection, and a request after its restart runs), and no node keeps a KV block or a
request (a pre-copy hold ends at its deadline). The cut between two decode hosts is tests/test_partitions.py's."""

from __future__ import annotations

import asyncio
import contextlib
import random
import signal
import time

import openai
import pytest
from cluster_helpers import client, complete, wait_idle, wait_until_async
from migration_helpers import (
    CLUSTER,
    MODEL_NAME,
    decode_cluster,
    metric,
    only,
    reference,
    router_metric,
    set_admin_state,
    until_progress,
)

from pdcluster.cli.admin import drain_node

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(300)]

PROMPT, OUTPUT = 60, 1800
PRE_COPIED = 'pdcluster_node_pre_copies_total{outcome="ok"}'


def tiny_model(tmp_path_factory, hidden: int) -> str:
    from pdcluster.engine.testing import make_tiny_model

    # wider than the default tiny model: a stream of OUTPUT tokens lasts several seconds, through the faults
    return make_tiny_model(str(tmp_path_factory.mktemp(f"migrate-faults-{hidden}") / MODEL_NAME), "llama",
                           hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=4,
                           max_position_embeddings=2048)


def greedy_job(model: str) -> tuple[list[int], str]:
    rng = random.Random(11)
    prompt = [rng.randrange(3, 400) for _ in range(PROMPT)]
    return prompt, reference(model, [prompt], OUTPUT)[0]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_model(tmp_path_factory, 256)


@pytest.fixture(scope="module")
def job(model):
    return greedy_job(model)


def router_log(cluster) -> str:
    return cluster.service("router-0").log_path.read_text(errors="replace")


async def pre_copy_to_stopped_decode_1(cluster, prompt: list[int]):
    """A stream under way on decode-0; decode-1 listed, then SIGSTOPped; decode-0 drains with migration, and the
    router has asked decode-1 to pre-copy. (the stream's task, the drain's task, decode-1's process)"""
    await only(cluster, "decode-0")
    progress = [0]
    stream = asyncio.create_task(complete(client(cluster), MODEL_NAME, prompt, OUTPUT, progress=progress))
    await until_progress(progress, 16, stream)
    await only(cluster, "decode-0", "decode-1")
    target = cluster.service("decode-1").proc
    target.send_signal(signal.SIGSTOP)
    drain = asyncio.create_task(drain_node([cluster.etcd], CLUSTER, "decode-0", timeout=90, migrate=True))
    await wait_until_async(lambda: "to decode-1 (drain): pre-copying" in router_log(cluster), 20,
                           "the router asked decode-1 to pre-copy")
    return stream, drain, target


async def test_target_dies_during_the_pre_copy(tmp_path_factory, tmp_path):
    """decode-1, the pre-copy's target, is stopped before it can answer and then killed: the router gives the
    pre-copy up when decode-1 leaves, has decode-0 (draining) hand the stream back, and it resumes on decode-2.
    A model twice as wide as the other tests': its stream outlasts decode-1's lease (2 s) on a fast machine too."""
    model = tiny_model(tmp_path_factory, 512)
    prompt, want = greedy_job(model)
    with decode_cluster(model, tmp_path, num_decode=3) as cluster:
        stream, drain, target = await pre_copy_to_stopped_decode_1(cluster, prompt)
        target.kill()
        target.wait(10)
        await set_admin_state(cluster, "decode-2", "active")
        # the router gives the pre-copy up when decode-1's lease ends (its stream's tokens never stop meanwhile)
        deadline = time.monotonic() + 20
        while not router_metric(cluster, 'pdcluster_router_pre_copies_total{outcome="failed"}'):
            assert not stream.done(), "the stream ended before the pre-copy was given up: make OUTPUT longer"
            assert time.monotonic() < deadline, "the router never gave the pre-copy up"
            await asyncio.sleep(0.05)
        out = await asyncio.wait_for(stream, 120)
        assert out.text == want and out.usage == OUTPUT and out.finish == "length"
        await asyncio.wait_for(drain, 90)
        assert metric(cluster, "decode-2", "pdcluster_node_kv_fetched_blocks_total") > 0
        assert cluster.service("decode-0").proc.wait(20) == 0
        wait_idle(cluster)


async def test_source_dies_between_the_pre_copy_and_the_hand_back(model, job, tmp_path):
    """decode-0 (draining) is stopped and killed as soon as decode-1 holds the pre-copied blocks: whether it had
    handed the stream back yet or not, the stream resumes on decode-1 without recomputing what was pre-copied."""
    prompt, want = job
    with decode_cluster(model, tmp_path) as cluster:
        await only(cluster, "decode-0")
        progress = [0]
        stream = asyncio.create_task(complete(client(cluster), MODEL_NAME, prompt, OUTPUT, progress=progress))
        await until_progress(progress, 16, stream)
        await only(cluster, "decode-0", "decode-1")
        computed = metric(cluster, "decode-1", "pdcluster_node_prefill_tokens_total")
        drain = asyncio.create_task(drain_node([cluster.etcd], CLUSTER, "decode-0", timeout=90, migrate=True))
        source = cluster.service("decode-0").proc
        while not metric(cluster, "decode-1", PRE_COPIED):
            assert not stream.done(), "the stream ended before the pre-copy: make OUTPUT longer"
            await asyncio.sleep(0.01)
        source.send_signal(signal.SIGSTOP)
        struck = len(progress) and progress[0]
        source.kill()
        source.wait(10)
        out = await asyncio.wait_for(stream, 120)
        assert out.text == want and out.usage == OUTPUT and out.finish == "length"
        with contextlib.suppress(Exception):
            await asyncio.wait_for(drain, 30)
        recomputed = metric(cluster, "decode-1", "pdcluster_node_prefill_tokens_total") - computed
        # at most what decode-0 computed after the pre-copy: never the history before it
        assert recomputed < PROMPT + struck, (recomputed, struck)
        assert metric(cluster, "decode-1", "pdcluster_node_kv_fetched_blocks_total") >= (PROMPT + 16) // 16 - 1
        wait_idle(cluster, timeout=30)


async def test_router_killed_mid_migration_and_restarted(model, job, tmp_path):
    """The router dies while decode-1 (stopped) has the pre-copy pending: decode-1, resumed, copies and holds the
    blocks for a router that is gone; decode-0 aborts the orphaned stream after router_reconnect_timeout and
    finishes draining. A restarted router serves a new request, and every block comes free (the hold ends at its
    deadline)."""
    prompt, want = job
    with decode_cluster(model, tmp_path, node={"router_reconnect_timeout": 3.0}) as cluster:
        await only(cluster, "decode-1")   # one request first: the router's connection to decode-1 is up before it
        await complete(client(cluster), MODEL_NAME, prompt[:8], 4)   # stops, so the PreCopy reaches its socket
        stream, drain, target = await pre_copy_to_stopped_decode_1(cluster, prompt)
        router = cluster.service("router-0")
        router.proc.kill()
        router.proc.wait(10)
        target.send_signal(signal.SIGCONT)
        with pytest.raises(openai.APIError):
            await asyncio.wait_for(stream, 60)
        await asyncio.wait_for(drain, 60)   # decode-0 gave the orphan up and left
        end = time.monotonic() + 30
        while not router.alive:
            cluster.supervise()
            assert time.monotonic() < end, "the router was not restarted"
            await asyncio.sleep(0.2)
        await wait_until_async(lambda: (cluster.health() or {}).get("decode_nodes") == ["decode-1"], 30,
                               "the new router lists decode-1")
        out = await complete(client(cluster), MODEL_NAME, prompt, 64)
        assert out.text == reference(model, [prompt], 64)[0]
        assert metric(cluster, "decode-1", PRE_COPIED) == 1
        wait_idle(cluster, timeout=40)
