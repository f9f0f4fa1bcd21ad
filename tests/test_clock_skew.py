"""Hosts' wall clocks differ: nothing that crosses a host may compare them. The decode node's clock runs 60 s
ahead of the router's and the prefill node's 60 s ahead of the decode node's (an injected offset on
`time.time()` in those processes, see SKEW; only forward: grpc turns a timeout into a deadline with
`time.time()` and hands it to its C core's real clock, so an injected backward offset would expire every etcd
call, which a really skewed host does not). With wall-clock deadlines on the wire the decode node would abort
every Generate (request_timeout 30 s "passed" a minute ago) and the prefill node would refuse every KV
destination (prefill_timeout 15 s); with durations every request is prefilled remotely and completes.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from cluster_helpers import bounded, client, complete, node_metrics, total, wait_idle

from pdcluster.cli.supervisor import LocalCluster
from pdcluster.control.etcd_client import close_quietly, connect
from pdcluster.control.queries import list_nodes

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(240)]

MODEL_NAME = "tiny-llama"
# Loaded first by the interpreter (PYTHONPATH): shifts this process's wall clock; the monotonic one is untouched.
SKEW = '''
import os, time
_offset = float(os.environ.get("PDCLUSTER_TEST_CLOCK_OFFSET", "0"))
if _offset:
    _real = time.time
    time.time = lambda: _real() + _offset
    time.time_ns = lambda: int((_real() + _offset) * 1e9)
'''


class SkewedCluster(LocalCluster):
    """LocalCluster whose services run with a wall-clock offset each (node id → seconds)."""

    offsets: dict[str, float] = {}
    site_dir: Path | None = None

    def _launch(self, kind: str, config_path: Path, log_path: Path) -> subprocess.Popen:
        saved = dict(os.environ)
        try:
            os.environ["PDCLUSTER_TEST_CLOCK_OFFSET"] = str(self.offsets.get(config_path.stem, 0.0))
            os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(self.site_dir), saved.get("PYTHONPATH")) if p)
            return super()._launch(kind, config_path, log_path)
        finally:
            os.environ.clear()
            os.environ.update(saved)


@pytest.fixture(scope="module")
def skewed(tmp_path_factory):
    from pdcluster.engine.testing import make_tiny_model

    root = tmp_path_factory.mktemp("skew")
    site = root / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SKEW)
    model = make_tiny_model(str(root / MODEL_NAME), "llama")
    c = SkewedCluster(model=model, work_dir=root / "cluster", num_prefill=1, num_decode=1, port=0,
                      cluster="skew", lease_ttl=2, threads_per_node=1,
                      node_config={"kv_cache_memory": "8MiB", "device": "cpu", "prefill_timeout": 15.0},
                      router_config={"disagg_min_tokens": 0, "request_timeout": 30.0})
    c.work_dir.mkdir()
    c.site_dir = site
    c.offsets = {"router-0": 0.0, "decode-0": 60.0, "prefill-0": 120.0}
    with c:
        yield c


async def test_disaggregation_works_with_skewed_clocks(skewed):
    etcd = await connect([skewed.etcd])
    try:  # the offset really reached the processes: their records' started_at (wall clock) differ by a minute
        started = {n.node_id: n.started_at for n in await list_nodes(etcd, skewed.cluster)}
    finally:
        await close_quietly(etcd)
    assert started["prefill-0"] - started["decode-0"] > 50, started
    api = client(skewed)
    prompts = ["Hello world! How are you today?", "Once upon a time there was a cluster of machines"]
    outs = await bounded([complete(api, MODEL_NAME, p, max_tokens=6) for p in prompts], timeout=120)
    assert [o.finish for o in outs] == ["length", "length"] and all(o.usage == 6 for o in outs), outs
    wait_idle(skewed)
    decode = node_metrics(skewed, "decode")
    assert total(decode, 'pdcluster_node_prefills_total{path="remote"}') == len(prompts), decode
    assert total(decode, "pdcluster_node_remote_prefill_failures_total{") == 0
    assert total(decode, 'pdcluster_node_prefills_total{path="local"}') == 0
