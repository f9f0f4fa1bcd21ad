"""Run the router: uvicorn (uvloop + httptools) serving `app.RouterAPI` on a socket bound here."""

from __future__ import annotations

import dataclasses
import logging
import socket
import time
from typing import TYPE_CHECKING, Any

import uvicorn

from pdcluster.control.gc_tuning import quiet_gc
from pdcluster.router.app import RouterAPI
from pdcluster.router.cluster import NodeSource
from pdcluster.router.membership import ETCD_WAIT_S, RouterMembership
from pdcluster.router.router import build_router
from pdcluster.router.settings import RouterConfig, RouterSettings, default_router_id

if TYPE_CHECKING:   # imported where used: aetcd and grpc load only for a router on etcd
    from pdcluster.control.cluster_view import ClusterView
    from pdcluster.control.records import NodeInfo

log = logging.getLogger(__name__)


def uvicorn_config(app: Any, host: str, port: int, log_level: str = "warning") -> uvicorn.Config:
    """How the router's app is served (a `RouterAPI`'s app: its router's settings hold the HTTP knobs)."""
    settings: RouterSettings = app.state.router.settings
    return uvicorn.Config(app, host=host, port=port, loop="uvloop", http="httptools", log_level=log_level,
                          access_log=False, timeout_graceful_shutdown=5,
                          # uvicorn annotates int but takes float seconds (it is a call_later delay)
                          timeout_keep_alive=settings.keep_alive_timeout)  # type: ignore[arg-type]


def bind_socket(host: str, port: int, reuse_port: bool = False) -> socket.socket:
    """The listening socket's bound (not yet listening) socket; `reuse_port`: shared with the other router
    workers on this port (SO_REUSEPORT: the kernel spreads new connections over them)."""
    family, kind, proto, _, addr = socket.getaddrinfo(host or "0.0.0.0", port, type=socket.SOCK_STREAM,
                                                      flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind(addr)
    return sock


def run_router(config: RouterConfig, source: NodeSource | None = None, reuse_port: bool = False) -> None:
    """Serve until SIGINT/SIGTERM or an admin drain. `config`: what `pdcluster router` loads (its
    `cluster_secret` authenticates the router to the nodes).

    Without `source`, nodes come from etcd (`pdcluster.control.cluster_view.ClusterView` on `config.etcd`)
    and the router registers there itself (`membership.py`).
    """
    if not config.node_id:
        config = dataclasses.replace(config, node_id=default_router_id())
    from pdcluster.control.keys import keys_from_config
    from pdcluster.control.metrics import new_registry

    registry = new_registry()  # shared by the app's metrics and the etcd view's connection gauge
    etcd_config: RouterConfig | None = None
    if source is None:
        from pdcluster.control.cluster_view import ClusterView
        from pdcluster.control.etcd_client import EtcdCredentials

        source = _StartedOnLifespan(ClusterView(list(config.etcd), config.cluster, registry=registry,
                                                credentials=EtcdCredentials.from_config(config)))
        etcd_config = config
    router = build_router(config, source, registry, keys_from_config(config.cluster_secret, f"router {config.node_id}"))
    sock = bind_socket(config.host, config.port, reuse_port)
    port = sock.getsockname()[1]

    # A drain acts on the server made below (it runs only while `server.run` does).
    def stop_listening() -> None:   # drain: no new connections; open ones (and their streams) go on
        for listener in getattr(server, "servers", []):
            listener.close()

    def exit_server() -> None:
        server.should_exit = True

    membership = RouterMembership(router, port, etcd_config, stop_listening, exit_server)
    server = uvicorn.Server(uvicorn_config(RouterAPI(router, membership).app, config.host, port))
    log.info("router %s serving %s on http://%s:%d (policy %s)", config.node_id, config.model,
             config.host, port, config.routing_policy)
    quiet_gc()
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()


class _StartedOnLifespan:
    """A ClusterView the app starts (waiting for the first etcd sync) and stops in its lifespan."""

    def __init__(self, view: ClusterView) -> None:
        self.view = view
        self.resynced_at = 0.0   # monotonic time of the view's last full reload (RouterCluster.sync reads it)
        view.add_listener(self._on_view_event)

    def _on_view_event(self, event: str, node_id: str | None) -> None:
        if event == "resync":
            self.resynced_at = time.monotonic()

    async def start(self) -> None:
        await self.view.start(wait=ETCD_WAIT_S)

    async def stop(self) -> None:
        await self.view.stop()

    def nodes_by_role(self, role: str) -> list[NodeInfo]:
        return self.view.nodes_by_role(role)

    def admin_state(self, node_id: str) -> str:
        return self.view.admin_state(node_id)
