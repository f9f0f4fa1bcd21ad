"""Fault drills against real processes (docs/reliability.md): real etcd, router and node processes, traffic
from the official openai client, and one fault each: a prefill node that hangs while its lease lives, etcd
down for 30 s, a prefill node SIGKILLed with prompts on it, a decode node SIGKILLed under 16 streams.
Each drill: 0 failed requests, and afterwards every node's KV pool has 0 blocks used or reserved.

One cluster for the module (2 prefill + 2 decode nodes, lease TTL 2 s), drills in file order (the last two
each take a node away for good). The model is a random Llama big enough that a 1536-token prompt keeps a
prefill node busy for more than a second on one CPU thread; its vocabulary is the tokenizer's, so equal
text and equal per-token strings mean equal token ids. Every wait has a deadline.
"""

from __future__ import annotations

import asyncio
import random
import signal
import time
from itertools import pairwise

import pytest
from cluster_helpers import (
    all_node_metrics,
    bounded,
    client,
    complete,
    registered_nodes,
    router_metrics,
    total,
    wait_idle,
    wait_until_async,
)

from pdcluster.cli.smoke import scrape_metrics
from pdcluster.cli.supervisor import LocalCluster

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

MODEL_NAME = "drill-llama"
MODEL = dict(hidden_size=512, intermediate_size=2048, num_hidden_layers=8, num_attention_heads=8,
             num_key_value_heads=1, vocab_size=400, max_position_embeddings=2048)
LONG_PROMPT = 1536      # tokens: over a second of prefill on one thread
STREAMS = 16
PREFILL_TIMEOUT = 10.0  # the decode nodes' prefill_timeout knob: how long a hung prefill node costs
ETCD_OUTAGE = 30.0
FAILURES = "pdcluster_node_remote_prefill_failures_total{"
LOCAL = 'pdcluster_node_prefills_total{path="local"}'


def prompt(seed: int, length: int) -> list[int]:
    """Distinct token-id prompts (no prefix-cache hit between two seeds)."""
    rng = random.Random(seed)
    return [rng.randrange(3, MODEL["vocab_size"]) for _ in range(length)]


def delta(after: dict, before: dict, key: str) -> float:
    return total(after, key) - total(before, key)


def report(drill: str, **figures) -> None:
    """One line of figures per drill (docs/reliability.md quotes them; `pytest -s` shows them)."""
    print(f"\nDRILL {drill}: " + ", ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}"
                                         for k, v in figures.items()))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    from pdcluster.engine.testing import make_tiny_model

    model = make_tiny_model(str(tmp_path_factory.mktemp("drills") / MODEL_NAME), "llama", **MODEL)
    c = LocalCluster(model=model, work_dir=tmp_path_factory.mktemp("cluster"), num_prefill=2, num_decode=2, port=0,
                     cluster="drills", lease_ttl=2, threads_per_node=1,
                     node_config={"kv_cache_memory": "48MiB", "max_num_seqs": 32, "device": "cpu",
                                  "prefill_timeout": PREFILL_TIMEOUT},
                     # round robin: a drill knows how its requests spread over the nodes (a hung node's Load
                     # going stale must not steer them away before they are placed)
                     router_config={"disagg_min_tokens": 0, "routing_policy": "round_robin", "load_stale_s": 30})
    with c:
        yield c


@pytest.mark.timeout(180)
async def test_prefill_node_that_hangs_while_its_lease_lives_costs_only_the_prefill_timeout(cluster):
    # A long lease: the hung node stays in everybody's view, so only the decode nodes' prefill timeout saves
    # the prompts sent to it.
    hung = cluster.start_node("prefill", "prefill-hung", lease_ttl=int(3 * PREFILL_TIMEOUT))
    cluster.wait_ready(0, 0, timeout=90, nodes={"prefill-hung"})
    api = client(cluster)
    ok = 'pdcluster_node_prefill_requests_total{outcome="ok"}'
    seed = 1000
    while not scrape_metrics(hung.metrics_url).get(ok):   # until the decode nodes, too, have it in their view
        assert seed < 1030, "the new prefill node got no prefill to do"
        await bounded([complete(api, MODEL_NAME, prompt(seed + i, 32), 4, stream=False) for i in range(3)], 60)
        seed += 3
    wait_idle(cluster)
    before = all_node_metrics(cluster)
    hung.proc.send_signal(signal.SIGSTOP)
    try:
        started = time.monotonic()
        tasks = [asyncio.create_task(complete(api, MODEL_NAME, prompt(2000 + i, 32), 8, stream=i % 2 == 0))
                 for i in range(6)]   # round robin over 3 prefill nodes: 2 of them go to the hung one
        results = await bounded(tasks, 60 + PREFILL_TIMEOUT)
        elapsed = time.monotonic() - started
        after = all_node_metrics_except(cluster, hung)
    finally:
        hung.proc.send_signal(signal.SIGCONT)
    assert all(r.finish == "length" and r.usage == 8 and len(r.tokens) == 8 for r in results)
    timeouts = delta(after, before, FAILURES + 'reason="timeout"}')
    assert timeouts >= 1, "no prompt went to the hung prefill node"
    assert delta(after, before, FAILURES) == timeouts, "the hung node's lease lived: only timeouts, no other cause"
    assert delta(after, before, LOCAL) == timeouts, "every timed-out prompt was prefilled on its decode node"
    # Once it runs again it drains and leaves cleanly, its stale prompts aborted.
    hung.proc.send_signal(signal.SIGTERM)
    assert hung.proc.wait(90) == 0
    cluster.services.remove(hung)
    report("hung-prefill", requests=len(results), timed_out_prefills=int(timeouts), slowest_request_s=elapsed,
           prefill_timeout_s=PREFILL_TIMEOUT)
    wait_idle(cluster)


def all_node_metrics_except(cluster: LocalCluster, stopped) -> dict[str, dict[str, float]]:
    """Metrics of every node but a stopped one (its /metrics would not answer)."""
    return {s.node_id: scrape_metrics(s.metrics_url) for s in cluster.services
            if s.kind != "router" and s.alive and s is not stopped}


@pytest.mark.timeout(180)
async def test_etcd_down_for_30_s_under_traffic_fails_nothing_and_every_node_registers_again(cluster):
    api = client(cluster)
    done, failed, stop = [], [], asyncio.Event()

    async def traffic(worker: int) -> None:
        n = 0
        while not stop.is_set():
            try:
                await complete(api, MODEL_NAME, prompt(10_000 * (worker + 1) + n, 24), 8, stream=n % 2 == 0)
                done.append(time.monotonic())
            except Exception as exc:   # counted: the drill's bar is 0
                failed.append(repr(exc))
            n += 1

    nodes = {s.node_id for s in cluster.services if s.kind != "router"}
    workers = [asyncio.create_task(traffic(i)) for i in range(3)]
    await wait_until_async(lambda: len(done) >= 3, 60, "no traffic before the outage")
    await asyncio.to_thread(cluster.etcd_server.kill)
    down = time.monotonic()
    await asyncio.sleep(ETCD_OUTAGE)   # the outage itself: traffic keeps flowing meanwhile
    cluster.etcd_server.start()   # on this thread: etcd ends with the thread that started it (control.process)
    up = time.monotonic()
    during = sum(1 for t in done if down <= t <= up)
    # etcd restores the old leases with a fresh TTL, so the old records still list for a moment: what proves
    # a node is back is its own gauge, set once it has written its record under a lease it keeps alive.
    await wait_until_async(lambda: etcd_sessions_up(cluster), 30, "not every process is back on etcd", interval=0.2)
    back = time.monotonic() - up
    await asyncio.sleep(2 * cluster.lease_ttl)   # past the restored leases: what lists now is kept alive
    assert nodes <= await registered_nodes(cluster)
    stop.set()
    await bounded(workers, 60)
    assert not failed, failed[:5]
    assert during >= 3, "requests completed while etcd was down"
    health = await asyncio.to_thread(cluster.wait_ready, 0, 0, 30, nodes)
    assert nodes <= set(health["prefill_nodes"]) | set(health["decode_nodes"])
    report("etcd-down", outage_s=ETCD_OUTAGE, requests=len(done), during_outage=during, failed=len(failed),
           all_back_on_etcd_after_s=back)
    wait_idle(cluster)


def etcd_sessions_up(cluster: LocalCluster) -> bool:
    """Every node registered (and watching) again, and the router's view reconnected."""
    gauge = 'pdcluster_etcd_connected{component="%s"}'
    for s in cluster.services:
        m = scrape_metrics(s.metrics_url)
        components = ("view",) if s.kind == "router" else ("registration", "view")
        if any(m.get(gauge % c) != 1 for c in components):
            return False
    return True


@pytest.mark.timeout(180)
async def test_prefill_node_sigkilled_with_prompts_on_it_fails_no_request(cluster):
    victim = cluster.service("prefill-1")
    api = client(cluster)
    before = all_node_metrics(cluster)
    started = time.monotonic()
    tasks = [asyncio.create_task(complete(api, MODEL_NAME, prompt(3000 + i, LONG_PROMPT), 8, stream=i % 2 == 0))
             for i in range(4)]   # round robin: 2 prompts on each prefill node

    def on_victim() -> float:
        return scrape_metrics(victim.metrics_url)["pdcluster_node_requests_in_flight"]

    await wait_until_async(on_victim, 60, "no prompt reached the victim", interval=0.05)
    victim.proc.kill()
    killed = time.monotonic()
    victim.proc.wait(10)
    cluster.services.remove(victim)
    cluster.sweep_dead_pools()
    results = await bounded(tasks, 120)
    assert all(r.finish == "length" and r.usage == 8 for r in results)
    after = all_node_metrics(cluster)
    fallbacks = delta(after, before, LOCAL)
    assert fallbacks >= 1, "the victim's prompts were prefilled again on their decode nodes"
    assert delta(after, before, FAILURES) == fallbacks
    # The fallback's output is the one an undisturbed cluster gives.
    again = await bounded([complete(api, MODEL_NAME, prompt(3000 + i, LONG_PROMPT), 8, stream=False)
                           for i in range(4)], 120)
    assert [(r.text, r.tokens) for r in again] == [(r.text, r.tokens) for r in results]
    report("prefill-sigkill", requests=len(results), fell_back=int(fallbacks), kill_after_s=killed - started,
           kill_to_all_done_s=max(r.ended for r in results) - killed)
    wait_idle(cluster)


@pytest.mark.timeout(180)
async def test_decode_node_sigkilled_mid_stream_all_streams_finish_token_identical(cluster):
    api = client(cluster)
    prompts = [prompt(4000 + i, 24 + i) for i in range(STREAMS)]
    tokens = 128   # the streams must still run when the kill comes (48 ended first once decode steps got faster)
    undisturbed = await bounded([complete(api, MODEL_NAME, p, tokens) for p in prompts], 120)
    wait_idle(cluster)
    migrations = "pdcluster_router_migrations_total"
    before = router_metrics(cluster)
    progress = [0] * STREAMS
    tasks = [asyncio.create_task(complete(api, MODEL_NAME, p, tokens, progress=progress, slot=i))
             for i, p in enumerate(prompts)]
    await wait_until_async(lambda: min(progress) >= 4, 60, "streams did not get under way", interval=0.02)
    decode = {s.node_id: s for s in cluster.services if s.kind == "decode"}
    running = {n: scrape_metrics(s.metrics_url)["pdcluster_node_running_requests"] for n, s in decode.items()}
    victim = decode[max(running, key=running.get)]
    assert not any(t.done() for t in tasks)
    victim.proc.kill()
    killed = time.monotonic()
    victim.proc.wait(10)
    cluster.services.remove(victim)
    cluster.sweep_dead_pools()
    results = await bounded(tasks, 120)
    moved = router_metrics(cluster)[migrations] - before.get(migrations, 0.0)
    for got, want in zip(results, undisturbed, strict=True):
        assert (got.text, got.tokens, got.usage, got.finish) == (want.text, want.tokens, tokens, "length")
    assert moved == running[victim.node_id] >= 1, "every stream on the killed node moved, once"
    # The longest silence a stream saw across the kill: detection (lease expiry) + re-prefill elsewhere.
    pause = max(max((b - a for a, b in pairwise(r.chunk_times) if b > killed), default=0.0)
                for r in results)
    report("decode-sigkill", streams=STREAMS, migrated=int(moved), longest_pause_s=pause)
    wait_idle(cluster)
