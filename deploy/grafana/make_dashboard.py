"""Writes pdcluster-dashboard.json, the Grafana dashboard over pdcluster's Prometheus metrics.

The JSON is generated so that every panel follows the same conventions (one datasource variable,
`$job` filter, units); edit this file and run `python deploy/grafana/make_dashboard.py`.
tests/test_deploy.py checks that the committed JSON is what this script writes.
"""

from __future__ import annotations

import json
from pathlib import Path

OUT = Path(__file__).with_name("pdcluster-dashboard.json")
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
SEL = '{job=~"$job"}'  # every query is restricted to the selected scrape jobs
RATE = "$__rate_interval"


def quantiles(metric: str, by: str = "") -> list[tuple[str, str]]:
    """p50 and p99 of a histogram, optionally one series per `by` label."""
    group = f"le{', ' + by if by else ''}"
    suffix = f" {{{{{by}}}}}" if by else ""
    return [(f"histogram_quantile({q}, sum by ({group}) (rate({metric}_bucket{SEL}[{RATE}])))",
             f"p{int(q * 100)}{suffix}") for q in (0.5, 0.99)]


class Layout:
    """Places panels left to right in rows of 24 grid units."""

    def __init__(self) -> None:
        self.panels: list[dict] = []
        self.x = self.y = 0
        self.row_height = 0

    def row(self, title: str) -> None:
        self._newline()
        self.panels.append({"type": "row", "title": title, "collapsed": False, "id": len(self.panels) + 1,
                            "gridPos": {"h": 1, "w": 24, "x": 0, "y": self.y}, "panels": []})
        self.y += 1

    def panel(self, title: str, targets: list[tuple[str, str]], unit: str = "short", width: int = 8,
              kind: str = "timeseries", description: str = "", stack: bool = False) -> None:
        if self.x + width > 24:
            self._newline()
        height = 8
        fieldconfig: dict = {"defaults": {"unit": unit}, "overrides": []}
        if kind == "timeseries":
            fieldconfig["defaults"]["custom"] = {"fillOpacity": 10, "lineWidth": 1, "showPoints": "never",
                                                 "stacking": {"mode": "normal" if stack else "none"}}
        self.panels.append({
            "type": kind,
            "title": title,
            "description": description,
            "id": len(self.panels) + 1,
            "datasource": DATASOURCE,
            "gridPos": {"h": height, "w": width, "x": self.x, "y": self.y},
            "fieldConfig": fieldconfig,
            "options": {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                        "tooltip": {"mode": "multi", "sort": "desc"}} if kind == "timeseries" else {},
            "targets": [{"datasource": DATASOURCE, "expr": expr, "legendFormat": legend, "refId": chr(ord("A") + i)}
                        for i, (expr, legend) in enumerate(targets)],
        })
        self.x += width
        self.row_height = max(self.row_height, height)

    def _newline(self) -> None:
        self.y += self.row_height
        self.x = self.row_height = 0


def build() -> dict:
    d = Layout()

    d.row("Requests (router)")
    d.panel("Requests / s by outcome",
            [(f"sum by (outcome) (rate(pdcluster_router_requests_total{SEL}[{RATE}]))", "{{outcome}}")],
            unit="reqps", stack=True)
    d.panel("Requests in flight", [(f"sum by (instance) (pdcluster_router_requests_in_flight{SEL})", "{{instance}}")])
    d.panel("Token throughput",
            [(f"sum(rate(pdcluster_router_generation_tokens_total{SEL}[{RATE}]))", "generated tokens/s"),
             (f"sum(rate(pdcluster_router_prompt_tokens_total{SEL}[{RATE}]))", "prompt tokens/s")],
            unit="short")
    d.panel("TTFT p50 / p99", quantiles("pdcluster_router_ttft_seconds"), unit="s")
    d.panel("TPOT p50 / p99", quantiles("pdcluster_router_tpot_seconds"), unit="s")
    d.panel("ITL p50 / p99", quantiles("pdcluster_router_itl_seconds"), unit="s")
    d.panel("End-to-end latency p50 / p99", quantiles("pdcluster_router_e2e_seconds"), unit="s")
    d.panel("Retries and migrations / s",
            [(f"sum(rate(pdcluster_router_retries_total{SEL}[{RATE}]))", "retries"),
             (f"sum(rate(pdcluster_router_migrations_total{SEL}[{RATE}]))", "migrations")],
            unit="ops", description="Retries: a prefill/decode node refused or failed before the first token. "
                                    "Migrations: a decode node died mid-stream and the request moved.")
    d.panel("Non-OK request ratio",
            [(f'sum(rate(pdcluster_router_requests_total{{job=~"$job", outcome!="ok"}}[{RATE}])) '
              f"/ clamp_min(sum(rate(pdcluster_router_requests_total{SEL}[{RATE}])), 1e-9)", "non-ok")],
            unit="percentunit")
    d.panel("Decode-node attempts / s by node and outcome",
            [(f"sum by (node, outcome) (rate(pdcluster_router_backend_requests_total{SEL}[{RATE}]))",
              "{{node}} {{outcome}}")],
            unit="ops", description="ok: finished there; rejected: the node refused (full, cordoned); "
                                    "failed: it stalled, left or errored and the request moved on.")
    d.panel("First token p99 by decode node", quantiles("pdcluster_router_backend_first_token_seconds", by="node")[1:],
            unit="s", description="Generate sent -> first Tokens message, per attempt (includes the prefill).")

    d.row("Nodes (prefill and decode)")
    d.panel("Running requests", [(f"sum by (instance) (pdcluster_node_running_requests{SEL})", "{{instance}}")])
    d.panel("Waiting requests", [(f"sum by (instance) (pdcluster_node_waiting_requests{SEL})", "{{instance}}")])
    d.panel("KV cache usage",
            [(f"sum by (instance) (pdcluster_node_kv_blocks_used{SEL}) / clamp_min(sum by (instance) "
              f"(pdcluster_node_kv_blocks_used{SEL} + pdcluster_node_kv_blocks_free{SEL}), 1)", "{{instance}}")],
            unit="percentunit",
            description="Used / (used + free) blocks; prefix-cached blocks nobody references count as free.")
    d.panel("KV blocks reserved for incoming transfers",
            [(f"sum by (instance) (pdcluster_node_kv_blocks_reserved{SEL})", "{{instance}}")],
            description="Decode-side blocks held for prefills in flight; stuck high = transfers not completing.")
    d.panel("Engine tokens / s by node",
            [(f"sum by (instance) (rate(pdcluster_node_prefill_tokens_total{SEL}[{RATE}]))", "prefill {{instance}}"),
             (f"sum by (instance) (rate(pdcluster_node_decode_tokens_total{SEL}[{RATE}]))", "decode {{instance}}")])
    d.panel("Prefix cache hit ratio",
            [(f"avg by (instance) (pdcluster_node_prefix_cache_hit_ratio{SEL})", "{{instance}}")], unit="percentunit")
    d.panel("Preemptions / s",
            [(f"sum by (instance) (rate(pdcluster_node_preemptions_total{SEL}[{RATE}]))", "{{instance}}")],
            unit="ops",
            description="Sequences evicted to free KV blocks; sustained preemption means the decode pool is too small.")
    d.panel("etcd connected", [(f"min by (instance) (pdcluster_etcd_connected{SEL})", "{{instance}}")],
            description="1 while the process's etcd session works; 0 = serving on the last known membership.")
    d.panel("Device memory used", [(f"sum by (instance) (pdcluster_device_memory_used_bytes{SEL})", "{{instance}}")],
            unit="bytes")
    d.panel("Device utilization", [(f"avg by (instance) (pdcluster_device_utilization_ratio{SEL})", "{{instance}}")],
            unit="percentunit")

    d.row("KV transfer (prefill -> decode)")
    d.panel("Transfer throughput by backend",
            [(f"sum by (backend) (rate(pdcluster_kv_transfer_bytes_total{SEL}[{RATE}]))", "{{backend}}")],
            unit="Bps", description="Bytes of KV blocks moved per second; Grafana scales the axis to MB/s or GB/s.")
    d.panel("Transfer time p50 / p99 by backend", quantiles("pdcluster_kv_transfer_seconds", by="backend"), unit="s")
    d.panel("Transfer failures / s by backend",
            [(f"sum by (backend) (rate(pdcluster_kv_transfer_failures_total{SEL}[{RATE}]))", "{{backend}}")],
            unit="ops",
            description="Timeouts, checksum mismatches, dead peers; each failure is re-prefilled, never served.")

    return {
        "title": "pdcluster",
        "uid": "pdcluster-overview",
        "description": "Disaggregated prefill/decode serving: latency, throughput, KV cache and KV transfer.",
        "tags": ["pdcluster", "llm-serving"],
        "editable": True,
        "graphTooltip": 1,
        "refresh": "30s",
        "schemaVersion": 39,
        "time": {"from": "now-1h", "to": "now"},
        "timezone": "",
        "templating": {"list": [
            {"name": "datasource", "label": "Prometheus", "type": "datasource", "query": "prometheus",
             "current": {}, "hide": 0, "refresh": 1},
            {"name": "job", "label": "Job", "type": "query", "datasource": DATASOURCE,
             "query": {"query": "label_values(pdcluster_etcd_connected, job)", "refId": "job"},
             "definition": "label_values(pdcluster_etcd_connected, job)",
             "includeAll": True, "multi": True, "allValue": ".*", "current": {}, "refresh": 2, "hide": 0, "sort": 1},
        ]},
        "annotations": {"list": []},
        "panels": d.panels,
    }


def render() -> str:
    return json.dumps(build(), indent=2) + "\n"


if __name__ == "__main__":
    OUT.write_text(render())
    print(f"wrote {OUT}")
