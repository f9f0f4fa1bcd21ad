"""Small helpers on prometheus_client shared by every pdcluster process.

Each process (and each node object in tests that run several in one process) owns a registry from
`new_registry()`, so metric names never collide. Names follow Prometheus conventions:
`pdcluster_<what>_<unit>` with `_seconds`, `_bytes`, `_total`.
"""

from __future__ import annotations

import threading
import weakref
from typing import Callable, TypeVar

from prometheus_client import (
    CONTENT_TYPE_LATEST,  # noqa: F401  (re-exported for HTTP handlers)
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    start_http_server,
)

# Latency buckets in seconds. TTFT spans queueing + prefill (ms to tens of s); TPOT/ITL are per
# token (sub-ms on accelerators, ~50 ms+ on CPUs); E2E is the whole request.
TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15,
                0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
ITL_BUCKETS = TPOT_BUCKETS
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 60.0, 120.0, 240.0, 480.0)
TRANSFER_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)

M = TypeVar("M", Counter, Gauge, Histogram)

_lock = threading.Lock()
_shared: "weakref.WeakKeyDictionary[CollectorRegistry, dict[str, object]]" = weakref.WeakKeyDictionary()


def new_registry() -> CollectorRegistry:
    """A fresh registry (no default process/platform collectors)."""
    return CollectorRegistry(auto_describe=True)


def get_or_create(registry: CollectorRegistry, kind: type[M], name: str, documentation: str,
                  labelnames: tuple[str, ...] = (), **kwargs) -> M:
    """The metric `name` in `registry`, created on first use: several components can share one."""
    with _lock:
        metrics = _shared.setdefault(registry, {})
        metric = metrics.get(name)
        if metric is None:
            metric = kind(name, documentation, labelnames, registry=registry, **kwargs)
            metrics[name] = metric
        elif not isinstance(metric, kind):
            raise TypeError(f"metric {name} already registered as {type(metric).__name__}")
        return metric


def etcd_connected_gauge(registry: CollectorRegistry) -> Gauge:
    """`pdcluster_etcd_connected{component}`: 1 while that component's etcd session works."""
    return get_or_create(registry, Gauge, "pdcluster_etcd_connected",
                         "1 when the component's etcd connection is up, else 0", ("component",))


def render(registry: CollectorRegistry) -> bytes:
    """Text exposition of `registry` for an HTTP /metrics handler (content type CONTENT_TYPE_LATEST)."""
    return generate_latest(registry)


class MetricsServer:
    """`/metrics` on its own thread, for node processes that have no HTTP server."""

    def __init__(self, registry: CollectorRegistry, port: int = 0, host: str = "0.0.0.0"):
        self._server, self._thread = start_http_server(port, addr=host, registry=registry)
        self.host = host
        self.port: int = self._server.server_port

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)


def serve_metrics(registry: CollectorRegistry, port: int = 0, host: str = "0.0.0.0") -> MetricsServer:
    """Serve `registry` at http://host:port/metrics; port 0 picks a free one (see `.port`)."""
    return MetricsServer(registry, port, host)


class DroppedFramesCollector:
    """`<name>{socket}` read at scrape time from the `count` of each socket's `transport.DroppedFrames`."""

    def __init__(self, name: str, sockets: Callable[[], dict[str, object]]) -> None:
        self.name = name
        self.sockets = sockets

    def collect(self):
        from prometheus_client.core import CounterMetricFamily

        family = CounterMetricFamily(self.name, "frames dropped as malformed or unexpected, by socket",
                                     labels=["socket"])
        for label, dropped in self.sockets().items():
            family.add_metric([label], getattr(dropped, "count", 0))
        yield family
