"""Placement on one host: CPU lists, how `pdcluster up` shares the host's cores among its nodes, the router
and etcd, and what a node process does with its `cpu_cores` (docs/cluster.md "Placement on one host")."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from pdcluster.cli.config import load_config
from pdcluster.cli.sizing import share_host_cores
from pdcluster.cli.supervisor import LocalCluster
from pdcluster.control.cpus import format_cpus, on_cpus, parse_cpus, share_cpus

HOST = sorted(os.sched_getaffinity(0))


# ---- CPU lists

def test_cpu_lists_read_as_taskset_writes_them():
    assert parse_cpus("0-3,8") == [0, 1, 2, 3, 8]
    assert parse_cpus(" 5, 1-2 ,2") == [1, 2, 5]
    assert parse_cpus("") == [] and parse_cpus("7") == [7]
    for bad in ("a", "3-1", "1,,2", "-1", "0-", "1.5", "0-3;8"):
        with pytest.raises(ValueError):
            parse_cpus(bad)
    assert format_cpus([8, 0, 1, 2, 3]) == "0-3,8" and format_cpus([]) == "" and format_cpus([4, 6]) == "4,6"


@given(st.sets(st.integers(0, 300)))
def test_a_formatted_cpu_list_reads_back_the_same(cpus):
    text = format_cpus(sorted(cpus))
    assert parse_cpus(text) == sorted(cpus)
    assert "--" not in text and not any(part.count("-") > 1 for part in text.split(","))


@given(st.lists(st.integers(0, 200), unique=True, max_size=80).map(sorted),
       st.lists(st.integers(1, 8), min_size=1, max_size=10))
def test_shared_cpus_are_contiguous_disjoint_slices_in_proportion(cpus, weights):
    slices = share_cpus(cpus, weights)
    assert len(slices) == len(weights)
    if not cpus:
        assert slices == [[] for _ in weights]
    elif len(cpus) < len(weights):   # one core each, every core shared by as few as can be
        assert all(len(s) == 1 for s in slices)
        uses = [sum(s == [c] for s in slices) for c in cpus]
        assert max(uses) - min(uses) <= 1
    else:
        assert [c for s in slices for c in s] == cpus   # in order, disjoint, every core used
        assert all(len(s) >= 1 for s in slices)
        if len(cpus) >= sum(weights):
            assert all(len(s) >= w for s, w in zip(slices, weights, strict=True))
        # More weight never fewer cores; equal weights within one core of each other.
        for s, w in zip(slices, weights, strict=True):
            assert all(len(s) >= len(t) for t, v in zip(slices, weights, strict=True) if v < w)
            assert all(abs(len(s) - len(t)) <= 1 for t, v in zip(slices, weights, strict=True) if v == w)


# ---- pdcluster up's split of the host

@pytest.mark.parametrize("cores, ranks, router, nodes", [
    ([0, 1], [1], [], [[0, 1]]),                                     # one node takes both
    ([0, 1], [1, 1], [], [[0], [1]]),                                # 1P1D on 2 cores: one each, router shares
    ([0, 1, 2], [1, 1], [], [[0, 1], [2]]),                          # one spare core is not enough to keep
    ([0, 1, 2, 3], [1, 1], [0], [[1, 2], [3]]),                      # two spare: one for router + etcd
    (list(range(16)), [1, 1], [0, 1], [list(range(2, 9)), list(range(9, 16))]),
    (list(range(64)), [1, 1, 1], [0, 1], [list(range(2, 23)), list(range(23, 44)), list(range(44, 64))]),
    (list(range(8)), [2, 2], [0], [[1, 2, 3, 4], [5, 6, 7]]),        # TP 2: at least two cores a node
    (list(range(6)), [2, 1], [0], [[1, 2, 3], [4, 5]]),              # weighted by tensor_parallel_size
    (list(range(16)), [8, 8], [], [list(range(8)), list(range(8, 16))]),   # no core to spare
    ([0, 1, 2, 3], [4, 4], [], [[0, 1], [2, 3]]),                    # fewer cores than ranks: a warning
    ([0, 1], [1, 1, 1], [], [[0], [1], [0]]),                        # fewer cores than nodes: as little sharing
    ([2, 3, 6, 7, 8], [1, 1], [2], [[3, 6], [7, 8]]),                # taskset-confined: only those cores
])
def test_pdcluster_up_shares_the_hosts_cores(cores, ranks, router, nodes, caplog):
    assert share_host_cores(cores, ranks) == (router, nodes)
    assert ("ranks share cores" in caplog.text) == (len(cores) < sum(ranks))


@pytest.mark.parametrize("cores, ranks, prefill_nodes, router, nodes", [
    ([0, 1], [1, 1], 1, [1], [[0], [1]]),                 # 1P1D on 2 cores: router + etcd with the decode node
    ([0, 1, 2], [1, 1], 1, [2], [[0, 1], [2]]),
    ([0, 1, 2], [1, 1, 1], 1, [1, 2], [[0], [1], [2]]),   # 1P2D: both decode nodes' cores
    ([0, 1], [1, 1, 1], 1, [1], [[0], [1], [0]]),         # decode-1 wraps onto the prefill core: not that one
    ([0, 1], [1, 1, 1], 2, [], [[0], [1], [0]]),          # every decode core also prefills: any core
    ([0, 1], [1], 1, [], [[0, 1]]),                       # prefill nodes only
    ([0, 1, 2, 3], [1, 1], 1, [0], [[1, 2], [3]]),        # a core to spare: theirs, as without prefill nodes
])
def test_without_a_spare_core_the_router_shares_the_decode_nodes_cores(cores, ranks, prefill_nodes, router, nodes):
    assert share_host_cores(cores, ranks, prefill_nodes) == (router, nodes)


def _cluster(tmp_path, **kw) -> LocalCluster:
    """A LocalCluster whose children are never started: start_node writes each node's config only."""
    cluster = LocalCluster(model="/m", etcd="127.0.0.1:2379", work_dir=tmp_path, **kw)
    cluster._launch = lambda kind, config_path, log_path: subprocess.Popen(["true"])
    return cluster


def _node_cores(cluster: LocalCluster, tmp_path) -> list[str | None]:
    for i in range(cluster.num_prefill):
        cluster.start_node("prefill", f"prefill-{i}")
    for i in range(cluster.num_decode):
        cluster.start_node("decode", f"decode-{i}")
    return [yaml.safe_load((tmp_path / f"{s.node_id}.yaml").read_text()).get("cpu_cores") for s in cluster.services]


def test_local_cluster_gives_each_node_its_share_unless_the_user_placed_them(tmp_path):
    (tmp_path / "split").mkdir()
    cluster = _cluster(tmp_path / "split", num_prefill=1, num_decode=2)
    router, nodes = share_host_cores(HOST, [1, 1, 1], 1)
    assert cluster.core_plan() == (router, nodes)
    assert _node_cores(cluster, tmp_path / "split") == [format_cpus(c) for c in nodes]
    # A node started later shares the cores of the node its index wraps to; one given cores keeps them.
    cluster.start_node("decode", "decode-9")
    cluster.start_node("decode", "decode-8", cpu_cores="0")
    later = [yaml.safe_load((tmp_path / "split" / f"decode-{i}.yaml").read_text())["cpu_cores"] for i in (9, 8)]
    assert later == [format_cpus(nodes[0]), "0"]
    # tensor_parallel_size weighs the shares.
    assert _cluster(tmp_path, node_config={"tensor_parallel_size": 2}).core_plan() == share_host_cores(HOST, [2, 2], 1)
    # threads_per_node or cpu_cores given: nothing is split, the router and etcd are not pinned.
    for i, (kw, want) in enumerate([({"threads_per_node": 1}, None), ({"node_config": {"cpu_cores": "0"}}, "0")]):
        (tmp_path / str(i)).mkdir()
        cluster = _cluster(tmp_path / str(i), **kw)
        assert cluster.core_plan() == ([], [])
        assert _node_cores(cluster, tmp_path / str(i)) == [want, want]


def test_processes_started_on_cpus_inherit_them_and_the_thread_gets_its_own_back():
    before = os.sched_getaffinity(0)
    with on_cpus([HOST[-1]]):
        out = subprocess.run([sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"],
                             capture_output=True, text=True, check=True).stdout
    assert json.loads(out) == [HOST[-1]]
    assert os.sched_getaffinity(0) == before
    with on_cpus([]):
        assert os.sched_getaffinity(0) == before


# ---- a node process on its cpu_cores

def test_cpu_cores_are_validated_like_the_other_knobs():
    assert load_config("decode", overrides={"model": "/m", "cpu_cores": format_cpus(HOST)}, env={}).cpu_cores
    for bad, why in [("a-b", "not a CPU list"), (str(max(HOST) + 1), "not within the CPUs")]:
        with pytest.raises(ValueError, match=f"cpu_cores: .*{why}"):
            load_config("decode", overrides={"model": "/m", "cpu_cores": bad}, env={})


PROBE = textwrap.dedent("""
    import json, os, sys, threading
    from pdcluster.cli.config import load_config
    from pdcluster.node.config import use_cpu_cores

    cfg = load_config("decode", overrides={"model": "/m", "cpu_cores": sys.argv[1],
                                           "tensor_parallel_size": int(sys.argv[2])}, env={})
    use_cpu_cores(cfg)
    import torch

    def work():   # the engine thread: its parallel regions start OpenMP's threads
        a = torch.randn(256, 256)
        for _ in range(10):
            a @ a
        masks = {tid: sorted(os.sched_getaffinity(int(tid))) for tid in os.listdir("/proc/self/task")}
        out.update(masks=masks, engine=sorted(os.sched_getaffinity(0)))

    out = {}
    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    out.update(process=sorted(os.sched_getaffinity(0)), threads=torch.get_num_threads(),
               places=os.environ.get("OMP_PLACES"))
    print(json.dumps(out))
""")


def _probe(cores: str, tp: int = 1) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "GOMP_", "PDCLUSTER_"))}
    done = subprocess.run([sys.executable, "-c", PROBE, cores, str(tp)], capture_output=True, text=True,
                          timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_a_node_on_its_cores_runs_one_torch_thread_per_core_each_bound_to_one():
    got = _probe(format_cpus(HOST))
    assert got["process"] == HOST and got["threads"] == len(HOST)
    assert got["places"] is None   # read by OpenMP as it loaded; children do not inherit it
    if len(HOST) > 1:   # the engine thread on the first core, one OpenMP thread on each of the others
        assert got["engine"] == [HOST[0]]
        assert {tuple(m) for m in got["masks"].values()} >= {(c,) for c in HOST}
    one = _probe(str(HOST[-1]))
    assert (one["process"], one["threads"]) == ([HOST[-1]], 1)
    assert all(m == [HOST[-1]] for m in one["masks"].values())


def test_tensor_parallel_nodes_leave_omp_binding_to_the_ranks_split(tiny_llama, make_engine):
    got = _probe(format_cpus(HOST), tp=2)
    assert got["process"] == HOST and got["places"] is None
    if len(HOST) < 2:
        pytest.skip("one core: nothing to split between two ranks")
    engine = make_engine(tiny_llama, tensor_parallel_size=2, device="cpu")
    rank1 = engine.runner.workers.procs[0].pid
    assert sorted(os.sched_getaffinity(rank1)) == share_cpus(HOST, [1, 1])[1]


@pytest.mark.slow
def test_pdcluster_up_runs_each_node_on_its_own_cores(tiny_llama, tmp_path):
    """...and a prefill node on one core pushes each prompt's KV once it is done (nothing to overlap there), on more
    cores layer by layer; the prompt is served either way, as the offline engine serves it."""
    import asyncio

    from cluster_helpers import client, complete, node_metrics, total
    from transformers import AutoTokenizer

    from pdcluster.engine import LLM
    from pdcluster.engine import SamplingParams as Params

    prompt = [(7 * j) % 300 + 3 for j in range(40)]
    llm = LLM(model=tiny_llama, dtype="float32", device="cpu", num_gpu_blocks_override=64)
    expected = list(llm.generate([prompt], Params(temperature=0, max_tokens=8, ignore_eos=True))[0].outputs[0]
                    .token_ids)
    del llm
    with LocalCluster(model=tiny_llama, num_prefill=1, num_decode=1, port=0, work_dir=tmp_path, lease_ttl=2,
                      node_config={"kv_cache_memory": "8MiB", "device": "cpu", "dtype": "float32"},
                      router_config={"disagg_min_tokens": 0}) as cluster:
        router, nodes = share_host_cores(HOST, [1, 1], 1)
        services = {s.kind: s for s in cluster.services}
        for kind, cores in zip(("prefill", "decode"), nodes, strict=True):
            pid = services[kind].proc.pid
            assert sorted(os.sched_getaffinity(pid)) == cores, kind
            with open(f"/proc/{pid}/status") as f:
                assert f"Cpus_allowed_list:\t{format_cpus(cores)}\n" in f.read()
            assert f"cpu_cores {format_cpus(cores)}: {len(cores)} torch threads" in services[kind].log_tail(200)
        assert sorted(os.sched_getaffinity(services["router"].proc.pid)) == (router or HOST)
        assert cluster.etcd_server is None or sorted(os.sched_getaffinity(cluster.etcd_server._proc.pid)) == (
            router or HOST)
        push = "once each prompt is done" if len(nodes[0]) == 1 else "layer by layer"
        assert f"KV pushed {push}" in services["prefill"].log_tail(200)
        out = asyncio.run(complete(client(cluster), os.path.basename(tiny_llama), prompt, 8))
        assert out.finish == "length" and out.text == AutoTokenizer.from_pretrained(tiny_llama).decode(
            expected, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        assert total(node_metrics(cluster, "decode"), 'pdcluster_node_prefills_total{path="remote"}') == 1
