"""A crashed node leaves nothing behind and `pdcluster up` restarts it. Its shared-memory KV pool leaves
/dev/shm with it, however it ends: exit hooks for what a process can catch, sweeps (next node start,
`pdcluster up`, `pdcluster cleanup`) for SIGKILL and OOM kills."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from pdcluster.cli.smoke import smoke_request
from pdcluster.cli.supervisor import LocalCluster, sweep_stale_work_dirs
from pdcluster.control.process import pid_alive
from pdcluster.kv_transfer import shm
from pdcluster.kv_transfer.shm import POOL_PREFIX, SHM_DIR, SharedKVPool, sweep_dead_pools

pytestmark = pytest.mark.slow   # real processes

SHAPE = (4, 2, 2, 16, 2, 8)
ROOT = Path(__file__).resolve().parent.parent
PDCLUSTER = Path(sys.executable).parent / "pdcluster"

# A child that creates a pool, prints its name, then ends the way argv[1] says.
CHILD = """
import os, signal, sys, time, torch
from pdcluster.kv_transfer.shm import SharedKVPool
how = sys.argv[1]
if how == "sigterm-handled":   # as a node does (run_service) before it builds anything
    signal.signal(signal.SIGTERM, lambda s, f: sys.exit(143))
pool = SharedKVPool.create((4, 2, 2, 16, 2, 8), torch.float32)
print(pool.name, flush=True)
if how == "raise":
    raise RuntimeError("boom")
if how == "exit":
    sys.exit(3)
time.sleep(60)
"""


def pool_files(pid: int | None = None) -> set[str]:
    prefix = POOL_PREFIX if pid is None else f"{POOL_PREFIX}{pid}-"
    return {n for n in os.listdir(SHM_DIR) if n.startswith(prefix)}


def start_child(how: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-c", CHILD, how], stdout=subprocess.PIPE, text=True)
    name = proc.stdout.readline().strip()
    assert name.startswith(POOL_PREFIX), name
    return proc, name


@pytest.mark.parametrize("how", ["raise", "exit"])
def test_pool_is_unlinked_when_its_process_exits_through_python(how):
    proc, name = start_child(how)
    assert proc.wait(30) != 0
    assert not pool_files(proc.pid), f"{name} left behind after '{how}'"


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_pool_is_unlinked_on_signals_a_process_can_catch(sig):
    proc, name = start_child("sigterm-handled")
    assert (Path(SHM_DIR) / name).exists()
    proc.send_signal(sig)
    proc.wait(30)
    assert not pool_files(proc.pid)


def test_sigkilled_creator_is_swept_even_before_it_is_reaped_and_live_pools_stay():
    mine = SharedKVPool.create(SHAPE, torch.float32)
    try:
        proc, name = start_child("sleep")
        proc.kill()
        time.sleep(0.2)   # killed but not reaped: a zombie still answers kill(pid, 0)
        assert (Path(SHM_DIR) / name).exists() and (Path(SHM_DIR) / (name + ".tags")).exists()
        removed = sweep_dead_pools()
        assert name in removed and not pool_files(proc.pid)
        assert mine.name not in removed and (Path(SHM_DIR) / mine.name).exists()
        proc.wait(10)
    finally:
        mine.close()


def test_a_recycled_pid_does_not_protect_a_dead_pool(tmp_path, monkeypatch):
    # A pool file named after a live process (this one) that does not map it: its creator is gone and the
    # pid now belongs to someone else. Young files are spared (their creator may be mapping them now).
    fake = f"{POOL_PREFIX}{os.getpid()}-deadbeef"
    for file in (fake, fake + ".tags"):
        (tmp_path / file).write_bytes(b"\0" * 64)
    assert sweep_dead_pools(str(tmp_path)) == []
    old = time.time() - 2 * shm.YOUNG_S
    for file in (fake, fake + ".tags"):
        os.utime(tmp_path / file, (old, old))
    assert sweep_dead_pools(str(tmp_path)) == [fake]
    assert list(tmp_path.iterdir()) == []


def test_cleanup_command_removes_dead_pools_only():
    mine = SharedKVPool.create(SHAPE, torch.float32)
    try:
        proc, name = start_child("sleep")
        proc.kill()
        proc.wait(10)
        out = subprocess.run([str(PDCLUSTER), "cleanup"], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        assert name in out.stdout and not pool_files(proc.pid)
        assert (Path(SHM_DIR) / mine.name).exists()
    finally:
        mine.close()


def test_a_pool_larger_than_dev_shm_is_refused_with_the_numbers():
    free = os.statvfs(SHM_DIR).f_bavail * os.statvfs(SHM_DIR).f_frsize
    with pytest.raises(ValueError, match=r"does not fit: /dev/shm has [0-9.]+ GiB free.*--kv-cache-memory"):
        shm.check_room(free + (1 << 30))


def test_kv_cache_memory_beyond_available_ram_fails_at_start(tiny_llama):
    from pdcluster.engine.args import EngineArgs
    from pdcluster.engine.device import available_memory_bytes
    from pdcluster.engine.llm_engine import LLMEngine

    too_much = available_memory_bytes() + (8 << 30)
    with pytest.raises(ValueError, match=r"kv_cache_memory: .* GiB asked .* GiB of memory available"):
        LLMEngine(EngineArgs(model=tiny_llama, kv_cache_memory=too_much))


def test_default_cpu_pools_share_the_available_memory():
    from pdcluster.engine.device import CPU_KV_CACHE_CAP, available_memory_bytes, default_cpu_kv_cache_bytes

    one, three = default_cpu_kv_cache_bytes(0.9), default_cpu_kv_cache_bytes(0.9, 3)
    assert one <= min(CPU_KV_CACHE_CAP, available_memory_bytes() * 0.9 / 2)
    assert 3 * three <= available_memory_bytes() * 0.9 / 2 + 3


def test_local_cluster_splits_memory_among_its_nodes_and_refuses_pools_that_do_not_fit(tmp_path, tiny_llama):
    from pdcluster.cli.sizing import size_node_memory
    from pdcluster.engine.device import available_memory_bytes

    shared: dict = {}
    size_node_memory(shared, 3)
    assert 3 * shared["kv_cache_memory"] <= available_memory_bytes() // 2
    too_big = LocalCluster(model=tiny_llama, num_prefill=1, num_decode=2, port=0, work_dir=tmp_path,
                           node_config={"kv_cache_memory": available_memory_bytes() // 2})
    with pytest.raises(ValueError, match=r"3 nodes x .* GiB of KV pools, but this host has .* GiB available"):
        too_big.start()
    assert too_big.services == [] and too_big.etcd_server is None


@pytest.mark.cluster
@pytest.mark.timeout(240)
def test_sigkilled_nodes_leave_no_pool_once_a_node_restarts_or_the_cluster_stops(tmp_path, tiny_llama):
    cluster = LocalCluster(model=tiny_llama, num_prefill=1, num_decode=1, port=0, work_dir=tmp_path, threads_per_node=1,
                           node_config={"kv_cache_memory": "8MiB", "max_num_seqs": 8, "device": "cpu"})
    with cluster:
        decode, prefill = cluster.service("decode-0"), cluster.service("prefill-0")
        assert pool_files(decode.proc.pid), "the decode node keeps its KV pool in /dev/shm"
        for s in (decode, prefill):
            s.proc.kill()
            s.proc.wait(10)
            cluster.services.remove(s)   # gone for good: readiness checks look at the live ones
        assert pool_files(decode.proc.pid), "a SIGKILLed node cannot remove its own pool"
        restarted = cluster.start_node("decode", "decode-1")   # its start-up sweeps the dead pool
        cluster.wait_ready(0, 1, timeout=120, nodes={"decode-1"})
        assert not pool_files(decode.proc.pid) and not pool_files(prefill.proc.pid)
        assert pool_files(restarted.proc.pid)
        restarted.proc.kill()
        restarted.proc.wait(10)
    assert not pool_files(restarted.proc.pid), "LocalCluster.stop sweeps the pools of children that died"


@pytest.mark.cluster
@pytest.mark.timeout(240)
@pytest.mark.parametrize("when", ["serving", "starting"])
def test_sigint_to_the_process_group_of_pdcluster_up_leaves_nothing_in_dev_shm(when, tiny_llama):
    before = pool_files()
    # Large pools when starting: creating one (page population, zeroing) takes long enough for the signal to
    # land in the middle of it.
    pool = "1GiB" if when == "starting" else "64MiB"
    proc = subprocess.Popen([str(PDCLUSTER), "up", "--model", tiny_llama, "--port", "0", "--decode", "2",
                             "--kv-cache-memory", pool],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        if when == "serving":
            lines = []
            while not lines or lines[-1] and "Ctrl-C to stop" not in lines[-1]:
                lines.append(proc.stdout.readline())
            assert "Ctrl-C to stop" in lines[-1], "".join(lines)
            assert len(pool_files() - before) == 4, "two decode nodes, a pool and its tags file each"
        else:   # as soon as a decode node has made its pool, while the nodes are still starting up
            deadline = time.monotonic() + 180
            while not pool_files() - before and time.monotonic() < deadline:
                time.sleep(0.01)
            assert pool_files() - before
        os.killpg(proc.pid, signal.SIGINT)   # what a terminal's Ctrl-C does: every process of the group
        code = proc.wait(120)
        assert code == 0 or when == "starting"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    assert pool_files() - before == set()


def child_pids(parent: int) -> set[int]:
    found = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == parent:
                        found.add(int(entry))
            except (OSError, IndexError, ValueError):
                pass
    return found


@pytest.mark.cluster
@pytest.mark.timeout(240)
def test_a_sigkilled_pdcluster_up_takes_its_children_and_the_next_run_removes_its_work_dir(tmp_path, tiny_llama):
    before = pool_files()
    proc = subprocess.Popen([str(PDCLUSTER), "up", "--model", tiny_llama, "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True, env={**os.environ, "TMPDIR": str(tmp_path)})
    children: set[int] = set()
    try:
        lines = []
        while not lines or lines[-1] and "Ctrl-C to stop" not in lines[-1]:
            lines.append(proc.stdout.readline())
        assert "Ctrl-C to stop" in lines[-1], "".join(lines)
        children = child_pids(proc.pid)
        assert len(children) == 4, "etcd, router, prefill and decode node"
        (work_dir,) = tmp_path.glob("pdcluster-up-*")
        proc.kill()   # no chance to stop anything itself
        proc.wait(10)
        deadline = time.monotonic() + 120
        while any(pid_alive(pid) for pid in children) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(pid_alive(pid) for pid in children), "children outlived pdcluster up"
        assert pool_files() - before == set()
        assert work_dir.exists()
        assert sweep_stale_work_dirs(str(tmp_path)) == [work_dir] and not work_dir.exists()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        for pid in children:   # orphans, had the test failed
            if pid_alive(pid):
                os.kill(pid, signal.SIGTERM)


@pytest.mark.cluster
@pytest.mark.timeout(240)
def test_local_cluster_restarts_a_node_that_dies_while_the_others_keep_serving(tmp_path, monkeypatch, tiny_llama):
    from pdcluster.cli import supervisor

    monkeypatch.setattr(supervisor, "RESTART_BACKOFF", (0.5,))
    cluster = LocalCluster(model=tiny_llama, num_prefill=1, num_decode=2, port=0, work_dir=tmp_path, threads_per_node=1,
                           node_config={"kv_cache_memory": "8MiB", "max_num_seqs": 8, "device": "cpu"})
    with cluster:
        victim, other = cluster.service("decode-0"), cluster.service("decode-1")
        old_pid, other_pid = victim.proc.pid, other.proc.pid
        victim.proc.kill()
        victim.proc.wait(10)
        events: list[str] = []
        deadline = time.monotonic() + 30
        while victim.proc.pid == old_pid and time.monotonic() < deadline:
            events += cluster.supervise()
            time.sleep(0.1)
        assert victim.proc.pid != old_pid and victim.alive, events
        assert any("decode-0 exited" in e for e in events) and any("decode-0 restarted" in e for e in events)
        assert not pool_files(old_pid), "the dead node's pool was swept before the restart"
        health = cluster.wait_ready(1, 2, timeout=120, nodes={"decode-0", "decode-1", "prefill-0"})
        assert {"decode-0", "decode-1"} <= set(health["decode_nodes"])
        assert other.proc.pid == other_pid and other.alive   # untouched
        assert smoke_request(cluster.url, os.path.basename(tiny_llama))["choices"][0]["finish_reason"] == "length"
