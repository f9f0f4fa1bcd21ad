"""Prefill-node counters (engine gauges come from `pdcluster.node.service.EngineStatsCollector`)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

from pdcluster.control.metrics import TRANSFER_BUCKETS, get_or_create


class PrefillMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = get_or_create(registry, Counter, "pdcluster_node_prefill_requests_total",
                                      "Prefill requests by outcome (ok, error, aborted, rejected)", ("outcome",))
        self.transfers = get_or_create(registry, Counter, "pdcluster_kv_transfers_total",
                                       "KV transfers acknowledged by the receiver", ("backend",))
        self.transfer_bytes = get_or_create(registry, Counter, "pdcluster_kv_transfer_bytes_total",
                                            "KV bytes written into decode nodes", ("backend",))
        self.transfer_failures = get_or_create(registry, Counter, "pdcluster_kv_transfer_failures_total",
                                               "KV transfers that failed (timeout, checksum, peer lost)",
                                               ("backend",))
        self.transfer_seconds = get_or_create(registry, Histogram, "pdcluster_kv_transfer_seconds",
                                              "First KV write queued -> receiver's checksum ack", ("backend",),
                                              buckets=TRANSFER_BUCKETS)
