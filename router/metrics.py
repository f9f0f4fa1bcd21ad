"""The router's Prometheus metrics, on a per-app registry."""

from __future__ import annotations

from contextlib import suppress

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pdcluster.control.metrics import E2E_BUCKETS, ITL_BUCKETS, TPOT_BUCKETS, TTFT_BUCKETS, new_registry

BACKEND_OUTCOMES = ("ok", "rejected", "failed")  # backend_requests' outcome label


class RouterMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or new_registry()
        r = self.registry
        self.requests = Counter("pdcluster_router_requests_total", "HTTP generation requests by outcome",
                                ("outcome",), registry=r)
        self.ttft = Histogram("pdcluster_router_ttft_seconds", "Time to first token", buckets=TTFT_BUCKETS,
                              registry=r)
        self.tpot = Histogram("pdcluster_router_tpot_seconds", "Mean time per output token after the first",
                              buckets=TPOT_BUCKETS, registry=r)
        self.itl = Histogram("pdcluster_router_itl_seconds", "Time between token messages",
                             buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram("pdcluster_router_e2e_seconds", "Request latency, arrival to last token",
                             buckets=E2E_BUCKETS, registry=r)
        self.in_flight = Gauge("pdcluster_router_requests_in_flight", "Requests being served", registry=r)
        self.prompt_tokens = Counter("pdcluster_router_prompt_tokens_total", "Prompt tokens", registry=r)
        self.generation_tokens = Counter("pdcluster_router_generation_tokens_total", "Generated tokens",
                                         registry=r)
        self.retries = Counter("pdcluster_router_retries_total", "Requests re-sent after a decode node's Reject",
                               registry=r)
        self.queued = Counter("pdcluster_router_queued_total",
                              "Requests that arrived while no decode node served their model and waited for one",
                              registry=r)
        self.migrations = Counter("pdcluster_router_migrations_total",
                                  "Requests moved to another decode node mid-stream", registry=r)
        self.resumed_recomputed_tokens = Counter(
            "pdcluster_router_resumed_recomputed_tokens_total",
            "Tokens of a moved stream (prompt and output so far) its new decode node computed again instead of "
            "finding them cached or copied", registry=r)
        self.pre_copies = Counter("pdcluster_router_pre_copies_total",
                                  "Live migrations' pre-copies by outcome (ok: the KV was copied while the stream "
                                  "decoded on, failed: the stream stayed or moved without one)", ("outcome",),
                                  registry=r)
        # Per decode node ("backend"): how its attempts ended and how long it took to answer.
        self.backend_requests = Counter("pdcluster_router_backend_requests_total",
                                        "Attempts sent to a decode node, by node and outcome (ok, rejected, failed)",
                                        ("node", "outcome"), registry=r)
        self.backend_first_token = Histogram("pdcluster_router_backend_first_token_seconds",
                                             "Generate sent -> first Tokens message, by decode node", ("node",),
                                             buckets=TTFT_BUCKETS, registry=r)
        self.aborts = Counter("pdcluster_router_aborts_total", "Abort messages sent to decode nodes",
                              ("reason",), registry=r)

    def forget_node(self, node_id: str) -> None:
        """Remove a decode node's label children once it left the view: node ids carry the pid, so every restart
        would add children that stay forever."""
        for outcome in BACKEND_OUTCOMES:
            with suppress(KeyError):   # prometheus_client before 0.21 raises for children never created
                self.backend_requests.remove(node_id, outcome)
        with suppress(KeyError):
            self.backend_first_token.remove(node_id)
