"""`NPUMonitor`: device and engine utilization of an `LLM`, an `AsyncLLMEngine` or a running node, and why
its tokens/s swings.

    from pdcluster.monitor import NPUMonitor
    monitor = NPUMonitor(llm)                      # or an AsyncLLMEngine, an LLMEngine, or a node's metrics URL
    monitor.get_utilization()                      # device + engine figures now (a flat dict, KEYS)
    monitor.sample(); ...; monitor.report()        # tokens/s spread over the sampled window, flagged with a cause

Device figures (`DeviceReader`): NPU from torch_npu (`torch_npu.npu.utilization`, `torch_npu.npu.mem_get_info`),
each falling back to `npu-smi info -t usages -i <index>`; CUDA from NVML (`pynvml`, the `nvidia-ml-py` package of
the `cuda` extra; memory from `torch.cuda.mem_get_info` without it); CPU: this process's CPU share of the CPUs it
may run on and its RSS out of the host's memory (psutil). A node exports the same figures on /metrics
(`DeviceUsageCollector`), which is what the monitor reads when given a node's address. Importing this module
does not import torch.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from itertools import pairwise
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    import psutil

SPREAD_THRESHOLD = 0.15   # a tokens/s spread above this (relative to the mean) is flagged
KV_FULL_RATIO = 0.95      # KV blocks used / total counted as a full pool (with requests waiting)
UNDERFILL_RATIO = 0.5     # mean running / max_num_seqs below this: batch underfilled
MEMORY_NEAR_LIMIT = 0.95  # device memory used / total counted as near its limit
EXPERT_IMBALANCE = 2.0    # MoE: the busiest expert of a layer at this multiple of the layer's mean is flagged

KEYS = ("device_kind", "device_index", "device_utilization_pct", "device_memory_used_bytes",
        "device_memory_total_bytes", "device_source", "kv_blocks_used", "kv_blocks_total", "running", "waiting",
        "max_num_seqs", "batch_occupancy", "tokens_per_s", "generated_tokens", "preemptions",
        "expert_tokens", "expert_imbalance", "expert_imbalance_layer", "spec_method", "spec_acceptance_rate",
        "spec_mean_accepted_length", "timestamp")
# expert_* (MoE models, else None): tokens per routed expert summed over the MoE layers (a list), and the most
# imbalanced layer's max / mean tokens per expert with that layer's index, since the engine started
# spec_* (speculative decoding, else None): the method, accepted / scored drafts, and 1 + accepted drafts per
# sequence step that scored drafts (tokens such a step produced), since the engine started


# ---------------------------------------------------------------------------------------------- device

class DeviceReader:
    """Utilization and memory of one device, `read()` -> the device_* keys (None where unknown)."""

    def __init__(self, kind: str, index: int = 0) -> None:
        self.kind, self.index = kind, index
        self._process: psutil.Process | None = None   # cpu_percent measures since the previous call on this object
        self._nvml = None

    def read(self) -> dict[str, Any]:
        out: dict[str, Any] = {"device_kind": self.kind, "device_index": self.index, "device_utilization_pct": None,
                               "device_memory_used_bytes": None, "device_memory_total_bytes": None,
                               "device_source": None}
        reader = {"npu": self._npu, "cuda": self._cuda, "cpu": self._cpu}.get(self.kind)
        if reader is not None:
            reader(out)
        return out

    def _npu(self, out: dict[str, Any]) -> None:
        sources = []
        try:
            import torch_npu

            out["device_utilization_pct"] = float(torch_npu.npu.utilization(self.index))
            sources.append("torch_npu")
        except Exception:
            pass
        try:
            import torch_npu

            free, total = torch_npu.npu.mem_get_info(self.index)
            out["device_memory_used_bytes"], out["device_memory_total_bytes"] = int(total - free), int(total)
            if not sources:
                sources.append("torch_npu")
        except Exception:
            pass
        if out["device_utilization_pct"] is None or out["device_memory_total_bytes"] is None:
            smi = npu_smi_usages(self.index)
            if smi:
                sources.append("npu-smi")
                for key, value in smi.items():
                    if out[key] is None:
                        out[key] = value
        out["device_source"] = "+".join(sources) or None

    def _cuda(self, out: dict[str, Any]) -> None:
        try:
            import pynvml

            if self._nvml is None:
                pynvml.nvmlInit()
                self._nvml = pynvml.nvmlDeviceGetHandleByIndex(self.index)
            out["device_utilization_pct"] = float(pynvml.nvmlDeviceGetUtilizationRates(self._nvml).gpu)
            mem = pynvml.nvmlDeviceGetMemoryInfo(self._nvml)
            out["device_memory_used_bytes"], out["device_memory_total_bytes"] = int(mem.used), int(mem.total)
            out["device_source"] = "nvml"
            return
        except Exception:
            pass
        torch = sys.modules.get("torch")
        if torch is None:
            return
        try:
            free, total = torch.cuda.mem_get_info(self.index)
        except Exception:
            return
        out["device_memory_used_bytes"], out["device_memory_total_bytes"] = int(total - free), int(total)
        out["device_source"] = "torch.cuda"

    def _cpu(self, out: dict[str, Any]) -> None:
        import psutil

        if self._process is None:
            self._process = psutil.Process()
            self._process.cpu_percent(None)   # the first call only starts the measurement
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        out["device_utilization_pct"] = self._process.cpu_percent(None) / cpus
        out["device_memory_used_bytes"] = self._process.memory_info().rss
        out["device_memory_total_bytes"] = psutil.virtual_memory().total
        out["device_source"] = "psutil"


_SMI_LINE = re.compile(r"^\s*([^:]+?)\s*:\s*([0-9.]+)\s*$")


def npu_smi_usages(index: int, timeout: float = 5.0) -> dict[str, Any]:
    """`npu-smi info -t usages -i <index>` as device_* keys ({} when npu-smi is missing or fails). Utilization:
    "NPU Utilization(%)" where the driver prints it, else "Aicore Usage Rate(%)"; memory: HBM (DDR on cards
    without HBM) capacity in MB times its usage rate."""
    try:
        text = subprocess.run(["npu-smi", "info", "-t", "usages", "-i", str(index)], capture_output=True,
                              text=True, timeout=timeout, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    fields = {}
    for line in text.splitlines():
        m = _SMI_LINE.match(line)
        if m:
            fields[m.group(1)] = float(m.group(2))
    out: dict[str, Any] = {}
    util = fields.get("NPU Utilization(%)", fields.get("Aicore Usage Rate(%)"))
    if util is not None:
        out["device_utilization_pct"] = util
    for mem in ("HBM", "DDR"):
        capacity, rate = fields.get(f"{mem} Capacity(MB)"), fields.get(f"{mem} Usage Rate(%)")
        if capacity and rate is not None:
            total = int(capacity * 2**20)
            out["device_memory_total_bytes"], out["device_memory_used_bytes"] = total, int(total * rate / 100)
            break
    return out


# ---------------------------------------------------------------------------------------------- engine

def engine_figures(stats: Any) -> dict[str, Any]:
    """The engine keys of an `EngineStats`."""
    worst = stats.expert_imbalance
    return {"expert_tokens": list(stats.expert_totals) if stats.expert_tokens else None,
            "expert_imbalance": worst[0] if worst else None, "expert_imbalance_layer": worst[1] if worst else None,
            "kv_blocks_used": stats.num_total_blocks - stats.num_free_blocks, "kv_blocks_total": stats.num_total_blocks,
            "running": stats.num_running, "waiting": stats.num_waiting, "max_num_seqs": stats.max_num_seqs,
            "batch_occupancy": stats.batch_occupancy, "tokens_per_s": stats.tokens_per_s,
            "generated_tokens": stats.num_generated_tokens, "preemptions": stats.num_preemptions,
            **spec_figures(stats.spec_method, stats.spec_num_drafts, stats.spec_num_draft_tokens,
                           stats.spec_num_accepted_tokens)}


def spec_figures(method: str | None, drafts: float, draft_tokens: float, accepted: float) -> dict[str, Any]:
    if not method:
        return {"spec_method": None, "spec_acceptance_rate": None, "spec_mean_accepted_length": None}
    return {"spec_method": method, "spec_acceptance_rate": accepted / draft_tokens if draft_tokens else None,
            "spec_mean_accepted_length": 1.0 + accepted / drafts if drafts else None}


def metrics_url(address: str) -> str:
    """"host:port" or a URL -> the node's /metrics URL."""
    url = address if "://" in address else f"http://{address}"
    return url if url.rstrip("/").endswith("/metrics") else url.rstrip("/") + "/metrics"


def read_node_metrics(address: str, timeout: float = 2.0) -> dict[str, Any]:
    """The KEYS of a node, from its Prometheus endpoint (`metrics_addr` in its etcd record, or host:port)."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(metrics_url(address), timeout=timeout) as response:
        text = response.read().decode()
    values: dict[str, float] = {}
    labels: dict[str, dict[str, str]] = {}
    experts: dict[int, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            values.setdefault(s.name, s.value)
            labels.setdefault(s.name, s.labels)
            if s.name == "pdcluster_node_expert_tokens_total":
                experts[int(s.labels["expert"])] = s.value
    return figures_from_metrics(values, labels, experts)


def figures_from_metrics(values: dict[str, float], labels: dict[str, dict[str, str]],
                         experts: dict[int, float] | None = None) -> dict[str, Any]:
    """`experts`: pdcluster_node_expert_tokens_total by its expert label."""
    def num(name: str, cast: Callable = float) -> Any:
        return cast(values[name]) if name in values else None

    out: dict[str, Any] = {k: None for k in KEYS}
    if "pdcluster_device_memory_total_bytes" in values or "pdcluster_device_utilization_ratio" in values:
        lab = labels.get("pdcluster_device_memory_total_bytes") or labels.get("pdcluster_device_utilization_ratio") \
            or {}
        out["device_kind"], out["device_index"] = lab.get("device_type"), int(lab.get("device", 0))
        util = num("pdcluster_device_utilization_ratio")
        out["device_memory_used_bytes"] = num("pdcluster_device_memory_used_bytes", int)
        out["device_memory_total_bytes"] = num("pdcluster_device_memory_total_bytes", int)
    else:
        out["device_kind"], out["device_index"] = "cpu", 0
        util = num("pdcluster_node_cpu_utilization_ratio")
        out["device_memory_used_bytes"] = num("pdcluster_node_resident_memory_bytes", int)
        out["device_memory_total_bytes"] = num("pdcluster_node_host_memory_total_bytes", int)
    out["device_utilization_pct"] = None if util is None else util * 100.0
    out["device_source"] = "metrics"
    out.update(kv_blocks_used=num("pdcluster_node_kv_blocks_used", int),
               kv_blocks_total=num("pdcluster_node_kv_blocks_total", int),
               running=num("pdcluster_node_running_requests", int), waiting=num("pdcluster_node_waiting_requests", int),
               max_num_seqs=num("pdcluster_node_max_num_seqs", int),
               batch_occupancy=num("pdcluster_node_batch_occupancy_ratio"),
               tokens_per_s=num("pdcluster_node_tokens_per_second"),
               generated_tokens=num("pdcluster_node_generated_tokens_total", int),
               preemptions=num("pdcluster_node_preemptions_total", int), timestamp=time.time(),
               expert_tokens=[int(experts[e]) for e in sorted(experts)] if experts else None,
               expert_imbalance=num("pdcluster_node_expert_imbalance_ratio"),
               expert_imbalance_layer=num("pdcluster_node_expert_imbalance_layer", int))
    out.update(spec_figures(labels.get("pdcluster_node_spec_decode_drafts_total", {}).get("method"),
                            values.get("pdcluster_node_spec_decode_drafts_total", 0.0),
                            values.get("pdcluster_node_spec_decode_draft_tokens_total", 0.0),
                            values.get("pdcluster_node_spec_decode_accepted_tokens_total", 0.0)))
    return out


# ---------------------------------------------------------------------------------------------- the window

@dataclass
class SpreadReport:
    """tokens/s over the sampled window: one rate per interval between consecutive samples in which the
    engine had work; `spread` = (max - min) / mean of them; `flagged` when above the threshold. `causes`:
    what the samples show that slows an engine down ("kv_pool_full", "batch_underfilled",
    "device_memory_near_limit", "expert_imbalance"), each explained in `details`."""

    rates: list[float] = field(default_factory=list)
    mean_tokens_per_s: float = 0.0
    spread: float = 0.0
    threshold: float = SPREAD_THRESHOLD
    flagged: bool = False
    causes: list[str] = field(default_factory=list)
    details: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        head = (f"tokens/s {self.mean_tokens_per_s:.1f} mean over {len(self.rates)} interval(s), spread "
                f"{self.spread:.0%} ({'above' if self.flagged else 'within'} {self.threshold:.0%})")
        return "; ".join([head, *self.details])


def analyze(samples: list[dict[str, Any]], threshold: float = SPREAD_THRESHOLD) -> SpreadReport:
    """The report of a window of `get_utilization()` dicts, oldest first (pure: unit-testable on fed samples)."""
    report = SpreadReport(threshold=threshold)
    busy = [s for s in samples if (s.get("running") or 0) + (s.get("waiting") or 0) > 0]
    busy_ids = {id(s) for s in busy}
    for before, after in pairwise(samples):
        dt = after["timestamp"] - before["timestamp"]
        tokens = (after.get("generated_tokens") or 0) - (before.get("generated_tokens") or 0)
        if dt > 0 and (tokens > 0 or id(after) in busy_ids):
            report.rates.append(tokens / dt)
    if report.rates:
        report.mean_tokens_per_s = sum(report.rates) / len(report.rates)
        if report.mean_tokens_per_s > 0:
            report.spread = (max(report.rates) - min(report.rates)) / report.mean_tokens_per_s
    report.flagged = report.spread > threshold
    if not samples:
        return report
    preempted = (samples[-1].get("preemptions") or 0) - (samples[0].get("preemptions") or 0)
    full = [s for s in busy if s.get("kv_blocks_total") and s.get("waiting")
            and s["kv_blocks_used"] / s["kv_blocks_total"] >= KV_FULL_RATIO]
    if preempted > 0 or full:
        report.causes.append("kv_pool_full")
        report.details.append(f"kv_pool_full: {preempted} preemption(s) in the window, KV pool full with requests "
                              f"waiting in {len(full)} of {len(samples)} sample(s): raise kv_cache_memory or "
                              "lower max_num_seqs")
    occupancy = [s["batch_occupancy"] for s in busy if s.get("batch_occupancy") is not None]
    if "kv_pool_full" not in report.causes and occupancy and sum(occupancy) / len(occupancy) < UNDERFILL_RATIO:
        mean = sum(occupancy) / len(occupancy)
        report.causes.append("batch_underfilled")
        report.details.append(f"batch_underfilled: the batch ran {mean:.0%} full on average "
                              f"(running / max_num_seqs): too few concurrent requests reach this engine")
    near = [s for s in samples if s.get("device_memory_total_bytes") and s.get("device_memory_used_bytes")
            and s["device_memory_used_bytes"] / s["device_memory_total_bytes"] >= MEMORY_NEAR_LIMIT]
    if near:
        worst = max(s["device_memory_used_bytes"] / s["device_memory_total_bytes"] for s in near)
        report.causes.append("device_memory_near_limit")
        report.details.append(f"device_memory_near_limit: device memory up to {worst:.0%} used")
    imbalance = samples[-1].get("expert_imbalance")
    if imbalance is not None and imbalance >= EXPERT_IMBALANCE:
        report.causes.append("expert_imbalance")
        report.details.append(f"expert_imbalance: in MoE layer {samples[-1].get('expert_imbalance_layer')} the "
                              f"busiest expert got {imbalance:.1f}x the mean tokens per expert: its rank (expert "
                              "parallelism) or its grouped GEMM bounds the layer's time")
    if report.flagged and not report.causes:
        report.details.append("no cause visible in the samples (KV pool, batch occupancy and device memory look "
                              "fine): the load itself varies, or the host is shared")
    return report


class NPUMonitor:
    """Utilization of `target`: an `LLM`, `AsyncLLMEngine` or `LLMEngine` in this process (anything with
    `get_stats()` and an `.engine.device` or `.device`), or a running node given by its metrics address
    ("host:port" or "http://host:port/metrics", as `pdcluster nodes` lists it). `window`: samples kept."""

    def __init__(self, target: Any, window: int = 120, threshold: float = SPREAD_THRESHOLD) -> None:
        self.target = target
        self.threshold = threshold
        self.samples: deque[dict[str, Any]] = deque(maxlen=window)
        self._device: DeviceReader | None = None
        if not isinstance(target, str):
            if not hasattr(target, "get_stats"):
                raise TypeError(f"NPUMonitor: expected an LLM, AsyncLLMEngine, LLMEngine or a metrics address, "
                                f"got {type(target).__name__}")
            device = getattr(getattr(target, "engine", target), "device", None)
            self._device = DeviceReader(device.type if device is not None else "cpu",
                                        (device.index or 0) if device is not None else 0)

    def get_utilization(self) -> dict[str, Any]:
        """Device and engine figures now: a dict with the keys in `KEYS`."""
        if isinstance(self.target, str):
            return read_node_metrics(self.target)
        assert self._device is not None   # set for every target but an address
        out = self._device.read()
        out.update(engine_figures(self.target.get_stats()), timestamp=time.time())
        return out

    def sample(self) -> dict[str, Any]:
        """`get_utilization()`, also kept in the window."""
        figures = self.get_utilization()
        self.samples.append(figures)
        return figures

    def report(self) -> SpreadReport:
        """The tokens/s spread over the window and what the samples show (see `analyze`)."""
        return analyze(list(self.samples), self.threshold)

    def watch(self, seconds: float, interval: float = 1.0) -> SpreadReport:
        """Sample every `interval` s for `seconds` s (blocking), then report."""
        end = time.monotonic() + seconds
        while True:
            self.sample()
            if time.monotonic() + interval > end:
                return self.report()
            time.sleep(interval)


# ---------------------------------------------------------------------------------------------- Prometheus

class DeviceUsageCollector:
    """A node's device gauges, read at scrape time: `pdcluster_device_utilization_ratio` and
    `pdcluster_device_memory_{used,total}_bytes` {device_type, device} on NPU / CUDA; on CPU the process's
    `pdcluster_node_cpu_utilization_ratio`, `pdcluster_node_resident_memory_bytes` and
    `pdcluster_node_host_memory_total_bytes`."""

    def __init__(self, device: Callable[[], "tuple[str, int] | None"]) -> None:
        self.device = device   # -> (device type, index) of the node's engine, None before it exists
        self._reader: DeviceReader | None = None

    def collect(self):
        from prometheus_client.core import GaugeMetricFamily

        device = self.device()
        if device is None:
            return
        if self._reader is None or (self._reader.kind, self._reader.index) != device:
            self._reader = DeviceReader(*device)
        d = self._reader.read()
        util, used, total = d["device_utilization_pct"], d["device_memory_used_bytes"], d["device_memory_total_bytes"]
        if device[0] == "cpu":
            for name, doc, value in (
                    ("pdcluster_node_cpu_utilization_ratio",
                     "process CPU time / wall time / CPUs it may use, since the previous scrape", util and util / 100),
                    ("pdcluster_node_resident_memory_bytes", "resident memory of the node process", used),
                    ("pdcluster_node_host_memory_total_bytes", "memory of the host", total)):
                if value is not None:
                    yield GaugeMetricFamily(name, doc, value=value)
            return
        labels = [device[0], str(device[1])]
        for name, doc, value in (
                ("pdcluster_device_utilization_ratio", "fraction of the last sample period the device was busy",
                 None if util is None else util / 100),
                ("pdcluster_device_memory_used_bytes", "device memory in use (all processes)", used),
                ("pdcluster_device_memory_total_bytes", "device memory size", total)):
            if value is not None:
                family = GaugeMetricFamily(name, doc, labels=["device_type", "device"])
                family.add_metric(labels, value)
                yield family
