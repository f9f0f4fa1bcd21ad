"""A node id is claimed in etcd (create only if absent): a second holder is refused with the holder named;
the id frees up when the old lease expires, or at once when the old holder is provably gone."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import textwrap

import pytest

from pdcluster.control.etcd_client import close_quietly, connect
from pdcluster.control.records import NodeInfo
from pdcluster.control.registration import Holder, NodeIdTaken, Registration, id_key

pytestmark = pytest.mark.slow  # real etcd and processes

TTL = 2
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

HOLDER = textwrap.dedent("""
    import asyncio, sys
    from pdcluster.control.records import NodeInfo
    from pdcluster.control.registration import Registration
    async def main():
        reg = Registration([sys.argv[1]], sys.argv[2], NodeInfo("n1", "decode"), ttl=60)
        try:
            assert await reg.start(wait=20)
            print("registered", flush=True)
            await asyncio.sleep(600)
        except Exception as exc:
            print(f"refused: {exc}", flush=True)
            sys.exit(2)
    asyncio.run(main())
""")


async def _spawn(etcd, cluster) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(sys.executable, "-c", HOLDER, etcd.endpoint, cluster,
                                                stdout=asyncio.subprocess.PIPE, cwd=ROOT)


async def test_second_process_with_same_id_is_refused_naming_the_holder(etcd, cluster):
    first = Registration([etcd.endpoint], cluster, NodeInfo("n1", "decode"), ttl=TTL)
    try:
        assert await first.start(wait=5)
        proc = await _spawn(etcd, cluster)
        out = (await asyncio.wait_for(proc.stdout.read(), 30)).decode()
        assert await asyncio.wait_for(proc.wait(), 10) == 2
        assert "refused" in out and f"pid {os.getpid()}" in out and first.holder.hostname in out, out
        # the refused process left the holder's record alone
        client = await connect([etcd.endpoint])
        try:
            kv = await client.get(first.key.encode())
            assert kv is not None and kv.lease == first.lease_id
        finally:
            await close_quietly(client)
        # a role change does not get around the claim either
        other = Registration([etcd.endpoint], cluster, NodeInfo("n1", "prefill"), ttl=TTL)
        with pytest.raises(NodeIdTaken):
            await other.start(wait=5)
        await other.deregister()
    finally:
        await first.deregister()


async def test_crashed_holder_on_another_host_frees_the_id_when_its_lease_expires(etcd, cluster):
    elsewhere = Holder(role="decode", hostname="other-host", boot_id="another-boot", pid=4242)
    crashed = Registration([etcd.endpoint], cluster, NodeInfo("n2", "decode"), ttl=TTL, holder=elsewhere)
    assert await crashed.start(wait=5)
    await crashed._stop_task()  # a crash: no revoke, the lease just stops being refreshed
    restarted = Registration([etcd.endpoint], cluster, NodeInfo("n2", "decode"), ttl=TTL)
    try:
        with pytest.raises(NodeIdTaken, match="other-host.*pid 4242"):
            await restarted.start(wait=5)
        # Like a supervisor restarting the refused process: retry until the old lease expired (TTL plus
        # etcd's expiry granularity), then the id is free again.
        deadline = asyncio.get_running_loop().time() + TTL + 6
        while True:
            again = Registration([etcd.endpoint], cluster, NodeInfo("n2", "decode"), ttl=TTL)
            try:
                assert await again.start(wait=5)
                break
            except NodeIdTaken:
                await again.deregister()
                assert asyncio.get_running_loop().time() < deadline, "the crashed holder's claim never expired"
                await asyncio.sleep(0.5)
        await again.deregister()
    finally:
        await restarted.deregister()
        await close_quietly(crashed._client)


async def test_restart_on_the_same_host_reclaims_at_once_when_the_holder_is_dead(etcd, cluster):
    proc = await _spawn(etcd, cluster)
    try:
        assert (await asyncio.wait_for(proc.stdout.readline(), 30)).strip() == b"registered"
        proc.send_signal(signal.SIGKILL)
        await asyncio.wait_for(proc.wait(), 10)
        # its 60 s lease is still alive, but its pid is dead on this very boot: the claim is taken over at once
        reg = Registration([etcd.endpoint], cluster, NodeInfo("n1", "decode"), ttl=TTL)
        try:
            assert await reg.start(wait=5)
            client = await connect([etcd.endpoint])
            try:
                kv = await client.get(id_key(cluster, "n1").encode())
                assert Holder.from_json(kv.value).pid == os.getpid() and kv.lease == reg.lease_id
            finally:
                await close_quietly(client)
        finally:
            await reg.deregister()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
