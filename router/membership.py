"""The router as a cluster member: its record in etcd (role `router`, under a lease), its stats, and drain.

Stats go out like a node's: a `Load` (role "router"; `running` = requests in flight, `streams` = open token
streams, `tokens_per_s`, `errors` = failed requests since start, `state` serving | draining) on a CURVE
`LoadPublisher` at ~2 Hz, whose address is in the record, so `pdcluster status` reads routers and nodes
alike. Nothing changing is written to etcd (every process watches it). Uses `pdcluster.control` only.

Drain (`pdcluster drain ROUTER`: the admin state "draining" in etcd): the router stops listening (no new
connections), answers requests on open connections 503, lets every open stream finish, then exits, which
revokes its lease. It ignores "cordoned": nothing routes to a router.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from typing import Any

from pdcluster.control.etcd_client import EtcdCredentials
from pdcluster.control.protocol import Load
from pdcluster.control.records import NodeInfo
from pdcluster.control.registration import NodeIdTaken, Registration
from pdcluster.control.transport import LoadPublisher

log = logging.getLogger(__name__)


def advertised_host(host: str) -> str:
    """An address other hosts can use for a listener bound to `host` (a wildcard names this machine)."""
    return socket.getfqdn() if host in ("", "0.0.0.0", "::") else host


class RouterMembership:
    """Owned by `run_router`: `config` None (a router on a static node list) keeps only the drain watch."""

    def __init__(self, router: Any, port: int, config: Any = None, stop_listening: Any = None,
                 exit: Any = None) -> None:
        self.router = router   # router.app.Router: its counters and draining flag
        self.config = config   # RouterConfig: etcd, cluster, lease_ttl, credentials
        self.port = port
        self.stop_listening = stop_listening   # callables from the HTTP server
        self.exit = exit
        self.publisher = LoadPublisher(keys=router.cluster.keys)
        self.registration: Registration | None = None
        self._tasks: list[asyncio.Task] = []
        self._tokens = (time.monotonic(), 0.0)   # (when, generation tokens then): tokens/s between reports

    def info(self) -> NodeInfo:
        s = self.router.settings
        host = advertised_host(s.host)
        return NodeInfo(node_id=s.node_id, role="router", model=",".join(self.router.models), host=host,
                        control_addr=f"http://{host}:{self.port}", load_addr=self.publisher.address,
                        metrics_addr=f"http://{host}:{self.port}/metrics")

    async def start(self) -> None:
        if self.config is not None and getattr(self.config, "etcd", None):
            self.publisher.bind(f"tcp://{self.router.settings.host or '0.0.0.0'}:0")
            self.registration = Registration(list(self.config.etcd), self.config.cluster, self.info(),
                                             ttl=getattr(self.config, "lease_ttl", 10),
                                             registry=self.router.metrics.registry,
                                             credentials=EtcdCredentials.from_config(self.config))
            try:
                if not await self.registration.start(wait=5.0):
                    log.warning("router %s: etcd did not answer yet; registering when it does", self.info().node_id)
            except NodeIdTaken:
                self.registration = None
                raise
            self._tasks.append(asyncio.create_task(self.publisher.run(self.load, 0.5), name="router-load"))
        self._tasks.append(asyncio.create_task(self._watch_drain(), name="router-drain"))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.registration is not None:
            await self.registration.deregister()
        self.publisher.close()

    async def _watch_drain(self) -> None:
        router = self.router
        while True:
            await asyncio.sleep(0.25)
            if not router.draining and router.cluster.source.admin_state(router.settings.node_id) == "draining":
                router.draining = True
                log.info("router %s: draining (%d requests in flight)", router.settings.node_id, router.in_flight)
                if self.stop_listening is not None:
                    self.stop_listening()
            if router.draining and router.in_flight == 0:
                log.info("router %s: drained; exiting", router.settings.node_id)
                if self.exit is not None:
                    self.exit()
                return

    def _sample(self, name: str, labels: dict[str, str] | None = None) -> float:
        return self.router.metrics.registry.get_sample_value(name, labels or {}) or 0.0

    def load(self) -> Load:
        r = self.router
        now, tokens = time.monotonic(), self._sample("pdcluster_router_generation_tokens_total")
        then, before = self._tokens
        self._tokens = (now, tokens)
        return Load(node_id=r.settings.node_id, role="router", running=r.in_flight,
                    streams=len(r.decode.queues) if r.decode is not None else 0,
                    tokens_per_s=(tokens - before) / (now - then) if now > then else 0.0,
                    errors=int(self._sample("pdcluster_router_requests_total", {"outcome": "failed"})),
                    state="draining" if r.draining else "serving", timestamp=time.time())
