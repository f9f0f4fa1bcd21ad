"""NPUMonitor: device figures per backend (NPU and CUDA under emulators written from their documented APIs,
CPU for real), engine figures of LLM / AsyncLLMEngine / a node's /metrics, and the tokens/s spread analysis
(on fed samples, and on samples measured while an engine preempts or runs an underfilled batch)."""

from __future__ import annotations

import asyncio
import json
import os
import stat
import subprocess
import sys
import types
from pathlib import Path

import pytest

from pdcluster import LLM, AsyncLLMEngine, SamplingParams
from pdcluster.control.metrics import new_registry, serve_metrics
from pdcluster.engine.stats import EngineStats
from pdcluster.monitor import KEYS, DeviceReader, DeviceUsageCollector, NPUMonitor, analyze
from pdcluster.node.service import EngineStatsCollector

# `npu-smi info -t usages -i 0` as the Ascend docs print it (Atlas A2: HBM; the line set varies by driver).
NPU_SMI_USAGES = """\
        Memory Capacity(MB)            : 15034
        Memory Usage Rate(%)           : 6
        Hugepages Total(page)          : 0
        Hugepages Usage Rate(%)        : 0
        HBM Capacity(MB)               : 65536
        HBM Usage Rate(%)              : 25
        Aicore Usage Rate(%)           : 37
        Aivector Usage Rate(%)         : 0
        Aicpu Usage Rate(%)            : 0
        Ctrlcpu Usage Rate(%)          : 3
        HBM Bandwidth Usage Rate(%)    : 12
"""


def fake_npu_smi(tmp_path: Path, monkeypatch, text: str = NPU_SMI_USAGES) -> Path:
    """An `npu-smi` on PATH that prints `text` for `info -t usages -i N` and logs its arguments."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (tmp_path / "usages.txt").write_text(text)
    script = bin_dir / "npu-smi"
    script.write_text(f"#!/bin/sh\necho \"$@\" >> {tmp_path}/calls\n"
                      f"[ \"$1 $2 $3\" = \"info -t usages\" ] && exec cat {tmp_path}/usages.txt\nexit 3\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return tmp_path / "calls"


def fake_torch_npu(monkeypatch, utilization=None, mem=None):
    """A torch_npu whose `npu.utilization(device)` / `npu.mem_get_info(device)` answer as documented (a
    percent; (free, total) bytes), or raise when not given."""
    def missing(*_):
        raise RuntimeError("not supported by this driver")

    npu = types.SimpleNamespace(utilization=utilization or missing, mem_get_info=mem or missing)
    monkeypatch.setitem(sys.modules, "torch_npu", types.SimpleNamespace(npu=npu))


# ---------------------------------------------------------------------------------------------- devices

def test_npu_reads_torch_npu(monkeypatch, tmp_path):
    calls = fake_npu_smi(tmp_path, monkeypatch)
    fake_torch_npu(monkeypatch, utilization=lambda d: 71 if d == 1 else 0,
                   mem=lambda d: (24 << 30, 64 << 30) if d == 1 else (0, 0))
    d = DeviceReader("npu", 1).read()
    assert (d["device_kind"], d["device_index"], d["device_source"]) == ("npu", 1, "torch_npu")
    assert d["device_utilization_pct"] == 71.0
    assert (d["device_memory_used_bytes"], d["device_memory_total_bytes"]) == (40 << 30, 64 << 30)
    assert not calls.exists(), "npu-smi run although torch_npu answered"


def test_npu_falls_back_to_npu_smi_per_figure(monkeypatch, tmp_path):
    calls = fake_npu_smi(tmp_path, monkeypatch)
    fake_torch_npu(monkeypatch, mem=lambda d: (48 << 30, 64 << 30))   # utilization() raises
    d = DeviceReader("npu", 0).read()
    assert d["device_source"] == "torch_npu+npu-smi"
    assert d["device_utilization_pct"] == 37.0                      # Aicore Usage Rate(%)
    assert d["device_memory_used_bytes"] == 16 << 30                 # torch_npu's figure is kept
    assert calls.read_text().split() == ["info", "-t", "usages", "-i", "0"]


def test_npu_without_torch_npu_uses_npu_smi_only(monkeypatch, tmp_path):
    text = NPU_SMI_USAGES + "        NPU Utilization(%)             : 52\n"
    fake_npu_smi(tmp_path, monkeypatch, text)
    monkeypatch.setitem(sys.modules, "torch_npu", None)   # import fails
    d = DeviceReader("npu", 3).read()
    assert d["device_source"] == "npu-smi"
    assert d["device_utilization_pct"] == 52.0                      # the overall figure wins over Aicore
    assert d["device_memory_total_bytes"] == 65536 << 20
    assert d["device_memory_used_bytes"] == (65536 << 20) // 4      # HBM Usage Rate 25 %


def test_npu_with_nothing_answering_reports_unknowns(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "torch_npu", None)
    monkeypatch.setenv("PATH", str(tmp_path))   # no npu-smi
    d = DeviceReader("npu", 0).read()
    assert d["device_kind"] == "npu" and d["device_source"] is None
    assert d["device_utilization_pct"] is None and d["device_memory_total_bytes"] is None


def test_cuda_reads_nvml(monkeypatch):
    calls = []
    pynvml = types.SimpleNamespace(
        nvmlInit=lambda: calls.append("init"),
        nvmlDeviceGetHandleByIndex=lambda i: calls.append(("handle", i)) or f"h{i}",
        nvmlDeviceGetUtilizationRates=lambda h: types.SimpleNamespace(gpu=64 if h == "h2" else 0, memory=10),
        nvmlDeviceGetMemoryInfo=lambda h: types.SimpleNamespace(total=80 << 30, free=60 << 30, used=20 << 30))
    monkeypatch.setitem(sys.modules, "pynvml", pynvml)
    reader = DeviceReader("cuda", 2)
    for _ in range(2):
        d = reader.read()
        assert d["device_source"] == "nvml" and d["device_utilization_pct"] == 64.0
        assert (d["device_memory_used_bytes"], d["device_memory_total_bytes"]) == (20 << 30, 80 << 30)
    assert calls == ["init", ("handle", 2)], "NVML initialised more than once"


def test_cpu_reads_this_process():
    import psutil

    reader = DeviceReader("cpu")
    sum(i * i for i in range(300_000))   # some CPU time between the two calls
    d = reader.read()
    assert d["device_source"] == "psutil" and 0.0 <= d["device_utilization_pct"] <= 100.0
    assert d["device_memory_used_bytes"] == pytest.approx(psutil.Process().memory_info().rss, rel=0.2)
    assert d["device_memory_total_bytes"] == psutil.virtual_memory().total


# ---------------------------------------------------------------------------------------------- the window

def samples(rates, **fields):
    """Samples one second apart whose intervals generated `rates` tokens."""
    out, tokens = [], 0
    for t, rate in enumerate([0, *rates]):
        tokens += rate
        s = {"timestamp": float(t), "generated_tokens": tokens, "running": 8, "waiting": 0, "batch_occupancy": 1.0,
             "preemptions": 0, "kv_blocks_used": 10, "kv_blocks_total": 100, "device_memory_used_bytes": 1,
             "device_memory_total_bytes": 10}
        s.update({k: v(t) if callable(v) else v for k, v in fields.items()})
        out.append(s)
    return out


def test_steady_window_is_not_flagged():
    r = analyze(samples([100, 104, 98, 101]))
    assert r.rates == [100, 104, 98, 101] and r.mean_tokens_per_s == pytest.approx(100.75)
    assert r.spread == pytest.approx(6 / 100.75) and not r.flagged and r.causes == [] and r.details == []


def test_spread_without_a_visible_cause_says_so():
    r = analyze(samples([100, 50, 100]))
    assert r.flagged and r.causes == [] and "no cause visible" in str(r)


def test_spread_with_preemptions_names_the_kv_pool():
    r = analyze(samples([100, 40, 100, 30], preemptions=lambda t: t * 2, waiting=3))
    assert r.flagged and r.spread == pytest.approx(70 / 67.5)
    assert r.causes == ["kv_pool_full"] and "8 preemption(s)" in str(r)


def test_full_pool_with_waiting_requests_is_kv_pool_full_without_preemptions():
    r = analyze(samples([50, 20], kv_blocks_used=99, waiting=2))
    assert r.causes == ["kv_pool_full"]
    assert analyze(samples([50, 20], kv_blocks_used=99, waiting=0)).causes == []   # full but nobody waits


def test_underfilled_batch_and_device_memory():
    r = analyze(samples([10, 30, 10], running=2, batch_occupancy=2 / 64))
    assert r.flagged and r.causes == ["batch_underfilled"] and "3% full" in str(r)
    r = analyze(samples([10, 30], device_memory_used_bytes=98, device_memory_total_bytes=100))
    assert r.causes == ["device_memory_near_limit"]


def test_idle_intervals_do_not_count():
    r = analyze(samples([100, 0, 0, 100], running=lambda t: 0 if t in (2, 3) else 8))
    assert r.rates == [100, 100] and not r.flagged
    assert analyze([]).rates == [] and not analyze([]).flagged


# ---------------------------------------------------------------------------------------------- engines

def drive(llm: LLM, monitor: NPUMonitor, prompts: list[list[int]], params: SamplingParams) -> None:
    """Step the LLM's engine by hand, sampling after every step (wall-clock rates: only the logic is checked)."""
    for i, p in enumerate(prompts):
        llm.engine.add_request(f"r{i}", p, params)
    monitor.sample()
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
        monitor.sample()


def check_report_logic(monitor: NPUMonitor):
    r = monitor.report()
    assert r.rates, "no interval measured"
    mean = sum(r.rates) / len(r.rates)
    assert r.spread == pytest.approx((max(r.rates) - min(r.rates)) / mean)
    assert r.flagged == (r.spread > 0.15)
    return r


def test_llm_with_a_tiny_kv_pool_preempts_and_the_monitor_names_it(tiny_llama):
    llm = LLM(tiny_llama, num_gpu_blocks_override=8, block_size=16, max_num_seqs=8)
    monitor = NPUMonitor(llm)
    u = monitor.get_utilization()
    assert set(u) == set(KEYS) and u["device_kind"] == "cpu" and u["kv_blocks_total"] == 8
    assert u["max_num_seqs"] == 8 and u["preemptions"] == 0
    drive(llm, monitor, [[1 + i + j for j in range(20)] for i in range(4)],
          SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    last = monitor.samples[-1]
    assert last["preemptions"] > 0 and last["generated_tokens"] == 4 * 40
    assert max(s["batch_occupancy"] for s in monitor.samples) == 4 / 8
    r = check_report_logic(monitor)
    assert "kv_pool_full" in r.causes and "batch_underfilled" not in r.causes


def test_llm_with_an_underfilled_batch(tiny_llama):
    llm = LLM(tiny_llama, num_gpu_blocks_override=64, max_num_seqs=64)
    monitor = NPUMonitor(llm)
    drive(llm, monitor, [[5, 6, 7, 8]], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    r = check_report_logic(monitor)
    assert r.causes == ["batch_underfilled"]
    assert llm.get_stats().num_generated_tokens == 12


def test_async_engine_figures(tiny_llama):
    engine = AsyncLLMEngine(model=tiny_llama, num_gpu_blocks_override=32, max_num_seqs=4)
    try:
        monitor = NPUMonitor(engine)
        before = monitor.get_utilization()
        asyncio.run(engine.generate([3, 4, 5], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)))
        after = monitor.get_utilization()
    finally:
        engine.shutdown()
    assert before["generated_tokens"] == 0 and after["generated_tokens"] == 6
    assert after["kv_blocks_total"] == 32 and after["max_num_seqs"] == 4 and after["running"] == 0
    assert after["device_kind"] == "cpu" and after["device_memory_used_bytes"] > 0


def test_monitor_refuses_other_targets():
    with pytest.raises(TypeError, match="NPUMonitor"):
        NPUMonitor(42)


# ---------------------------------------------------------------------------------------------- a node's /metrics

def serve_node_metrics(stats: EngineStats, device: tuple[str, int]):
    registry = new_registry()
    registry.register(EngineStatsCollector(lambda: stats))
    registry.register(DeviceUsageCollector(lambda: device))
    return serve_metrics(registry, 0, host="127.0.0.1")


STATS = EngineStats(num_total_blocks=100, num_free_blocks=30, num_running=6, num_waiting=2, num_preemptions=5,
                    num_generated_tokens=1234, max_num_seqs=8, tokens_per_s=56.5)


def test_monitor_reads_a_cpu_node_from_its_metrics():
    server = serve_node_metrics(STATS, ("cpu", 0))
    try:
        u = NPUMonitor(f"127.0.0.1:{server.port}").get_utilization()
        u2 = NPUMonitor(f"http://127.0.0.1:{server.port}/metrics").get_utilization()
    finally:
        server.close()
    assert set(u) == set(KEYS) and u["device_kind"] == "cpu" and u["device_source"] == "metrics"
    assert u["device_memory_used_bytes"] > 0 and u["device_memory_total_bytes"] >= u["device_memory_used_bytes"]
    assert (u["kv_blocks_used"], u["kv_blocks_total"], u["running"], u["waiting"]) == (70, 100, 6, 2)
    assert (u["preemptions"], u["generated_tokens"], u["max_num_seqs"]) == (5, 1234, 8)
    assert u["batch_occupancy"] == 0.75 and u["tokens_per_s"] == 56.5
    assert u2["kv_blocks_used"] == 70


def test_monitor_reads_an_npu_node_from_its_metrics(monkeypatch, tmp_path):
    fake_npu_smi(tmp_path, monkeypatch)
    fake_torch_npu(monkeypatch, mem=lambda d: (48 << 30, 64 << 30))
    server = serve_node_metrics(STATS, ("npu", 0))
    try:
        u = NPUMonitor(f"127.0.0.1:{server.port}").get_utilization()
    finally:
        server.close()
    assert (u["device_kind"], u["device_index"]) == ("npu", 0)
    assert u["device_utilization_pct"] == pytest.approx(37.0)
    assert (u["device_memory_used_bytes"], u["device_memory_total_bytes"]) == (16 << 30, 64 << 30)


@pytest.mark.cluster
@pytest.mark.timeout(180)
def test_status_shows_device_figures_of_running_nodes(tmp_path):
    from pdcluster.cli.supervisor import LocalCluster
    from pdcluster.engine.testing import make_tiny_model

    model = make_tiny_model(str(tmp_path / "tiny-llama"), "llama")
    c = LocalCluster(model=model, work_dir=tmp_path, num_prefill=1, num_decode=1, port=0,
                     cluster="monitor", lease_ttl=2, threads_per_node=1,
                     node_config={"kv_cache_memory": "8MiB", "max_num_seqs": 16, "device": "cpu"})
    with c:
        r = subprocess.run([str(Path(sys.executable).with_name("pdcluster")), "status", "--json", "--etcd", c.etcd,
                            "--cluster", "monitor"], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        nodes = {n["node_id"]: n for n in json.loads(r.stdout)["nodes"] if n.get("role") != "router"}
        decode = next(n for n in c.services if n.kind == "decode")
        u = NPUMonitor(decode.metrics_url).get_utilization()
    assert set(nodes) == {"prefill-0", "decode-0"}
    for n in nodes.values():
        assert n["device_kind"] == "cpu" and 0 <= n["device_utilization_pct"] <= 100
        assert 0 < n["device_memory_used_bytes"] < n["device_memory_total_bytes"]
        assert n["batch_occupancy"] == 0 and n["preemptions"] == 0
    assert u["max_num_seqs"] == 16 and u["kv_blocks_total"] == nodes["decode-0"]["kv_blocks_total"]
