"""Router building blocks without HTTP: model info, stop strings, prefix hashes, policies, cluster view."""

from __future__ import annotations

import asyncio
import time

import pytest
from router_fakes import make_tokenizer_dir

from pdcluster.control.block_hash import block_hashes, cached_prefix_blocks
from pdcluster.control.protocol import Load
from pdcluster.control.records import Capacity, NodeInfo
from pdcluster.control.transport import LoadPublisher
from pdcluster.router.cluster import NodeState, RouterCluster, StaticNodeSource
from pdcluster.router.detokenizer import StopMatcher
from pdcluster.router.policies import (
    LeastLoadedPolicy,
    PrefixAwarePolicy,
    Prompt,
    RoundRobinPolicy,
    best_cover,
    choose_prefill,
    make_policy,
    note_assignment,
    prefill_locally_pays,
    prefix_holder,
)
from pdcluster.router.settings import RouterSettings
from pdcluster.router.tokenizer import read_model_info


def test_model_info(tmp_path) -> None:
    info = read_model_info(make_tokenizer_dir(str(tmp_path / "m"), max_position_embeddings=77))
    assert info.max_model_len == 77 and info.eos_token_ids == [2] and info.name == "m"
    assert read_model_info(str(tmp_path / "m"), name="x", max_model_len=10).max_model_len == 10


# -- stop strings

def test_stop_matcher_holds_back_partial_matches() -> None:
    m = StopMatcher(["STOP", "end"])
    assert m.feed("hello S") == ("hello ", False)
    assert m.feed("T") == ("", False)
    assert m.feed("OP and more") == ("", True)
    m = StopMatcher(["STOP"])
    assert m.feed("ST") == ("", False)
    assert m.feed("ay") == ("STay", False)
    assert m.feed("S") == ("", False)
    assert m.flush() == "S"


def test_stop_matcher_picks_the_earliest_stop() -> None:
    m = StopMatcher(["b", "abc"])
    assert m.feed("xxabc") == ("xx", True)  # "abc" starts before "b"
    assert StopMatcher([]).feed("anything") == ("anything", False)


# -- prefix hashes

def test_block_hashes_are_chained_and_stable() -> None:
    a = block_hashes(list(range(40)), 16)
    assert len(a) == 2 and all(0 <= h < 2**63 for h in a)
    assert a == block_hashes(list(range(40)), 16)
    b = block_hashes([99] + list(range(1, 40)), 16)
    assert a[0] != b[0] and a[1] != b[1]  # a change in block 0 changes every later hash
    assert block_hashes(list(range(32)), 16) == a
    assert cached_prefix_blocks(a, {a[0]}) == 1
    assert cached_prefix_blocks(a, {a[1]}) == 0  # only a leading run counts
    with pytest.raises(ValueError, match="block_size"):
        block_hashes([1], 0)


# -- policies

def node(node_id: str, role: str = "decode", admin: str = "active", **load) -> NodeState:
    state = NodeState(info=NodeInfo(node_id=node_id, role=role), admin=admin)
    if load:
        state.update(Load(node_id=node_id, role=role, **load))
    return state


def test_a_node_s_block_size_comes_from_its_registration_until_it_reports_load() -> None:
    state = NodeState(info=NodeInfo(node_id="d", role="decode", capacity=Capacity(block_size=128)))
    assert state.block_size == 128   # no Load yet: prefix matches hash the blocks the node hashes
    state.update(Load(node_id="d", role="decode", block_size=64))
    assert state.block_size == 64
    assert NodeState(info=NodeInfo(node_id="old", role="decode")).block_size == 16   # registered none


def held(hashes: list[int], tier: int = 0) -> dict:
    """Load fields saying a node holds `hashes` in `tier` (a KV snapshot)."""
    return {"kv_events": [[0, tier, list(hashes)]], "kv_seq": 1, "kv_snapshot": True}


def test_round_robin_order() -> None:
    policy = RoundRobinPolicy()
    nodes = [node("b"), node("a"), node("c")]
    assert [policy.pick_decode(nodes, 10).id for _ in range(4)] == ["a", "b", "c", "a"]
    assert policy.pick_decode([], 10) is None


def test_least_loaded_respects_kv_capacity_then_load() -> None:
    policy = LeastLoadedPolicy()
    busy_roomy = node("a", running=8, waiting=2, free_blocks=500, block_size=16)
    idle_full = node("b", running=0, free_blocks=2, block_size=16)
    mid = node("c", running=3, waiting=0, free_blocks=100, block_size=16)
    assert policy.pick_decode([busy_roomy, idle_full, mid], 64).id == "c"  # 4 blocks: b (2 free) cannot
    assert policy.pick_decode([busy_roomy, idle_full, mid], 20).id == "b"  # 2 blocks: fits idle b
    assert policy.pick_decode([busy_roomy, idle_full, mid], 100).id == "c"  # 7 blocks: only a, c fit
    assert policy.pick_decode([idle_full], 1000).id == "b"  # nobody fits: still try the least loaded


def test_least_loaded_spreads_a_burst_between_reports() -> None:
    policy = LeastLoadedPolicy()
    nodes = [node("a", free_blocks=100), node("b", free_blocks=100)]
    picks = []
    for _ in range(4):
        d = policy.pick_decode(nodes, 10)
        note_assignment(d, None, 10)
        picks.append(d.id)
    assert sorted(picks) == ["a", "a", "b", "b"]


def test_prefix_aware_prefill_choice() -> None:
    policy = PrefixAwarePolicy()
    prompt_ids = list(range(100, 100 + 200))
    hashes = block_hashes(prompt_ids, 16)
    cold = node("p-cold", "prefill", queued_prefill_tokens=0, block_size=16)
    warm = node("p-warm", "prefill", queued_prefill_tokens=100, block_size=16, **held(hashes[:10]))
    # warm: 100 queued + 200 - 160 cached = 140 < cold: 200
    assert policy.pick_prefill([cold, warm], Prompt(prompt_ids)).id == "p-warm"
    swamped = node("p-warm", "prefill", queued_prefill_tokens=1000, block_size=16, **held(hashes))
    assert policy.pick_prefill([cold, swamped], Prompt(prompt_ids)).id == "p-cold"
    # least_loaded ignores the cache: fewest queued tokens wins
    assert LeastLoadedPolicy().pick_prefill([cold, warm], Prompt(prompt_ids)).id == "p-cold"


def test_conditional_disaggregation() -> None:
    policy = PrefixAwarePolicy()
    short = list(range(20))
    long = list(range(100))
    p = node("p0", "prefill", block_size=16)
    assert choose_prefill(policy, [p], Prompt(short), disagg_min_tokens=64) is None  # short, uncached
    assert choose_prefill(policy, [p], Prompt(long), disagg_min_tokens=64).id == "p0"
    assert choose_prefill(policy, [], Prompt(long), disagg_min_tokens=64) is None  # no prefill node
    cached = node("p1", "prefill", block_size=16, **held(block_hashes(short, 16)))
    assert choose_prefill(policy, [p, cached], Prompt(short), disagg_min_tokens=64).id == "p1"


def test_prefix_aware_weights_cached_blocks_by_their_tier() -> None:
    policy = PrefixAwarePolicy()
    prompt_ids = list(range(500, 500 + 320))
    hashes = block_hashes(prompt_ids, 16)
    pool = node("p-pool", "prefill", block_size=16, queued_prefill_tokens=40, **held(hashes[:16]))
    host = node("p-host", "prefill", block_size=16, **held(hashes[:16], tier=1))
    disk = node("p-disk", "prefill", block_size=16, **held(hashes, tier=2))
    cold = node("p-cold", "prefill", block_size=16)
    prompt = Prompt(prompt_ids)
    assert [prompt.cached_tiers(n) for n in (pool, host, cold)] == [[0] * 16, [1] * 16, []]
    assert prompt.work_tokens(pool) == 320 - 256 and prompt.work_tokens(cold) == 320
    assert prompt.work_tokens(host) == pytest.approx(320 - 256 * 0.9)
    # pool: 40 queued + 64; host: 0 + 89.6; disk: 0 + 320 - 320 * 0.7 = 96
    assert policy.pick_prefill([pool, host, disk, cold], prompt).id == "p-host"
    assert policy.pick_prefill([pool, disk, cold], prompt).id == "p-disk"
    assert policy.pick_prefill([pool, cold], prompt).id == "p-pool"


def test_prefix_matching_uses_each_nodes_hash_seed() -> None:
    prompt_ids = list(range(64))
    seeded = NodeState(info=NodeInfo(node_id="s", role="prefill", prefix_hash_seed=42))
    seeded.update(Load(node_id="s", role="prefill", block_size=16, **held(block_hashes(prompt_ids, 16, 42))))
    bare = node("b", "prefill", block_size=16, **held(block_hashes(prompt_ids, 16, 42)))   # seed 0 registered
    assert Prompt(prompt_ids).cached_tokens(seeded) == 64 and Prompt(prompt_ids).cached_tokens(bare) == 0


def test_prefix_aware_decode_pick_when_the_decode_node_prefills() -> None:
    policy = PrefixAwarePolicy()
    prompt_ids = list(range(200))
    warm = node("d-warm", block_size=16, running=3, free_blocks=100, **held(block_hashes(prompt_ids, 16)))
    idle = node("d-idle", block_size=16, running=1, free_blocks=100)
    assert policy.pick_decode([idle, warm], 300, Prompt(prompt_ids)).id == "d-warm"   # within the load slack
    assert policy.pick_decode([idle, warm], 300).id == "d-idle"                        # a prefill node prefills
    busy = node("d-warm", block_size=16, running=4, free_blocks=100, **held(block_hashes(prompt_ids, 16)))
    assert policy.pick_decode([idle, busy], 300, Prompt(prompt_ids)).id == "d-idle"   # 3 more requests: too many
    full = node("d-warm", block_size=16, running=1, free_blocks=2, **held(block_hashes(prompt_ids, 16)))
    assert policy.pick_decode([idle, full], 300, Prompt(prompt_ids)).id == "d-idle"   # no room for it


def test_prefix_holder_is_the_longest_pool_run_worth_a_fetch() -> None:
    prompt_ids = list(range(300, 300 + 200))   # 12 full blocks
    hashes = block_hashes(prompt_ids, 16)
    prompt = Prompt(prompt_ids)
    d = node("d", block_size=16, **held(hashes[:3]))
    near = node("d-near", block_size=16, **held(hashes[:4]))                      # only 1 block more than d
    far = node("d-far", block_size=16, **held(hashes[:10]))
    host = node("p-host", "prefill", block_size=16, **held(hashes, tier=1))       # host tier: not lent
    mixed = NodeState(info=NodeInfo(node_id="p-mixed", role="prefill"))
    mixed.update(Load(node_id="p-mixed", role="prefill", block_size=16, kv_seq=1, kv_snapshot=True,
                      kv_events=[[0, 0, hashes[:5]], [0, 1, hashes[5:]]]))
    assert prompt.pool_blocks(mixed) == 5 and prompt.pool_blocks(host) == 0
    assert prefix_holder(prompt, [d, near, far, host, mixed], d, exclude="d") == (far, 10)
    assert prefix_holder(prompt, [d, near, host], d, exclude="d") is None
    assert prefix_holder(prompt, [far], far, exclude="d-far") is None            # the decode node itself
    other_seed = NodeState(info=NodeInfo(node_id="s", role="decode", prefix_hash_seed=7))
    other_seed.update(Load(node_id="s", role="decode", block_size=16, **held(block_hashes(prompt_ids, 16, 7))))
    assert prefix_holder(prompt, [other_seed], d) is None   # its hashes are not d's: nothing d could ask for


def test_a_short_uncached_tail_is_prefilled_on_the_decode_node() -> None:
    history = list(range(1000, 1000 + 190))               # a decode node holds the conversation so far
    turn = history + list(range(5000, 5030))               # + 30 new tokens
    hashes = block_hashes(turn, 16)
    prefill = node("p", "prefill", block_size=16, **held(hashes[:6]))    # the first turn's prompt only
    holder = node("d1", block_size=16, **held(hashes[:11], tier=1))     # history, answers included (host tier)
    lender = node("d2", block_size=16, **held(hashes[:11]))             # the same in a pool
    cold = node("d3", block_size=16)
    prompt = Prompt(turn)
    assert best_cover(prompt, [holder, cold], []) == 11 and best_cover(prompt, [cold], [holder]) == 0
    assert best_cover(prompt, [cold], [lender]) == 11
    assert prefill_locally_pays(prompt, prefill, 11, 16, disagg_min_tokens=64)        # 220 - 176 = 44 left
    assert not prefill_locally_pays(prompt, prefill, 11, 16, disagg_min_tokens=40)
    assert not prefill_locally_pays(prompt, prefill, 7, 16, disagg_min_tokens=200)    # 1 block over p's: not worth
    assert not prefill_locally_pays(prompt, prefill, 0, 16, disagg_min_tokens=64)


def _placement(loads: dict[str, dict], **settings):
    """A DecodeClient over nodes reporting `loads` (node id -> Load fields; "p..." ids are prefill nodes)."""
    from pdcluster.router.decode_client import DecodeClient
    from pdcluster.router.metrics import RouterMetrics

    infos = [NodeInfo(node_id=i, role="prefill" if i.startswith("p") else "decode") for i in loads]
    cluster = RouterCluster(StaticNodeSource(infos))
    cluster.sync()
    for i, fields in loads.items():
        cluster.get(i).update(Load(node_id=i, role=cluster.get(i).info.role, block_size=16, free_blocks=1000,
                                   **fields))
    return DecodeClient(cluster, make_policy("prefix_aware"), RouterSettings(node_id="r", **settings),
                        RouterMetrics())


def test_placement_of_a_conversations_next_turn() -> None:
    turn = list(range(1000, 1000 + 190)) + list(range(5000, 5030))   # history (11 full blocks) + 30 new tokens
    hashes = block_hashes(turn, 16)
    cases = [
        # the decode node holding the history (host tier) computes the tail itself: no prefill node, no fetch
        ({"p0": held(hashes[:6]), "d1": held(hashes[:11], tier=1), "d2": {}}, ("d1", None, None)),
        # ... too busy: the other decode node cannot lend from a host tier, so the prefill node computes it
        ({"p0": held(hashes[:6]), "d1": {"running": 9, **held(hashes[:11], tier=1)}, "d2": {}}, ("d2", "p0", None)),
        # ... its pool holds it: the other decode node fetches 11 blocks from it and computes the tail
        ({"p0": held(hashes[:6]), "d1": {"running": 9, **held(hashes[:11])}, "d2": {}}, ("d2", None, ("d1", 11))),
        # the prefill node holds as much: it computes the tail and pushes the KV as usual
        ({"p0": held(hashes[:11]), "d1": held(hashes[:11], tier=1), "d2": {}}, (None, "p0", None)),
        # no prefill node: the least loaded decode node fetches from the busy one's pool
        ({"d1": {"running": 9, **held(hashes[:11])}, "d2": {}}, ("d2", None, ("d1", 11))),
    ]
    for loads, (decode, prefill, source) in cases:
        client = _placement(loads)
        try:
            d, p, _, src = client.place(turn, 16, set())
        finally:
            client.close()
        assert (decode in (None, d.id), p.id if p else None, src) == (True, prefill, source), loads
    client = _placement(cases[2][0], prefix_fetch=False)   # fetching off: the prefill node computes it
    try:
        d, p, _, src = client.place(turn, 16, set())
    finally:
        client.close()
    assert (p.id, src) == ("p0", None)


def test_prefill_work_is_taken_back_when_done_unless_a_report_came() -> None:
    prefill, decode = node("p", "prefill", block_size=16), node("d", block_size=16)
    first = note_assignment(decode, prefill, 100)
    second = note_assignment(decode, prefill, 40)
    assert prefill.prefill_tokens_since_report == 140 and decode.assigned_since_report == 2
    first.done()
    first.done()   # once only
    assert prefill.prefill_tokens_since_report == 40
    prefill.update(Load(node_id="p", role="prefill", queued_prefill_tokens=40))   # the report counts it now
    second.done()
    assert prefill.prefill_tokens_since_report == 0 and prefill.load.queued_prefill_tokens == 40
    note_assignment(decode, None, 0).done()   # a local prefill: nothing to take back


def test_prefix_index_applies_events_in_order_by_tier() -> None:
    from pdcluster.router.prefix_index import PrefixIndex

    index = PrefixIndex(max_blocks=5)
    index.apply(1, [[0, 0, [1, 2, 3]], [0, 1, [1, 2, 3]]], snapshot=True)   # pool and host
    assert index.leading_tiers([1, 2, 3, 4]) == [0, 0, 0]
    index.apply(2, [[1, 0, [2]], [0, 2, [2, 9]], [1, 1, [3]]], snapshot=False)   # 2 leaves the pool, reaches disk
    assert index.leading_tiers([1, 2, 3]) == [0, 1, 0] and index.tiers[2] == 0b110 and index.tiers[9] == 0b100
    index.apply(3, [[1, 0, [3]], [1, 1, [1, 2]], [1, 2, [2]]], snapshot=False)
    assert 3 not in index.tiers and 2 not in index.tiers and index.leading_tiers([1]) == [0]
    assert index.counts == [1, 0, 1] and not index.stale
    index.apply(5, [[0, 0, [10, 11, 12, 13, 14]]], snapshot=False)   # report 4 was lost; full past 5 blocks
    assert index.stale and len(index) == 5 and index.dropped == 2
    index.apply(6, [[0, 0, [7]]], snapshot=True)
    assert not index.stale and list(index.tiers) == [7] and index.counts == [1, 0, 0]


def test_make_policy_and_settings() -> None:
    assert make_policy("round_robin").name == "round_robin"
    with pytest.raises(ValueError, match="routing_policy"):
        make_policy("random")

    class Cfg:
        model = "/m"
        routing_policy = "least_loaded"
        port = 9
        node_id = ""
        unrelated = 1

    s = RouterSettings.from_config(Cfg())
    assert s.routing_policy == "least_loaded" and s.port == 9 and s.node_id.startswith("router-")


# -- cluster view

@pytest.mark.slow
async def test_cluster_skips_cordoned_nodes_and_reads_load_reports() -> None:
    pub = LoadPublisher()
    load_addr = pub.bind("tcp://127.0.0.1:0")
    source = StaticNodeSource([NodeInfo(node_id="d0", role="decode", load_addr=load_addr),
                               NodeInfo(node_id="d1", role="decode"),
                               NodeInfo(node_id="p0", role="prefill")])
    cluster = RouterCluster(source, sync_interval=0.05)
    removed: list[str] = []
    cluster.on_removed.append(removed.append)
    await cluster.start()
    task = asyncio.create_task(pub.run(lambda: Load(node_id="d0", role="decode", running=3, free_blocks=7),
                                       interval=0.05))
    try:
        assert {n.id for n in cluster.candidates("decode")} == {"d0", "d1"}
        source.set_admin_state("d1", "cordoned")
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            d0 = cluster.get("d0")
            if d0.load is not None and [n.id for n in cluster.candidates("decode")] == ["d0"]:
                break
            await asyncio.sleep(0.05)
        assert [n.id for n in cluster.candidates("decode")] == ["d0"]
        assert cluster.get("d0").load.free_blocks == 7
        source.set_admin_state("d1", "draining")
        source.remove("d0")
        await asyncio.sleep(0.3)
        assert cluster.candidates("decode") == [] and removed == ["d0"] and not cluster.is_alive("d0")
        assert [n.id for n in cluster.candidates("prefill")] == ["p0"]
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await cluster.stop()
        pub.close()


def test_config_accepts_exactly_the_router_policies():
    from pdcluster.router.policies import POLICIES
    from pdcluster.router.settings import ROUTING_POLICIES

    assert set(ROUTING_POLICIES) == set(POLICIES)


# -- several models, node context limits

def test_candidates_are_nodes_of_the_model_that_hold_the_sequence() -> None:
    from pdcluster.control.records import Capacity

    def info(node_id: str, role: str, model: str, max_model_len: int = 0) -> NodeInfo:
        return NodeInfo(node_id=node_id, role=role, model=model, capacity=Capacity(max_model_len=max_model_len))

    cluster = RouterCluster(StaticNodeSource([info("a1", "decode", "alpha", 64), info("a2", "decode", "alpha"),
                                              info("b1", "decode", "beta", 4096), info("pa", "prefill", "alpha", 32),
                                              info("pb", "prefill", "beta")]))
    cluster.sync()
    ids = lambda nodes: sorted(n.id for n in nodes)  # noqa: E731
    assert ids(cluster.candidates("decode")) == ["a1", "a2", "b1"]
    assert ids(cluster.candidates("decode", model="alpha")) == ["a1", "a2"]
    assert ids(cluster.candidates("decode", model="alpha", num_tokens=64)) == ["a1", "a2"]
    assert ids(cluster.candidates("decode", model="alpha", num_tokens=65)) == ["a2"]  # 0: did not say
    assert ids(cluster.candidates("decode", model="beta", num_tokens=65)) == ["b1"]
    assert ids(cluster.candidates("prefill", model="alpha", num_tokens=33)) == []
    assert ids(cluster.candidates("decode", model="gamma")) == []
    old = NodeState(info=NodeInfo(node_id="old", role="decode", model="/models/alpha/"))  # a pre-name record
    assert old.serves("alpha") and not old.serves("models") and not old.serves("beta")


def test_served_models_and_their_validation() -> None:
    settings = RouterSettings(model="/m/llama-3", models=["/m/qwen2/", "small=/m/tiny", "/m/a=b"])
    assert settings.served_models() == [("llama-3", "/m/llama-3"), ("qwen2", "/m/qwen2/"), ("small", "/m/tiny"),
                                        ("a=b", "/m/a=b")]
    assert RouterSettings(model="/m/x", served_model_name="chat").served_models() == [("chat", "/m/x")]
    assert RouterSettings(models=["x=/m/x"]).served_models() == [("x", "/m/x")]
    with pytest.raises(ValueError, match="unique.*qwen2"):
        RouterSettings(model="/a/qwen2", models=["/b/qwen2"]).validate()
    for key, value in [("max_stop_strings", 65), ("max_stop_chars", 4097), ("max_stop_token_ids", -1),
                       ("max_body_bytes", 0), ("tokenizer_threads", 0), ("request_timeout", float("inf")),
                       ("stall_timeout", float("nan")), ("retry_after", float("inf")), ("keep_alive_timeout", 0)]:
        with pytest.raises(ValueError, match=key):
            RouterSettings(**{key: value}).validate()


def test_lora_requests_go_to_nodes_holding_the_adapter_else_to_ones_that_may_load_it() -> None:
    from pdcluster.router.lora import Adapter, lora_nodes

    holding = node("d1", loras=["sql"], max_loras=2)
    able = node("d2", max_loras=2)
    plain = node("d3")                                   # no enable_lora: never
    nodes = [holding, able, plain]
    assert lora_nodes(nodes, Adapter("sql", "m", "/adapters/sql")) == [holding]
    assert lora_nodes([able, plain], Adapter("sql", "m", "/adapters/sql")) == [able]   # it loads it on arrival
    assert lora_nodes([able, plain], Adapter("sql", "m", "")) == []                   # nowhere to load it from


def test_rebalance_moves_the_longest_stream_off_the_busiest_node() -> None:
    from pdcluster.router.decode_client import RequestStream, rebalance_pick

    busy, idle = node("d1", running=5, free_blocks=100), node("d2", running=1, free_blocks=100)

    def stream(node_id: str, max_tokens: int, done: int) -> RequestStream:
        s = RequestStream(None, [1, 2, 3], {"max_tokens": max_tokens}, deadline=1e18)  # type: ignore[arg-type]
        s._node_id, s.output_ids = node_id, [7] * done
        return s

    short, long, elsewhere = stream("d1", 100, 90), stream("d1", 500, 100), stream("d2", 900, 0)
    assert rebalance_pick([busy, idle], [short, long, elsewhere], threshold=2) is long
    assert rebalance_pick([busy, idle], [short, long, elsewhere], threshold=4) is None    # 5 - 1 is not > 4
    long.handed_back = True
    assert rebalance_pick([busy, idle], [short, long], threshold=2) is None    # short: 10 tokens left, not worth it
    assert rebalance_pick([busy], [stream("d1", 500, 0)], threshold=0) is None  # nowhere to go


class MoveClient:
    """What `RequestStream.move` / `precopied` use of a DecodeClient: the cluster's candidates, a policy, the
    dealers (recording what is sent), metrics, the pre-copies map, settings."""

    def __init__(self, nodes: list[NodeState], precopy: bool = True) -> None:
        from prometheus_client import CollectorRegistry

        from pdcluster.router.decode_client import DecodeClient
        from pdcluster.router.metrics import RouterMetrics
        from pdcluster.router.policies import make_policy
        from pdcluster.router.settings import RouterSettings

        self.cluster = RouterCluster(StaticNodeSource([n.info for n in nodes]))
        self.cluster.sync()
        for n in nodes:
            if n.load is not None:
                self.cluster.get(n.id).update(n.load)
        self.settings = RouterSettings(migration_precopy=precopy)
        self.policy = make_policy("least_loaded")
        self.metrics = RouterMetrics(CollectorRegistry())
        self.precopies: dict = {}
        self.queues: dict = {}
        self.streams: dict = {}
        self.sent: list[tuple[str, object]] = []
        self.place = DecodeClient.place.__get__(self)

        class Dealers:
            def send(_, node_id, addr, msg):
                self.sent.append((node_id, msg))
                return True

            def send_existing(_, node_id, msg):
                self.sent.append((node_id, msg))
                return True
        self.dealers = Dealers()


async def test_a_move_pre_copies_then_asks_for_the_stream_back_and_resumes_on_the_target() -> None:
    from pdcluster.control.protocol import Handback, PreCopied, PreCopy
    from pdcluster.router.decode_client import RequestStream

    def stream(client, fallback_node: str = "d1") -> RequestStream:
        s = RequestStream(client, list(range(40)), {"max_tokens": 100}, deadline=1e18)  # type: ignore[arg-type]
        s._node_id, s._rid, s._attempt, s.output_ids = fallback_node, f"{s.request_id}.1", 1, [7] * 9
        return s

    nodes = [node("d1", running=4, free_blocks=100, block_size=16), node("d2", running=0, free_blocks=100,
                                                                         block_size=16)]
    client = MoveClient(nodes)
    s = stream(client)
    s.move("rebalance", fallback=False)
    (target, pre), = client.sent
    assert target == "d2" and isinstance(pre, PreCopy) and pre.kv_source == "d1"
    assert pre.rid == f"{s.request_id}.2" and pre.token_ids == list(range(40)) + [7] * 9 and pre.num_blocks == 3
    s.move("rebalance", fallback=False)   # one move at a time
    assert len(client.sent) == 1 and client.precopies == {pre.rid: s}
    s.precopied(PreCopied(rid=pre.rid, num_blocks=3))
    assert client.sent[-1] == ("d1", Handback(rid=s._rid)) and not client.precopies
    # the node hands it back: the next attempt (the rid the target holds the blocks under) goes to the target
    s._move_away("d1", "rebalance")
    decode, prefill, _, source = client.place(s.prompt_ids + s.output_ids, 91, s._moved_from, None, True, None,
                                              s._kv_holder, s._move.target)
    assert decode.id == "d2" and prefill is None and source == ("d1", 3)

    # a failed pre-copy: a rebalanced stream stays; a draining node's is handed back all the same
    for fallback, handed_back in ((False, False), (True, True)):
        client.sent.clear()
        s = stream(client)
        s.move("drain" if fallback else "rebalance", fallback=fallback)
        s.precopied(PreCopied(rid=client.sent[0][1].rid, error="holder gone"))
        assert (client.sent[-1] == ("d1", Handback(rid=s._rid))) is handed_back and s._move is None
        assert not client.precopies
    # no target at all: nothing sent (a draining node asks again, then hands it back itself)
    client = MoveClient([node("d1", running=4, free_blocks=100)])
    s = stream(client)
    s.move("drain", fallback=True)
    assert client.sent == [] and s._move is None
    # migration_precopy off: straight to the hand-back
    client = MoveClient(nodes, precopy=False)
    s = stream(client)
    s.move("rebalance", fallback=False)
    assert client.sent == [("d1", Handback(rid=s._rid))]


async def test_a_pre_copy_is_given_up_when_its_target_leaves_or_it_times_out(monkeypatch) -> None:
    from pdcluster.control.protocol import PreCopy
    from pdcluster.router import decode_client
    from pdcluster.router.decode_client import RequestStream

    monkeypatch.setattr(decode_client, "PRECOPY_TIMEOUT_S", 0.05)
    client = MoveClient([node("d1", running=4, free_blocks=100), node("d2", free_blocks=100)])
    s = RequestStream(client, list(range(40)), {"max_tokens": 100}, deadline=1e18)  # type: ignore[arg-type]
    s._node_id, s._rid, s._attempt = "d1", f"{s.request_id}.1", 1
    s.move("drain", fallback=True)
    assert isinstance(client.sent[0][1], PreCopy)
    await asyncio.sleep(0.1)
    assert s._move is None and not client.precopies and client.sent[-1][0] == "d1"   # handed back without one
    assert client.metrics.pre_copies.labels("failed")._value.get() == 1


async def test_a_stream_whose_tokens_never_stop_still_sees_its_pre_copy_target_leave() -> None:
    """The node's tokens keep the mailbox full (the reader never waits, so the ticker never wakes it empty): the
    stream still checks its pre-copy's target each POLL_INTERVAL and gives the pre-copy up when it leaves."""
    from pdcluster.control.protocol import Handback, PreCopy, Tokens
    from pdcluster.router.decode_client import POLL_INTERVAL, Mailbox, RequestStream

    client = MoveClient([node("d1", running=4, free_blocks=100), node("d2", free_blocks=100)])
    s = RequestStream(client, list(range(40)), {"max_tokens": 100}, deadline=1e18)  # type: ignore[arg-type]
    s._node_id, s._rid, s._attempt = "d1", f"{s.request_id}.1", 1
    s._queue = mailbox = Mailbox()
    s.move("drain", fallback=True)
    assert isinstance(client.sent[0][1], PreCopy)
    client.cluster.source.remove("d2")
    client.cluster.sync()
    start = time.monotonic()
    while s._move is not None:
        assert time.monotonic() - start < 20 * POLL_INTERVAL, "the pre-copy's target left unnoticed"
        mailbox.put_nowait(Tokens(rid=s._rid, ids=[7]))
        assert isinstance(await s._wait(), Tokens)
        await asyncio.sleep(POLL_INTERVAL / 10)   # the next token is already there when the reader comes back
    assert client.metrics.pre_copies.labels("failed")._value.get() == 1
    assert client.sent[-1] == ("d1", Handback(rid=s._rid))   # a draining node's stream is handed back all the same


async def test_a_stream_whose_tokens_never_stop_still_ends_at_its_deadline() -> None:
    from pdcluster.control.protocol import Tokens
    from pdcluster.router.decode_client import POLL_INTERVAL, Mailbox, RequestStream, StreamFailed

    client = MoveClient([node("d1", running=1, free_blocks=100)])
    s = RequestStream(client, list(range(40)), {"max_tokens": 100},  # type: ignore[arg-type]
                      deadline=time.monotonic() + POLL_INTERVAL)
    s._node_id, s._rid, s._attempt = "d1", f"{s.request_id}.1", 1
    s._queue = mailbox = Mailbox()
    with pytest.raises(StreamFailed, match="deadline"):
        for _ in range(200):
            mailbox.put_nowait(Tokens(rid=s._rid, ids=[7]))
            await s._wait()
            await asyncio.sleep(POLL_INTERVAL / 10)
    assert s.finished and client.metrics.aborts.labels("deadline")._value.get() == 1


def test_the_tokenizer_pool_has_all_its_threads_from_the_start() -> None:
    """The router's tokenize pool (control/threads.started_pool, as the nodes' pools): its thread count never depends
    on the most concurrent load it saw, so an idle router's threads come back to their idle value (the soak test's
    check, which a pool growing on demand failed once: 13 threads before the load, 14 after)."""
    import threading
    from concurrent.futures import wait

    from pdcluster.control.threads import started_pool

    def named() -> int:
        return sum(t.name.startswith("pool-under-test") for t in threading.enumerate())

    pool = started_pool(4, "pool-under-test")
    try:
        assert named() == 4
        gate = threading.Event()
        futures = [pool.submit(gate.wait, 5.0) for _ in range(4)] + [pool.submit(sum, [1, 2]) for _ in range(50)]
        gate.set()
        wait(futures, timeout=10)
        assert named() == 4 and futures[-1].result() == 3
    finally:
        pool.shutdown(wait=True)
