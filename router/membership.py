"""The router as a cluster member: its record in etcd (role `router`, under a lease), its stats, and drain.

Stats go out like a node's: a `Load` (role "router"; `running` = requests in flight, `streams` = open token
streams, `tokens_per_s` = generated tokens received per second over the window since the previous report,
`errors` = failed requests since start, `state` serving | draining) on a CURVE `LoadPublisher` at ~2 Hz,
whose address is in the record, so `pdcluster status` reads routers and nodes alike. Nothing changing is
written to etcd (every process watches it). Uses `pdcluster.control` only.

Drain (`pdcluster drain ROUTER`: the admin state "draining" in etcd): the router stops listening (no new
connections), answers requests on open connections 503, lets every open stream finish, then exits, which
revokes its lease. It ignores "cordoned": nothing routes to a router.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from typing import Callable

from pdcluster.control.etcd_client import EtcdCredentials
from pdcluster.control.protocol import Load
from pdcluster.control.records import NodeInfo
from pdcluster.control.registration import NodeIdTaken, Registration
from pdcluster.control.transport import LoadPublisher
from pdcluster.router.router import Router
from pdcluster.router.settings import RouterConfig

log = logging.getLogger(__name__)

DRAIN_POLL_S = 0.25   # how often the admin state (and, once draining, the in-flight count) is read
LOAD_INTERVAL_S = 0.5
ETCD_WAIT_S = 5.0   # how long a start waits for etcd before going on (registering or syncing once it answers)


def advertised_host(host: str) -> str:
    """An address other hosts can use for a listener bound to `host` (a wildcard names this machine)."""
    return socket.getfqdn() if host in ("", "0.0.0.0", "::") else host


class RouterMembership:
    """Owned by `run_router`; owns the drain state, which `app.RouterAPI` reads. `config` None (a router on a
    static node list): no etcd record and no Load reports, only the drain watch (on the node source's admin
    state). `stop_listening` and `exit_server` act on the HTTP server when a drain starts and ends."""

    def __init__(self, router: Router, port: int, config: RouterConfig | None = None,
                 stop_listening: Callable[[], None] | None = None,
                 exit_server: Callable[[], None] | None = None) -> None:
        self.router = router   # read only: its settings, counters and cluster view
        self.config = config
        self.port = port
        self.stop_listening = stop_listening
        self.exit_server = exit_server
        self.draining = False   # set once, by the drain watch; never cleared (the process exits drained)
        self.publisher = LoadPublisher(keys=router.cluster.keys)
        self.registration: Registration | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._tokens = (time.monotonic(), 0)   # (when, tokens received then): the window of the next report

    def info(self) -> NodeInfo:
        s = self.router.settings
        host = advertised_host(s.host)
        return NodeInfo(node_id=s.node_id, role="router", model=",".join(self.router.models), host=host,
                        control_addr=f"http://{host}:{self.port}", load_addr=self.publisher.address,
                        metrics_addr=f"http://{host}:{self.port}/metrics")

    async def start(self) -> None:
        config = self.config
        if config is not None and config.etcd:
            self.publisher.bind(f"tcp://{self.router.settings.host or '0.0.0.0'}:0")
            self.registration = Registration(list(config.etcd), config.cluster, self.info(), ttl=config.lease_ttl,
                                             registry=self.router.metrics.registry,
                                             credentials=EtcdCredentials.from_config(config))
            try:
                if not await self.registration.start(wait=ETCD_WAIT_S):
                    log.warning("router %s: etcd did not answer yet; registering when it does", self.info().node_id)
            except NodeIdTaken:
                self.registration = None
                raise
            self._tasks.append(asyncio.create_task(self.publisher.run(self.load, LOAD_INTERVAL_S),
                                                   name="router-load"))
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
        node_id = router.settings.node_id
        while True:
            await asyncio.sleep(DRAIN_POLL_S)
            if not self.draining and router.cluster.source.admin_state(node_id) == "draining":
                self.draining = True
                log.info("router %s: draining (%d requests in flight)", node_id, router.in_flight)
                if self.stop_listening is not None:
                    self.stop_listening()
            if self.draining and router.in_flight == 0:
                log.info("router %s: drained; exiting", node_id)
                if self.exit_server is not None:
                    self.exit_server()
                return

    def _sample(self, name: str, labels: dict[str, str] | None = None) -> float:
        return self.router.metrics.registry.get_sample_value(name, labels or {}) or 0.0

    def load(self) -> Load:
        """This report. `tokens_per_s`: generated (output) tokens received from decode nodes per second over
        the window since the previous report (since start for the first), counted as they arrive."""
        r = self.router
        now, tokens = time.monotonic(), r.tokens_received
        then, before = self._tokens
        self._tokens = (now, tokens)
        return Load(node_id=r.settings.node_id, role="router", running=r.in_flight, streams=r.open_streams,
                    tokens_per_s=(tokens - before) / (now - then) if now > then else 0.0,
                    errors=int(self._sample("pdcluster_router_requests_total", {"outcome": "failed"})),
                    state="draining" if self.draining else "serving", timestamp=time.time())
