"""Partition drills on "hosts" of one machine (tests/netns.py: network namespace, own address, own /dev/shm):
etcd, the router, one prefill node and two decode nodes each on its own host, cut from each other while
requests run, then healed. Cuts are silent (dropped packets, no reset): nft rules in a host's input for a cut
between two hosts (`cut`) or one way (`drop_from`), the cable pulled (`link_down`) to cut etcd from everybody.

The bar after each heal (docs/reliability.md "Partition drills"): every request completes with exactly the
greedy output of offline generation (`ignore_eos`, `max_retries=0` in the client, so a failure shows) or fails
with a clear error within its deadline; no node holds a KV block or a request; every node and the router is
registered in etcd exactly once and listed by the router.

One cluster for the module, drills in file order, each healing in `finally`. Short knobs keep it quick: lease
TTL 2 s, the router's stall_timeout 8 s, the decode nodes' prefill_timeout 4 s and router_reconnect_timeout 6 s.
Root only (skipped otherwise); the packet filter needs `nft` (`make test-deps`).
"""

from __future__ import annotations

import asyncio
import random
import re
import string
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from itertools import pairwise

import pytest
import yaml
from cluster_helpers import IDLE_GAUGES, bounded, client, complete, total, wait_until_async
from netns import Host, cut, hosts, module_hosts, nft_missing  # noqa: F401  (fixtures)

from pdcluster.cli.smoke import scrape_metrics
from pdcluster.control.etcd_server import etcd_binary, health_ok

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

MODEL_NAME = "partition-llama"
# Big enough that a 1536-token prompt keeps the prefill node (and its KV push) busy for a second or more.
MODEL = dict(hidden_size=512, intermediate_size=2048, num_hidden_layers=8, num_attention_heads=8,
             num_key_value_heads=1, vocab_size=400, max_position_embeddings=2048)
LONG_PROMPT = 1536
STREAMS = 8
STREAM_TOKENS = 48
TRAFFIC_TOKENS = 8
MOVE_TOKENS = 1800    # streams that outlast a drain with migration and its failed copies (~5 s: kv_landing_timeout)
                      # on a fast CPU too: 700 ended on d0 before the copy failed there (nothing to count)
LEASE_TTL = 2
STALL_TIMEOUT = 8.0
PREFILL_TIMEOUT = 4.0
ROUTER_RECONNECT_TIMEOUT = 6.0
REQUEST_TIMEOUT = 90.0
KV_PORT = 9200
NODES = ("p0", "d0", "d1")
FAILURES = "pdcluster_node_remote_prefill_failures_total{"
LOCAL = 'pdcluster_node_prefills_total{path="local"}'
MIGRATIONS = "pdcluster_router_migrations_total"


def prompt(tokenizer, seed: int, length: int) -> tuple[int, ...]:
    """`length` token ids of random ASCII words: every token boundary is a character boundary, so the router's
    text (detokenized after the prompt) equals the offline output decoded alone."""
    rng = random.Random(seed)
    words = " ".join("".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(2, 8)))
                     for _ in range(length))
    return tuple(tokenizer.encode(words, add_special_tokens=False)[:length])


def report(drill: str, **figures) -> None:
    """One line of figures per drill (docs/reliability.md quotes them; `pytest -s` shows them)."""
    print(f"\nDRILL {drill}: " + ", ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}"
                                         for k, v in figures.items()))


@dataclass
class Net:
    etcd: Host
    router: Host
    prefill: Host
    decode: list[Host]
    url: str
    endpoint: str
    cluster: str
    streams: list[tuple[int, ...]]   # prompts of the drills that cut streams mid-way
    long: list[tuple[int, ...]]      # prompts whose prefill is cut mid-transfer
    traffic: list[tuple[int, ...]]   # steady traffic through the etcd cuts
    moving: list[tuple[int, ...]]    # streams of the drain with migration across a cut
    expected: dict[tuple[tuple[int, ...], int], str] = field(default_factory=dict)  # (prompt, tokens) -> text

    def host_of(self, node_id: str) -> Host:
        return {"p0": self.prefill, "d0": self.decode[0], "d1": self.decode[1]}[node_id]

    def metrics(self, node_id: str) -> dict[str, float]:
        return scrape_metrics(f"http://{self.host_of(node_id).address}:9100/metrics")

    def all_metrics(self) -> dict[str, dict[str, float]]:
        return {n: self.metrics(n) for n in NODES}

    def router_metrics(self) -> dict[str, float]:
        return scrape_metrics(self.url + "/metrics")

    def router_log(self) -> str:
        return (self.router.work_dir / "router.log").read_text(errors="replace")

    def logs(self) -> str:
        return "\n".join(f"--- {log}\n{log.read_text(errors='replace')[-2500:]}"
                         for h in (self.router, self.prefill, *self.decode) for log in h.work_dir.glob("*.log"))


def _write_config(host: Host, name: str, config: dict) -> str:
    path = host.work_dir / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


def _offline(model: str, tokenizer, jobs: list[tuple[tuple[int, ...], int]]) -> dict[tuple[tuple[int, ...], int], str]:
    """Greedy text of every (prompt, tokens) the drills send, from the engine run in this process (the reference)."""
    from pdcluster.engine import LLM, SamplingParams

    llm = LLM(model=model, dtype="float32", device="cpu", num_gpu_blocks_override=512)
    results = llm.generate([list(p) for p, _ in jobs],   # one batch: far quicker than one prompt at a time
                           [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in jobs])
    return {job: tokenizer.decode(list(r.outputs[0].token_ids), skip_special_tokens=True,
                                  clean_up_tokenization_spaces=False) for job, r in zip(jobs, results, strict=True)}


@pytest.fixture(scope="module")
def net(module_hosts, tmp_path_factory):  # noqa: F811
    why = nft_missing()
    if why:
        pytest.skip(why)
    from transformers import AutoTokenizer

    from pdcluster.control.keys import generate_secret
    from pdcluster.engine.testing import make_tiny_model

    root = tmp_path_factory.mktemp("partitions")
    model = make_tiny_model(str(root / MODEL_NAME), "llama", **MODEL)
    tokenizer = AutoTokenizer.from_pretrained(model)
    streams = [prompt(tokenizer, 100 + i, 24 + i) for i in range(STREAMS)]
    long = [prompt(tokenizer, 200 + i, LONG_PROMPT) for i in range(2)]
    traffic = [prompt(tokenizer, 300 + i, 16 + 4 * i) for i in range(6)]
    moving = [prompt(tokenizer, 400 + i, 40 + 8 * i) for i in range(4)]
    expected = _offline(model, tokenizer, [(p, STREAM_TOKENS) for p in streams]
                        + [(p, TRAFFIC_TOKENS) for p in long + traffic] + [(p, MOVE_TOKENS) for p in moving])
    etcd_host, router_host, prefill_host, d0_host, d1_host = module_hosts(5)
    endpoint = f"{etcd_host.address}:2379"
    etcd_host.popen([str(etcd_binary()), "--data-dir", str(etcd_host.work_dir / "data"),
                     "--listen-client-urls", f"http://{endpoint}", "--advertise-client-urls", f"http://{endpoint}",
                     "--listen-peer-urls", "http://127.0.0.1:2380", "--log-level", "warn"], "etcd.log")
    secret = str(root / "cluster.secret")
    generate_secret(secret, force=True)
    common = {"etcd": [endpoint], "cluster": "partitions", "model": model, "log_level": "INFO",
              "lease_ttl": LEASE_TTL, "cluster_secret": secret}
    router = _write_config(router_host, "router", {
        **common, "host": router_host.address, "port": 8000, "node_id": "r0", "disagg_min_tokens": 0,
        "routing_policy": "round_robin", "stall_timeout": STALL_TIMEOUT, "request_timeout": REQUEST_TIMEOUT})
    # 16-token blocks: the moving streams (40-64 prompt tokens) have whole blocks to pre-copy a few tokens in
    node = {**common, "device": "cpu", "block_size": 16, "kv_cache_memory": "48MiB", "max_num_seqs": 32,
            "metrics_port": 9100,
            "prefill_timeout": PREFILL_TIMEOUT, "router_reconnect_timeout": ROUTER_RECONNECT_TIMEOUT,
            "kv_connect_timeout": 2.0, "kv_port": KV_PORT}
    env = {"OMP_NUM_THREADS": "1"}
    net = Net(etcd_host, router_host, prefill_host, [d0_host, d1_host], f"http://{router_host.address}:8000",
              endpoint, "partitions", streams, long, traffic, moving, expected)
    asyncio.run(wait_until_async(lambda: health_ok(f"http://{endpoint}/health"), 30, "etcd up"))
    router_host.popen([sys.executable, "-m", "pdcluster", "router", "--config", router], "router.log")
    for node_id in NODES:
        host = net.host_of(node_id)
        kind = "prefill" if node_id.startswith("p") else "decode"
        config = _write_config(host, node_id, {**node, "host": host.address, "node_id": node_id})
        host.popen([sys.executable, "-m", "pdcluster", kind, "--config", config], f"{node_id}.log", env)
    try:
        asyncio.run(wait_until_async(lambda: listed(net), 180, "router lists every node"))
    except AssertionError:
        print(net.logs())
        raise
    yield net


def listed(net: Net) -> bool:
    import httpx

    try:
        health = httpx.get(net.url + "/health", timeout=2).json()
    except Exception:
        return False
    return set(NODES) <= set(health.get("prefill_nodes", [])) | set(health.get("decode_nodes", []))


async def registrations(net: Net) -> Counter:
    """How many records each node id (and router id) has in etcd now."""
    from pdcluster.control.etcd_client import close_quietly, connect
    from pdcluster.control.queries import list_nodes

    etcd = await connect([net.endpoint])
    try:
        return Counter(n.node_id for n in await list_nodes(etcd, net.cluster))
    finally:
        await close_quietly(etcd)


async def converged(net: Net, timeout: float = 40.0) -> float:
    """Until the cluster is whole again: every node idle with no KV block used or reserved, every process
    registered exactly once (past a lease TTL, so no stale record counts), every node listed by the router
    (fresh Load reports). Returns how long it took, not counting the lease TTL waited out."""
    started = time.monotonic()

    def idle() -> bool:
        try:
            return not any(m.get(k) for m in net.all_metrics().values() for k in IDLE_GAUGES)
        except OSError:
            return False

    async def registered_once() -> bool:
        try:
            return await registrations(net) == Counter({"r0": 1, **{n: 1 for n in NODES}})
        except Exception:
            return False

    try:
        await wait_until_async(idle, timeout, "nodes idle, KV pools empty", interval=0.2)
        await wait_until_async(registered_once, timeout, "every process registered exactly once", interval=0.2)
        await wait_until_async(lambda: listed(net), timeout, "router lists every node", interval=0.2)
        await asyncio.sleep(LEASE_TTL + 0.5)   # a record that outlived its process would still show now
        await wait_until_async(registered_once, timeout, "every process registered exactly once", interval=0.2)
    except AssertionError:
        print({n: {k: v for k, v in m.items() if k in IDLE_GAUGES} for n, m in net.all_metrics().items()})
        print(await registrations(net))
        print(net.logs())
        raise
    return time.monotonic() - started - (LEASE_TTL + 0.5)


def check(net: Net, result, p: tuple[int, ...], tokens: int) -> None:
    assert (result.finish, result.usage) == ("length", tokens)
    assert result.text == net.expected[(p, tokens)], "output differs from offline greedy generation"


def kv_bytes_in(host: Host) -> int:
    """Bytes received so far on the host's KV port (its established connections, per the kernel)."""
    out = host.exec(["ss", "-tinH", "state", "established", f"( sport = :{KV_PORT} )"]).stdout
    return sum(int(n) for n in re.findall(r"bytes_received:(\d+)", out))


def test_cut_and_heal_between_two_hosts(hosts):  # noqa: F811
    """The partition tools themselves: nft drops between two hosts and a pulled cable, each healed."""
    why = nft_missing()
    if why:
        pytest.skip(why)
    a, b = hosts(2)
    b.popen([sys.executable, "-m", "http.server", "8123", "--bind", b.address], "http.log")
    probe = ("import sys, urllib.request\ntry:\n    urllib.request.urlopen(sys.argv[1], timeout=1)\n"
             "except OSError:\n    sys.exit(1)\n")
    url = f"http://{b.address}:8123/"

    def reaches() -> bool:
        return a.run([sys.executable, "-c", probe, url]).returncode == 0

    asyncio.run(wait_until_async(reaches, 20, "b serves"))
    cut(a, b)
    assert not reaches()
    a.heal()
    b.heal()
    assert reaches()
    b.link_down()
    assert not reaches()
    b.heal()
    asyncio.run(wait_until_async(reaches, 10, "b back after link up"))


async def _streams_across_a_router_decode_cut(net: Net, outage: float) -> dict:
    """STREAMS streams over both decode nodes; once each has 2 chunks d0 is cut from the router for `outage` s."""
    api = client(net, timeout=REQUEST_TIMEOUT)
    router, d0 = net.router, net.decode[0]
    before = net.router_metrics().get(MIGRATIONS, 0.0)
    progress = [0] * STREAMS
    tasks = [asyncio.create_task(complete(api, MODEL_NAME, list(p), STREAM_TOKENS, progress=progress, slot=i))
             for i, p in enumerate(net.streams)]
    await wait_until_async(lambda: min(progress) >= 2, 60, "streams did not get under way", interval=0.02)
    on_d0 = net.metrics("d0")["pdcluster_node_running_requests"]
    cut(router, d0)
    struck, at = time.monotonic(), time.strftime("%H:%M:%S")
    try:
        await asyncio.sleep(outage)
    finally:
        router.heal()
        d0.heal()
    healed = time.monotonic()
    results = await bounded(tasks, REQUEST_TIMEOUT)
    for p, r in zip(net.streams, results, strict=True):
        check(net, r, p, STREAM_TOKENS)
    moved = net.router_metrics()[MIGRATIONS] - before
    pause = max(max((b - a for a, b in pairwise(r.chunk_times) if b > struck), default=0.0)
                for r in results)
    done_after_heal = max(r.ended for r in results) - healed
    return dict(cut_at=at, streams=STREAMS, on_cut_node=int(on_d0), migrated=int(moved), longest_pause_s=pause,
                last_done_after_heal_s=done_after_heal, converged_s=await converged(net))


@pytest.mark.timeout(360)   # the first drill's time includes the cluster's start
async def test_decode_host_cut_from_router_5_s_mid_stream(net):
    figures = await _streams_across_a_router_decode_cut(net, 5.0)
    assert figures["migrated"] <= figures["on_cut_node"]
    report("router-decode-5s", **figures)


@pytest.mark.timeout(150)
async def test_decode_host_cut_from_router_30_s_mid_stream(net):
    figures = await _streams_across_a_router_decode_cut(net, 30.0)
    # Silence past stall_timeout: every stream still on the cut node moved to the other one, once.
    assert 1 <= figures["migrated"] <= figures["on_cut_node"]
    report("router-decode-30s", **figures)


@pytest.mark.timeout(150)
async def test_prefill_host_cut_from_decode_host_mid_transfer(net):
    api = client(net, timeout=REQUEST_TIMEOUT)
    prefill, d0 = net.prefill, net.decode[0]
    before = net.all_metrics()
    landed = kv_bytes_in(d0)
    tasks = [asyncio.create_task(complete(api, MODEL_NAME, list(p), TRAFFIC_TOKENS, stream=i % 2 == 0))
             for i, p in enumerate(net.long)]   # round robin: one per decode node, both prefilled on p0
    # Strike once the first layers' KV bytes reach d0 (its prompt's KV is 6 MiB, pushed layer by layer as
    # the prefill node computes): the rest of the transfer, the ack and PrefillDone are cut off.
    await wait_until_async(lambda: kv_bytes_in(d0) > landed + 256 * 1024, 90, "no KV bytes reached d0",
                           interval=0.02)
    cut(prefill, d0)
    struck, at = time.monotonic(), time.strftime("%H:%M:%S")
    try:
        await asyncio.sleep(PREFILL_TIMEOUT + 6.0)   # past the fallback and the receiver's I/O timeout
    finally:
        prefill.heal()
        d0.heal()
    results = await bounded(tasks, REQUEST_TIMEOUT)
    for p, r in zip(net.long, results, strict=True):
        check(net, r, p, TRAFFIC_TOKENS)
    after = net.all_metrics()
    failures = {k: v - before["d0"].get(k, 0.0) for k, v in after["d0"].items() if k.startswith(FAILURES) and v}
    fell_back = after["d0"].get(LOCAL, 0.0) - before["d0"].get(LOCAL, 0.0)
    assert fell_back >= 1 and sum(failures.values()) == fell_back, failures
    outcomes = {k.split('"')[1]: int(v - before["p0"].get(k, 0.0)) for k, v in after["p0"].items()
                if k.startswith("pdcluster_node_prefill_requests_total{") and v != before["p0"].get(k, 0.0)}
    report("prefill-decode-cut", cut_at=at, requests=len(results), p0_outcomes=outcomes,
           d0_local_fallbacks=int(fell_back),
           d0_failure_reasons={k.split('"')[1]: int(v) for k, v in failures.items() if v},
           slowest_after_cut_s=max(r.ended for r in results) - struck,
           p0_transfer_failures=int(total({"p0": after["p0"]}, "pdcluster_kv_transfer_failures_total{")
                                    - total({"p0": before["p0"]}, "pdcluster_kv_transfer_failures_total{")),
           converged_s=await converged(net))


class Traffic:
    """`workers` clients sending the traffic prompts in a loop (streaming every other one), each result checked
    against the offline output, until stopped."""

    def __init__(self, net: Net, workers: int = 3) -> None:
        self.net = net
        self.api = client(net, timeout=REQUEST_TIMEOUT)
        self.done: list[float] = []
        self.failed: list[str] = []
        self.stop = asyncio.Event()
        self.tasks = [asyncio.create_task(self._run(i)) for i in range(workers)]

    async def _run(self, worker: int) -> None:
        n = 0
        while not self.stop.is_set():
            p = self.net.traffic[(worker * 2 + n) % len(self.net.traffic)]
            try:
                r = await complete(self.api, MODEL_NAME, list(p), TRAFFIC_TOKENS, stream=n % 2 == 0)
                check(self.net, r, p, TRAFFIC_TOKENS)
                self.done.append(time.monotonic())
            except Exception as exc:   # counted: the bar is 0
                self.failed.append(repr(exc))
            n += 1

    async def finish(self) -> None:
        self.stop.set()
        await bounded(self.tasks, REQUEST_TIMEOUT)


def etcd_gauges(net: Net) -> dict[str, float]:
    """Every process's etcd_connected gauges (nodes: registration + view; router: view)."""
    gauge = 'pdcluster_etcd_connected{component="%s"}'
    out = {"r0/view": net.router_metrics().get(gauge % "view", 0.0)}
    for node_id, m in net.all_metrics().items():
        for component in ("registration", "view"):
            out[f"{node_id}/{component}"] = m.get(gauge % component, 0.0)
    return out


@pytest.mark.timeout(120)
async def test_router_cut_from_etcd_one_way(net):
    traffic = Traffic(net)
    await wait_until_async(lambda: len(traffic.done) >= 3, 60, "no traffic before the cut")
    outage = 4 * LEASE_TTL + 2.0   # the router's lease expires; its view's health read notices the dead watch
    net.etcd.drop_from(net.router.address)   # the router's packets never reach etcd; etcd's still reach it
    down = time.monotonic()
    try:
        await asyncio.sleep(outage)
        gone = (await registrations(net)).get("r0", 0)
    finally:
        net.etcd.heal()
    up = time.monotonic()
    await wait_until_async(lambda: etcd_gauges(net)["r0/view"] == 1, 30, "router back on etcd", interval=0.2)
    back = time.monotonic() - up
    await traffic.finish()
    assert not traffic.failed, traffic.failed[:5]
    during = sum(1 for t in traffic.done if down <= t <= up)
    assert during >= 3, "requests completed while the router was cut from etcd"
    assert gone == 0, "the router's record outlived its lease during the cut"
    report("router-etcd-cut", outage_s=outage, requests=len(traffic.done), during_outage=during, failed=0,
           router_back_on_etcd_after_s=back, converged_s=await converged(net))


@pytest.mark.timeout(180)
async def test_etcd_cut_from_every_node_for_30_s(net):
    traffic = Traffic(net)
    await wait_until_async(lambda: len(traffic.done) >= 3, 60, "no traffic before the cut")
    mark = len(net.router_log())
    net.etcd.link_down()
    down = time.monotonic()
    try:
        await asyncio.sleep(30.0)
    finally:
        net.etcd.heal()
    up = time.monotonic()
    await wait_until_async(lambda: all(v == 1 for v in etcd_gauges(net).values()), 30,
                           "not every process is back on etcd", interval=0.2)
    back = time.monotonic() - up
    await asyncio.sleep(2.0)   # traffic across the re-registration
    await traffic.finish()
    assert not traffic.failed, traffic.failed[:5]
    during = sum(1 for t in traffic.done if down <= t <= up)
    assert during >= 3, "requests completed while etcd was cut off"
    # The router's view reloads when etcd is back, before the nodes (whose leases expired) registered again:
    # it keeps routing to the nodes still reporting Load instead of dropping them (router/cluster.py).
    assert "left the cluster view" not in net.router_log()[mark:]
    report("etcd-cut-30s", requests=len(traffic.done), during_outage=during, failed=0,
           all_back_on_etcd_after_s=back, converged_s=await converged(net))


@pytest.mark.timeout(300)
async def test_drain_with_migration_while_the_decode_hosts_are_cut_from_each_other(net):
    """Last of the drills (d0 is drained, then started again): d0 drains with migration while it is cut from d1,
    the only target. d1 cannot copy the KV (its FetchKV is dropped): the pre-copies fail, d0 hands its streams over
    without one, d1's fetch of their history fails too and d1 recomputes it. Every stream is exactly the offline
    output; no reservation or hold is left on either side once healed."""
    from pdcluster.cli.admin import drain_node, set_state

    api = client(net, timeout=REQUEST_TIMEOUT)
    d0, d1 = net.decode
    before = net.router_metrics()
    progress = [0] * len(net.moving)
    tasks = [asyncio.create_task(complete(api, MODEL_NAME, list(p), MOVE_TOKENS, progress=progress, slot=i))
             for i, p in enumerate(net.moving)]   # round robin: two on each decode node
    await wait_until_async(lambda: min(progress) >= 8, 60, "streams did not get under way", interval=0.02)
    cut(d0, d1)
    struck = time.monotonic()
    try:
        took = await drain_node([net.endpoint], net.cluster, "d0", timeout=120, migrate=True)
    finally:
        d0.heal()
        d1.heal()
    results = await bounded(tasks, REQUEST_TIMEOUT)
    for p, r in zip(net.moving, results, strict=True):
        check(net, r, p, MOVE_TOKENS)
    after = net.router_metrics()
    failed = after.get('pdcluster_router_pre_copies_total{outcome="failed"}', 0.0) - \
        before.get('pdcluster_router_pre_copies_total{outcome="failed"}', 0.0)
    assert failed >= 1, "no pre-copy was tried across the cut"
    assert not any(r.finish != "length" for r in results)
    # d0 again, as a rolling upgrade brings it back: started, then uncordoned (a drain leaves it cordoned)
    config = d0.work_dir / "d0.yaml"
    d0.popen([sys.executable, "-m", "pdcluster", "decode", "--config", str(config)], "d0.log", {"OMP_NUM_THREADS": "1"})
    await set_state([net.endpoint], net.cluster, "d0", "active")
    await wait_until_async(lambda: listed(net), 120, "d0 back in the router's list")
    report("decode-decode-cut-drain-migrate", streams=len(net.moving), drain_s=took, pre_copies_failed=int(failed),
           last_done_after_cut_s=max(r.ended for r in results) - struck, converged_s=await converged(net))


def test_router_keeps_a_reporting_node_over_the_reload_after_an_etcd_outage():
    """The unit behind the etcd drill's bar (no process needed): a node missing from the source's full reload
    but still reporting Load stays routable for a while; one that stopped reporting, or one removed outside a
    reload (a watched delete: drained, lease expired), leaves at once."""
    from pdcluster.control.protocol import Load
    from pdcluster.control.records import NodeInfo
    from pdcluster.router.cluster import LIVE_REPORT_S, RESYNC_GRACE_S, RouterCluster, StaticNodeSource

    class Reloading(StaticNodeSource):
        resynced_at = 0.0

    d0, d1 = NodeInfo(node_id="d0", role="decode"), NodeInfo(node_id="d1", role="decode")
    source = Reloading([d0, d1])
    cluster = RouterCluster(source)
    cluster.sync()
    cluster.get("d0").update(Load(node_id="d0", role="decode"))   # d0 reports; d1 went quiet
    source.set_nodes([])
    source.resynced_at = time.monotonic()   # the reload after the outage: both leases expired meanwhile
    cluster.sync()
    assert cluster.is_alive("d0") and [n.id for n in cluster.candidates("decode")] == ["d0"]
    assert not cluster.is_alive("d1")
    source.set_nodes([d0])   # registered again
    cluster.sync()
    assert cluster.is_alive("d0")
    source.set_nodes([])
    source.resynced_at -= RESYNC_GRACE_S   # a removal long after the reload: a watched delete
    cluster.sync()
    assert not cluster.is_alive("d0")
    source.set_nodes([d0])
    cluster.sync()
    cluster.get("d0").update(Load(node_id="d0", role="decode"))
    cluster.get("d0").load_time -= LIVE_REPORT_S   # stopped reporting
    source.set_nodes([])
    source.resynced_at = time.monotonic()
    cluster.sync()
    assert not cluster.is_alive("d0")
