"""`pdcluster up`: a `LocalCluster` (cli.supervisor) started in the foreground: the URL printed, children
that die restarted, everything stopped on SIGINT / SIGTERM; with `--smoke`, one chat question answered
(cli.smoke) and the cluster stopped again."""

from __future__ import annotations

import signal
import sys
import threading
from pathlib import Path

from pdcluster.cli.smoke import SMOKE_MAX_TOKENS, SMOKE_QUESTION, scrape_metrics, smoke_request
from pdcluster.cli.supervisor import LocalCluster


def run_up(cluster: LocalCluster, smoke: bool = False) -> int:
    """Start, wait until the router's /health is 200 (every served model has a decode node), print the URL,
    serve until SIGINT/SIGTERM (or one smoke request); the exit code."""
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        cluster.start()
        cluster.wait_ready(cluster.num_prefill, cluster.num_decode, serving=True)
        assert cluster.model is not None
        served_name = cluster.router_config.get("served_model_name") or Path(cluster.model).name
        print(f"pdcluster up: {cluster.num_prefill} prefill + {cluster.num_decode} decode node(s), "
              f"etcd {cluster.etcd}, logs in {cluster.work_dir}", flush=True)
        print(f"OpenAI API at {cluster.url}/v1 (model {served_name!r})", flush=True)
        if smoke:
            report_smoke(cluster, served_name)
            return 0
        secret = f"PDCLUSTER_CLUSTER_SECRET={cluster.cluster_secret} " if cluster.cluster_secret else ""
        print(f"admin: {secret}pdcluster status --etcd {cluster.etcd} --cluster {cluster.cluster}", flush=True)
        print("Ctrl-C to stop.", flush=True)
        while not stop.wait(0.5):
            try:
                for line in cluster.supervise():   # a node that dies is restarted; the rest keep serving
                    print(f"pdcluster up: {line}", file=sys.stderr, flush=True)
            except RuntimeError as exc:
                print(f"pdcluster up: {exc}; stopping", file=sys.stderr, flush=True)
                return 1
        return 0
    finally:
        print("pdcluster up: stopping", flush=True)
        cluster.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def report_smoke(cluster: LocalCluster, served_name: str) -> None:
    """Ask SMOKE_QUESTION, print the answer, and where the prompt was prefilled (the decode nodes' metrics)."""
    reply = smoke_request(cluster.url, served_name, max_tokens=SMOKE_MAX_TOKENS)
    choice = reply["choices"][0]
    print(f"Q: {SMOKE_QUESTION}\nA: {choice['message']['content'].strip()}", flush=True)
    print(f"smoke request ok: {reply['usage']['completion_tokens']} tokens, "
          f"finish_reason={choice['finish_reason']!r}", flush=True)
    paths = {"remote": 0.0, "local": 0.0}
    for s in cluster.services:
        if s.kind == "decode":
            m = scrape_metrics(s.metrics_url)
            for path in paths:
                paths[path] += m.get(f'pdcluster_node_prefills_total{{path="{path}"}}', 0.0)
    print(f"prefills: {paths['remote']:.0f} on a prefill node (KV transferred), "
          f"{paths['local']:.0f} on the decode node", flush=True)
