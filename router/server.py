"""Run the router: uvicorn (uvloop + httptools) serving `router.app.create_app` on a socket bound here."""

from __future__ import annotations

import gc
import logging
import socket
import time
from typing import Any

import uvicorn

from pdcluster.router.app import create_app
from pdcluster.router.cluster import NodeSource
from pdcluster.router.membership import RouterMembership
from pdcluster.router.settings import RouterSettings

log = logging.getLogger(__name__)


def uvicorn_config(app: Any, host: str, port: int, log_level: str = "warning") -> uvicorn.Config:
    """How the router's app is served (`create_app`'s app: its settings hold the HTTP knobs)."""
    settings: RouterSettings = app.state.router.settings
    return uvicorn.Config(app, host=host, port=port, loop="uvloop", http="httptools", log_level=log_level,
                          access_log=False, timeout_graceful_shutdown=5,
                          timeout_keep_alive=settings.keep_alive_timeout)


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


def run_router(config: Any, source: NodeSource | None = None, reuse_port: bool = False) -> None:
    """Serve until SIGINT/SIGTERM or an admin drain. `config`: a `RouterConfig` (what `pdcluster router`
    loads), a `RouterSettings`, or any object with those attribute names.

    Without `source`, nodes come from etcd (`pdcluster.control.cluster_view.ClusterView` on `config.etcd`)
    and the router registers there itself (`membership.py`).
    """
    settings = config if isinstance(config, RouterSettings) else RouterSettings.from_config(config)
    from pdcluster.control.metrics import new_registry

    registry = new_registry()  # shared by the app's metrics and the etcd view's connection gauge
    etcd_config = None
    if source is None:
        from pdcluster.control.cluster_view import ClusterView
        from pdcluster.control.etcd_client import EtcdCredentials

        source = _StartedOnLifespan(ClusterView(list(config.etcd), config.cluster, registry=registry,
                                                credentials=EtcdCredentials.from_config(config)))
        etcd_config = config
    app = create_app(settings, source, registry)
    sock = bind_socket(settings.host, settings.port, reuse_port)
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn_config(app, settings.host, port))

    def stop_listening() -> None:   # drain: no new connections; open ones (and their streams) go on
        for listener in getattr(server, "servers", []):
            listener.close()

    def exit_server() -> None:
        server.should_exit = True

    app.state.router.membership = RouterMembership(app.state.router, port, etcd_config, stop_listening, exit_server)
    log.info("router %s serving %s on http://%s:%d (policy %s)", settings.node_id, settings.model,
             settings.host, port, settings.routing_policy)
    quiet_gc()
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()


def quiet_gc() -> None:
    """Per streamed token the router allocates a few short-lived containers (a frame's items, chunks, deltas),
    in bursts of a whole engine step; with CPython's default gen-0 threshold (700) the bursts set off a young
    collection every few steps, and what start-up built is scanned again by every old one. Measured with
    `benchmarks/serving.py --start fake --pin-router` (4096 requests, 256 streams): 961 young collections and
    0.40 s of collecting before, 24 and 0.03 s after."""
    gc.collect()
    gc.freeze()   # start-up's objects (app, tokenizer tables, modules) leave the collected generations
    gc.set_threshold(5000, 10, 10)


class _StartedOnLifespan:
    """A ClusterView the app starts (waiting for the first etcd sync) and stops in its lifespan."""

    def __init__(self, view: Any) -> None:
        self.view = view
        self.resynced_at = 0.0   # monotonic time of the view's last full reload (RouterCluster.sync reads it)
        view.add_listener(self._on_view_event)

    def _on_view_event(self, event: str, node_id: str | None) -> None:
        if event == "resync":
            self.resynced_at = time.monotonic()

    async def start(self) -> None:
        await self.view.start(wait=5.0)

    async def stop(self) -> None:
        await self.view.stop()

    def nodes_by_role(self, role: str) -> list[Any]:
        return self.view.nodes_by_role(role)

    def admin_state(self, node_id: str) -> str:
        return self.view.admin_state(node_id)
