"""Decode-node counters (engine gauges come from `pdcluster.node.service.EngineStatsCollector`)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

from pdcluster.control.metrics import TRANSFER_BUCKETS, get_or_create


class DecodeMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = get_or_create(registry, Counter, "pdcluster_node_requests_total",
                                      "requests by outcome (stop, length, abort, error, rejected)", ("outcome",))
        self.prefills = get_or_create(registry, Counter, "pdcluster_node_prefills_total",
                                      "prompts by where they were prefilled (local, remote)", ("path",))
        self.remote_failures = get_or_create(
            registry, Counter, "pdcluster_node_remote_prefill_failures_total",
            "remote prefills that fell back to a local prefill, by reason", ("reason",))
        self.received_bytes = get_or_create(registry, Counter, "pdcluster_kv_received_bytes_total",
                                            "KV bytes received from prefill nodes", ("backend",))
        self.transfer_failures = get_or_create(registry, Counter, "pdcluster_kv_transfer_failures_total",
                                               "KV transfers that failed (timeout, checksum, peer lost)",
                                               ("backend",))
        self.handbacks = get_or_create(registry, Counter, "pdcluster_node_handbacks_total",
                                       "requests handed back to their router to run elsewhere with their KV, by why "
                                       "(drain, rebalance, pressure)", ("reason",))
        self.remote_prefill_seconds = get_or_create(
            registry, Histogram, "pdcluster_node_remote_prefill_seconds",
            "Prefill sent to a prefill node -> KV landed and first token known", buckets=TRANSFER_BUCKETS)
